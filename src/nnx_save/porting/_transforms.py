"""Value transforms as data: small frozen steps and the pipeline that chains them.

Each step is a pure numpy function in a frozen dataclass, so a mapping prints, compares,
and needs neither pickle nor closures. A step records the shape it expects, which lets
``Rules.inverse(recorded=mapping)`` reshape back to the recorded source shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..format._boxes import Box
from ._boxes import Feed, concat_feeds, extents, inside, reshape_back, with_extent
from ._compute_steps import Computed, ComputedPart
from ._errors import RuleError

__all__ = [
    "Chain",
    "Concatenate",
    "Constant",
    "Each",
    "Index",
    "Reshape",
    "Restore",
    "Same",
    "Stack",
    "Sum",
    "Take",
    "Transform",
    "Transpose",
]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Transpose:
    """``np.transpose(x, axes)``."""

    axes: tuple[int, ...]
    rule: int = -1  # position of the rule that made it in its Rules, for messages

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.axes)

    def box_before(self, box: Box) -> Box | None:
        """The input box whose transpose is ``box``."""
        before = [(0, 0)] * len(self.axes)
        for i, axis in enumerate(self.axes):
            before[axis] = box[i]
        return tuple(before)

    def on_box(self, x: np.ndarray, box: Box) -> np.ndarray:
        """Output box ``box`` from the region :meth:`box_before` named."""
        return np.transpose(x, self.axes)


@dataclass(frozen=True)
class Reshape:
    """``x.reshape(shape)``; ``source_shape`` is the shape it was planned for."""

    shape: Shape
    source_shape: Shape
    rule: int = -1

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.shape)

    def box_before(self, box: Box) -> Box | None:
        """The input box whose reshape is ``box``, if it is rectangular."""
        return reshape_back(self.source_shape, self.shape, box)

    def on_box(self, x: np.ndarray, box: Box) -> np.ndarray:
        return x.reshape(extents(box))


@dataclass(frozen=True)
class Take:
    """Part ``[start, stop)`` of the one source along ``axis`` (a split)."""

    axis: int
    start: int
    stop: int

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        (x,) = xs
        return x[(slice(None),) * self.axis + (slice(self.start, self.stop),)]

    def feeds(self, box: Box) -> list[Feed]:
        """The source boxes that make ``box`` of the result."""
        lo, hi = box[self.axis]
        return [(0, with_extent(box, self.axis, (lo + self.start, hi + self.start)))]

    def on_boxes(self, regions: Sequence[np.ndarray]) -> np.ndarray:
        """The result's box from the regions :meth:`feeds` named."""
        return regions[0]


@dataclass(frozen=True)
class Index:
    """Entry ``index`` of the one source along ``axis`` (an unstack)."""

    axis: int
    index: int

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        (x,) = xs
        return np.take(x, self.index, axis=self.axis)

    def feeds(self, box: Box) -> list[Feed]:
        return [(0, (*box[: self.axis], (self.index, self.index + 1), *box[self.axis :]))]

    def on_boxes(self, regions: Sequence[np.ndarray]) -> np.ndarray:
        return np.take(regions[0], 0, axis=self.axis)


@dataclass(frozen=True)
class Concatenate:
    """``np.concatenate(sources, axis)``; ``sizes`` are the parts' extents on ``axis``."""

    axis: int
    sizes: tuple[int, ...]
    rule: int = -1

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(list(xs), axis=self.axis)

    def feeds(self, box: Box) -> list[Feed]:
        return concat_feeds(self.axis, self.sizes, box)

    def on_boxes(self, regions: Sequence[np.ndarray]) -> np.ndarray:
        return regions[0] if len(regions) == 1 else np.concatenate(list(regions), axis=self.axis)


@dataclass(frozen=True)
class Stack:
    """``np.stack(sources, axis)`` (layer ``i`` is source ``i``)."""

    axis: int

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.stack(list(xs), axis=self.axis)

    def feeds(self, box: Box) -> list[Feed]:
        lo, hi = box[self.axis]
        return [(i, (*box[: self.axis], *box[self.axis + 1 :])) for i in range(lo, hi)]

    def on_boxes(self, regions: Sequence[np.ndarray]) -> np.ndarray:
        return np.stack(list(regions), axis=self.axis)


Step = Transpose | Reshape


@dataclass(frozen=True)
class Constant:
    """``value`` of ``dtype`` filling ``shape`` (default 0-d), from no source (a torch
    buffer written on export, an LSTM's zero second bias)."""

    value: int | float
    dtype: str
    shape: Shape = ()

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.full(self.shape, self.value, np.dtype(self.dtype))


