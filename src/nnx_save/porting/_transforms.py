"""Value transforms as data: small frozen steps and the pipeline that chains them.

Every step is a pure numpy function held in a frozen dataclass, so a mapping can be
printed and compared and its transforms need neither pickle nor closures. A step
knows the shape it expects (recorded at mapping time), which is what lets
``Rules.inverse(recorded=mapping)`` reshape back to the recorded source shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Concatenate", "Constant", "Index", "Reshape", "Stack", "Take", "Transform", "Transpose"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Transpose:
    """``np.transpose(x, axes)``."""

    axes: tuple[int, ...]
    rule: int = -1  # position of the rule that made it in its Rules, for messages

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.axes)


@dataclass(frozen=True)
class Reshape:
    """``x.reshape(shape)``; ``source_shape`` is the shape it was planned for."""

    shape: Shape
    source_shape: Shape
    rule: int = -1

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.shape)


@dataclass(frozen=True)
class Take:
    """Part ``[start, stop)`` of the one source along ``axis`` (a split)."""

    axis: int
    start: int
    stop: int

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        (x,) = xs
        index = [slice(None)] * x.ndim
        index[self.axis] = slice(self.start, self.stop)
        return x[tuple(index)]


@dataclass(frozen=True)
class Index:
    """Entry ``index`` of the one source along ``axis`` (an unstack)."""

    axis: int
    index: int

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        (x,) = xs
        return np.take(x, self.index, axis=self.axis)


@dataclass(frozen=True)
class Concatenate:
    """``np.concatenate(sources, axis)``; ``sizes`` are the parts' extents on ``axis``."""

    axis: int
    sizes: tuple[int, ...]
    rule: int = -1

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(list(xs), axis=self.axis)


@dataclass(frozen=True)
class Stack:
    """``np.stack(sources, axis)`` (layer ``i`` is source ``i``)."""

    axis: int

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.stack(list(xs), axis=self.axis)


Step = Transpose | Reshape


@dataclass(frozen=True)
class Constant:
    """A 0-d ``value`` of ``dtype`` that no source holds (a torch buffer written on
    export, such as BatchNorm's ``num_batches_tracked``); takes no sources."""

    value: int | float
    dtype: str

    def __call__(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.asarray(self.value, np.dtype(self.dtype))


Combine = Take | Index | Concatenate | Stack | Constant


@dataclass(frozen=True)
class Transform:
    """``post(combine([pre_i(x_i) for each source i]))``.

    On load ``pre`` is empty and ``post`` holds the target's transposes and reshapes;
    on export it is the other way round (each model tensor is transformed before the
    split, concatenation or unstack that makes the file tensor).

    Attributes:
        pre: one tuple of steps per source (empty tuple: no source steps).
        combine: how the sources make one array; ``None`` when there is one source.
        post: steps applied to the combined array.
    """

    pre: tuple[tuple[Step, ...], ...]
    combine: Combine | None
    post: tuple[Step, ...]

    def __call__(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        xs = [_chain(self.pre[i] if self.pre else (), np.asarray(x)) for i, x in enumerate(arrays)]
        if self.combine is None:
            (x,) = xs
        else:
            x = self.combine(xs)
        return _contiguous(_chain(self.post, x))


def _contiguous(x: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray alone: it turns a 0-d result into shape (1,).
    x = np.asarray(x)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(x.shape)


def _chain(steps: Sequence[Step], x: np.ndarray) -> np.ndarray:
    for step in steps:
        x = step(x)
    return x
