"""Concurrent readers: while a writer process replaces a file with ``save_file`` over
and over, readers loading it in a loop get exactly one complete version each time,
never a mix of two and never an error (other than not-found before the first save).

Versions alternate between two layouts (the tensors swap sizes), so a header read
from one version and data from the next could not go unnoticed: every loaded tree
must equal one written version key for key, value for value, and carry that
version's number in its metadata.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import nnx_save

WRITES = 150

_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from test_reliability_concurrent import version
    import nnx_save

    for v in range(int(sys.argv[3])):
        nnx_save.save_file(version(v), sys.argv[1], metadata={"v": str(v)})
    """
)


def version(v: int) -> dict[str, np.ndarray]:
    """Version ``v``: even versions have a big ``a`` and a small ``b``, odd ones the reverse."""
    big, small = (4096, 16) if v % 2 == 0 else (16, 4096)
    return {
        "a": np.full(big, v, np.float32),
        "b": np.full(small, -v, np.int32),
        "c": np.arange(v % 7 + 1, dtype=np.int64) + v,
    }


def matches(tree: dict, v: int) -> bool:
    want = version(v)
    return set(tree) == set(want) and all(
        tree[k].shape == want[k].shape and np.array_equal(tree[k], want[k]) for k in want
    )


def report_version(report, tree) -> int:
    """The version a loaded tree's own values say it is (``a`` holds ``v`` everywhere)."""
    return int(tree["a"][0]) if tree["a"].size else -1


@pytest.mark.slow  # ~20 s: a writer process and two reader threads racing
def test_readers_see_one_whole_version_while_a_writer_replaces_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), os.path.dirname(__file__), str(WRITES)],
        env=env,
        stderr=subprocess.PIPE,
    )
    seen, problems, stop = [], [], threading.Event()

    def read_loop(verify: bool) -> None:
        started = False
        while not stop.is_set():
            try:
                tree, report = nnx_save.load_file(path, return_report=True, verify=verify)
            except FileNotFoundError:
                if started:
                    problems.append("not found after the first save")
                continue
            except Exception as e:
                problems.append(f"{type(e).__name__}: {e}")
                continue
            started = True
            v = int(report_version(report, tree))
            if not matches(tree, v):
                problems.append(f"version {v}'s metadata over other values: { {k: x[:3] for k, x in tree.items()} }")
            else:
                seen.append(v)

    # One reader checks the recorded checksums; the other does not, so a mix could
    # only be caught by the values themselves.
    readers = [threading.Thread(target=read_loop, args=(verify,)) for verify in (True, False)]
    for r in readers:
        r.start()
    try:
        _, err = writer.communicate(timeout=240)
    finally:
        stop.set()
        for r in readers:
            r.join(60)
        if writer.poll() is None:
            writer.kill()
            writer.communicate()
    assert writer.returncode == 0, err.decode()[-3000:]
    assert problems == [], problems[:5]
    assert len(seen) > 20 and len(set(seen)) > 5, (len(seen), sorted(set(seen))[:20])
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_a_header_read_before_a_replacement_still_loads_its_own_file(tmp_path):
    path = tmp_path / "m.safetensors"
    nnx_save.save_file(version(0), path)
    header = nnx_save.read_header(path)
    nnx_save.save_file(version(1), path)  # another layout renamed over it
    assert matches(nnx_save.load_file(header), 0)  # the file the header describes
    assert matches(nnx_save.load_file(path), 1)


def open_in(directory) -> int:
    """Descriptors this process holds on files in ``directory`` (other tests' and
    libraries' descriptors do not count)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor)
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{os.path.realpath(directory)}/")
    return count


def test_a_header_keeps_its_files_open_only_while_it_lives(tmp_path):
    import gc

    nnx_save.save_file({"x": np.zeros(3)}, tmp_path / "a.safetensors")
    nnx_save.save_file({"y": np.ones(3)}, tmp_path / "b.safetensors")
    header = nnx_save.read_header(tmp_path)  # a directory of two files
    assert open_in(tmp_path) == 2
    del header
    gc.collect()
    assert open_in(tmp_path) == 0
    for _ in range(50):  # loads open nothing that outlives them
        nnx_save.load_file(tmp_path / "a.safetensors")
    assert open_in(tmp_path) == 0


def test_a_header_of_many_files_pins_at_most_its_limit(tmp_path, monkeypatch):
    import gc

    from _limits import descriptor_limit  # here: the child processes import this module, not tests/

    descriptor_limit(monkeypatch, 12)  # a pool of 3
    for i in range(5):
        nnx_save.save_file({f"t{i}": np.full(2, i, np.float32)}, tmp_path / f"{i}.safetensors")
    header = nnx_save.read_header(tmp_path)
    assert open_in(tmp_path) == 3
    loaded = nnx_save.load_file(header)  # pinned or not, every file loads
    assert {k: v.tolist() for k, v in loaded.items()} == {f"t{i}": [float(i)] * 2 for i in range(5)}
    del header
    gc.collect()
    assert open_in(tmp_path) == 0
