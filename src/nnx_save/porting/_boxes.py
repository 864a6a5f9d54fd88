"""Box geometry for porting transforms: pure functions on boxes and shapes.

A box is ``((start, stop), ...)`` per dimension. A reshape maps boxes only where each
group of merged or split dimensions is one contiguous run (:func:`reshape_back`);
elsewhere the caller reads the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..format._boxes import Box, extents

__all__ = ["Box", "concat_feeds", "extents", "inside", "reshape_back", "with_extent"]
Feed = tuple[int, Box]  # (source index, box of that source)


def inside(box: Box, shape: tuple[int, ...]) -> bool:
    """Whether ``box`` is a non-empty box of a tensor of ``shape``."""
    return len(box) == len(shape) and all(0 <= lo < hi <= d for (lo, hi), d in zip(box, shape, strict=True))


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[range, range]] | None:
    """Dimensions of ``src`` and ``dst`` in the smallest groups of equal products
    (``None`` if a size is zero)."""
    if 0 in src or 0 in dst:
        return None
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        i0, j0, a, b = i, j, 1, 1
        if i < len(src):
            a, i = src[i], i + 1
        if j < len(dst):
            b, j = dst[j], j + 1
        while a != b:  # the products agree overall, so the smaller side has dimensions left
            if a < b:
                a, i = a * src[i], i + 1
            else:
                b, j = b * dst[j], j + 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


def reshape_back(src: tuple[int, ...], dst: tuple[int, ...], box: Box) -> Box | None:
    """The box of ``src`` whose reshape to ``dst`` is ``box``, where there is one.

    Examples:
        >>> reshape_back((12, 2), (4, 3, 2), ((1, 3), (0, 3), (0, 2)))  # rows 1-2 of 4: rows 3-8 of 12
        ((3, 9), (0, 2))
        >>> reshape_back((12, 2), (4, 3, 2), ((0, 4), (1, 2), (0, 2))) is None  # rows 1, 4, 7, 10
        True
    """
    groups = _groups(src, dst)
    if groups is None:
        return None
    out: list[tuple[int, int]] = []
    for ins, outs in groups:
        flat = _flat_range([dst[d] for d in outs], [box[d] for d in outs])
        part = None if flat is None else _unflatten([src[d] for d in ins], *flat)
        if part is None:
            return None
        out.extend(part)
    return tuple(out)


def _flat_range(shape: list[int], box: list[tuple[int, int]]) -> tuple[int, int] | None:
    """``box`` of ``shape`` as one C-order run ``[start, stop)``, if it is one."""
    partial = [d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, shape[d])]
    k = partial[0] if partial else 0
    if any(hi - lo != 1 for lo, hi in box[:k]) or any(box[d] != (0, shape[d]) for d in range(k + 1, len(box))):
        return None
    inner = math.prod(shape[k + 1 :])
    start = sum(box[d][0] * math.prod(shape[d + 1 :]) for d in range(k + 1)) if box else 0
    return start, start + (box[k][1] - box[k][0]) * inner if box else 1


def _unflatten(shape: list[int], start: int, stop: int) -> list[tuple[int, int]] | None:
    """The box of ``shape`` that is the C-order run ``[start, stop)``, if there is one."""
    for k in range(len(shape)):
        inner, block = math.prod(shape[k + 1 :]), math.prod(shape[k:])
        if start % inner or stop % inner or start // block != (stop - 1) // block:
            continue
        fixed: list[tuple[int, int]] = []
        rest = start // block
        for d in range(k - 1, -1, -1):
            fixed.insert(0, (rest % shape[d], rest % shape[d] + 1))
            rest //= shape[d]
        lo, hi = (start % block) // inner, (stop - start) // inner + (start % block) // inner
        return [*fixed, (lo, hi), *((0, s) for s in shape[k + 1 :])]
    return [] if not shape and (start, stop) == (0, 1) else None


def with_extent(box: Box, axis: int, extent: tuple[int, int]) -> Box:
    """``box`` with ``extent`` on ``axis``."""
    return (*box[:axis], extent, *box[axis + 1 :])


def concat_feeds(axis: int, sizes: Sequence[int], box: Box) -> list[Feed]:
    """The parts (index, box in the part) of a concatenation along ``axis`` of parts
    of ``sizes`` that ``box`` of the result meets, in order."""
    lo, hi = box[axis]
    feeds, offset = [], 0
    for i, size in enumerate(sizes):
        a, b = max(lo, offset), min(hi, offset + size)
        if a < b:
            feeds.append((i, with_extent(box, axis, (a - offset, b - offset))))
        offset += size
    return feeds
