"""Targets made by a porting transform, read box by box.

Each distinct ``(source key, source box)`` that the transform's
:meth:`~nnx_save.load._target.SourceTransform.source_boxes` names is one engine
destination, which may feed several targets; a target is made once its last source box
is read, and a source box's buffer is released when the last target it feeds is made.
A transform with no per-box map reads its sources whole (``report.io.read_whole``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ShapeMismatchError
from ._assemble import held_dtype, place
from ._pieces import Box, extents
from ._target import Target, shard_boxes

__all__ = ["BoxedTargets"]


@dataclass
class _Plan:
    """One target's boxes: each with its local devices and the destinations that feed it."""

    target: Target
    boxes: list[tuple[Box, list[Any], list[int]]]
    left: set[int]  # destinations not read yet


class BoxedTargets:
    """The box-mapped targets of one engine run. Each method takes the engine (which
    imports this module) rather than holding it: no reference cycle keeps a finished
    load's arrays alive until the next garbage collection."""

    def __init__(self) -> None:
        self.plans: dict[str, _Plan] = {}
        self.by_box: dict[tuple[str, Box], int] = {}  # (source key, box) -> its destination
        self.feeding: dict[int, list[str]] = {}  # destination -> the targets it feeds
        self.uses: dict[int, int] = {}  # destination -> targets still to be made from it

    def add(self, engine: Any, t: Target) -> bool:
        """Plan ``t`` box by box; False (nothing added) when its transform cannot."""
        assert t.transform is not None
        infos = [engine.header.tensors[k] for k in t.sources]
        if not all(info.dtype.byte_aligned for info in infos):
            return False  # packed sub-byte sources: read whole, unpacked after
        shapes = [info.shape for info in infos]
        mapped = []
        for box, devices in shard_boxes(t):
            feeds = t.transform.source_boxes(box, shapes)
            if feeds is None:
                return False
            mapped.append((box, devices, feeds))
        plan = _Plan(t, [], set())
        for box, devices, feeds in mapped:
            plan.boxes.append((box, devices, [self._dest(engine, t, t.sources[i], b, plan) for i, b in feeds]))
        self.plans[t.path] = plan
        return True

    def _dest(self, engine: Any, t: Target, key: str, box: Box, plan: _Plan) -> int:
        index = self.by_box.get((key, box))
        if index is None:
            index = engine.add(f"box:{key}{list(box)}", key, box, [None], False)
            self.by_box[(key, box)] = index
        if index not in plan.left:
            plan.left.add(index)
            self.feeding.setdefault(index, []).append(t.path)
            self.uses[index] = self.uses.get(index, 0) + 1
        return index

    def filled(self, engine: Any, index: int) -> None:
        """Destination ``index`` is read: make every target it completes."""
        for path in self.feeding.pop(index, ()):
            plan = self.plans[path]
            plan.left.discard(index)
            if not plan.left:
                self._make(engine, plan)

    def _make(self, engine: Any, plan: _Plan) -> None:
        t = plan.target
        assert t.transform is not None
        held, pieces = held_dtype(t), []
        for box, devices, feeds in plan.boxes:
            regions = [engine.host(i) for i in feeds]
            value = np.asarray(t.transform.from_boxes(box, regions))
            if value.shape != extents(box):
                raise ShapeMismatchError(
                    f"{t.path}: rule produced shape {value.shape} for box {[list(b) for b in box]} "
                    f"from {list(t.sources)}, expected {extents(box)}"
                )
            pieces.append((np.ascontiguousarray(value, dtype=held), devices))
        for index in {i for _, _, feeds in plan.boxes for i in feeds}:
            self.uses[index] -= 1
            if not self.uses[index]:
                engine.dests[index].buffer = None  # released once every target it feeds exists
        engine.results[t.path] = place(t, pieces)
        engine.bar.update(items=1)
