"""The streaming path, forced on the CPU backend (``stream=True``, the testing aid
for what accelerators do): bounded, reused staging buffers; shards larger than a
staging buffer assembled on the device; strided last-dimension shards over 8
devices; several files read at once; a failure mid-stream leaves no thread, reader
or buffer behind; values bit-exact against numpy; and host memory beyond the
loaded arrays stays within ``max_inflight_bytes`` (+10%), measured in a fresh
process on a checkpoint several times the budget.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import jax
import ml_dtypes
import numpy as np
import pytest
from _arrays import every_kind
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_save
from nnx_save import LoadOptions
from nnx_save.bridges import _pytree
from nnx_save.io import _reader
from nnx_save.load import _stream

DEV = jax.devices()
MESH8 = Mesh(np.array(DEV), ("x",))
MESH24 = Mesh(np.array(DEV).reshape(2, 4), ("x", "y"))


FULL = every_kind(3)
LAYOUTS = {
    "replicated": lambda nd: NamedSharding(MESH8, P()),
    "dim0": lambda nd: NamedSharding(MESH8, P("x") if nd else P()),
    "last": lambda nd: NamedSharding(MESH8, P(*([None] * (nd - 1)), "x") if nd else P()),  # strided
    "2x4": lambda nd: NamedSharding(MESH24, P("x", "y") if nd >= 2 else P()),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "m.safetensors"
    nnx_save.save_file(FULL, path)
    return path


@pytest.fixture
def pools(monkeypatch):
    """Every staging pool a load makes, counting what it hands out."""
    made = []

    class Counting(_stream.StagingPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.acquired = 0
            made.append(self)

        def acquire(self):
            got = super().acquire()
            self.acquired += 1
            return got

    monkeypatch.setattr(_stream, "StagingPool", Counting)
    return made


def _abstract(layout: str) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=LAYOUTS[layout](v.ndim)) for k, v in FULL.items()}


def _check(tree: dict, abstract: dict) -> None:
    for k, v in FULL.items():
        got = tree[k]
        assert got.sharding == abstract[k].sharding and got.dtype == v.dtype, k
        for shard in got.addressable_shards:  # every device, bit-exact
            want = v[shard.index]
            assert np.asarray(shard.data).tobytes() == np.ascontiguousarray(want).tobytes(), (k, shard.index)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("staging", [1 << 20, 256])  # 256 B: nearly every shard is several slabs
def test_streamed_loads_are_bit_exact(checkpoint, layout, staging, monkeypatch, pools):
    monkeypatch.setattr(_stream, "MAX_STAGING", staging)
    abstract = _abstract(layout)
    tree, report = nnx_save.load_file(checkpoint, abstract, stream=True, return_report=True)
    _check(tree, abstract)
    assert len(pools) == 1 and pools[0].size <= staging and pools[0].out == 0
    assert report.clean and report.io.bytes_read >= report.io.bytes_needed > 0


def test_staging_buffers_are_reused(checkpoint, monkeypatch, pools):
    monkeypatch.setattr(_stream, "MAX_STAGING", 512)
    tree = nnx_save.load_file(checkpoint, _abstract("dim0"), stream=True, num_threads=3)
    pool = pools[0]
    assert pool.count == 3 and pool.allocations <= 3  # never more buffers than workers
    assert pool.acquired > 10 * pool.allocations  # each one reused many times
    assert pool.out == 0 and not pool._free  # all handed back, then dropped
    assert np.asarray(tree["d"]).tobytes() == FULL["d"].tobytes()


def test_a_shard_larger_than_a_staging_buffer_is_cast_and_assembled_on_its_device(tmp_path, monkeypatch, pools):
    monkeypatch.setattr(_stream, "MAX_STAGING", 1000)
    big = np.arange(64 * 50, dtype=np.float32).reshape(64, 50).astype(ml_dtypes.bfloat16)  # 6.4 KB
    path = tmp_path / "big.safetensors"
    nnx_save.save_file({"big": big, "row": big[0]}, path)
    one = NamedSharding(Mesh(np.array(DEV[3:4]), ("x",)), P())
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, np.float32, sharding=one) for k, v in {"big": big, "row": big[0]}.items()
    }
    with pytest.warns(nnx_save.LoadWarning, match=re.escape("big: bfloat16 in the file -> float32 in the model")):
        tree = nnx_save.load_file(path, abstract, stream=True, verify=True)
    assert tree["big"].dtype == np.float32 and tree["big"].devices() == {DEV[3]}
    np.testing.assert_array_equal(np.asarray(tree["big"]), big.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(tree["row"]), big[0].astype(np.float32))
    assert _stream.slabs(((0, 64), (0, 50)), 2, pools[0].size)[1:]  # it really was several slabs


def test_verify_checks_pieces_held_whole_and_rereads_the_ones_cut_into_slabs(tmp_path, monkeypatch):
    monkeypatch.setattr(_stream, "MAX_STAGING", 300)
    path = tmp_path / "v.safetensors"
    data = {"big": np.arange(400, dtype=np.float32), "small": np.arange(8, dtype=np.float32)}
    nnx_save.save_file(data, path)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH8, P())) for k, v in data.items()}
    _, report = nnx_save.load_file(path, abstract, stream=True, verify=True, return_report=True)
    assert report.verified == ["big", "small"]
    raw = bytearray(path.read_bytes())
    raw[-4 * 399] ^= 0xFF  # inside "big" (written first by size order, or not: a mismatch either way)
    path.write_bytes(bytes(raw))
    with pytest.raises(nnx_save.ChecksumError, match="checksum mismatch"):
        nnx_save.load_file(path, abstract, stream=True, verify=True)


class _Tracking:
    """A reader that records how many files have reads in flight at once."""

    live: ClassVar[dict[str, int]] = {}
    most: ClassVar[int] = 0
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, path: str, fail_after: int | None = None) -> None:
        self.inner, self.path, self.fail_after = _reader.LocalReader(path), path, fail_after
        self.closed = False

    @property
    def requests(self) -> int:
        return self.inner.requests

    def can_read_tables(self) -> bool:
        return self.inner.can_read_tables()

    def can_read_runs(self) -> bool:
        return False  # batches of raw-address preads are the local reader's own

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def _timed(self, read) -> None:
        cls = type(self)
        with cls.lock:
            cls.live[self.path] = cls.live.get(self.path, 0) + 1
            cls.most = max(cls.most, sum(1 for n in cls.live.values() if n))
            if self.fail_after is not None:
                self.fail_after -= 1
                if self.fail_after < 0:
                    cls.live[self.path] -= 1
                    raise nnx_save.NnxSaveError(f"{self.path}: injected read failure")
        try:
            time.sleep(0.02)  # widen the window in which reads overlap
            read()
        finally:
            with cls.lock:
                cls.live[self.path] -= 1

    def readv(self, buffers, offset):
        self._timed(lambda: self.inner.readv(buffers, offset))

    def readv_table(self, table, offset):
        self._timed(lambda: self.inner.readv_table(table, offset))


@pytest.fixture
def four_files(tmp_path):
    rng = np.random.default_rng(5)
    data = {f"t{i}": rng.standard_normal((64, 32)).astype(np.float32) for i in range(8)}
    for i in range(4):
        nnx_save.save_file({k: data[k] for k in (f"t{2 * i}", f"t{2 * i + 1}")}, tmp_path / f"part{i}.safetensors")
    return tmp_path, data


@pytest.mark.parametrize("stream", [True, False])
def test_several_files_are_read_at_once(four_files, monkeypatch, stream):
    directory, data = four_files
    opened: list[_Tracking] = []

    def factory(header):
        def open_reader(f):
            opened.append(_Tracking(f))
            return opened[-1]

        return open_reader

    monkeypatch.setattr(_Tracking, "live", {})
    monkeypatch.setattr(_Tracking, "most", 0)
    monkeypatch.setattr(_pytree, "reader_factory", factory)
    monkeypatch.setattr(_stream, "MAX_STAGING", 4096)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH8, P("x"))) for k, v in data.items()
    }
    tree = nnx_save.load_file(directory, abstract, stream=stream, num_threads=4)
    for k, v in data.items():
        np.testing.assert_array_equal(np.asarray(tree[k]), v)
    assert _Tracking.most >= 2  # reads of two files or more in flight together
    assert len({r.path for r in opened}) == 4 and all(r.closed for r in opened)


def test_a_failure_mid_stream_leaves_nothing_behind(four_files, monkeypatch, pools):
    directory, data = four_files
    opened: list[_Tracking] = []

    def factory(header):
        def open_reader(f):
            opened.append(_Tracking(f, fail_after=3 if f.endswith("part2.safetensors") else None))
            return opened[-1]

        return open_reader

    monkeypatch.setattr(_pytree, "reader_factory", factory)
    monkeypatch.setattr(_stream, "MAX_STAGING", 2048)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH8, P("x"))) for k, v in data.items()
    }
    before = set(threading.enumerate())
    result = None
    with pytest.raises(nnx_save.NnxSaveError, match=re.escape("part2.safetensors: injected read failure")):
        result = nnx_save.load_file(directory, abstract, stream=True, num_threads=4)
    assert result is None  # no partial result
    assert [t.name for t in set(threading.enumerate()) - before] == []  # every worker joined
    assert opened and all(r.closed for r in opened)
    assert pools[0].out == 0 and not pools[0]._free  # every staging buffer handed back and dropped


def test_options_choose_the_path_and_the_staging_memory(monkeypatch):
    monkeypatch.delenv("NNX_SAVE_STREAM", raising=False)
    monkeypatch.delenv("NNX_SAVE_STAGING", raising=False)
    opt = LoadOptions()
    assert not opt.streaming("cpu") and opt.streaming("gpu") and opt.streaming("tpu")
    assert LoadOptions(stream=True).streaming("cpu") and not LoadOptions(stream=False).streaming("gpu")
    monkeypatch.setenv("NNX_SAVE_STREAM", "1")
    assert opt.streaming("cpu")
    monkeypatch.setenv("NNX_SAVE_STREAM", "maybe")
    with pytest.raises(nnx_save.errors.ConfigError, match=re.escape("NNX_SAVE_STREAM='maybe': expected 1, 0 or auto")):
        opt.streaming("cpu")
    assert opt.staging_kind("gpu", ("device", "pinned_host")) == "pinned"
    assert opt.staging_kind("cpu", ("device", "pinned_host")) == "pageable"
    assert opt.staging_kind("gpu", ("device",)) == "pageable"
    assert LoadOptions(staging="pinned").staging_kind("cpu", ()) == "pinned"
    monkeypatch.setenv("NNX_SAVE_STAGING", "pageable")
    assert opt.staging_kind("gpu", ("device", "pinned_host")) == "pageable"
    with pytest.raises(ValueError, match=re.escape("staging must be one of ('auto', 'pinned', 'pageable'), got 'x'")):
        LoadOptions(staging="x")


def test_pinned_staging_buffers_on_the_cpu_backend(checkpoint, monkeypatch, pools):
    # the CPU backend offers a pinned_host memory kind too: the same code path as on a GPU
    monkeypatch.setattr(_stream, "MAX_STAGING", 4096)
    abstract = _abstract("last")
    tree = nnx_save.load_file(checkpoint, abstract, stream=True, staging="pinned")
    _check(tree, abstract)
    assert pools[0].allocations >= 1 and pools[0].out == 0


def test_slabs_tile_the_box_within_the_size():
    rng = np.random.default_rng(0)
    for _ in range(200):
        shape = tuple(int(x) for x in rng.integers(1, 7, rng.integers(0, 4)))
        box = tuple((int(lo), int(rng.integers(lo + 1, d + 1))) for d in shape for lo in [rng.integers(0, d)])
        itemsize, size = int(rng.choice([1, 2, 4, 8])), int(rng.integers(8, 200))
        seen = np.zeros(shape, np.int64)
        for s in _stream.slabs(box, itemsize, size):
            nbytes = itemsize * int(np.prod([hi - lo for lo, hi in s]))
            assert nbytes <= max(size, itemsize)
            seen[tuple(slice(lo, hi) for lo, hi in s)] += 1
        want = np.zeros(shape, np.int64)
        want[tuple(slice(lo, hi) for lo, hi in box)] = 1
        assert np.array_equal(seen, want), (box, itemsize, size)


RSS_SCRIPT = Path(__file__).parents[1] / "_stream_rss.py"


def _rss(path: Path, mode: str, budget: int, warm: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(nnx_save.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    # A fixed mmap threshold: glibc's dynamic one rises after a large free, so later
    # 16-32 MiB blocks come from per-thread arenas that keep them after they are freed,
    # and the peak measured what the allocator retains, not what the load holds
    # (33-80 MiB over the arrays run to run without it, 64 MiB every run with it).
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    done = subprocess.run(
        [sys.executable, str(RSS_SCRIPT), str(path), mode, str(budget), warm],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_host_memory_beyond_the_arrays_stays_within_the_budget(tmp_path):
    # 256 MB of f32 and bf16 (cast to f32 on load), 4x the 64 MiB budget; on CPU the
    # loaded arrays are host memory too, so what is bounded is the growth beyond them
    budget = 64 << 20
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(8):
        dtype = np.float32 if i % 2 else ml_dtypes.bfloat16
        tensors[f"w{i}"] = rng.standard_normal((2048, 4096 if i % 2 else 8192), np.float32).astype(dtype)
    path = tmp_path / "big.safetensors"
    nnx_save.save_file(tensors, path)
    del tensors
    # warm: the second load of a fresh process (the first one's one-time costs, jax compiling
    # the on-device copy and update and starting its runtime, ~50 MB here, are not per load)
    streamed = _rss(path, "stream", budget, "warm")
    assert streamed["peak"] - streamed["before"] - streamed["results"] <= 1.1 * budget, streamed
    for mode in ("host", "verify"):  # casts slab by slab into their results; verify hashes them in file order
        host = _rss(path, mode, budget, "cold")
        assert host["peak"] - host["before"] - host["results"] <= 1.1 * budget, (mode, host)
    # a cast made after the load holds the bf16 arrays beside the results: the check can fail
    after = _rss(path, "after", budget, "cold")
    assert after["peak"] - after["before"] - after["results"] > 1.1 * budget, after


def test_automatic_ratio_over_read_warns_once_on_the_streaming_path_too(tmp_path, monkeypatch, pools):
    # 2500 one-element tensors, each followed by an unused 4 KiB one; staging for 1300 of
    # them: two batches of over 1024 page blocks each, so each batch's plan reads through
    full = {}
    for i in range(2500):
        full[f"t.{i:04d}.keep"] = np.array([i], np.float32)  # same rank: laid out by name
        full[f"t.{i:04d}.skip"] = np.zeros(1024, np.float32)
    path = str(tmp_path / "sparse.safetensors")
    nnx_save.save_file(full, path)
    kept = {k: v for k, v in full.items() if k.endswith(".keep")}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH8, P())) for k, v in kept.items()}
    monkeypatch.setattr(_stream, "MAX_STAGING", 1300 * _stream.ALIGN)
    with pytest.warns(nnx_save.OverReadWarning) as caught:
        out, report = nnx_save.load_file(path, abstract, allow_unexpected=["*.skip"], stream=True, return_report=True)
    assert len(caught) == 1 and len(pools) == 1 and pools[0].acquired == 2
    ratio = report.io.over_read_by_file[path]
    message = str(caught[0].message)
    assert ratio > 900 and f"{path}: read " in message and f"for 9.8 KiB needed (over-read {ratio:.2f}x" in message
    # both batches' read-through counted: every skip tensor but the last one and the one
    # between the batches (t.1299.skip: each batch's reads stop at its last run)
    assert "the automatic merge cap for this file was" in message and re.search(
        r"t.\d{4}.skip \(4\.0 KiB\) and 2493 more", message
    )
    assert "t.1299.skip" not in message
    assert all(np.asarray(out[k]).tobytes() == v.tobytes() for k, v in kept.items())
    # an explicit ratio is the caller's choice: exact reads and no warning
    out, report = nnx_save.load_file(
        path, abstract, allow_unexpected=["*.skip"], stream=True, max_over_read_ratio=1.0, return_report=True
    )
    assert report.io.bytes_read == report.io.bytes_needed == 2500 * 4
