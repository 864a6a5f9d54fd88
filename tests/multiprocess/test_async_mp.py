"""Asynchronous saves across processes: the collective protocol runs in the
background, after every process has snapshotted its shards, and the file is the
one a blocking single-process save of the same values makes, byte for byte, even
though every process donated its arrays right after the call."""

from __future__ import annotations

import mp_common as c
import numpy as np
import pytest

import nnx_save

pytestmark = pytest.mark.multiprocess


def test_async_collective_save_holds_the_values_at_the_call(run_workers, files, tmp_path):
    paths = {k: str(tmp_path / f"{k}.safetensors") for k in ("path", "path2", "path3")}
    pod = str(tmp_path / "pod")
    workers = run_workers("save_async.py", 2, 4, {**paths, "pod": pod, "mesh": [2, 4]})
    assert [w.result["first"] for w in workers] == [paths["path"]] * 2
    assert [w.result["pod"] for w in workers] == [pod] * 2
    single, pieces = nnx_save.load_file(files["single"]), nnx_save.load_file(pod, verify=True)
    assert sorted(pieces) == sorted(single) and nnx_save.read_header(pod).num_processes == 2
    for k in single:  # the pod holds the values at the call, though the arrays were donated after it
        np.testing.assert_array_equal(pieces[k], single[k])
    with open(paths["path"], "rb") as a, open(files["single"], "rb") as b:
        assert a.read() == b.read()
    for key in ("path2", "path3"):
        got = nnx_save.load_file(paths[key], verify=True)
        assert sorted(got) == sorted(c.MIXED)
        assert all(np.all(v == 1) for v in got.values()), key
