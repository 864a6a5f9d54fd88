"""Pure planning for the box-mapped path: a target's boxes cut into units of slabs.

A unit is a slab of the boxes' hull (a run of whole rows where the source allows), with
its part of every box it meets and the source boxes that make each part
(:meth:`~nnx_save.load._target.SourceTransform.source_boxes`); :mod:`nnx_save.load._boxed`
reads and applies them. A dtype cast is the identity map here (:data:`CAST`), so a cast
is cut, read and copied into its final buffer like any transform.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._pieces import Box, extents, intersect
from ._target import SourceTransform

__all__ = ["CAST", "Cast", "Feeds", "Part", "plan_units", "units"]

Feeds = list[tuple[int, Box]]


class Cast:
    """The identity map between boxes: a target read from one file tensor, box for box,
    whose only change is its dtype (made as each slab is copied into its final buffer)."""

    def __call__(self, arrays: list[np.ndarray]) -> np.ndarray:
        return arrays[0]

    def source_boxes(self, box: Box, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, Box]]:
        return [(0, box)]

    def from_boxes(self, box: Box, regions: Sequence[np.ndarray]) -> np.ndarray:
        return regions[0]


CAST = Cast()


def _with_extent(box: Box, axis: int, extent: tuple[int, int]) -> Box:
    return (*box[:axis], extent, *box[axis + 1 :])


def _run_length(box: Box, shape: tuple[int, ...]) -> int:
    """Elements in each contiguous run of ``box`` of a C-ordered ``shape``."""
    n = 1
    for (lo, hi), d in zip(reversed(box), reversed(shape), strict=True):
        n *= hi - lo
        if (lo, hi) != (0, d):
            break
    return n


def _axis(transform: SourceTransform, box: Box, shapes: Sequence[tuple[int, ...]]) -> int | None:
    """The axis of ``box`` to cut into slabs: the one whose one-wide slab reads the
    longest runs of its sources (a slab of whole source rows reads one run; slabs
    across the rows would each read through the same gaps)."""
    best, score = None, -1
    for axis, (lo, hi) in enumerate(box):
        feeds = transform.source_boxes(_with_extent(box, axis, (lo, lo + 1)), shapes) if hi - lo > 1 else None
        if feeds is not None and (run := min(_run_length(b, shapes[i]) for i, b in feeds)) > score:
            best, score = axis, run
    return best


def units(
    transform: SourceTransform,
    box: Box,
    shapes: Sequence[tuple[int, ...]],
    itemsizes: Sequence[int],
    limit: float,
) -> list[tuple[Box, Feeds]] | None:
    """``box`` cut into slabs of about ``limit`` source bytes each, with each slab's
    source boxes (one slab where it cannot be cut); ``None`` when ``box`` itself has
    no per-box preimage. A slab one index wide that is still over ``limit`` (a row
    wider than it) is cut again on another axis.

    Examples:
        >>> from nnx_save.porting._transforms import Transform, Transpose
        >>> t = Transform((), None, (Transpose((1, 0)),))  # kernel (4, 6) from weight (6, 4)
        >>> [sub for sub, _ in units(t, ((0, 4), (0, 6)), [(6, 4)], [4], 32)]  # 2 weight rows each
        [((0, 4), (0, 2)), ((0, 4), (2, 4)), ((0, 4), (4, 6))]
        >>> [sub for sub, _ in units(CAST, ((0, 2), (0, 6)), [(2, 6)], [4], 12)]  # rows of 24 bytes: halves
        [((0, 1), (0, 3)), ((0, 1), (3, 6)), ((1, 2), (0, 3)), ((1, 2), (3, 6))]
    """
    feeds = transform.source_boxes(box, shapes)
    if feeds is None:
        return None
    nbytes = sum(math.prod(extents(b)) * itemsizes[i] for i, b in feeds)
    axis = _axis(transform, box, shapes) if nbytes > limit else None
    if axis is None:
        return [(box, feeds)]
    lo, hi = box[axis]
    step = max(1, int((hi - lo) * limit // nbytes))
    across = step == 1 and nbytes > limit * (hi - lo)  # one slab is still over the limit: cut it on another axis
    out = []
    for a in range(lo, hi, step):
        sub = _with_extent(box, axis, (a, min(a + step, hi)))
        part = transform.source_boxes(sub, shapes)
        if part is None:
            return [(box, feeds)]
        out += (units(transform, sub, shapes, itemsizes, limit) or [(sub, part)]) if across else [(sub, part)]
    return out


Part = tuple[int, Box, Feeds]  # (box of the target, its slab, that slab's source boxes)


def _hull(boxes: Sequence[Box]) -> Box:
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def _slab_parts(transform: SourceTransform, slabs: list[Box], boxes: Sequence[Box], shapes: Sequence[tuple[int, ...]]):
    """Per slab, its part of each box it meets; ``None`` if some part has no preimage."""
    out: list[list[Part]] = []
    for slab in slabs:
        parts: list[Part] = []
        for i, box in enumerate(boxes):
            sub = intersect(slab, box)
            feeds = None if sub is None else transform.source_boxes(sub, shapes)
            if sub is not None and feeds is None:
                return None
            if sub is not None and feeds is not None:
                parts.append((i, sub, feeds))
        if parts:
            out.append(parts)
    return out


def plan_units(
    transform: SourceTransform,
    boxes: Sequence[Box],
    shapes: Sequence[tuple[int, ...]],
    itemsizes: Sequence[int],
    limit: float,
) -> list[list[Part]] | None:
    """The units that make ``boxes`` of a target (its shards here): slabs of the boxes'
    hull (:func:`units`), each with its part of every box it meets, so that one unit
    reads the adjacent parts of all shards together (shards of a strided source, read
    one by one, would each read through the others); per box where the hull does not
    map. ``None`` when some box has no per-box preimage.

    Examples:
        >>> from nnx_save.porting._transforms import Transform, Transpose
        >>> t = Transform((), None, (Transpose((1, 0)),))  # kernel (4, 6) from weight (6, 4)
        >>> rows = [((0, 2), (0, 6)), ((2, 4), (0, 6))]  # two shards of kernel rows: weight columns
        >>> [[(i, sub) for i, sub, _ in unit] for unit in plan_units(t, rows, [(6, 4)], [4], 48)]
        [[(0, ((0, 2), (0, 3))), (1, ((2, 4), (0, 3)))], [(0, ((0, 2), (3, 6))), (1, ((2, 4), (3, 6)))]]
    """
    slabs = units(transform, _hull(boxes), shapes, itemsizes, limit)
    out = None if slabs is None else _slab_parts(transform, [sub for sub, _ in slabs], boxes, shapes)
    if out is not None:
        return out
    out = []
    for i, box in enumerate(boxes):
        cut = units(transform, box, shapes, itemsizes, limit)
        if cut is None:
            return None
        out += [[(i, sub, feeds)] for sub, feeds in cut]
    return out
