"""Reading a whole Orbax checkpoint as host arrays, for conversion to safetensors.

Leaves are named as :func:`nnx_save.save_model` names a model's state (no store root
node, no NNX ``value`` node), so :func:`nnx_save.load_model` reads the file; typed PRNG
keys become their key data, Python numbers 0-d arrays, each with its type recorded.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..errors import UnsupportedValueError
from ._format import DTYPES_ITEM, ROOT
from ._tree import Path, flatten, is_key_dtype, show

__all__ = ["OrbaxLeaf", "orbax_arrays"]

_PY_DTYPES = {bool: np.bool_, int: np.int64, float: np.float64}


class OrbaxLeaf(NamedTuple):
    """One converted leaf: its path, its host array, and what it was before."""

    path: Path
    array: np.ndarray
    rng_impl: str | None = None  # a typed PRNG key: its implementation's name
    scalar: str | None = None  # a Python number: "int" | "float" | "bool"


def orbax_arrays(path: str | os.PathLike) -> list[OrbaxLeaf]:
    """Every leaf of an Orbax PyTree checkpoint directory, as host numpy arrays (a leaf
    that is no array or number is an :class:`UnsupportedValueError` naming it)."""
    where = os.path.abspath(path)  # Orbax refuses relative paths
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # orbax warns that no target sharding was given: host arrays are wanted
        tree = ocp.PyTreeCheckpointer().restore(where)
    pairs = flatten(tree)
    if os.path.isdir(os.path.join(os.path.dirname(where), DTYPES_ITEM)) and all(p[:1] == (ROOT,) for p, _ in pairs):
        pairs = [(p[1:], leaf) for p, leaf in pairs]  # one item of a store step: drop the store's root node
    if pairs and all(len(p) > 1 and p[-1] == "value" for p, _ in pairs):
        pairs = [(p[:-1], leaf) for p, leaf in pairs]  # an NNX state: every leaf is a variable's value
    name = os.path.basename(os.path.normpath(where))
    return [_leaf(p or (name,), leaf) for p, leaf in pairs]


def _leaf(path: Path, leaf: Any) -> OrbaxLeaf:
    if isinstance(leaf, jax.Array) and is_key_dtype(leaf.dtype):
        return OrbaxLeaf(path, np.asarray(jax.random.key_data(leaf)), rng_impl=str(jax.random.key_impl(leaf)))
    if type(leaf) in _PY_DTYPES:
        return OrbaxLeaf(path, np.asarray(leaf, _PY_DTYPES[type(leaf)]), scalar=type(leaf).__name__)
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        raise UnsupportedValueError(
            f"{show(path)}: a {type(leaf).__name__} leaf; safetensors stores arrays and numbers only", show(path)
        )
    return OrbaxLeaf(path, np.asarray(leaf))
