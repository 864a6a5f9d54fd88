"""Execute a :class:`~nnx_save._plan.FilePlan`: concurrent positioned reads under a
byte budget, straight into destination buffers.

Two ways to read a chunk, chosen per chunk:

- **direct**: one ``os.preadv`` iovec per destination slice (and a small reusable
  scratch for the gaps between them): no intermediate copy. Used when runs are
  few or large.
- **scatter**: read the chunk into a scratch block, then copy each run with one
  strided numpy copy per regular group of runs. Used for finely strided runs (a
  last-dimension split makes one run per row per shard), where building hundreds of
  thousands of iovecs in Python would dominate.

Both count the chunk's bytes against the in-flight budget while it is being read.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ._errors import NnxSaveError
from ._plan import FilePlan

__all__ = ["ReadStats", "Budget", "LocalReader", "execute", "aligned_empty", "DIRECT_MIN_RUN"]

IOV_MAX = 1024
DIRECT_MIN_RUN = 64 << 10  # mean run length above which direct preadv wins
DIRECT_MAX_RUNS = 64  # few runs: always direct


@dataclass
class ReadStats:
    """I/O counters of one load (summed over files)."""

    bytes_read: int = 0
    bytes_needed: int = 0
    requests: int = 0
    chunks: int = 0
    max_inflight: int = 0
    seconds: float = 0.0
    per_file: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def over_read(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


class Budget:
    """A byte semaphore: ``with budget(n):`` waits until ``n`` bytes fit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self._cond = threading.Condition()

    def __call__(self, n: int) -> "_Hold":
        return _Hold(self, min(n, self.limit))


class _Hold:
    def __init__(self, budget: Budget, n: int) -> None:
        self.budget, self.n = budget, n

    def __enter__(self) -> None:
        b = self.budget
        with b._cond:
            b._cond.wait_for(lambda: b.used + self.n <= b.limit)
            b.used += self.n
            b.peak = max(b.peak, b.used)

    def __exit__(self, *exc: object) -> None:
        b = self.budget
        with b._cond:
            b.used -= self.n
            b._cond.notify_all()


def aligned_empty(nbytes: int, align: int = 64) -> np.ndarray:
    """A flat uint8 buffer whose data pointer is ``align``-byte aligned (jax on CPU
    adopts such buffers without a copy)."""
    raw = np.empty(nbytes + align, np.uint8)
    shift = -raw.ctypes.data % align
    return raw[shift:shift + nbytes]


class LocalReader:
    """Positioned reads from a local file; ``preadv`` releases the GIL."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.requests = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        os.close(self.fd)

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        """Fill ``buffers`` in order from ``offset``, or raise naming the offset."""
        total = sum(len(b) for b in buffers)
        done = 0
        while buffers:
            n = os.preadv(self.fd, buffers[:IOV_MAX], offset + done)
            with self._lock:
                self.requests += 1
            if n == 0:
                raise NnxSaveError(f"{self.path}: file ended at byte {offset + done}, expected {total - done} more bytes (was it truncated while loading?)")
            done += n
            while buffers and n >= len(buffers[0]):
                n -= len(buffers[0])
                buffers = buffers[1:]
            if n:
                buffers[0] = buffers[0][n:]


def _direct(reader, plan: FilePlan, dests: list[np.ndarray], i: int, scratch: np.ndarray) -> None:
    cs, ce = int(plan.chunk_start[i]), int(plan.chunk_end[i])
    lo, hi = int(plan.chunk_lo[i]), int(plan.chunk_hi[i])
    iovs, pos = [], cs
    gap_view = memoryview(scratch)
    for off, ln, d, doff in zip(plan.offset[lo:hi].tolist(), plan.length[lo:hi].tolist(),
                                plan.dest[lo:hi].tolist(), plan.dest_offset[lo:hi].tolist()):
        if off > pos:
            iovs.append(gap_view[:off - pos])
        iovs.append(memoryview(dests[d])[doff:doff + ln])
        pos = off + ln
    if ce > pos:
        iovs.append(gap_view[:ce - pos])
    reader.readv(iovs, cs)


def _segments(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Boundaries of maximal stretches where both src and dst steps are constant."""
    if len(src) <= 2:
        return np.array([0, len(src)])
    ds, dd = np.diff(src), np.diff(dst)
    change = np.flatnonzero((ds[1:] != ds[:-1]) | (dd[1:] != dd[:-1])) + 1
    # a change at step j means run j+1 starts a new stretch
    return np.unique(np.concatenate([[0], change + 1, [len(src)]]))


