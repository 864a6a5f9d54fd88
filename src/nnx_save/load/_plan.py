"""Pure planning: shard boxes -> byte runs -> coalesced blocks -> read chunks.

:func:`plan_file` turns one file's :class:`Request` s into numpy arrays of runs (no
Python object per run), then merges runs less than :data:`PAGE_GAP` apart, merges
neighbouring blocks while the over-read ratio allows (:func:`auto_ratio`), and cuts
blocks into chunks trimmed to their runs. Overlapping boxes are planned in separate
passes, so each chunk is one sequential read of sorted, disjoint runs. Property-tested
against numpy slicing (tests/load/test_plan.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import OptionError
from ..format._boxes import Box, intersect, run_geometry, run_grid
from ._pieces import Request

__all__ = [
    "AUTO_MAX_READS",
    "PAGE_GAP",
    "FilePlan",
    "chunk_runs",
    "over_read_by_range",
    "plan_file",
]

PAGE_GAP = 4096  # gaps below a page are always read through: cheaper than another request
AUTO_MAX_READS = 1024  # the automatic ratio keeps exact reads while they stay this few


@dataclass(frozen=True, eq=False)
class FilePlan:
    """Every byte one file must give, sorted, merged and chunked.

    Runs (one per contiguous destination slice): ``offset``, ``length``, ``dest``,
    ``dest_offset``. Chunks (one read each): ``[chunk_start, chunk_end)`` in the
    file, serving the parts of runs ``[chunk_lo, chunk_hi)`` that fall inside it
    (a run a chunk boundary cuts is served by both chunks; runs are never copied to
    be split), ``chunk_needed`` of those bytes. A chunk's runs are sorted and
    disjoint, and it is trimmed: it starts at its first run, or where the previous
    chunk ended when that run began there, and ends likewise. Runs are sorted
    file-wide unless overlapping boxes made several passes.
    """

    offset: np.ndarray
    length: np.ndarray
    dest: np.ndarray
    dest_offset: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    chunk_lo: np.ndarray
    chunk_hi: np.ndarray
    chunk_needed: np.ndarray
    ratio: float
    page_blocks: int
    needed_bytes: int = field(init=False)  # computed once here: the engine and the report ask for them
    read_bytes: int = field(init=False)
    num_chunks: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "needed_bytes", int(self.length.sum()))
        object.__setattr__(self, "read_bytes", int((self.chunk_end - self.chunk_start).sum()))
        object.__setattr__(self, "num_chunks", len(self.chunk_start))

    def __repr__(self) -> str:
        return (
            f"FilePlan(runs={len(self.offset)}, chunks={self.num_chunks}, needed={self.needed_bytes}, "
            f"read={self.read_bytes}, ratio={self.ratio:.3g}, page_blocks={self.page_blocks})"
        )


def _gather_runs(requests: Sequence[Request]) -> tuple[np.ndarray, ...]:
    """Every run of every request, sorted by file offset: offset, length, dest, dest_offset.

    One-run boxes are sorted as plain numbers; each tensor's strided boxes are built
    straight into the output columns (:func:`_tensor_runs`), between them.
    """
    flat: list[tuple[int, int, int, int]] = []  # (offset, length, dest, dest offset) of one-run boxes
    strided: dict[tuple, list] = {}  # tensor -> its strided boxes
    for r in requests:
        g = run_geometry(r.shape, r.itemsize, r.box, r.base, r.dest_shape, r.dest_at)
        if g is None:
            continue
        if g[2]:
            plain = r.dest_shape is None and r.dest_at is None  # runs land back to back
            strided.setdefault((r.base, r.shape, r.itemsize), []).append((*g[:4], r.box, r.dest, g[4], plain))
        else:
            flat.append((g[0], g[1], r.dest, g[4]))
    flat.sort()
    flat_cols = np.array(flat, np.int64).reshape(-1, 4).T  # offset, length, dest, dest offset
    groups = sorted((min(b[0] for b in boxes), boxes) for boxes in strided.values())
    sizes = np.array([sum(math.prod(row[0] for row in b[2]) for b in boxes) for _, boxes in groups], np.int64)
    before = np.searchsorted(flat_cols[0], np.array([g[0] for g in groups], np.int64))  # flat runs before each group
    shift = np.concatenate([[0], np.cumsum(sizes)])
    cols = tuple(np.empty(len(flat) + int(shift[-1]), np.int64) for _ in range(4))
    pos = np.arange(len(flat)) + shift[np.searchsorted(before, np.arange(len(flat)), "right")]
    for c, v in zip(cols, flat_cols, strict=True):
        c[pos] = v
    for (_, boxes), n, at in zip(groups, sizes.tolist(), (before + shift[:-1]).tolist(), strict=False):
        _tensor_runs(boxes, tuple(c[at : at + n] for c in cols))
    offset = cols[0]
    if len(offset) > 1 and (offset[1:] < offset[:-1]).any():  # only boxes that overlap get here
        order = np.argsort(offset, kind="stable")
        cols = tuple(c[order] for c in cols)
    return cols


def _interleaves(boxes: list) -> bool:
    """Same cut dimension, same outer ranges, disjoint ranges on the cut dimension."""
    if len(boxes) == 1:
        return True
    k = boxes[0][3]
    if any(b[3] != k or b[4][:k] != boxes[0][4][:k] for b in boxes) or k < 0:
        return False
    spans = sorted((b[0], b[0] + b[1]) for b in boxes)
    return all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))


def _tensor_runs(boxes: list, out: tuple[np.ndarray, ...]) -> None:
    """Fill ``out`` (offset, length, dest, dest_offset) with one tensor's runs, sorted."""
    offset, length, dest, dest_offset = out
    if _interleaves(boxes):
        boxes = sorted(boxes, key=lambda b: b[0])
        grid = run_grid(0, boxes[0][2])  # row starts, shared by every box
        firsts = np.array([b[0] for b in boxes], np.int64)
        lens = np.array([b[1] for b in boxes], np.int64)
        m = len(boxes)
        np.add(grid[:, None], firsts[None, :], out=offset.reshape(-1, m))
        length.reshape(-1, m)[:] = lens
        dest.reshape(-1, m)[:] = np.array([b[5] for b in boxes], np.int64)
        if all(b[7] for b in boxes):
            np.multiply(np.arange(len(grid), dtype=np.int64)[:, None], lens[None, :], out=dest_offset.reshape(-1, m))
        else:
            for j, b in enumerate(boxes):
                dest_offset.reshape(-1, m)[:, j] = run_grid(b[6], b[2], 2)
        return
    at = 0
    for first, ln, outer, _, _, d, dfirst, _ in boxes:  # overlapping or differently cut boxes: sort
        grid = run_grid(first, outer)
        offset[at : at + len(grid)] = grid
        length[at : at + len(grid)] = ln
        dest[at : at + len(grid)] = d
        dest_offset[at : at + len(grid)] = run_grid(dfirst, outer, 2)
        at += len(grid)
    order = np.argsort(offset, kind="stable")
    for c in out:
        c[:] = c[order]


