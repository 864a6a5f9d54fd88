"""Boxes: ``((start, stop), ...)`` per dimension of a tensor, and their geometry (pure)."""

from __future__ import annotations

__all__ = ["Box", "extents", "intersect", "of_index", "whole"]

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
