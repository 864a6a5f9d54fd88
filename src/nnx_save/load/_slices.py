"""Indices of a lazily read tensor, checked as ``safetensors.safe_open`` checks them,
and the errors a safetensors caller catches.

Pure: no I/O. :func:`normalize_index` turns ``get_slice(key)[...]``'s index into one
int or ``slice(start, stop, step)`` per dimension, or refuses it with a
:class:`~nnx_save.errors.SliceError`; :func:`slice_box` gives the box of the tensor it
touches, which the engine reads.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from ..errors import SafetensorError, SliceError
from ..format._boxes import Box

__all__ = ["compat", "extents", "normalize_index", "plain", "slice_box"]


# --------------------------------------------------------------------------- errors

_COMPAT: dict[type, Any] = {}
_E = TypeVar("_E", bound=SafetensorError)


def compat(cls: type[_E]) -> type[_E]:
    """``cls``, or a subclass that is also ``safetensors.SafetensorError`` when the
    caller's process has imported safetensors (so ``except SafetensorError`` written
    for it catches ours); it pickles as ``cls``."""
    theirs = getattr(sys.modules.get("safetensors"), "SafetensorError", None)
    if not isinstance(theirs, type) or not issubclass(theirs, Exception):
        return cls
    found = _COMPAT.get(cls)
    if found is None:

        def reduce(self):  # pickles as the plain nnx_save class: safetensors may be absent there
            return cls, self.args, self.__dict__ or None

        found = type(cls.__name__, (cls, theirs), {"__module__": cls.__module__, "__reduce__": reduce})
        found.__qualname__ = cls.__qualname__
        _COMPAT[cls] = found
    return found


def _show(index: Any) -> str:
    items = index if isinstance(index, tuple) else (index,)
    return "[" + ", ".join(_show_one(i) for i in items) + "]"


def _show_one(item: Any) -> str:
    if isinstance(item, slice):
        parts = ["" if v is None else str(v) for v in (item.start, item.stop)]
        return ":".join(parts) + ("" if item.step is None else f":{item.step}")
    return "..." if item is Ellipsis else repr(item)


# --------------------------------------------------------------------------- indices


def _int(value: Any) -> int | None:
    """``value`` as an index int (a bool counts, as in safetensors), else None."""
    return int(value) if isinstance(value, (int, np.integer)) else None


def _bound(value: Any, default: int, size: int, fail) -> int:
    if value is None:
        return default
    i = _int(value)
    if i is None:
        raise fail(f"a slice bound must be an int, found {type(value).__name__}")
    # Negative bounds count from the end and clip at 0, as in numpy (safetensors 0.8
    # fails on every negative bound with an OverflowError, a crash rather than a rule).
    return max(i + size, 0) if i < 0 else i


def _one(item: Any, size: int, dim: int, fail) -> int | slice:
    """One dimension's index, checked as safetensors checks it, in numpy's terms."""
    if isinstance(item, slice):
        step = 1 if item.step is None else _int(item.step)
        if step is None or step < 1:
            raise fail(f"the step must be a positive integer (as in safetensors), found {item.step!r}")
        start, stop = _bound(item.start, 0, size, fail), _bound(item.stop, size, size, fail)
        if stop > size:  # numpy would clip; safetensors refuses, and so do we
            raise fail(f"index {stop - 1} is out of bounds for dimension {dim} of size {size}")
        if start >= size > 0 and item.start is not None:  # [n:], [n:n]: refused by safetensors too
            raise fail(f"index {start} is out of bounds for dimension {dim} of size {size}")
        return slice(start, stop, step)
    i = _int(item)
    if i is None:
        raise fail(
            f"unsupported index at position {dim}: expected a slice, an int or an Ellipsis, "
            f"found {type(item).__name__}; read the tensor (get_tensor) for fancy indexing"
        )
    j = i + size if i < 0 else i
    if not 0 <= j < size:
        raise fail(f"index {i} is out of bounds for dimension {dim} of size {size}")
    return j


def normalize_index(index: Any, shape: Sequence[int], key: str = "tensor") -> tuple[int | slice, ...] | None:
    """``index`` checked as ``safetensors.safe_open`` checks it and made explicit: one
    int or ``slice(start, stop, step)`` per dimension (bounds in range, step >= 1).
    ``None`` for the empty list ``[[]]`` (no rows).

    Raises:
        SliceError: an index safetensors refuses, naming the key, shape and index.

    Examples:
        >>> normalize_index((slice(1, 3), Ellipsis, -1), (4, 5, 6))
        (slice(1, 3, 1), slice(0, 5, 1), 5)
        >>> normalize_index([], (4, 5)) is None
        True
    """

    quick = plain(index, shape)
    if quick is not None:
        return quick

    def fail(why: str) -> SliceError:
        return compat(SliceError)(f"{key}: cannot slice a tensor of shape {list(shape)} with {_show(index)}: {why}")

    if isinstance(index, list):
        if index or not shape:
            raise fail("non-empty lists are not implemented (nor in safetensors); read the tensor (get_tensor)")
        return None
    items = index if isinstance(index, tuple) else (index,)
    at = [n for n, i in enumerate(items) if i is Ellipsis]
    if len(at) > 1:
        raise fail("only one Ellipsis (...) is allowed")
    if at:
        items = items[: at[0]] + (slice(None),) * (len(shape) - len(items) + 1) + items[at[0] + 1 :]
    if len(items) > len(shape):
        raise fail(f"more indices ({len(items)}) than dimensions ({len(shape)})")
    items = items + (slice(None),) * (len(shape) - len(items))
    return tuple(_one(i, d, n, fail) for n, (i, d) in enumerate(zip(items, shape, strict=True)))


def plain(index: Any, shape: Sequence[int]) -> tuple[int | slice, ...] | None:
    """The common index (one in-range int or step-less non-negative slice per
    dimension) made explicit without the general checks, else None."""
    if type(index) is not tuple or len(index) != len(shape):
        index = (index,) if type(index) in (int, slice) and len(shape) == 1 else None
        if index is None:
            return None
    out: list[int | slice] = []
    for item, size in zip(index, shape, strict=False):
        if type(item) is int:
            if not -size <= item < size:
                return None
            out.append(item if item >= 0 else item + size)
            continue
        if type(item) is not slice or item.step is not None:
            return None
        start = 0 if item.start is None else item.start
        stop = size if item.stop is None else item.stop
        if type(start) is not int or type(stop) is not int or not 0 <= start < size or not 0 <= stop <= size:
            return None
        out.append(slice(start, stop, 1))
    return tuple(out)


def slice_box(index: Any, shape: Sequence[int], key: str = "tensor") -> tuple[Box, tuple[Any, ...]]:
    """The box ``index`` touches in a tensor of ``shape``, and the index that takes the
    result out of that box (steps, dropped dimensions).

    Examples:
        >>> slice_box((slice(1, 3), Ellipsis, -1), (4, 5, 6))
        (((1, 3), (0, 5), (5, 6)), (slice(None, None, None), slice(None, None, None), 0))
    """
    items = normalize_index(index, shape, key)
    if items is None:
        return ((0, 0), *tuple((0, d) for d in shape[1:])), (slice(None),) * len(shape)
    return tuple(zip(*(_box_one(i) for i in items), strict=True)) if items else ((), ())  # type: ignore[return-value]


def _box_one(item: int | slice) -> tuple[tuple[int, int], Any]:
    if isinstance(item, int):
        return (item, item + 1), 0
    count = len(range(item.start, item.stop, item.step))
    if count == 0:
        return (item.start, item.start), slice(None)
    last = item.start + (count - 1) * item.step
    return (item.start, last + 1), slice(None) if item.step == 1 else slice(None, None, item.step)


def extents(items: tuple[int | slice, ...]) -> list[int]:
    return [len(range(i.start, i.stop, i.step)) for i in items if isinstance(i, slice)]
