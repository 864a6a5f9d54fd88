"""Boxes: ``((start, stop), ...)`` per dimension of a tensor, and their geometry (pure):
intersections, byte runs, whether a set of boxes tiles a tensor exactly, and where in a
box (and in its file) a BOOL byte that is neither 0 nor 1 sits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ChecksumError, HeaderError

if TYPE_CHECKING:
    from ._header import TensorInfo

__all__ = [
    "Box",
    "box_runs",
    "check_bools",
    "check_tiling",
    "extents",
    "intersect",
    "of_index",
    "run_geometry",
    "run_grid",
    "whole",
]

Box = tuple[tuple[int, int], ...]
# The overlap check paints the grid the pieces' edges cut a tensor into; pieces
# that cut it into more cells than this (an irregular layout no save makes) are
# checked pairwise up to MAX_PAIRWISE_PIECES, and refused beyond.
MAX_GRID_CELLS = 1 << 22
MAX_PAIRWISE_PIECES = 2048


def whole(shape: tuple[int, ...]) -> Box:
    """The box of a whole tensor of ``shape``.

    Examples:
        >>> whole((2, 3))
        ((0, 2), (0, 3))
    """
    return tuple((0, d) for d in shape)


def of_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """The box that the slices ``index`` (a jax shard's index) select from a tensor of ``shape``.

    Examples:
        >>> of_index((slice(None), slice(2, 4)), (2, 6))
        ((0, 2), (2, 4))
    """
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or ``None`` when they share no element.

    Examples:
        >>> intersect(((0, 4),), ((2, 6),)), intersect(((0, 2),), ((2, 4),))
        (((2, 4),), None)
    """
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def extents(box: Box) -> tuple[int, ...]:
    """The box's shape."""
    return tuple(hi - lo for lo, hi in box)


def run_geometry(
    shape: Sequence[int],
    itemsize: int,
    box: Box,
    base: int,
    dest_shape: Sequence[int] | None = None,
    dest_at: Sequence[int] | None = None,
):
    """``(first offset, run length, outer, k, dest first offset)`` of a box, or None
    when it is empty.

    ``k`` is the dimension the runs are cut on (-1: the whole tensor is one run):
    the dimensions after it are read whole and fill the destination whole.
    ``outer`` lists ``(count, byte stride, destination byte stride)`` of the
    dimensions before it: the runs are the C-order grid over them.
    """
    dest_shape = extents(box) if dest_shape is None else dest_shape
    dest_at = (0,) * len(shape) if dest_at is None else dest_at
    k, stride, dstride = len(shape) - 1, itemsize, itemsize
    while k >= 0 and box[k] == (0, shape[k]) and dest_shape[k] == shape[k]:  # trailing dimensions read whole
        stride *= shape[k]
        dstride *= shape[k]
        k -= 1
    if k < 0:
        return (base, stride, [], k, 0) if stride else None
    lo, hi = box[k]
    if hi <= lo or not stride:
        return None
    first, length, outer, dfirst = base + lo * stride, (hi - lo) * stride, [], dest_at[k] * dstride
    for d in range(k - 1, -1, -1):
        stride *= shape[d + 1]
        dstride *= dest_shape[d + 1]
        lo, hi = box[d]
        if hi <= lo:
            return None
        first += lo * stride
        dfirst += dest_at[d] * dstride
        outer.append((hi - lo, stride, dstride))
    return first, length, outer[::-1], k, dfirst


def run_grid(first: int, outer: list[tuple[int, ...]], column: int = 1) -> np.ndarray:
    """Run starts: the C-order grid over ``outer``'s ``(count, stride, ...)`` rows,
    with the stride of ``column`` (1: the file's, 2: the destination's)."""
    offsets = np.array([first], np.int64)
    for row in outer:
        offsets = (offsets[:, None] + np.arange(row[0], dtype=np.int64) * row[column]).reshape(-1)
    return offsets


def box_runs(shape: Sequence[int], itemsize: int, box: Box, base: int = 0) -> tuple[np.ndarray, int]:
    """File offsets of the contiguous runs that make up ``box``, and the run length.

    Runs come in C order of the box, so run ``i`` lands at ``i * length`` in a
    C-ordered destination of the box's shape.

    Examples:
        >>> offsets, length = box_runs((4, 6), 4, ((0, 4), (3, 6)))
        >>> offsets.tolist(), length
        ([12, 36, 60, 84], 12)
    """
    g = run_geometry(tuple(shape), itemsize, tuple(box), base)
    if g is None:
        return np.empty(0, np.int64), 0
    first, length, outer, _, _ = g
    return run_grid(first, outer), length


def check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box], where: str) -> None:
    """Refuse unless the distinct ``boxes`` lie inside ``shape``, are pairwise
    disjoint and cover it exactly. O(n log n) in the boxes of a regular grid.

    Raises:
        HeaderError: naming ``key`` and the offending boxes.

    Examples:
        >>> check_tiling("w", (8,), [((0, 4),), ((4, 8),), ((0, 4),)], "m.json")  # a replica: fine
        >>> check_tiling("w", (8,), [((0, 6),), ((1, 3),)], "m.json")
        Traceback (most recent call last):
        ...
        nnx_save.errors.HeaderError: m.json: tensor 'w': pieces [[0, 6]] and [[1, 3]] overlap
    """
    distinct = list(dict.fromkeys(boxes))
    for box in distinct:
        if len(box) != len(shape):
            raise _outside(key, box, shape, where)
    try:
        arr = np.array(distinct, np.int64).reshape(len(distinct), len(shape), 2)
        np.array(shape, np.int64)
    except OverflowError:
        raise HeaderError(
            f"{where}: tensor {key!r}: a shape or piece coordinate exceeds 2**63 - 1", check="pieces"
        ) from None
    lo, hi = arr[..., 0], arr[..., 1]
    inside = ((lo >= 0) & (lo <= hi) & (hi <= np.array(shape, np.int64))).all(1)
    if not inside.all():
        raise _outside(key, distinct[int(np.argmin(inside))], shape, where)
    keep = (lo < hi).all(1)
    nonempty = arr[keep]
    if shape and len(nonempty) > 1:
        pair = _overlap(nonempty, key, where)
        if pair is not None:
            i, j = pair
            raise HeaderError(
                f"{where}: tensor {key!r}: pieces {_show(nonempty[i].tolist())} and {_show(nonempty[j].tolist())} overlap",
                check="pieces",
            )
    covered, total = sum(map(math.prod, (nonempty[:, :, 1] - nonempty[:, :, 0]).tolist())), math.prod(shape)
    if covered != total or (not shape and not distinct):
        raise HeaderError(
            f"{where}: tensor {key!r}: pieces {[_show(b) for b in distinct][:8]} cover {covered} of the "
            f"{total} elements of shape {list(shape)}",
            check="pieces",
        )


