"""Shapes and dtypes by key, the input the planner takes: :func:`shapes_of` reads them
from arrays, ``jax.ShapeDtypeStruct``s or a header without touching tensor data."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ._errors import RuleError

__all__ = ["Shape", "shapes_of", "source_shapes"]

Shape = tuple[int, ...]


def _numpy_dtype(dtype: object) -> np.dtype:
    """A numpy dtype from a numpy / jax dtype or a header's dtype entry (its ``.numpy``)."""
    held = getattr(dtype, "numpy", None)
    return held if isinstance(held, np.dtype) else np.dtype(dtype)  # type: ignore[call-overload]  # any dtype-like object


def shapes_of(arrays: Mapping[str, object] | object) -> dict[str, tuple[Shape, np.dtype]]:
    """``{key: (shape, dtype)}`` of anything with ``.shape`` and ``.dtype``: arrays,
    ``jax.ShapeDtypeStruct``, a header's tensor entries, or a whole header
    (``nnx_save.read_header(path)``), which reads no tensor data.

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> nnx_save.save_file({"fc.weight": np.zeros((3, 2), np.float32)}, path)
        >>> shapes_of(nnx_save.read_header(path))
        {'fc.weight': ((3, 2), dtype('float32'))}
    """
    items = getattr(arrays, "tensors", arrays)  # a Header: its tensor entries
    if not isinstance(items, Mapping) or not all(hasattr(v, "shape") and hasattr(v, "dtype") for v in items.values()):
        raise RuleError(
            f"shapes_of: arrays must be a mapping of names to arrays (anything with .shape and .dtype) or a "
            f"Header, got {type(arrays).__name__}"
        )
    return {k: (tuple(int(s) for s in v.shape), _numpy_dtype(v.dtype)) for k, v in items.items()}


def source_shapes(sources: Mapping[str, object] | object) -> dict[str, tuple[Shape, np.dtype]]:
    """``{key: (shape, dtype)}`` pairs as they are, or anything :func:`shapes_of` reads."""
    items = getattr(sources, "tensors", sources)
    if all(isinstance(v, tuple) and len(v) == 2 for v in items.values()):  # type: ignore[attr-defined]  # a mapping, checked by shapes_of
        return {k: (tuple(int(s) for s in shape), _numpy_dtype(dtype)) for k, (shape, dtype) in items.items()}  # type: ignore
    return shapes_of(items)