def _page_blocks(offset: np.ndarray, end: np.ndarray, gap: np.ndarray, length: np.ndarray):
    """Merge sorted, disjoint runs whose gap is under a page: block starts, ends and
    needed bytes (``gap[i]`` is the gap before run ``i + 1``)."""
    first = np.concatenate([[0], np.flatnonzero(gap >= PAGE_GAP) + 1])
    last = np.append(first[1:], len(offset)) - 1
    return offset[first], end[last], np.add.reduceat(length, first)


def _merge_under_ratio(start: np.ndarray, end: np.ndarray, need: np.ndarray, ratio: float):
    """Greedy left-to-right merge while block span / needed bytes stays <= ratio."""
    total_span, total_need = int(end[-1] - start[0]), int(need.sum())
    if ratio * total_need >= total_span:  # everything fits under the cap: one block
        return start[:1], end[-1:]
    if ratio <= 1.0:  # page blocks are separated by gaps: none can merge
        return start, end
    out_s, out_e = [int(start[0])], [int(end[0])]
    cur_need = int(need[0])
    for s, e, n in zip(start[1:].tolist(), end[1:].tolist(), need[1:].tolist(), strict=False):
        if (e - out_s[-1]) <= ratio * (cur_need + n):
            out_e[-1], cur_need = e, cur_need + n
        else:
            out_s.append(s)
            out_e.append(e)
            cur_need = n
    return np.array(out_s, np.int64), np.array(out_e, np.int64)