def _outside(key: str, box: Box, shape: tuple[int, ...], where: str) -> HeaderError:
    return HeaderError(
        f"{where}: tensor {key!r}: piece {_show(box)} does not lie inside shape {list(shape)}", check="pieces"
    )


def _overlap(boxes: np.ndarray, key: str, where: str) -> tuple[int, int] | None:
    """``(i, j)``, ``i < j``, of distinct non-empty ``boxes`` (``[n, rank, 2]``) that
    share an element: the first ``j`` overlapping an earlier box, and the first such
    ``i``; or ``None``.

    The edges of all boxes cut the tensor into a grid of cells, and each box is a
    block of cells. Distinct boxes of one cell each (every regular sharding) cannot
    overlap; otherwise the boxes are painted on the grid in order.
    """
    cuts = [np.unique(boxes[:, k, :]) for k in range(boxes.shape[1])]
    cells = [(np.searchsorted(c, boxes[:, k, 0]), np.searchsorted(c, boxes[:, k, 1])) for k, c in enumerate(cuts)]
    if all(bool((hi - lo == 1).all()) for lo, hi in cells):
        return None
    if math.prod(len(c) - 1 for c in cuts) <= MAX_GRID_CELLS:
        return _paint(cells, tuple(len(c) - 1 for c in cuts))
    if len(boxes) <= MAX_PAIRWISE_PIECES:
        return _pairwise(boxes[:, :, 0], boxes[:, :, 1])
    raise HeaderError(
        f"{where}: tensor {key!r}: {len(boxes)} pieces of irregular sizes (more than {MAX_PAIRWISE_PIECES}, cutting "
        f"it into more than {MAX_GRID_CELLS} cells); save it again with save_pod, whose pieces form a regular grid",
        check="pieces",
    )


def _paint(cells: list[tuple[np.ndarray, np.ndarray]], grid_shape: tuple[int, ...]) -> tuple[int, int] | None:
    # Until the first overlap every cell is painted once, so this costs at most the grid.
    grid = np.full(grid_shape, -1, np.int32)
    for j in range(len(cells[0][0])):
        block = grid[tuple(slice(int(lo[j]), int(hi[j])) for lo, hi in cells)]
        earlier = block[block >= 0]
        if earlier.size:
            return int(earlier.min()), j
        block[...] = j
    return None


def _pairwise(lo: np.ndarray, hi: np.ndarray) -> tuple[int, int] | None:
    share = (np.maximum(lo[:, None], lo[None]) < np.minimum(hi[:, None], hi[None])).all(-1)
    hit = np.argwhere(np.triu(share, 1).T)  # rows: (j, i) with i < j, in order of j
    return (int(hit[0][1]), int(hit[0][0])) if len(hit) else None


def _show(box: Box) -> list[list[int]]:
    return [[lo, hi] for lo, hi in box]


def check_bools(array: np.ndarray, info: TensorInfo, box: Box) -> np.ndarray:
    """``array`` (box ``box`` of ``info``), after refusing a BOOL byte other than 0 or 1:
    numpy would hold it as a bool that is neither (``x == True`` false, ``x.sum()`` off).
    One vectorised pass, for BOOL tensors only.

    Raises:
        ChecksumError: naming the tensor, the first such element, its byte offset in the
            file (for a tensor of one file) and the byte found.

    Examples:
        >>> from nnx_save.format._dtypes import from_code
        >>> from nnx_save.format._header import TensorInfo
        >>> info = TensorInfo("m", from_code("BOOL", "m"), (3,), 100, 103, "f.safetensors")
        >>> check_bools(np.frombuffer(bytes([1, 0, 2]), np.bool_), info, ((0, 3),))
        Traceback (most recent call last):
        ...
        nnx_save.errors.ChecksumError: f.safetensors: tensor 'm' (BOOL): element [2] (byte 102 of the file) is 2; a BOOL byte is 0 or 1
    """
    if info.dtype.code != "BOOL" or not array.size:
        return array
    raw = array.view(np.uint8)
    if int(raw.max()) <= 1:
        return array
    local = np.unravel_index(int(np.argmax(raw.reshape(-1) > 1)), raw.shape)
    at = [int(i) + lo for i, (lo, _) in zip(local, box, strict=True)]
    where = f" (byte {info.begin + int(np.ravel_multi_index(at, info.shape))} of the file)" if info.begin else ""
    found = int(raw[tuple(local)])
    raise ChecksumError(
        f"{info.file}: tensor {info.name!r} (BOOL): element {at}{where} is {found}; a BOOL byte is 0 or 1",
        info.name,
        info.file,
        "a BOOL byte 0 or 1",
        f"{found} at element {at}{where}",
    )
