"""Execute a :class:`~nnx_save.load._plan.FilePlan`: concurrent positioned reads under a
byte budget, straight into destination buffers.

Each chunk is one sequential read of exactly ``[chunk_start, chunk_end)``, its runs
checked against their destination buffers first (reads write through raw addresses),
its bytes held against the shared :class:`Budget`. Per chunk, by its mean run length:
a ``preadv`` iovec **table** (local files), a **direct** ``memoryview`` per run (other
readers), or a **scatter** through a scratch block; chunks of one short run are batched
(local files). How each works and the crossovers: docs/performance.md.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import NnxSaveError
from ..io._reader import Reader
from ._plan import FilePlan, chunk_runs

__all__ = [
    "DIRECT_MAX_RUNS",
    "DIRECT_MIN_RUN",
    "Budget",
    "Cancelled",
    "aligned_empty",
    "execute",
    "pack_buffers",
]

# Mean run length (bytes) at or above which a chunk is read with one iovec per run.
DIRECT_MIN_RUN = 128
# The same for readers without tables (one memoryview, a Python object, per run).
DIRECT_MIN_RUN_PY = 4 << 10
DIRECT_MAX_RUNS = 64  # a chunk of this few runs is always read directly
GAP_SCRATCH = 1 << 20  # bytes a gap iovec may cover; longer gaps take several
TABLE_RUNS = 1 << 16  # runs per iovec table (~2.5 MiB of table and temporaries)
SCATTER_BLOCK = 1 << 20  # local scatter reads: cache-sized blocks
# A chunk of one run and at most this many bytes is "small": local readers read runs
# of consecutive small chunks in batches (alone, each would cost a pool task, checks,
# an iovec table and a budget hold).
SMALL_CHUNK = 64 << 10
BATCH_CHUNKS = 1024  # chunks per batch: enough batches remain to keep threads busy
BATCH_BYTES = 4 << 20  # bytes per batch (held against the budget while it is read)


class Cancelled(Exception):
    """Raised inside a read when another part of the same load failed."""


class Budget:
    """A byte semaphore: ``with budget(n):`` waits until ``n`` bytes fit. ``peak``: the
    most bytes in flight at once, reads and the scratch buffers :meth:`hold` counts
    (a buffer that is only a step, alive beside the result: a sub-byte tensor's packed
    bytes, a porting rule's whole source; a unit larger than the budget)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak, self.held = limit, 0, 0, 0
        self._cond = threading.Condition()

    def hold(self, n: int) -> None:
        """Count ``n`` bytes of scratch as in flight until :meth:`drop` (never waits: the
        reads that fill it must go on)."""
        with self._cond:
            self.held += n
            self.peak = max(self.peak, self.used + self.held)

    def drop(self, n: int) -> None:
        with self._cond:
            self.held -= n

    @contextlib.contextmanager
    def __call__(self, n: int) -> Iterator[None]:
        n = min(n, self.limit)  # a chunk above the limit runs alone
        with self._cond:
            self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used + self.held)
        try:
            yield
        finally:
            with self._cond:
                self.used -= n
                self._cond.notify_all()


def aligned_empty(nbytes: int, align: int = 64) -> np.ndarray:
    """A flat uint8 buffer whose data pointer is ``align``-byte aligned (jax on CPU
    adopts such buffers without a copy)."""
    raw = np.empty(nbytes + align, np.uint8)
    shift = -raw.ctypes.data % align
    return raw[shift : shift + nbytes]


SLAB_BYTES = 256 << 20
HUGE_BYTES = 4 << 20  # from this size a mapping asks for transparent huge pages, as numpy does
MAPPED_MIN_BYTES = 128 << 10  # glibc's initial mapping threshold: smaller buffers come from the heap