@dataclass(frozen=True)
class Sum:
    """The element-wise sum of the sources (torch's two LSTM biases into one)."""

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        out = np.array(xs[0], copy=True)
        for x in xs[1:]:
            out += x
        return out


@dataclass(frozen=True)
class Same:
    """The first source, after checking every other source equals it (tied copies).

    ``keys`` name the sources, for the message.
    """

    keys: tuple[str, ...]

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        first = xs[0]
        for key, x in zip(self.keys[1:], xs[1:], strict=True):
            if x.shape != first.shape or not np.array_equal(x, first, equal_nan=first.dtype.kind in "fc"):
                raise RuleError(_untied(self.keys[0], key, first, x), kind="tied")
        return first


def _untied(source: str, copy: str, a: np.ndarray, b: np.ndarray) -> str:
    diff = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))) if a.shape == b.shape else "shape"
    return (
        f"`{copy}` is declared tied to `{source}` but holds other values (max |difference| {diff}); "
        f"the file's copies were trained apart: give the model a separate param for `{copy}`, "
        "or pass check=False to tie() to keep the source and report the copy"
    )


@dataclass(frozen=True)
class Each:
    """``outer([inner([x]) for x in xs])``: a step per source, then one combine
    (one part of each layer's fused tensor, stacked)."""

    inner: Take | Index
    outer: Stack | Concatenate

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return self.outer([self.inner([x]) for x in xs])

    def feeds(self, box: Box) -> list[Feed]:
        """Each part the outer combine names, through the inner step (one feed each)."""
        return [(i, self.inner.feeds(part)[0][1]) for i, part in self.outer.feeds(box)]

    def on_boxes(self, regions: Sequence[np.ndarray]) -> np.ndarray:
        return self.outer.on_boxes([self.inner.on_boxes([r]) for r in regions])


@dataclass(frozen=True)
class Chain:
    """``outer([inner(xs)])``: combine the sources, then cut (a sum, split)."""

    inner: Sum
    outer: Take

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return self.outer([self.inner(xs)])


@dataclass(frozen=True)
class Restore:
    """A sum's part ``into`` on an export made against the source file: the model's
    value (``inner`` of the model's tensors) with the file's ``parts`` summed tensors
    as the last inputs. While the file's parts still add up to the model's value, bit
    for bit, the file's own part; else the model's value minus the other parts (so
    they stay as the file has them and add up to the model's value)."""

    inner: Concatenate | None
    parts: int
    into: int

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        model, parts = xs[: len(xs) - self.parts], xs[len(xs) - self.parts :]
        whole = np.asarray(model[0] if self.inner is None else self.inner(model))
        if Sum()(parts).tobytes() == np.ascontiguousarray(whole).tobytes():
            return parts[self.into]
        out = np.array(whole, copy=True)
        for i, part in enumerate(parts):
            if i != self.into:
                out -= part
        return out


Combine = Take | Index | Concatenate | Stack | Constant | Sum | Same | Each | Chain | Restore | Computed | ComputedPart
_BOX_COMBINES = (Take, Index, Concatenate, Stack, Each)  # the combines with a per-box map


