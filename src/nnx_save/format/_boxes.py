"""Boxes: ``((start, stop), ...)`` per dimension of a tensor, and their geometry (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Box", "box_runs", "extents", "intersect", "of_index", "run_geometry", "run_grid", "whole"]

Box = tuple[tuple[int, int], ...]


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