def mapped_empty(nbytes: int) -> np.ndarray:
    """A flat uint8 buffer, 64-byte aligned, that goes back to the system as soon as the
    last array using it is freed: from :data:`MAPPED_MIN_BYTES` up, an anonymous mapping
    of its own. A ``malloc``'d buffer below the allocator's mapping threshold (which
    grows as large blocks are freed) comes from the heap, and its pages stay in the
    process after it is freed. Where the system refuses a mapping (too many), the heap.

    Raises:
        MemoryError: the memory cannot be allocated.

    Examples:
        >>> b = mapped_empty(1 << 20)
        >>> len(b), b.ctypes.data % mmap.PAGESIZE, b.flags.writeable
        (1048576, 0, True)
    """
    if nbytes < MAPPED_MIN_BYTES:
        return aligned_empty(nbytes)
    try:
        m = mmap.mmap(-1, nbytes)
    except OSError:
        return aligned_empty(nbytes)
    if nbytes >= HUGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, np.uint8)


def pack_buffers(sizes: list[int], *, align: int = 64, slab_bytes: int = SLAB_BYTES) -> list[np.ndarray]:
    """``align``-byte aligned flat uint8 buffers of these sizes, carved in order out of
    a few large allocations: slabs of up to ``slab_bytes`` (a larger buffer is a slab
    of its own); with ``slab_bytes=0`` each buffer is a mapping of its own
    (:func:`mapped_empty`), freed with its array.

    Why: numpy asks for transparent huge pages on allocations of 4 MiB and more, which
    usually fault in far cheaper (docs/performance.md), while a sharded load makes
    thousands of buffers far below 4 MiB. The price: a slab is freed when the last
    array using it is.

    Examples:
        >>> bufs = pack_buffers([3, 100, 0, 64])
        >>> [len(b) for b in bufs], all(b.ctypes.data % 64 == 0 for b in bufs if len(b))
        ([3, 100, 0, 64], True)
    """
    if slab_bytes == 0:
        return [mapped_empty(n) for n in sizes]
    out: list[np.ndarray] = []
    padded = [-(-n // align) * align for n in sizes]
    start = 0
    while start < len(sizes):
        stop, total = start, 0
        while stop < len(sizes) and (stop == start or total + sizes[stop] <= slab_bytes):
            total += padded[stop]
            stop += 1
        slab = aligned_empty(total, align)
        starts = itertools.accumulate(padded[start:stop], initial=0)
        out += [slab[at : at + n] for at, n in zip(starts, sizes[start:stop], strict=False)]
        start = stop
    return out


def _runs(plan: FilePlan, i: int) -> tuple[int, int, int, int]:
    return int(plan.chunk_start[i]), int(plan.chunk_end[i]), int(plan.chunk_lo[i]), int(plan.chunk_hi[i])


def _iov_table(
    plan: FilePlan,
    lo: int,
    hi: int,
    start: int,
    dest_ptr: np.ndarray,
    scratch: np.ndarray,
    gapless: bool,
    cs: int,
    ce: int,
) -> np.ndarray:
    """Iovecs for runs ``[lo, hi)`` clipped to ``[cs, ce)``, read from file byte
    ``start`` on, as ``(address, length)`` rows in file order: one per run (into its
    destination) and one per ``len(scratch)`` bytes of each gap before a run."""
    off, length = plan.offset[lo:hi], plan.length[lo:hi]
    addr = dest_ptr[plan.dest[lo:hi]]
    np.add(addr, plan.dest_offset[lo:hi], out=addr, casting="unsafe")
    head = max(cs - int(off[0]), 0)  # a run that began in the previous chunk
    tail = max(int(off[-1] + length[-1]) - ce, 0)  # one that goes on in the next
    if not gapless:
        gap = np.empty(len(off), np.int64)  # gap[j] precedes run j
        gap[:1] = off[:1] + head - start
        np.subtract(off[1:], off[:-1] + length[:-1], out=gap[1:])
        gapless = not gap.any()
    if gapless:
        table = np.empty((len(off), 2), np.uint64)
        table[:, 0], table[:, 1] = addr, length
        first = 0
    else:
        g = max(len(scratch), 1)
        pieces = -(-gap // g)
        row_of_run = np.cumsum(pieces + 1) - 1
        table = np.empty((int(pieces.sum()) + len(off), 2), np.uint64)
        is_gap = np.ones(len(table), bool)
        is_gap[row_of_run] = False
        table[row_of_run, 0], table[row_of_run, 1] = addr, length
        owner = np.repeat(np.arange(len(gap)), pieces)
        k = np.arange(len(owner)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        table[is_gap, 0] = scratch.ctypes.data
        table[is_gap, 1] = np.minimum(g, gap[owner] - k * g)
        first = int(row_of_run[0])
    table[first, 0] += head
    table[first, 1] -= head
    table[-1, 1] -= tail  # gaps only ever precede runs: the last row is the last run
    return table


def _read_table(reader, plan: FilePlan, i: int, dest_ptr: np.ndarray, scratch: np.ndarray, gapless: bool) -> None:
    """A chunk through ``preadv`` iovec tables, :data:`TABLE_RUNS` runs per table
    (so a thread's table memory stays a few MiB however many runs a chunk has)."""
    cs, ce, lo, hi = _runs(plan, i)
    start = cs
    for a in range(lo, hi, TABLE_RUNS):
        b = min(a + TABLE_RUNS, hi)
        reader.readv_table(_iov_table(plan, a, b, start, dest_ptr, scratch, gapless, cs, ce), start)
        start = int(plan.offset[b - 1] + plan.length[b - 1])


def _direct(reader, plan: FilePlan, dests: list[np.ndarray], i: int, scratch: np.ndarray) -> None:
    """One memoryview per run (gaps into ``scratch``), for readers without tables."""
    cs, ce, _, _ = _runs(plan, i)
    iovs, pos, gap_view = [], cs, scratch.data

    def skip(n: int) -> None:
        while n > 0:
            iovs.append(gap_view[: min(n, len(gap_view))])
            n -= len(gap_view)

    for off, ln, d, doff in zip(*(c.tolist() for c in chunk_runs(plan, i)), strict=False):
        skip(off - pos)
        iovs.append(memoryview(dests[d])[doff : doff + ln])
        pos = off + ln
    skip(ce - pos)
    reader.readv(iovs, cs)


def _segments(src: np.ndarray, dst: np.ndarray) -> list[int]:
    """Boundaries of maximal stretches where both the src and the dst steps are constant."""
    if len(src) <= 2:
        return [0, len(src)]
    ds, dd = np.diff(src), np.diff(dst)
    change = np.flatnonzero((ds[1:] != ds[:-1]) | (dd[1:] != dd[:-1])) + 1
    bounds = [0]  # a step change at j: run j+1 starts a stretch (greedy, left to right)
    for c in change.tolist():
        if c > bounds[-1]:
            bounds.append(c + 1)
    if bounds[-1] != len(src):
        bounds.append(len(src))
    return bounds


def _copy_out(block: np.ndarray, src, length, dest, doff, dests: list[np.ndarray]) -> None:
    """Copy runs ``block[src:src+length] -> dests[dest][doff:...]``: one strided
    numpy copy per stretch of equal length and constant steps."""
    order = np.lexsort((src, length, dest))
    src, length, dest, doff = src[order], length[order], dest[order], doff[order]
    cut = np.flatnonzero((np.diff(dest) != 0) | (np.diff(length) != 0)) + 1
    for g0, g1 in zip([0, *cut.tolist()], [*cut.tolist(), len(src)], strict=False):
        ln, target = int(length[g0]), dests[int(dest[g0])]
        bounds = _segments(src[g0:g1], doff[g0:g1])
        for a, b in itertools.pairwise(bounds):
            a, b = a + g0, b + g0
            n = b - a
            s_step = int(src[a + 1] - src[a]) if n > 1 else 0
            d_step = int(doff[a + 1] - doff[a]) if n > 1 else 0
            s_view = as_strided(block[int(src[a]) :], (n, ln), (s_step, 1), writeable=False)
            as_strided(target[int(doff[a]) :], (n, ln), (d_step, 1))[...] = s_view


def _scatter(
    reader, plan: FilePlan, dests: list[np.ndarray], i: int, scratch: Callable[[int], np.ndarray], block_bytes: int
) -> None:
    """Read the chunk in blocks of about ``block_bytes`` (cut between runs) into
    scratch, copying each block's runs out with strided numpy copies."""
    cs, _ce, _, _ = _runs(plan, i)
    off, length, dest, doff = chunk_runs(plan, i)
    bucket = (off - cs) // block_bytes
    cut = (np.flatnonzero(np.diff(bucket)) + 1).tolist()
    start = cs
    for a, b in zip([0, *cut], [*cut, len(off)], strict=False):
        stop = int(off[b - 1] + length[b - 1])
        buf = scratch(stop - start)[: stop - start]
        reader.readv([buf.data], start)  # from the previous block's end: the chunk, read once
        _copy_out(buf, off[a:b] - start, length[a:b], dest[a:b], doff[a:b], dests)
        start = stop


_PLAN_BUG = "internal error: a planned read falls outside its chunk or destination buffer"


def _check_dests(dest: np.ndarray, doff: np.ndarray, length: np.ndarray, sizes: np.ndarray) -> None:
    """Every run must land inside its destination buffer: reads write through raw
    addresses, so a planning bug must stop here, not corrupt memory."""
    if dest.min() < 0 or dest.max() >= len(sizes) or doff.min() < 0 or (doff + length > sizes[dest]).any():
        raise NnxSaveError(_PLAN_BUG)


def _check_runs(plan: FilePlan, i: int, sizes: np.ndarray) -> None:
    """Chunk ``i``'s runs must meet the chunk, be sorted and disjoint, and land inside their destinations."""
    cs, ce, lo, hi = _runs(plan, i)
    off, length = plan.offset[lo:hi], plan.length[lo:hi]
    if (
        not (0 <= lo < hi <= len(plan.offset))
        or off[0] + length[0] <= cs
        or off[-1] >= ce
        or length.min() <= 0
        or (off[1:] < off[:-1] + length[:-1]).any()
    ):
        raise NnxSaveError(_PLAN_BUG)
    _check_dests(plan.dest[lo:hi], plan.dest_offset[lo:hi], length, sizes)


class _Scratch:
    """Per-thread reusable buffers: one for gaps, one for scatter blocks."""

    def __init__(self, gap_bytes: int) -> None:
        self.gap_bytes = gap_bytes
        self.local = threading.local()

    def gap(self) -> np.ndarray:
        buf = getattr(self.local, "gap", None)
        if buf is None:
            buf = self.local.gap = np.empty(max(self.gap_bytes, 1), np.uint8)
        return buf

    def block(self, n: int) -> np.ndarray:
        buf = getattr(self.local, "block", None)
        if buf is None or len(buf) < n:
            buf = self.local.block = np.empty(n, np.uint8)
        return buf


def _small_chunks(batches: bool, plan: FilePlan) -> np.ndarray:
    """Per chunk: whether it is one run's part of at most :data:`SMALL_CHUNK` bytes
    that a local reader can batch (all False for other readers: ``batches``, whether
    the reader can read runs)."""
    if not batches or not len(plan.offset):
        return np.zeros(plan.num_chunks, bool)
    cs, ce, lo, hi = plan.chunk_start, plan.chunk_end, plan.chunk_lo, plan.chunk_hi
    valid = (lo >= 0) & (hi <= len(plan.offset))  # a bad index takes the chunk path, whose checks refuse it
    run = np.clip(lo, 0, len(plan.offset) - 1)
    inside = (plan.offset[run] <= cs) & (ce <= plan.offset[run] + plan.length[run])
    return valid & (hi - lo == 1) & (ce - cs <= SMALL_CHUNK) & (ce > cs) & inside


def _batch_bounds(small: list[bool], span: list[int], max_bytes: int) -> list[tuple[int, int]]:
    """Chunk index ranges ``[a, b)`` run as one task: a chunk alone, or a batch of
    consecutive small chunks (at most :data:`BATCH_CHUNKS` of them, ``max_bytes`` bytes)."""
    units, a, n = [], 0, len(small)
    while a < n:
        b, held = a + 1, span[a]
        while small[a] and b < n and small[b] and b - a < BATCH_CHUNKS and held + span[b] <= max_bytes:
            held += span[b]
            b += 1
        units.append((a, b))
        a = b
    return units


def _read_batch(reader: Reader, plan: FilePlan, a: int, b: int, dest_ptr: np.ndarray, sizes: np.ndarray) -> None:
    """Small chunks ``[a, b)`` (see :func:`_small_chunks`), one ``pread`` each, once
    their runs are checked against their destinations."""
    cs, ce, run = plan.chunk_start[a:b], plan.chunk_end[a:b], plan.chunk_lo[a:b]
    dest, doff, off, length = plan.dest[run], plan.dest_offset[run], plan.offset[run], plan.length[run]
    _check_dests(dest, doff, length, sizes)
    addr = dest_ptr[dest] + (doff + cs - off).astype(np.uint64)
    reader.read_runs(addr.tolist(), (ce - cs).tolist(), cs.tolist())


def _method(table: bool, runs: int, nbytes_needed: int) -> str:
    """How a chunk of ``runs`` runs is read, by a reader that reads iovec tables (``table``) or not."""
    if runs <= DIRECT_MAX_RUNS or nbytes_needed >= runs * (DIRECT_MIN_RUN if table else DIRECT_MIN_RUN_PY):
        return "table" if table else "direct"
    return "scatter"


def execute(
    reader: Reader,
    plan: FilePlan,
    dests: list[np.ndarray],
    *,
    budget: Budget,
    num_threads: int,
    on_chunk: Callable[[int], None] | None = None,
    cancel: threading.Event | None = None,
    capabilities: tuple[bool, bool] | None = None,
    pool: Executor | None = None,
) -> None:
    """Run every chunk of ``plan`` into ``dests`` (flat uint8 arrays), concurrently,
    never holding more than ``budget.limit`` bytes of chunks in flight.
    ``pool``: the load's reading threads, shared by the files read at once (each
    file's chunks queue there, so no thread idles while another file has chunks
    left); without it, ``num_threads`` threads of this file's own.
    ``on_chunk(needed bytes)`` is called after each chunk (progress). Once
    ``cancel`` is set, chunks not yet started raise :class:`Cancelled`.
    ``capabilities``: the reader's ``(can_read_tables(), can_read_runs())`` when the
    caller asked them as it opened it (else asked here)."""
    if not plan.num_chunks:
        return
    sizes = np.array([len(d) for d in dests], np.int64)
    dest_ptr = np.array([d.ctypes.data for d in dests], np.uint64)
    local, batches = capabilities or (reader.can_read_tables(), reader.can_read_runs())  # once per file
    needed, span = plan.chunk_needed, plan.chunk_end - plan.chunk_start
    gap_bytes = span - needed  # per chunk: 0 when its runs touch
    scratch = _Scratch(min(int(gap_bytes.max()), GAP_SCRATCH))
    small = _small_chunks(batches, plan)

    def run(a: int, b: int) -> None:
        """Chunk ``a`` alone, or the batch of small chunks ``[a, b)``."""
        if not small[a]:
            _check_runs(plan, a, sizes)
        if cancel is not None and cancel.is_set():
            raise Cancelled
        with budget(int(span[a:b].sum())):
            if small[a]:
                _read_batch(reader, plan, a, b, dest_ptr, sizes)
            elif (how := _method(local, int(plan.chunk_hi[a] - plan.chunk_lo[a]), int(needed[a]))) == "table":
                _read_table(reader, plan, a, dest_ptr, scratch.gap(), gapless=not gap_bytes[a])
            elif how == "direct":
                _direct(reader, plan, dests, a, scratch.gap())
            else:
                _scatter(reader, plan, dests, a, scratch.block, SCATTER_BLOCK if local else int(span[a]))
        if on_chunk is not None:
            for n in needed[a:b].tolist():
                on_chunk(n)

    tasks = _batch_bounds(small.tolist(), span.tolist(), min(BATCH_BYTES, budget.limit))
    if pool is None and (len(tasks) <= 1 or num_threads <= 1):
        for a, b in tasks:
            run(a, b)
        return
    if pool is not None:
        _run_all(pool, run, tasks)
        return
    with ThreadPoolExecutor(min(num_threads, len(tasks)), thread_name_prefix="nnx_save-read") as own:
        _run_all(own, run, tasks)


def _run_all(pool: Executor, run: Callable[[int, int], None], tasks: list[tuple[int, int]]) -> None:
    """``run`` every task on ``pool``; the first failure raised once the tasks already
    running are over, those not started dropped, not read."""
    futures = [pool.submit(run, a, b) for a, b in tasks]
    try:
        for f in futures:
            f.result()
    finally:
        for f in futures:
            f.cancel()
