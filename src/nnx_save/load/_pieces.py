"""What a layout says: "this tensor is these pieces at (file, byte range, box)", and
the :class:`Request` that reads part of a piece (the planner's input).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format._boxes import Box, extents, intersect, whole
from ..format._header import TensorInfo

__all__ = ["Box", "Piece", "Request", "extents", "intersect", "request", "whole"]


@dataclass(frozen=True, slots=True)  # slots: made per tensor, twice as fast
class Piece:
    """Box ``box`` of a global tensor, stored as tensor ``info`` of ``info.file``
    (whose shape is the box's extents). ``process``: the pod process that wrote it
    (-1 for layouts without processes)."""

    box: Box
    info: TensorInfo
    process: int = -1


@dataclass(frozen=True, slots=True)  # slots: made per tensor, twice as fast
class Request:
    """Elements ``box`` (per-dimension ``[start, stop)``) of a C-ordered tensor whose
    data starts at byte ``base`` of its file, into destination ``dest`` (C-ordered).

    By default the destination is the box itself (shape: the box's extents). A
    destination of shape ``dest_shape`` takes the box as a sub-box at ``dest_at``
    (the destination index of the box's first element): the pieces of a tensor
    stored in several boxes each fill their part of one shard buffer, their runs
    landing at strided destination offsets.
    """

    dest: int
    base: int
    shape: tuple[int, ...]
    itemsize: int
    box: Box
    dest_shape: tuple[int, ...] | None = None
    dest_at: tuple[int, ...] | None = None


def request(piece: Piece, part: Box, box: Box, dest: int) -> Request:
    """The read of ``part`` (global coordinates, inside ``piece`` and ``box``) into
    destination ``dest``, which holds ``box``."""
    info = piece.info
    if not info.dtype.byte_aligned:  # packed: the whole (single) piece, sliced after
        return Request(dest, info.begin, (info.nbytes,), 1, ((0, info.nbytes),))
    if part == box == piece.box:  # a whole piece into its own buffer (many small tensors: keep it cheap)
        return Request(dest, info.begin, info.shape, info.dtype.itemsize, tuple((0, d) for d in info.shape))
    local = tuple((lo - p, hi - p) for (lo, hi), (p, _) in zip(part, piece.box, strict=True))
    if part == box:
        return Request(dest, info.begin, info.shape, info.dtype.itemsize, local)
    at = tuple(lo - b for (lo, _), (b, _) in zip(part, box, strict=True))
    return Request(dest, info.begin, info.shape, info.dtype.itemsize, local, extents(box), at)
