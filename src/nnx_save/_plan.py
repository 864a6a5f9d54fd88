"""Pure planning: shard boxes -> byte runs -> coalesced blocks -> read chunks.

Nothing here knows about files or devices. A :class:`Request` says "these elements
of this tensor go to destination buffer ``dest``"; :func:`plan_file` turns all the
requests of one file into numpy arrays of runs (file offset, length, destination,
destination offset), merges them into blocks and splits blocks into chunks. The
result is plain data that can be printed, compared and property-tested against
numpy slicing. Everything is vectorised: a shard split on its last dimension makes
one run per row, hundreds of thousands of them, without a Python object each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Request", "FilePlan", "box_runs", "plan_file", "PAGE_GAP", "AUTO_MAX_READS"]

PAGE_GAP = 4096  # gaps below a page are always read through: cheaper than another request
AUTO_MAX_READS = 1024  # the automatic ratio keeps exact reads while they stay this few

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Request:
    """Elements ``box`` (per-dimension ``[start, stop)``) of a C-ordered tensor whose
    data starts at byte ``base`` of its file, into destination ``dest`` (C-ordered)."""

    dest: int
    base: int
    shape: tuple[int, ...]
    itemsize: int
    box: Box


def box_runs(shape: Sequence[int], itemsize: int, box: Box, base: int = 0) -> tuple[np.ndarray, int]:
    """File offsets of the contiguous runs that make up ``box``, and the run length.

    Runs come in C order of the box, so run ``i`` lands at ``i * length`` in a
    C-ordered destination of the box's shape.

    Examples:
        >>> offsets, length = box_runs((4, 6), 4, ((0, 4), (3, 6)))
        >>> offsets.tolist(), length
        ([12, 36, 60, 84], 12)
    """
    extents = [hi - lo for lo, hi in box]
    if any(e == 0 for e in extents):
        return np.empty(0, np.int64), 0
    strides = [itemsize * math.prod(shape[d + 1:]) for d in range(len(shape))]
    k = len(shape) - 1
    while k >= 0 and box[k] == (0, shape[k]):
        k -= 1
    if k < 0:  # the whole tensor
        return np.array([base], np.int64), itemsize * math.prod(shape)
    length = extents[k] * strides[k]
    offsets = np.array(base + box[k][0] * strides[k], np.int64).reshape((1,) * k)
    for d in range(k):
        axis = np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d]
        offsets = offsets + axis.reshape((1,) * d + (-1,) + (1,) * (k - d - 1))
    return offsets.reshape(-1), length


@dataclass(frozen=True, eq=False)
class FilePlan:
    """Every byte one file must give, sorted, merged and chunked.

    Runs (sorted by offset; split where a chunk boundary cuts them):
    ``offset``, ``length``, ``dest``, ``dest_offset``. Chunks: ``[chunk_start,
    chunk_end)`` in the file, with runs ``[chunk_lo, chunk_hi)``.
    """

    offset: np.ndarray
    length: np.ndarray
    dest: np.ndarray
    dest_offset: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    chunk_lo: np.ndarray
    chunk_hi: np.ndarray
    ratio: float
    page_blocks: int

    @property
    def needed_bytes(self) -> int:
        return int(self.length.sum())

    @property
    def read_bytes(self) -> int:
        return int((self.chunk_end - self.chunk_start).sum())

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_start)

    def __repr__(self) -> str:
        return (
            f"FilePlan(runs={len(self.offset)}, chunks={self.num_chunks}, needed={self.needed_bytes}, "
            f"read={self.read_bytes}, ratio={self.ratio:.3g}, page_blocks={self.page_blocks})"
        )


def _gather_runs(requests: Sequence[Request]) -> tuple[np.ndarray, ...]:
    parts = []
    for r in requests:
        offsets, length = box_runs(r.shape, r.itemsize, r.box, r.base)
        if len(offsets):
            n = len(offsets)
            parts.append((offsets, np.full(n, length, np.int64), np.full(n, r.dest, np.int64),
                          np.arange(n, dtype=np.int64) * length))
    if not parts:
        return tuple(np.empty(0, np.int64) for _ in range(4))
    cols = [np.concatenate([p[i] for p in parts]) for i in range(4)]
    order = np.argsort(cols[0], kind="stable")
    return tuple(c[order] for c in cols)


def _page_blocks(offset: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs whose gap is under a page: block starts, ends and needed bytes."""
    end = offset + length
    reach = np.maximum.accumulate(end)
    new = np.empty(len(offset), bool)
    new[:1] = True
    new[1:] = offset[1:] - reach[:-1] >= PAGE_GAP
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(offset)) - 1
    return offset[first], reach[last], np.add.reduceat(length, first)


