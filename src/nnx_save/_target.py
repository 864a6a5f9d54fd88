"""What a load asks for: one :class:`Target` per value the caller wants.

At the bottom of the import graph (numpy only), so every bridge (pytrees, NNX
models, porting rules) can build targets without importing the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Target"]


@dataclass(frozen=True)
class Target:
    """One value the caller wants.

    Attributes:
        path: the caller's key for it (tree path joined with ``/``).
        shape, dtype: what the caller expects.
        sharding: a ``jax.sharding.Sharding``, or ``None`` for a host numpy array.
        sources: the file key(s) it is made from (one, unless ``transform``).
        transform: for porting rules: full source arrays -> the value; ``None``
            reads the single source directly, sharded.
        source_shape: the shape ``transform`` produces (checked before reading).
        box: for a host target (``sharding=None``), the region ``((start, stop), ...)``
            to read, ``None`` for all of it; the value then has the box's shape
            (``nnx_save.safe_open``'s slices).

    Examples:
        >>> import numpy as np
        >>> Target("w", (2, 3), np.dtype(np.float32), sources=("w",)).sources
        ('w',)
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any = None
    sources: tuple[str, ...] = ()
    transform: Callable[[list[np.ndarray]], np.ndarray] | None = None
    source_shape: tuple[int, ...] | None = None
    box: tuple[tuple[int, int], ...] | None = None
