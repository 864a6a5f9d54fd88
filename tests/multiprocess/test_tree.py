"""save_file / load_file across processes: one standard file, byte ranges per process."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest

import mp_common as c
import nnx_save

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20
SLACK = 256  # rchar also counts the read of /proc/self/io that took the first sample


def _header_bytes(path) -> int:
    return nnx_save.read_header(path).files[0].data_start


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The row-split and column-split files, written by this (single) process."""
    d = tmp_path_factory.mktemp("bytes")
    paths = {}
    for suite in ("rows", "wide"):
        paths[suite] = str(d / f"{suite}.safetensors")
        nnx_save.save_file(c.nest({k: c.value(k, e[0], e[1]) for k, e in c.SUITES[suite].items()}), paths[suite])
    return paths


@pytest.mark.parametrize("n,devices", [(2, 4), (4, 2)])
def test_each_process_reads_its_share(run_workers, files, n, devices):
    jobs = [{"path": files["rows"], "suite": "rows", "mesh": [n, devices]},
            {"path": files["wide"], "suite": "wide", "mesh": [n, devices], "ratio": 1.0},
            {"path": files["wide"], "suite": "wide", "mesh": [n, devices], "ratio": 1.5}]
    workers = run_workers("load_tree.py", n, devices, {"jobs": jobs})
    data = os.path.getsize(files["rows"]) - _header_bytes(files["rows"])
    assert data == 4 * MiB
    rows = [w.result["jobs"][0] for w in workers]
    for r in rows:  # dim 0 over N processes: each reads 1/N of the data, exactly, plus the header
        assert r["bytes_read"] == r["bytes_needed"] == data // n
        assert data // n <= r["rchar"] <= data // n + _header_bytes(files["rows"]) + SLACK
        assert r["checked"] == 4 * devices and r["clean"]
    assert sum(r["bytes_read"] for r in rows) == data
    assert sum(r["rchar"] for r in rows) <= data + n * (_header_bytes(files["rows"]) + SLACK)  # every one reads the header
    for w in workers:  # last dim over N processes: never more than the cap allows
        for job, r in zip(jobs[1:], w.result["jobs"][1:]):
            assert r["bytes_needed"] == data // n
            assert r["bytes_read"] <= job["ratio"] * r["bytes_needed"]
            assert r["rchar"] <= r["bytes_read"] + _header_bytes(files["wide"]) + SLACK
            assert r["checked"] == 4 * devices


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The mixed tree saved by 2 processes x 4 devices, and by this process alone."""
    from conftest import launch

    d = tmp_path_factory.mktemp("saved")
    (d / "scratch").mkdir()
    path = str(d / "mixed.safetensors")
    workers = launch("save_tree.py", 2, 4, d / "run", {"path": path, "mesh": [2, 4], "dir": str(d / "scratch")})
    single = str(d / "single.safetensors")
    tree = c.nest({**c.make_tree("mixed", c.mesh([2, 4])), **c.host_values()})
    nnx_save.save_file(tree, single, metadata={"made_by": "save_tree"})
    return path, single, workers


def test_two_process_save_is_byte_identical(saved):
    path, single, workers = saved
    with open(path, "rb") as a, open(single, "rb") as b:
        assert a.read() == b.read()
    for w in workers:  # and it loaded back on 2 x 4 with another mesh
        assert w.result["checked_shards"] == 7 * 4 and w.result["host_ok"] and w.result["clean"]


def test_loads_on_one_process_with_eight_devices(saved):
    path, _, _ = saved
    assert jax.process_count() == 1 and jax.device_count() == 8
    for shape in ([8], [2, 4]):
        abstract = c.nest({**c.abstract_tree("mixed", c.mesh(shape)), **c.host_values()})
        flat = c.flat(nnx_save.load_file(path, abstract, max_over_read_ratio=4.0))
        assert c.check_tree("mixed", flat) == 7 * 8
        np.testing.assert_array_equal(flat["host_table"], c.host_values()["host_table"])


def test_loads_on_four_processes(run_workers, saved):
    path, _, _ = saved
    jobs = [{"path": path, "suite": "mixed", "mesh": [4, 2], "ratio": 4.0, "host": True},
            {"path": path, "suite": "mixed", "mesh": [8], "ratio": 4.0, "host": True}]
    for w in run_workers("load_tree.py", 4, 2, {"jobs": jobs}):
        assert [j["checked"] for j in w.result["jobs"]] == [7 * 2, 7 * 2]


def test_refusals(saved):
    _, _, workers = saved
    for w in workers:
        r = w.result
        assert re.search(r"the processes computed different headers \(process 0: 8 tensors, \d+ data bytes, "
                         r"a \d+-byte header; process 1: .*\); every process must save the same keys", r["differs"])
        assert "Nothing was written" in r["differs"] and r["differs_left"] == []
        assert r["local_writer"].startswith("SaveError: an array of shape (64, 32)")
        assert "spans 2 processes; this process holds only its shards" in r["local_writer"]
        assert r["foreign"].startswith("ShardingError: embed: its sharding SingleDeviceSharding")
        assert f"places no shard on a device of process {w.process_id}" in r["foreign"]


def test_load_without_abstract_refused(run_workers, saved):
    path, _, _ = saved
    workers = run_workers("no_abstract.py", 2, 1, {"path": path})
    for w in workers:
        assert "without an abstract tree in a 2-process run would read every tensor on every host" in w.result["error"]