def _merge_under_ratio(start: np.ndarray, end: np.ndarray, need: np.ndarray, ratio: float):
    """Greedy left-to-right merge while block span / needed bytes stays <= ratio."""
    total_span, total_need = int(end[-1] - start[0]), int(need.sum())
    if ratio * total_need >= total_span:  # everything fits under the cap: one block
        return start[:1], end[-1:]
    out_s, out_e = [int(start[0])], [int(end[0])]
    cur_need = int(need[0])
    for s, e, n in zip(start[1:].tolist(), end[1:].tolist(), need[1:].tolist()):
        if (e - out_s[-1]) <= ratio * (cur_need + n):
            out_e[-1], cur_need = e, cur_need + n
        else:
            out_s.append(s), out_e.append(e)
            cur_need = n
    return np.array(out_s, np.int64), np.array(out_e, np.int64)


def _chunk_bounds(start: np.ndarray, end: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    counts = -(-(end - start) // chunk)
    block = np.repeat(np.arange(len(start)), counts)
    k = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    cs = start[block] + k * chunk
    return cs, np.minimum(cs + chunk, end[block])


def _split_at(cuts: np.ndarray, offset, length, dest, dest_offset):
    """Split runs at every cut strictly inside them, so each piece lies in one chunk."""
    end = offset + length
    i0 = np.searchsorted(cuts, offset, "right")
    i1 = np.searchsorted(cuts, end, "left")
    pieces = np.maximum(i1 - i0, 0) + 1
    if (pieces == 1).all():
        return offset, length, dest, dest_offset
    run = np.repeat(np.arange(len(offset)), pieces)
    j = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    lo_cut = cuts[np.clip(i0[run] + j - 1, 0, max(len(cuts) - 1, 0))]
    p_start = np.where(j == 0, offset[run], lo_cut)
    hi_cut = cuts[np.clip(i0[run] + j, 0, max(len(cuts) - 1, 0))]
    p_end = np.where(j == pieces[run] - 1, end[run], hi_cut)
    return p_start, p_end - p_start, dest[run], dest_offset[run] + (p_start - offset[run])


def auto_ratio(page_starts: np.ndarray, page_ends: np.ndarray, needed: int) -> float:
    """1.0 while at most :data:`AUTO_MAX_READS` reads survive the page-gap merge,
    else the file's span / needed (read the span in big sequential chunks)."""
    if len(page_starts) <= AUTO_MAX_READS or needed == 0:
        return 1.0
    return float(page_ends[-1] - page_starts[0]) / needed


def plan_file(
    requests: Sequence[Request],
    *,
    max_over_read_ratio: float | None = None,
    chunk_bytes: int = 128 << 20,
) -> FilePlan:
    """Plan every read of one file.

    Args:
        requests: the destinations to fill from this file.
        max_over_read_ratio: cap on (block span / needed bytes) when merging
            blocks beyond page gaps; ``None`` picks it with :func:`auto_ratio`.
        chunk_bytes: the largest single read.

    Returns:
        A :class:`FilePlan`.

    Examples:
        >>> reqs = [Request(0, 100, (4, 6), 4, ((0, 4), (0, 3))), Request(1, 100, (4, 6), 4, ((0, 4), (3, 6)))]
        >>> p = plan_file(reqs)
        >>> p.needed_bytes, p.read_bytes, p.num_chunks
        (96, 96, 1)
    """
    if max_over_read_ratio is not None and max_over_read_ratio < 1.0:
        raise ValueError(f"max_over_read_ratio must be >= 1.0, got {max_over_read_ratio}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    offset, length, dest, dest_offset = _gather_runs(requests)
    if len(offset) == 0:
        empty = np.empty(0, np.int64)
        return FilePlan(offset, length, dest, dest_offset, empty, empty, empty, empty, 1.0, 0)
    ps, pe, pneed = _page_blocks(offset, length)
    ratio = auto_ratio(ps, pe, int(pneed.sum())) if max_over_read_ratio is None else float(max_over_read_ratio)
    bs, be = _merge_under_ratio(ps, pe, pneed, ratio) if len(ps) > 1 else (ps, pe)
    cs, ce = _chunk_bounds(bs, be, chunk_bytes)
    offset, length, dest, dest_offset = _split_at(cs[1:], offset, length, dest, dest_offset)
    lo = np.searchsorted(offset, cs, "left")
    hi = np.searchsorted(offset, ce, "left")
    return FilePlan(offset, length, dest, dest_offset, cs, ce, lo, hi, ratio, len(ps))