def _scatter(reader, plan: FilePlan, dests: list[np.ndarray], i: int) -> None:
    cs, ce = int(plan.chunk_start[i]), int(plan.chunk_end[i])
    lo, hi = int(plan.chunk_lo[i]), int(plan.chunk_hi[i])
    block = np.empty(ce - cs, np.uint8)
    reader.readv([memoryview(block)], cs)
    src = plan.offset[lo:hi] - cs
    length, dest, doff = plan.length[lo:hi], plan.dest[lo:hi], plan.dest_offset[lo:hi]
    order = np.lexsort((src, length, dest))
    src, length, dest, doff = src[order], length[order], dest[order], doff[order]
    groups = np.flatnonzero((np.diff(dest) != 0) | (np.diff(length) != 0)) + 1
    for g0, g1 in zip(np.r_[0, groups].tolist(), np.r_[groups, len(src)].tolist()):
        d, ln, target = int(dest[g0]), int(length[g0]), dests[int(dest[g0])]
        bounds = _segments(src[g0:g1], doff[g0:g1]).tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            a, b, n = a + g0, b + g0, b - a
            s_step = int(src[a + 1] - src[a]) if n > 1 else 0
            d_step = int(doff[a + 1] - doff[a]) if n > 1 else 0
            s_view = as_strided(block[int(src[a]):], (n, ln), (s_step, 1), writeable=False)
            d_view = as_strided(target[int(doff[a]):], (n, ln), (d_step, 1))
            d_view[...] = s_view


def execute(
    reader,
    plan: FilePlan,
    dests: list[np.ndarray],
    *,
    budget: Budget,
    num_threads: int,
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    """Run every chunk of ``plan`` into ``dests`` (flat uint8 arrays), concurrently,
    never holding more than ``budget.limit`` bytes of chunks in flight.
    ``on_chunk(needed bytes)`` is called after each chunk (progress)."""
    max_gap = 0
    if plan.num_chunks:
        gaps = plan.offset[1:] - (plan.offset[:-1] + plan.length[:-1])
        max_gap = int(max(gaps.max(initial=0), PAGE_SCRATCH))
    local = threading.local()

    def run(i: int) -> None:
        nbytes = int(plan.chunk_end[i] - plan.chunk_start[i])
        runs = int(plan.chunk_hi[i] - plan.chunk_lo[i])
        with budget(nbytes):
            if runs <= DIRECT_MAX_RUNS or nbytes >= runs * DIRECT_MIN_RUN:
                scratch = getattr(local, "scratch", None)
                if scratch is None or len(scratch) < min(max_gap, nbytes):
                    scratch = local.scratch = np.empty(min(max_gap, nbytes), np.uint8)
                _direct(reader, plan, dests, i, scratch)
            else:
                _scatter(reader, plan, dests, i)
        if on_chunk is not None:
            on_chunk(int(plan.length[plan.chunk_lo[i]:plan.chunk_hi[i]].sum()))

    if plan.num_chunks <= 1 or num_threads <= 1:
        for i in range(plan.num_chunks):
            run(i)
        return
    with ThreadPoolExecutor(min(num_threads, plan.num_chunks), thread_name_prefix="nnx_save-read") as pool:
        for f in [pool.submit(run, i) for i in range(plan.num_chunks)]:
            f.result()


PAGE_SCRATCH = 4096
