"""save_file / load_file across processes: one standard file, and per-process byte
ranges. Two launches (the ``two`` and ``four`` fixtures in conftest.py) serve every
test here, since starting JAX dominates the cost."""

from __future__ import annotations

import os
import re

import jax
import mp_common as c
import numpy as np
import pytest

import nnx_save

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20
SLACK = 256  # rchar also counts the read of /proc/self/io that took the first sample


def _data_start(path) -> int:
    return nnx_save.read_header(path).files[0].data_start


@pytest.fixture(params=[2, 4], ids=["2x4", "4x2"])
def byte_results(request, files):
    workers = request.getfixturevalue("two" if request.param == 2 else "four")
    return request.param, [w.result["jobs"][:3] for w in workers]


def test_leading_dim_split_reads_one_nth_per_process(files, byte_results):
    n, results = byte_results
    data = os.path.getsize(files["rows"]) - _data_start(files["rows"])
    assert data == 4 * MiB
    header = _data_start(files["rows"])
    rows = [r[0] for r in results]
    for r in rows:  # the library's count: exactly 1/N; the kernel's: that plus one header
        assert r["bytes_read"] == r["bytes_needed"] == data // n
        assert data // n + header <= r["rchar"] <= data // n + header + SLACK
        assert r["checked"] == 4 * (8 // n) and r["clean"]
    assert sum(r["bytes_read"] for r in rows) == data
    assert sum(r["rchar"] for r in rows) <= data + n * (header + SLACK)  # every process reads the header


def test_last_dim_split_stays_under_the_cap(files, byte_results):
    n, results = byte_results
    data = os.path.getsize(files["wide"]) - _data_start(files["wide"])
    for per_process in results:
        for ratio, r in zip((1.0, 1.5), per_process[1:], strict=False):
            assert r["bytes_needed"] == data // n
            assert r["bytes_needed"] <= r["bytes_read"] <= ratio * r["bytes_needed"]
            assert r["rchar"] <= r["bytes_read"] + _data_start(files["wide"]) + SLACK
            assert r["checked"] == 4 * (8 // n)


def test_two_process_save_is_byte_identical_to_single_process(files, two):
    with open(files["mixed"], "rb") as a, open(files["single"], "rb") as b:
        assert a.read() == b.read()
    assert "nnx_save.checksums" in nnx_save.read_header(files["mixed"]).metadata
    for w in two:  # it loaded back on 2 x 4 with a mesh of another shape, values equal
        assert w.result["checked_shards"] == 7 * 4 and w.result["host_ok"] and w.result["clean"]


def test_loads_on_four_processes_with_two_devices(four):
    for w in four:
        assert [j["checked"] for j in w.result["jobs"][3:5]] == [7 * 2, 7 * 2]


def test_without_the_private_key_value_store_the_steps_use_the_public_collective(two):
    """jax._src.distributed's client taken away: the same file, byte for byte."""
    assert [w.result["fallback_identical"] for w in two] == [True, True]


def test_loads_on_one_process_with_eight_devices(files, two):
    assert jax.process_count() == 1 and jax.device_count() == 8
    for shape in ([8], [2, 4]):
        abstract = c.nest({**c.abstract_tree("mixed", c.mesh(shape)), **c.host_values()})
        loaded, _report = nnx_save.load_file(files["mixed"], abstract, max_over_read_ratio=4.0, return_report=True)
        flat = c.flat(loaded)
        assert c.check_tree("mixed", flat) == 7 * 8
        np.testing.assert_array_equal(flat["host_table"], c.host_values()["host_table"])
    assert nnx_save.load_file(files["mixed"])["embed"].shape == (64, 32)  # checksums verified


def test_refusals(two):
    for w in two:
        r = w.result
        assert re.search(
            r"the processes computed different headers \(process 0: 8 tensors, \d+ data bytes, "
            r"a \d+-byte header; process 1: .*\); every process must save the same keys",
            r["differs"],
        )
        assert "Nothing was written" in r["differs"] and r["differs_left"] == []
        assert r["local_writer"].startswith("SaveError: an array of shape (64, 32)")
        assert "spans 2 processes; this process holds only its shards" in r["local_writer"]
        assert r["foreign"].startswith("ShardingError: embed: its sharding SingleDeviceSharding")
        assert f"places no shard on a device of process {w.process_id}" in r["foreign"]
        assert "without an abstract tree in a 2-process run would read every tensor on every host" in r["no_abstract"]


def test_a_staged_two_process_save_is_byte_identical_to_single_process(files, run_workers, tmp_path):
    """The device -> host copies forced (as on accelerators) under a 4 KiB budget:
    each process copies only its own replica-0 shards, and the file is the same."""
    path = str(tmp_path / "staged.safetensors")
    env = {"NNX_SAVE_FORCE_HOST_STAGING": "1", "NNX_SAVE_SAVE_INFLIGHT_BYTES": "4096"}
    workers = run_workers("save_staged.py", 2, 4, {"path": path, "mesh": [2, 4]}, env=env)
    copied = [w.result["copied_bytes"] for w in workers]
    assert all(w.result["copies"] > 0 for w in workers), copied
    data = os.path.getsize(files["single"]) - _data_start(files["single"])
    assert sum(copied) <= data  # no element copied twice (replica 0 only; host values are not device arrays)
    with open(path, "rb") as a, open(files["single"], "rb") as b:
        assert a.read() == b.read()
