"""Loading over HTTP from a real nginx: bit-exact values, ranged requests only, the
traffic the plan says, retries through faults, and a changed object refused."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from faulty_proxy import FaultyProxy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_save
from nnx_save.errors import RemoteError

RNG = np.random.default_rng(0)
NESTED = {
    "embed": RNG.standard_normal((512, 64), np.float32),
    "layers": [{"w": RNG.standard_normal((64, 256), np.float32)}, {"w": RNG.standard_normal((64, 256), np.float32)}],
    "ids": np.arange(1000, dtype=np.int64),
    "half": RNG.standard_normal((128, 8)).astype(np.float16),
}
TREE = {
    "embed": NESTED["embed"],
    "layers/0/w": NESTED["layers"][0]["w"],
    "layers/1/w": NESTED["layers"][1]["w"],
    "ids": NESTED["ids"],
    "half": NESTED["half"],
}  # the flat keys a load returns
SPECULATIVE_HEADER_BYTES = 64 << 10  # a load's first request: the file's first 64 KiB (docs/remote.md)


@pytest.fixture
def served(nginx):
    nginx.clear_log()
    nnx_save.save_file(NESTED, nginx.root / "model.safetensors")
    return nginx


def data_requests(log, name="model.safetensors"):
    return [r for r in log if r.uri.endswith(name)]


def test_flat_load_is_bit_exact_and_only_ranged(served):
    url = f"{served.url}/model.safetensors"
    out, report = nnx_save.load_file(url, return_report=True)
    assert sorted(out) == sorted(TREE)
    for k, v in TREE.items():
        assert out[k].dtype == v.dtype and np.array_equal(out[k], v), k
    log = data_requests(served.requests())
    assert log and all(r.range.startswith("bytes=") and r.status == 206 for r in log), log
    # one speculative header request, then the plan's reads
    assert len(log) == 1 + report.io.requests
    file_size = (served.root / "model.safetensors").stat().st_size
    assert log[0].bytes_sent == min(SPECULATIVE_HEADER_BYTES, file_size)
    assert sum(r.bytes_sent for r in log[1:]) == report.io.bytes_read == report.io.bytes_needed


def test_sharded_partial_load_requests_only_its_ranges(served):
    mesh = jax.make_mesh((8,), ("x",))
    abstract = {"embed": jax.ShapeDtypeStruct((512, 64), np.float32, sharding=NamedSharding(mesh, P("x", None)))}
    header = nnx_save.read_header(f"{served.url}/model.safetensors")
    served.clear_log()
    out, report = nnx_save.load_file(
        header, abstract, allow_unexpected=["*"], read_chunk_bytes=16 << 10, return_report=True
    )
    np.testing.assert_array_equal(np.asarray(out["embed"]), TREE["embed"])
    assert len(out["embed"].sharding.device_set) == 8
    log = data_requests(served.requests())
    info = header["embed"]
    assert all(r.status == 206 for r in log)
    assert sum(r.bytes_sent for r in log) == info.nbytes  # not a byte of the other tensors
    assert len(log) == report.io.requests == -(-info.nbytes // (16 << 10))
    spans = sorted(tuple(map(int, re.match(r"bytes=(\d+)-(\d+)", r.range).groups())) for r in log)
    assert spans[0][0] == info.begin and spans[-1][1] == info.end - 1


def test_multi_file_index_over_http(nginx):
    nginx.clear_log()
    directory = nginx.root / "sharded"
    nnx_save.save_file(NESTED, directory, max_shard_size=64 << 10)  # a HuggingFace index and its shards
    assert len(list(directory.glob("*.safetensors"))) > 2
    for url in (f"{nginx.url}/sharded", f"{nginx.url}/sharded/model.safetensors.index.json"):
        out = nnx_save.load_file(url)
        assert all(np.array_equal(out[k], v) for k, v in TREE.items())
    assert all(r.status == 206 for r in nginx.requests() if r.uri.endswith(".safetensors"))


def test_a_small_remote_checkpoint_is_cut_into_rounds_for_every_thread(nginx):
    """A remote load's requests are sized by the checkpoint: every thread gets a few
    (``REMOTE_ROUNDS``), down to 1 MiB, so that a small checkpoint does not end on one
    request per thread, each as long as a capped stream allows."""
    from nnx_save.load._options import MIN_REMOTE_CHUNK, REMOTE_ROUNDS

    nginx.clear_log()
    tree = {"big": RNG.standard_normal((24 << 20) // 4).astype(np.float32), "small": np.arange(64, dtype=np.float32)}
    nnx_save.save_file(tree, nginx.root / "rounds", max_shard_size=24 << 20)  # 24 MiB, then 256 bytes
    threads = 4
    out, report = nnx_save.load_file(f"{nginx.url}/rounds", num_threads=threads, return_report=True)
    assert all(np.array_equal(out[k], v) for k, v in tree.items())
    total = sum(v.nbytes for v in tree.values())
    chunk = max(MIN_REMOTE_CHUNK, total // (threads * REMOTE_ROUNDS))  # 1.5 MiB: 16 requests for the big file
    big = [r for r in nginx.requests() if r.uri.endswith("00001-of-00002.safetensors")]
    assert max(r.bytes_sent for r in big) <= max(chunk, SPECULATIVE_HEADER_BYTES), [
        (r.range, r.bytes_sent) for r in big
    ]
    assert report.io.requests >= threads * REMOTE_ROUNDS


def test_large_header_takes_exactly_two_requests(nginx):
    nginx.clear_log()
    many = {f"t{i:05d}": np.full((2,), i, np.float32) for i in range(2500)}  # ~150 KB header
    nnx_save.save_file(many, nginx.root / "wide.safetensors")
    header = nnx_save.read_header(f"{nginx.url}/wide.safetensors")
    assert header.files[0].header_size > SPECULATIVE_HEADER_BYTES
    assert len(header) == 2500
    assert len(data_requests(nginx.requests(), "wide.safetensors")) == 2


@pytest.mark.parametrize("fault", ["503", "drop", "truncate"])
def test_transient_faults_are_retried_and_counted(served, fault):
    hits = {"n": 0}

    def plan(n: int, rng: str) -> str:
        if n in (2, 4):  # the header request goes through; two data ranges fail once
            hits["n"] += 1
            return fault
        return "pass"

    port = int(served.url.rsplit(":", 1)[1])
    with FaultyProxy(port, plan) as proxy:
        out, report = nnx_save.load_file(
            f"http://127.0.0.1:{proxy.port}/model.safetensors",
            read_chunk_bytes=64 << 10,
            num_threads=1,
            return_report=True,
        )
    assert all(np.array_equal(out[k], v) for k, v in TREE.items())
    assert proxy.faults == [fault, fault]
    assert report.io.retries == 2


def test_object_replaced_mid_load_is_an_error(served):
    path = served.root / "model.safetensors"

    def plan(n: int, rng: str) -> str:
        if n == 3:  # after the header and one data range: replace the file
            nnx_save.save_file({**NESTED, "extra": np.zeros(7, np.float32)}, path)
        return "pass"

    port = int(served.url.rsplit(":", 1)[1])
    with (
        FaultyProxy(port, plan) as proxy,
        pytest.raises(
            nnx_save.SourceChangedError,
            match=re.escape(f"http://127.0.0.1:{proxy.port}/model.safetensors: the object changed during the load"),
        ),
    ):
        nnx_save.load_file(f"http://127.0.0.1:{proxy.port}/model.safetensors", read_chunk_bytes=64 << 10, num_threads=1)


def test_missing_url_and_unknown_scheme(served):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{served.url}/nope.safetensors: not found (HTTP 404)")):
        nnx_save.read_header(f"{served.url}/nope.safetensors")
    with pytest.raises(
        RemoteError,
        match=re.escape("nosuchstore://bucket/model.safetensors: no fsspec implementation for nosuchstore://"),
    ):
        nnx_save.read_header("nosuchstore://bucket/model.safetensors")


def test_persistent_failure_gives_up_with_the_range(served):
    port = int(served.url.rsplit(":", 1)[1])
    with FaultyProxy(port, lambda n, rng: "503" if n > 1 else "pass") as proxy:
        url = f"http://127.0.0.1:{proxy.port}/model.safetensors"
        with pytest.raises(
            RemoteError, match=re.escape(f"{url}: bytes ") + r"\d+-\d+ failed after 6 attempts: HTTP 503"
        ):
            nnx_save.load_file(url, num_threads=1)