@dataclass(frozen=True)
class Transform:
    """``post(combine([pre_i(x_i) for each source i]))``.

    On load ``pre`` is empty and ``post`` holds the target's transposes and reshapes; on
    export the other way round (each model tensor is transformed before the combine).

    Attributes:
        pre: one tuple of steps per source (empty tuple: no source steps).
        combine: how the sources make one array; ``None`` when there is one source.
        post: steps applied to the combined array.
    """

    pre: tuple[tuple[Step, ...], ...]
    combine: Combine | None
    post: tuple[Step, ...]

    def __call__(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        xs = [_chain(self.pre[i] if i < len(self.pre) else (), np.asarray(x)) for i, x in enumerate(arrays)]
        if self.combine is None:
            (x,) = xs
        else:
            x = self.combine(xs)
        return _contiguous(_chain(self.post, x))

    def source_boxes(self, box: Box, shapes: Sequence[Shape]) -> list[Feed] | None:
        """The ``(source index, source box)`` reads that make ``box`` of the result, in the
        order :meth:`from_boxes` takes them; ``None`` when ``box`` has no per-box preimage
        (a reshape across it, a combine with no box map): read whole.

        Examples:
            >>> t = Transform((), None, (Transpose((1, 0)),))
            >>> t.source_boxes(((0, 4), (2, 3)), [(3, 4)])  # kernel column 2: weight row 2
            [(0, ((2, 3), (0, 4)))]
        """
        chain = None if self.pre or not all(lo < hi for lo, hi in box) else self._boxes_before(box)
        if chain is None:
            return None
        if self.combine is None:
            feeds = [(0, chain[0])]
        elif isinstance(self.combine, _BOX_COMBINES):
            feeds = self.combine.feeds(chain[0])
        else:
            return None
        return feeds if all(inside(b, shapes[i]) for i, b in feeds) else None

    def from_boxes(self, box: Box, regions: Sequence[np.ndarray]) -> np.ndarray:
        """Box ``box`` of the result from the regions read for :meth:`source_boxes`.

        Examples:
            >>> t = Transform((), None, (Transpose((1, 0)),))
            >>> t.from_boxes(((0, 2), (1, 2)), [np.array([[5, 6]])]).tolist()
            [[5], [6]]
        """
        chain = self._boxes_before(box)
        assert chain is not None, "from_boxes of a box source_boxes refused"
        x = self.combine.on_boxes(regions) if isinstance(self.combine, _BOX_COMBINES) else regions[0]
        for step, out in zip(self.post, chain[1:], strict=True):
            x = step.on_box(x, out)
        return x

    def image(self, i: int, box: Box, x: np.ndarray) -> list[tuple[Box, np.ndarray]] | None:
        """Where box ``box`` of source ``i`` (holding ``x``) lands in the result, with its
        values (how an export writes each shard): one part, or none; ``None`` when a step
        or the combine has no box map forward (a reshape across the box, a sum, a tie).

        Examples:
            >>> t = Transform(((Transpose((1, 0)),),) * 2, Concatenate(0, (2, 3)), ())  # two kernels, one weight
            >>> [(box, x.shape) for box, x in t.image(1, ((0, 4), (1, 3)), np.zeros((4, 2)))]  # kernel columns 1-2
            [(((3, 5), (0, 4)), (2, 4))]
            >>> Transform((), Take(0, 4, 8), ()).image(0, ((0, 4), (0, 2)), np.zeros((4, 2)))  # rows 4-7 only
            []
        """
        moved = _forward(self.pre[i] if self.pre else (), box, x)
        if moved is None:
            return None
        parts = _combine_forward(self.combine, i, *moved)
        if parts is None:
            return None
        out = [_forward(self.post, b, v) for b, v in parts]
        return None if any(part is None for part in out) else [part for part in out if part is not None]

    def _boxes_before(self, box: Box) -> list[Box] | None:
        """The box before each post step, then ``box``: ``[combined box, ..., box]``."""
        chain = [box]
        for step in reversed(self.post):
            before = step.box_before(chain[0]) if isinstance(step, (Transpose, Reshape)) else None
            if before is None:
                return None
            chain.insert(0, before)
        return chain


def _contiguous(x: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray alone: it turns a 0-d result into shape (1,).
    x = np.asarray(x)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(x.shape)


def _chain(steps: Sequence[Step], x: np.ndarray) -> np.ndarray:
    for step in steps:
        x = step(x)
    return x


def _combine_forward(combine: Combine | None, i: int, box: Box, x: np.ndarray) -> list[tuple[Box, np.ndarray]] | None:
    """Box ``box`` of the ``i``-th combined array (holding ``x``) in the combine's result."""
    if combine is None:
        return [(box, x)]
    if isinstance(combine, Concatenate):
        lo = sum(combine.sizes[:i])
        return [(with_extent(box, combine.axis, (box[combine.axis][0] + lo, box[combine.axis][1] + lo)), x)]
    if isinstance(combine, Stack):
        return [((*box[: combine.axis], (i, i + 1), *box[combine.axis :]), np.expand_dims(x, combine.axis))]
    if isinstance(combine, Take):
        (lo, hi), (start, stop) = box[combine.axis], (combine.start, combine.stop)
        a, b = max(lo, start), min(hi, stop)
        part = x[(slice(None),) * combine.axis + (slice(a - lo, b - lo),)]
        return [(with_extent(box, combine.axis, (a - start, b - start)), part)] if a < b else []
    if isinstance(combine, Index):
        lo, hi = box[combine.axis]
        if not lo <= combine.index < hi:
            return []
        at = (slice(None),) * combine.axis + (combine.index - lo,)  # a view: the placeholders take no memory
        return [((*box[: combine.axis], *box[combine.axis + 1 :]), x[at])]
    return None


def _forward(steps: Sequence[Step], box: Box, x: np.ndarray) -> tuple[Box, np.ndarray] | None:
    """``box`` (holding ``x``) through ``steps``: its box and values after them, or
    ``None`` where a reshape does not keep it rectangular."""
    for step in steps:
        if isinstance(step, Transpose):
            box = tuple(box[a] for a in step.axes)
        else:
            after = reshape_back(step.shape, step.source_shape, box)
            if after is None:
                return None
            box = after
        x = step.on_box(x, box)
    return box, x