def _chunk_bounds(start: np.ndarray, end: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    counts = -(-(end - start) // chunk)
    block = np.repeat(np.arange(len(start)), counts)
    k = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    cs = start[block] + k * chunk
    return cs, np.minimum(cs + chunk, end[block])


def auto_ratio(page_starts: np.ndarray, page_ends: np.ndarray, needed: int) -> float:
    """1.0 while at most :data:`AUTO_MAX_READS` reads survive the page-gap merge,
    else the file's span / needed (read the span in big sequential chunks)."""
    if len(page_starts) <= AUTO_MAX_READS or needed == 0:
        return 1.0
    return float(page_ends[-1] - page_starts[0]) / needed


def _disjoint_layers(requests: Sequence[Request]) -> list[list[Request]]:
    """Requests in groups whose boxes never overlap (two targets made from one tensor
    with different shardings, or a tensor wanted both sharded and whole). Each group
    is planned on its own: one sequential read cannot fill two places at once."""
    layers: list[list[Request]] = []
    seen: dict[tuple, list[list[Box]]] = {}  # tensor -> boxes per layer
    for r in requests:
        per_layer = seen.setdefault((r.base, r.shape, r.itemsize), [])
        k = next(
            (i for i, boxes in enumerate(per_layer) if not any(intersect(r.box, b) is not None for b in boxes)),
            len(per_layer),
        )
        if k == len(per_layer):
            per_layer.append([])
        per_layer[k].append(r.box)
        if k == len(layers):
            layers.append([])
        layers[k].append(r)
    return layers


def plan_file(
    requests: Sequence[Request],
    *,
    max_over_read_ratio: float | None = None,
    chunk_bytes: int = 128 << 20,
) -> FilePlan:
    """Plan every read of one file (the steps of the module docstring).

    Args:
        requests: the destinations to fill from this file.
        max_over_read_ratio: cap on (block span / needed bytes) when merging
            blocks beyond page gaps; ``None`` picks it with :func:`auto_ratio`.
        chunk_bytes: the largest single read.

    Returns:
        A :class:`FilePlan`.

    Raises:
        OptionError: ``max_over_read_ratio`` below 1 or ``chunk_bytes`` not positive.

    Examples:
        >>> reqs = [Request(0, 100, (4, 6), 4, ((0, 4), (0, 3))), Request(1, 100, (4, 6), 4, ((0, 4), (3, 6)))]
        >>> p = plan_file(reqs)
        >>> p.needed_bytes, p.read_bytes, p.num_chunks
        (96, 96, 1)
    """
    if max_over_read_ratio is not None and not max_over_read_ratio >= 1.0:
        raise OptionError(f"max_over_read_ratio must be >= 1.0, got {max_over_read_ratio}", "max_over_read_ratio")
    if chunk_bytes <= 0:
        raise OptionError(f"chunk_bytes must be positive, got {chunk_bytes}", "chunk_bytes")
    runs = _gather_runs(requests)
    offset, length = runs[0], runs[1]
    end = offset + length
    gap = offset[1:] - end[:-1]
    if len(gap) and gap.min() < 0:  # overlapping boxes
        return _concat(
            [_plan_runs(_gather_runs(layer), max_over_read_ratio, chunk_bytes) for layer in _disjoint_layers(requests)]
        )
    return _plan_runs(runs, max_over_read_ratio, chunk_bytes, end, gap)


def _plan_runs(
    runs: tuple[np.ndarray, ...],
    max_over_read_ratio: float | None,
    chunk_bytes: int,
    end: np.ndarray | None = None,
    gap: np.ndarray | None = None,
) -> FilePlan:
    """Plan sorted, disjoint runs."""
    offset, length, dest, dest_offset = runs
    if len(offset) == 0:
        empty = np.empty(0, np.int64)
        return FilePlan(offset, length, dest, dest_offset, empty, empty, empty, empty, empty, 1.0, 0)
    if end is None or gap is None:
        end = offset + length
        gap = offset[1:] - end[:-1]
    ps, pe, pneed = _page_blocks(offset, end, gap, length)
    del gap
    ratio = auto_ratio(ps, pe, int(pneed.sum())) if max_over_read_ratio is None else float(max_over_read_ratio)
    bs, be = _merge_under_ratio(ps, pe, pneed, ratio) if len(ps) > 1 else (ps, pe)
    cs, ce = _chunk_bounds(bs, be, chunk_bytes)
    lo = np.searchsorted(end, cs, "right")  # the first run ending after the chunk starts
    hi = np.searchsorted(offset, ce, "left")  # past the last run starting before it ends
    keep = hi > lo  # a chunk cut from the middle of a merged gap holds no run: skip it
    cs, ce, lo, hi = cs[keep], ce[keep], lo[keep], hi[keep]
    start = np.maximum(cs, offset[lo])  # trimmed: the edges would be gap only
    stop = np.minimum(ce, end[hi - 1])
    below = np.concatenate([[0], np.cumsum(length)])
    needed = below[hi] - below[lo] - (start - offset[lo]) - (end[hi - 1] - stop)
    return FilePlan(offset, length, dest, dest_offset, start, stop, lo, hi, needed, ratio, len(ps))


def _concat(plans: list[FilePlan]) -> FilePlan:
    """One plan of the passes' plans (run indices shifted past the earlier passes' runs)."""
    names = [f.name for f in dataclasses.fields(FilePlan) if f.init and f.name not in ("ratio", "page_blocks")]
    cat = {name: np.concatenate([getattr(p, name) for p in plans]) for name in names}
    first = np.repeat(np.cumsum([0] + [len(p.offset) for p in plans[:-1]]), [p.num_chunks for p in plans])
    cat["chunk_lo"] += first
    cat["chunk_hi"] += first
    return FilePlan(**cat, ratio=max(p.ratio for p in plans), page_blocks=sum(p.page_blocks for p in plans))


def chunk_runs(plan: FilePlan, i: int) -> tuple[np.ndarray, ...]:
    """Chunk ``i``'s runs clipped to it: offset, length, dest, dest_offset (copies).

    Examples:
        >>> p = plan_file([Request(0, 0, (10,), 1, ((0, 10),))], chunk_bytes=4)
        >>> [[c.tolist() for c in chunk_runs(p, i)] for i in range(p.num_chunks)]
        [[[0], [4], [0], [0]], [[4], [4], [0], [4]], [[8], [2], [0], [8]]]
    """
    cs, ce, lo, hi = (int(x) for x in (plan.chunk_start[i], plan.chunk_end[i], plan.chunk_lo[i], plan.chunk_hi[i]))
    off = np.maximum(plan.offset[lo:hi], cs)
    end = np.minimum(plan.offset[lo:hi] + plan.length[lo:hi], ce)
    return off, end - off, plan.dest[lo:hi].copy(), plan.dest_offset[lo:hi] + (off - plan.offset[lo:hi])


def _covered_below(start: np.ndarray, stop: np.ndarray, x: np.ndarray) -> np.ndarray:
    """For each ``x``: bytes of the intervals ``[start, stop)`` below ``x`` (a byte
    in two intervals counts twice). Vectorised: ``sum(clip(x - start, 0, stop - start))``."""
    by_start, by_stop = np.argsort(start), np.argsort(stop)
    s_sorted, e_sorted = start[by_start], stop[by_stop]
    sum_s = np.concatenate([[0], np.cumsum(s_sorted)])
    sum_len_done = np.concatenate([[0], np.cumsum((stop - start)[by_stop])])
    sum_s_done = np.concatenate([[0], np.cumsum(start[by_stop])])
    begun = np.searchsorted(s_sorted, x, "right")
    done = np.searchsorted(e_sorted, x, "right")
    open_ = begun - done  # intervals with start <= x < stop
    return sum_len_done[done] + x * open_ - (sum_s[begun] - sum_s_done[done])


def over_read_by_range(plan: FilePlan, begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Bytes read inside each file range ``[begin[i], end[i])`` that no run needed.

    Ranges are typically tensors: the result says which tensors' bytes were read
    through to keep the request count down.

    Examples:
        >>> p = plan_file([Request(0, 0, (4, 1024), 1, ((0, 4), (0, 8)))])  # 4 runs of 8 bytes, 1016 apart
        >>> over_read_by_range(p, np.array([0, 4096]), np.array([4096, 8192])).tolist()
        [3048, 0]
    """
    begin, end = np.asarray(begin, np.int64), np.asarray(end, np.int64)
    if not plan.num_chunks:
        return np.zeros(len(begin), np.int64)

    def within(start: np.ndarray, stop: np.ndarray) -> np.ndarray:  # per range, bytes of these intervals in it
        return _covered_below(start, stop, end) - _covered_below(start, stop, begin)

    return within(plan.chunk_start, plan.chunk_end) - within(plan.offset, plan.offset + plan.length)
