"""Layouts and the descriptors their headers hold: one pool for the whole process,
bounded by its descriptor limit, released by ``close()``; a file whose descriptor
was let go is reopened only if it is still the file its header was read from."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _limits import descriptor_limit
from reliability.test_reliability_concurrent import open_in

import nnx_save


def test_four_headers_of_64_files_under_a_limit_of_256_descriptors(tmp_path):
    for i in range(64):
        nnx_save.save_file({f"t{i:02d}": np.full(3, i, np.float32)}, tmp_path / f"{i:02d}.safetensors")
    child = textwrap.dedent(
        f"""
        import resource, sys
        import numpy as np
        import nnx_save
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        d = {str(tmp_path)!r}
        sys.path.insert(0, {os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability")!r})
        from test_reliability_concurrent import open_in
        headers = [nnx_save.read_header(d) for _ in range(4)]
        assert open_in(d) == 64, open_in(d)  # a quarter of the limit, for the whole process
        for h in headers:  # pinned or released, every file loads, exactly
            loaded = nnx_save.load_file(h)
            assert {{k: v.tolist() for k, v in loaded.items()}} == {{f"t{{i:02d}}": [float(i)] * 3 for i in range(64)}}
        for h in headers:
            h.close()
        assert open_in(d) == 0, open_in(d)
        handle = nnx_save.safe_open(d)
        assert open_in(d) == 64 and handle.get_tensor("t07").tolist() == [7.0] * 3
        handle.close()
        assert open_in(d) == 0, open_in(d)  # closed at once, not when collected
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_file_replaced_or_removed_after_its_descriptor_was_released_is_refused(tmp_path, monkeypatch):
    descriptor_limit(monkeypatch, 4)  # a pool of 1
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    nnx_save.save_file({"a": np.zeros(2, np.float32)}, a)
    nnx_save.save_file({"b": np.zeros(2, np.float32)}, b)
    header = nnx_save.read_header(tmp_path)  # b's descriptor pushed a's out of the pool
    assert open_in(tmp_path) == 1
    assert nnx_save.load_file(header)["a"].tolist() == [0.0, 0.0]  # unchanged: reopened by name
    nnx_save.save_file({"a": np.ones(2, np.float32)}, a)
    with pytest.raises(
        nnx_save.SourceChangedError, match=re.escape(f"{a}: replaced or changed since its header was read")
    ) as info:
        nnx_save.load_file(header)
    assert info.value.file == str(a)
    assert nnx_save.load_file(tmp_path)["a"].tolist() == [1.0, 1.0]  # a new header reads the new file
    header = nnx_save.read_header(tmp_path)
    a.unlink()  # a writer's clean-up: gone, not replaced
    with pytest.raises(nnx_save.SourceChangedError, match=re.escape(f"{a}: gone since its header was read")):
        nnx_save.load_file(header)


def test_a_header_passed_to_safe_open_stays_open_after_the_handle_closes(tmp_path):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(3, dtype=np.float32)}, path)
    header = nnx_save.read_header(path)
    with nnx_save.safe_open(header) as f:
        assert f.get_tensor("w").tolist() == [0.0, 1.0, 2.0]
    assert open_in(tmp_path) == 1  # its owner closes it
    header.close()
    assert open_in(tmp_path) == 0
    assert nnx_save.load_file(header)["w"].tolist() == [0.0, 1.0, 2.0]  # reopened by name: still the same file
