"""Where a load's bytes go, decided before any byte is read: the engine's planning.

Each box a process needs of a target (a shard it holds, or a porting transform's whole
source) is one :class:`Dest`, with the pieces that fill it and the files they are in;
runs of small whole tensors go to :class:`~nnx_save.load._batch.Batch` and box-mapped
transforms to :class:`~nnx_save.load._boxed.BoxedTargets` instead. A sharding jax cannot
apply, or a piece no file of this directory holds, is refused here, so a refusal reads
nothing. :class:`~nnx_save.load._engine.Engine` then reads into the destinations and
places their values.
"""

from __future__ import annotations

import collections
import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import NnxSaveError
from ..format._header import TensorInfo
from . import _boxed
from ._assemble import held_of
from ._batch import Batch
from ._options import LoadOptions
from ._pieces import Box, Piece, extents, intersect, whole
from ._source import Header
from ._target import Target, shard_boxes

__all__ = ["Dest", "Destinations"]

_PATH = operator.attrgetter("path")


@dataclass
class Dest:
    """One destination: box ``box`` of file tensor ``key``, for local ``devices``.

    ``owner`` is the target path it is a shard of (``"source:<key>"`` for a transform's
    whole source); ``parts`` the pieces that give it and the box each gives (global
    coordinates); ``files`` the files still to read into it.
    """

    owner: str
    key: str
    box: Box
    devices: list[Any]
    nbytes: int
    adopted: bool
    parts: list[tuple[Piece, Box]]
    files: set[str] = field(default_factory=set)
    buffer: Any = None


class Destinations:
    """Every destination of one load, by owner and by file, and the targets that take
    another way (batched runs, box-mapped transforms, transforms read whole)."""

    def __init__(self, header: Header, targets: Sequence[Target], opt: LoadOptions, slab_bytes: int) -> None:
        import jax

        self.header, self.opt = header, opt
        self.slab_bytes = slab_bytes  # adopted buffers are packed into allocations of up to this size
        self.x64: bool = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # asked once, not per tensor
        self.by_path = dict(zip(map(_PATH, targets), targets, strict=True))
        self._streams: dict[str, bool] = {}  # platform -> whether its device targets stream
        self.dests: list[Dest] = []
        self.shards: dict[str, list[int]] = {}  # owner -> its destinations
        self.by_file: dict[str, list[int]] = {}  # file -> destinations it fills
        self.boxed = _boxed.BoxedTargets(slab_bytes, _boxed.unit_bytes(opt.max_inflight_bytes, opt.threads))
        self.pending: list[Target] = []  # transforms read from their whole sources
        self.batch, targets = Batch.split(  # runs of small whole tensors: no destination each
            header, targets, self.x64, opt.streaming, slab_bytes > 0
        )
        for t in targets:
            if t.transform is None:
                info = header.tensors[t.sources[0]]
                held = held_of(np.dtype(t.dtype), t.sharding is not None, self.x64)
                adopted = info.dtype.byte_aligned and info.dtype.numpy == held  # the buffer becomes the array
                if not adopted and self.cast_in_slabs(t, info):
                    self.boxed.cast(self, t)
                    continue
                for box, devices in shard_boxes(t):  # refusals before any read
                    self.add(t.path, t.sources[0], box, devices, adopted)
            elif not self.boxed.add(self, t):
                self.pending.append(t)
        self.refs: collections.Counter[str] = collections.Counter()  # source -> transforms to run
        for t in self.pending:
            self.refs.update(t.sources)
        for key in self.refs:
            self.add(f"source:{key}", key, whole(header.tensors[key].shape), [None], False)

    def cast_in_slabs(self, t: Target, info: TensorInfo) -> bool:
        """Whether target ``t`` of file tensor ``info``, held in another dtype than the
        file's, is cast slab by slab into its final buffer
        (:data:`~nnx_save.load._slabs.CAST`), rather than read whole in the file's dtype:
        not a packed sub-byte tensor (unpacked whole), not an empty one (nothing to
        read), and not a device target that streams (its slabs are cast on the device)."""
        if not info.dtype.byte_aligned or not info.nbytes:
            return False
        if t.sharding is None:
            return True
        platform = next(iter(t.sharding.device_set)).platform
        streams = self._streams.get(platform)
        if streams is None:  # asked once per platform: the answer reads the environment
            streams = self._streams[platform] = self.opt.streaming(platform)
        return not streams

    def add(self, owner: str, key: str, box: Box, devices: list[Any], adopted: bool) -> int:
        info = self.header.tensors[key]
        index = len(self.dests)
        numel = math.prod(hi - lo for lo, hi in box)  # extents(box), per tensor inline
        nbytes = numel * info.dtype.itemsize if info.dtype.byte_aligned else info.nbytes
        parts = self.choose(key, box)
        files = {parts[0][0].info.file} if len(parts) == 1 else {piece.info.file for piece, _ in parts}
        dest = Dest(owner, key, box, devices, nbytes, adopted, parts, files)
        self.dests.append(dest)
        self.shards.setdefault(dest.owner, []).append(index)
        for file in dest.files:
            self.by_file.setdefault(file, []).append(index)
        return index

    def choose(self, key: str, box: Box) -> list[tuple[Piece, Box]]:
        """The pieces that give ``box`` and the part each gives: one per distinct
        piece box, this process's own pod file first."""
        pieces = self.header.pieces_of(key)
        if len(pieces) == 1 and pieces[0].box == box and pieces[0].info.nbytes:  # a whole tensor, one piece
            return [(pieces[0], box)]
        info = self.header.tensors[key]
        if not info.dtype.byte_aligned or (len(pieces) == 1 and pieces[0].box == whole(info.shape)):
            part = intersect(pieces[0].box, box) if info.dtype.byte_aligned else pieces[0].box
            return [(pieces[0], part)] if part is not None and pieces[0].info.nbytes else []
        best: dict[Box, tuple[Piece, Box]] = {}
        own = self.own
        for piece in sorted(pieces, key=lambda p: (p.process != own, p.process)):
            if (part := intersect(piece.box, box)) is not None:
                best.setdefault(piece.box, (piece, part))
        parts = list(best.values())
        if sum((math.prod(extents(part)) for _, part in parts), start=0) != math.prod(extents(box)):
            raise NnxSaveError(
                f"{info.file}: tensor {key!r}: the part {[list(b) for b in box]} this process needs is in "
                f"shard file(s) {list(self.header.missing_files)}, not present in this directory; copy them here, "
                "or load on the process layout that wrote them"
            )
        return parts

    @functools.cached_property
    def own(self) -> int | None:
        """This process's pod rank, or None for files another process layout wrote."""
        import jax

        return jax.process_index() if self.header.num_processes == jax.process_count() else None

    def held(self, owner: str) -> np.dtype:
        """:func:`~nnx_save.load._assemble.held_dtype` of target ``owner``: the dtype its
        value will have."""
        t = self.by_path[owner]
        return held_of(np.dtype(t.dtype), t.sharding is not None, self.x64)
