"""Shared helpers for the NNX bridge tests: poisoning and bit-exact state comparison."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["assert_differs", "assert_same_state", "poison", "snapshot"]


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _poison_leaf(x: Any) -> Any:
    if isinstance(x, bool):
        return not x
    if isinstance(x, int):
        return x + 1000
    if isinstance(x, float):
        return -1234.5
    if _is_key(x):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(jnp.full_like(jax.random.key_data(x), 77), impl=impl)
    if x.dtype == jnp.bool_:
        return jnp.logical_not(x)
    return jnp.full_like(x, 3)  # a constant: a no-op loader leaves it there


def poison(model: Any) -> Any:
    """Overwrite every value of ``model`` (floats, ints, bools, rng keys, Python
    scalars) with something a correct load must replace; returns ``model``."""
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(_poison_leaf, state))
    return model


def _host(x: Any) -> Any:
    if _is_key(x):
        return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
    if isinstance(x, (bool, int, float)):
        return x
    return np.array(x)


def snapshot(model: Any, filter: Any = ...) -> dict[tuple, Any]:
    """Every value of ``model`` copied to the host, by path (rng keys as key data)."""
    flat = nnx.to_flat_state(nnx.state(model, filter))
    return {tuple(p): _host(v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in flat}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return isinstance(b, tuple) and a[:2] == b[:2] and _same(a[2], b[2])
    if isinstance(a, (bool, int, float)):
        return type(a) is type(b) and a == b
    return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_state(a: dict, b: dict) -> None:
    """Bit-exact equality of two snapshots: same paths, dtypes, shapes, bytes, types."""
    assert sorted(map(str, a)) == sorted(map(str, b))
    bad = [p for p in a if not _same(a[p], b[p])]
    assert not bad, f"differ at {bad}"


def assert_differs(a: dict, b: dict) -> None:
    """Every leaf differs (so a loader that skipped any leaf would be caught)."""
    same = [p for p in a if p in b and _same(a[p], b[p])]
    assert not same, f"poisoning left {same} unchanged"
