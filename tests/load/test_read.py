"""The executor: every read method fills destinations exactly like numpy slicing.

Plans over random boxes are executed from a real file by each method the reader
picks from (``preadv`` iovec tables, memoryviews for readers without tables,
block + strided scatter), forced in turn; short reads, ``EINTR``, other errors,
truncated files, plans that point outside a buffer and the byte budget are
checked on their own.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import re
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnx_save import NnxSaveError, TruncatedFileError
from nnx_save.io import _reader
from nnx_save.load import _execute
from nnx_save.load._pieces import Request
from nnx_save.load._plan import FilePlan, plan_file

ITEMSIZES = [1, 2, 3, 4, 8, 16]


@st.composite
def requests(draw):
    """1-3 tensors in a file, each with 1-6 arbitrary boxes (overlaps included)."""
    base = draw(st.sampled_from([0, 8, 4100]))
    reqs, sizes = [], []
    for _ in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        itemsize = draw(st.sampled_from(ITEMSIZES))
        for _ in range(draw(st.integers(1, 6))):
            box = []
            for d in shape:
                lo = draw(st.integers(0, d - 1))
                box.append((lo, draw(st.integers(lo + 1, d))))
            reqs.append(Request(len(reqs), base, shape, itemsize, tuple(box)))
            sizes.append(itemsize * math.prod(hi - lo for lo, hi in box))
        base += itemsize * math.prod(shape) + draw(st.sampled_from([0, 16, 5000]))
    return reqs, sizes, base


def _expected(data: np.ndarray, r: Request) -> np.ndarray:
    full = data[r.base : r.base + r.itemsize * math.prod(r.shape)].reshape(*r.shape, r.itemsize)
    return np.ascontiguousarray(full[tuple(slice(lo, hi) for lo, hi in r.box)]).reshape(-1)


class _NoTable:
    """A reader with only ``readv`` (like the remote ones)."""

    def __init__(self, path: str) -> None:
        self.inner = _reader.LocalReader(path)
        self.readv = self.inner.readv

    @property
    def requests(self) -> int:
        return self.inner.requests

    def close(self) -> None:
        self.inner.close()

    def can_read_tables(self) -> bool:
        return False

    def can_read_runs(self) -> bool:
        return False  # batches of raw-address preads are the local reader's own

    def readv_table(self, table, offset):
        raise AssertionError("a reader without tables was given one")


METHODS = {  # SMALL_CHUNK 0: no batches, so that small chunks take the forced method too
    "auto": {},
    "table": {"DIRECT_MIN_RUN": 0, "SMALL_CHUNK": 0},
    "scatter": {"DIRECT_MIN_RUN": 1 << 40, "DIRECT_MAX_RUNS": 0, "SMALL_CHUNK": 0},
    "batched": {"SMALL_CHUNK": 1 << 40, "BATCH_CHUNKS": 3},
    "memoryview": {"reader": _NoTable, "DIRECT_MIN_RUN_PY": 0},
    "scatter-whole-chunk": {"reader": _NoTable, "DIRECT_MIN_RUN_PY": 1 << 40, "DIRECT_MAX_RUNS": 0},
    "tiny-gap-scratch": {"DIRECT_MIN_RUN": 0, "GAP_SCRATCH": 7, "SMALL_CHUNK": 0},
    "two-run-tables": {"DIRECT_MIN_RUN": 0, "TABLE_RUNS": 2, "SMALL_CHUNK": 0},
}


def _run(path: str, plan: FilePlan, sizes: list[int], method: str, monkeypatch, threads: int = 3, reader=None):
    opts = dict(METHODS[method])
    reader = (opts.pop("reader", None) or reader or _reader.LocalReader)(path)
    for name, value in opts.items():
        monkeypatch.setattr(_execute, name, value)
    dests = [_execute.aligned_empty(n) for n in sizes]
    for d in dests:
        d[:] = 0xAB  # poisoned
    seen, got, lock = [], [0], threading.Lock()
    for name in ("readv", "readv_table"):  # count the bytes each call asks for
        inner = getattr(reader, name)
        if name == "readv" or reader.can_read_tables():

            def counted(buffers, offset, inner=inner, table=name == "readv_table"):
                with lock:
                    got[0] += int(buffers[:, 1].sum()) if table else sum(len(b) for b in buffers)
                return inner(buffers, offset)

            setattr(reader, name, counted)
    if hasattr(reader, "read_runs"):
        inner_runs = reader.read_runs

        def counted_runs(addr, length, offset):
            with lock:
                got[0] += sum(length)
            return inner_runs(addr, length, offset)

        reader.read_runs = counted_runs
    try:
        _execute.execute(
            reader, plan, dests, budget=_execute.Budget(1 << 30), num_threads=threads, on_chunk=seen.append
        )
    finally:
        reader.close()
    assert sum(seen) == plan.needed_bytes and len(seen) == plan.num_chunks
    assert got[0] == plan.read_bytes  # each chunk read once, whole, nothing more
    return dests, reader.requests


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("read")


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    requests(),
    st.sampled_from([None, 1.0, 3.0, 1e9]),
    st.sampled_from([3, 64, 5000, 1 << 20]),
    st.sampled_from(sorted(METHODS)),
)
def test_every_method_fills_destinations_like_numpy(workdir, monkeypatch, case, ratio, chunk, method):
    reqs, sizes, size = case
    data = np.random.default_rng(size).integers(0, 256, size + 3, dtype=np.uint8)
    path = str(workdir / "data.bin")
    data.tofile(path)
    plan = plan_file(reqs, max_over_read_ratio=ratio, chunk_bytes=chunk)
    with monkeypatch.context() as m:
        dests, _ = _run(path, plan, sizes, method, m)
    for r, dest in zip(reqs, dests, strict=False):
        assert np.array_equal(dest, _expected(data, r)), (method, r, plan)


def _strided_file(tmp_path, rows: int, cols: int, itemsize: int = 4):
    data = np.random.default_rng(0).integers(0, 256, rows * cols * itemsize, dtype=np.uint8)
    path = str(tmp_path / "m.bin")
    data.tofile(path)
    step = cols // 8
    reqs = [Request(i, 0, (rows, cols), itemsize, ((0, rows), (i * step, (i + 1) * step))) for i in range(8)]
    return path, data, reqs, [rows * step * itemsize] * 8


@pytest.mark.parametrize(
    "kind, rows, cols, method",
    [
        ("local", 512, 256, "table"),  # 128-byte runs
        ("local", 512, 16, "scatter"),  # 8-byte runs
        ("no-table", 512, 16, "scatter"),
        ("no-table", 2, 65536, "direct"),  # 32 KiB runs: memoryviews
        ("no-table", 4, 256, "direct"),  # 32 runs: few enough for memoryviews
    ],
)
def test_the_automatic_choice_by_run_length(tmp_path, monkeypatch, kind, rows, cols, method):
    path, data, reqs, sizes = _strided_file(tmp_path, rows, cols)
    reader = _reader.LocalReader(path) if kind == "local" else _NoTable(path)
    plan = plan_file(reqs)
    assert _execute._method(reader.can_read_tables(), len(plan.offset), plan.needed_bytes) == method
    reader.close()
    dests, _requests = _run(path, plan, sizes, "auto", monkeypatch, reader=_NoTable if kind == "no-table" else None)
    for r, d in zip(reqs, dests, strict=False):
        assert np.array_equal(d, _expected(data, r))


def test_table_reads_are_about_one_syscall_per_1024_runs(tmp_path, monkeypatch):
    path, _data, reqs, sizes = _strided_file(tmp_path, 4096, 512)  # 32768 runs of 256 bytes
    plan = plan_file(reqs)
    _, requests = _run(path, plan, sizes, "auto", monkeypatch)
    assert len(plan.offset) == 32768 and requests == 32


def test_scatter_reads_local_files_in_cache_sized_blocks(tmp_path, monkeypatch):
    path, data, reqs, sizes = _strided_file(tmp_path, 1 << 15, 16)  # 2 MiB of 8-byte runs
    plan = plan_file(reqs)
    dests, requests = _run(path, plan, sizes, "auto", monkeypatch)
    assert requests == 2 and all(np.array_equal(d, _expected(data, r)) for r, d in zip(reqs, dests, strict=False))


def _rows_file(tmp_path, rows: int = 512, cols: int = 2048):
    """A fp32 matrix and one request for its columns [100, 164): one 256-byte run per
    row, rows apart by more than a page, so each run is its own chunk at ratio 1."""
    data = np.random.default_rng(1).integers(0, 256, rows * cols * 4, dtype=np.uint8)
    path = str(tmp_path / "rows.bin")
    data.tofile(path)
    reqs = [Request(0, 0, (rows, cols), 4, ((0, rows), (100, 164)))]
    return path, data, reqs, [rows * 64 * 4]


def _spy_batches(monkeypatch) -> list[int]:
    """Record the bytes of each batch read through ``LocalReader.read_runs``."""
    batches, real = [], _reader.LocalReader.read_runs

    def spy(self, addr, length, offset):
        batches.append(sum(length))
        return real(self, addr, length, offset)

    monkeypatch.setattr(_reader.LocalReader, "read_runs", spy)
    return batches


@pytest.mark.parametrize("limit, per_batch", [(1 << 30, 100), (1000, 3)])
def test_small_one_run_chunks_are_read_in_batches_one_pread_each(tmp_path, monkeypatch, limit, per_batch):
    path, data, reqs, sizes = _rows_file(tmp_path)
    plan = plan_file(reqs, max_over_read_ratio=1.0)
    assert plan.num_chunks == 512 and plan.read_bytes == plan.needed_bytes == 512 * 256
    monkeypatch.setattr(_execute, "BATCH_CHUNKS", 100)
    batches = _spy_batches(monkeypatch)
    reader, budget = _reader.LocalReader(path), _execute.Budget(limit)
    dests = [_execute.aligned_empty(sizes[0])]
    dests[0][:] = 0xAB  # poisoned
    seen: list[int] = []
    try:
        _execute.execute(reader, plan, dests, budget=budget, num_threads=3, on_chunk=seen.append)
    finally:
        reader.close()
    assert np.array_equal(dests[0], _expected(data, reqs[0]))
    assert reader.requests == 512 and len(seen) == 512 and sum(seen) == 512 * 256  # one pread, one call each
    assert len(batches) == -(-512 // per_batch) and max(batches) == per_batch * 256 and sum(batches) == 512 * 256
    assert budget.peak <= limit and budget.used == 0


def test_batched_short_reads_and_eintr_resume_where_they_stopped(tmp_path, monkeypatch):
    path, data, reqs, sizes = _rows_file(tmp_path, rows=64)
    plan = plan_file(reqs, max_over_read_ratio=1.0)
    real, calls = _reader._PREAD, {"n": 0}

    def fake(fd, addr, n, offset):  # every 3rd call fails with EINTR, the others give at most 100 bytes
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            ctypes.set_errno(errno.EINTR)
            return -1
        return real(fd, addr, min(n, 100), offset)

    monkeypatch.setattr(_reader, "_PREAD", fake)
    reader, dests = _reader.LocalReader(path), [_execute.aligned_empty(sizes[0])]
    dests[0][:] = 0xAB  # poisoned
    try:
        _execute.execute(reader, plan, dests, budget=_execute.Budget(1 << 30), num_threads=1)
    finally:
        reader.close()
    assert np.array_equal(dests[0], _expected(data, reqs[0]))
    assert calls["n"] == 64 and reader.requests == 128  # each 256-byte run: a short pread, then one preadv resumes


def test_a_batched_run_pointing_outside_its_buffer_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path, _data, reqs, sizes = _rows_file(tmp_path, rows=16)
    plan = plan_file(reqs, max_over_read_ratio=1.0)
    batches = _spy_batches(monkeypatch)
    sizes[0] -= 1  # the last row's run no longer fits
    with pytest.raises(NnxSaveError, match=re.escape("a planned read falls outside its chunk or destination buffer")):
        _run(path, plan, sizes, "auto", monkeypatch)  # the 16 rows make one batch
    assert batches == []


def _preadv_at_most(limit: int, fail_first: int = 0):
    """A stand-in for libc preadv that fills at most ``limit`` bytes per call (and
    fails the first ``fail_first`` calls with EINTR)."""
    real = _reader._PREADV
    calls = {"n": 0}

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    def fake(fd, iov, count, offset):
        calls["n"] += 1
        if calls["n"] <= fail_first:
            ctypes.set_errno(errno.EINTR)
            return -1
        first = Iovec.from_address(iov)
        one = Iovec(first.base, min(first.len, limit))
        return real(fd, ctypes.addressof(one), 1, offset)

    return fake, calls


def test_short_reads_and_eintr_resume_where_they_stopped(tmp_path, monkeypatch):
    path, data, reqs, sizes = _strided_file(tmp_path, 64, 256)
    plan = plan_file(reqs)
    fake, calls = _preadv_at_most(100, fail_first=2)
    monkeypatch.setattr(_reader, "_PREADV", fake)
    dests, requests = _run(path, plan, sizes, "table", monkeypatch, threads=1)
    assert all(np.array_equal(d, _expected(data, r)) for r, d in zip(reqs, dests, strict=False))
    assert calls["n"] == requests > plan.needed_bytes // 100


def test_a_failing_read_raises_with_the_file_and_offset(tmp_path, monkeypatch):
    path, _data, reqs, sizes = _strided_file(tmp_path, 8, 256)
    plan = plan_file(reqs)

    def fake(fd, iov, count, offset):
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(_reader, "_PREADV", fake)
    with pytest.raises(OSError, match=re.escape(f"reading {path} at byte 0")) as info:
        _run(path, plan, sizes, "table", monkeypatch)
    assert info.value.errno == errno.EIO


@pytest.mark.parametrize("method", ["table", "memoryview", "scatter"])
def test_a_truncated_file_raises_naming_where_it_ended(tmp_path, monkeypatch, method):
    path, _data, reqs, sizes = _strided_file(tmp_path, 64, 256)
    plan = plan_file(reqs)
    os.truncate(path, 10_000)
    with pytest.raises(TruncatedFileError, match=re.escape(f"{path}: file ended at byte 10000, expected ")) as info:
        _run(path, plan, sizes, method, monkeypatch, threads=1)
    assert (info.value.file, info.value.offset) == (path, 10_000)


def test_a_truncated_file_raises_naming_where_it_ended_in_a_batch(tmp_path, monkeypatch):
    path, _data, reqs, sizes = _rows_file(tmp_path, rows=16)  # row r's run: bytes [8192 r + 400, +256)
    plan = plan_file(reqs, max_over_read_ratio=1.0)
    os.truncate(path, 5 * 8192 + 500)  # row 5's run ends early, at byte 41460, 156 bytes short
    message = f"{path}: file ended at byte 41460, expected 156 more bytes (was it truncated while loading?)"
    with pytest.raises(TruncatedFileError, match=re.escape(message)) as info:
        _run(path, plan, sizes, "auto", monkeypatch, threads=1)
    assert (info.value.file, info.value.offset) == (path, 41460)


@pytest.mark.parametrize("method", ["table", "memoryview", "scatter"])
def test_a_run_pointing_outside_its_buffer_is_refused_before_it_is_read(tmp_path, monkeypatch, method):
    path, _data, reqs, sizes = _strided_file(tmp_path, 8, 256)
    plan = plan_file(reqs)
    sizes[3] -= 1
    with pytest.raises(NnxSaveError, match="a planned read falls outside its chunk or destination buffer"):
        _run(path, plan, sizes, method, monkeypatch)


def test_budget_never_exceeds_its_limit_and_clamps_larger_holds():
    budget = _execute.Budget(100)
    inside, peak, lock = [0], [0], threading.Lock()

    def hold(n: int) -> None:
        with budget(n):
            with lock:
                inside[0] += min(n, 100)
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.001)
            with lock:
                inside[0] -= min(n, 100)

    threads = [threading.Thread(target=hold, args=(n,)) for n in [30, 70, 250, 10, 60, 40, 100, 5] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] <= 100 and budget.peak <= 100 and budget.used == 0


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 4097, 1 << 20])
def test_aligned_empty_is_aligned_and_sized(nbytes):
    buf = _execute.aligned_empty(nbytes)
    assert buf.shape == (nbytes,) and buf.dtype == np.uint8
    assert buf.ctypes.data % 64 == 0 or nbytes == 0  # an empty array has no data to align


def test_pack_buffers_are_aligned_disjoint_and_share_few_allocations():
    sizes = [3, 100, 0, 64, 5000, 1, 7]
    bufs = _execute.pack_buffers(sizes, slab_bytes=4096)
    assert [len(b) for b in bufs] == sizes
    assert all(b.ctypes.data % 64 == 0 for b in bufs if len(b))
    for i, b in enumerate(bufs):
        b[:] = i
    assert all((b == i).all() for i, b in enumerate(bufs))  # no two overlap
    owners = [id(b.base) for b in bufs]
    # slabs fill in order up to 4096 bytes; a larger buffer is a slab of its own
    assert owners[0] == owners[1] == owners[2] == owners[3] != owners[4] != owners[5] == owners[6]


def test_readv_with_many_buffers_is_linear_and_leaves_the_list_alone(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, 16 * 60_000, dtype=np.uint8)
    (tmp_path / "d.bin").write_bytes(data.tobytes())
    out = np.zeros_like(data)
    views = [memoryview(out)[i : i + 16] for i in range(0, len(out), 16)]
    given = list(views)
    reader = _reader.LocalReader(str(tmp_path / "d.bin"))
    t0 = time.perf_counter()
    reader.readv(views, 0)
    assert time.perf_counter() - t0 < 5  # slicing the list per buffer took minutes
    reader.close()
    assert np.array_equal(out, data) and views == given and reader.requests >= 59


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(_execute)
    assert result.attempted >= 1 and result.failed == 0
