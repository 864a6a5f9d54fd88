"""A state dict already in memory as the source of :func:`load_model` / :func:`load_file`
(the torch habit ``model.load_state_dict(state)``): ``{key: array}`` with numpy arrays,
jax arrays, torch tensors (torch is never imported here: a tensor exists only if the
caller imported it), NNX variables or Python numbers, flat or nested as
:func:`save_file` takes a tree. It becomes a virtual file (:mod:`nnx_save.layouts._memory`),
so matching, porting rules, shardings, casts, the report and ``strict`` are a file's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UnsupportedValueError, short_repr
from ..format import _paths
from ..format._torch import torch_to_numpy
from ..layouts._memory import MEMORY, memory_header
from ..layouts._registry import read_header
from ..load._source import Header
from ._leaves import tree_pairs

__all__ = ["source_header", "state_dict_header"]

RNG_KEY = "nnx_save.rng_impl"  # as bridges._nnx records typed keys (that module imports flax)


def source_header(source: Any) -> Header:
    """The header of a load's ``source``: a state dict in memory, or what :func:`read_header` reads."""
    if isinstance(source, Mapping):
        return state_dict_header(source)
    return read_header(source)


def state_dict_header(state: Mapping[str, Any]) -> Header:
    """The :class:`Header` of a state dict in memory, its keys as :func:`save_file` would
    write them (``{"a": {"b": x}}`` and ``{"a/b": x}`` both make ``a/b``); typed PRNG keys
    become their key data, their implementation recorded as :func:`save_model` does.
    A ``dict`` is read as it is at one moment (a shallow copy): another thread's
    ``update`` of it lands before or after, whole; a value changed in place (an array
    written into, a nested dict updated key by key) is the caller's to order.

    Raises:
        UnsupportedValueError: a value that is not an array or a number (names its key).
        KeyPathError: a key that cannot be a file key, or two that make the same one.
        HeaderError: an array whose dtype safetensors has no code for (``check="dtype"``).

    Examples:
        >>> import numpy as np
        >>> header = state_dict_header({"encoder": {"w": np.ones((2, 3), np.float32)}})
        >>> list(header), header["encoder/w"].shape
        (['encoder/w'], (2, 3))
    """
    if type(state) is dict:  # copied in one C call: a thread updating it meanwhile lands before or after, whole
        state = state.copy()
    pairs = tree_pairs(state)
    _paths.check_unique(p for p, _ in pairs)
    rng: dict[str, str] = {}
    arrays = {}
    for path, value in pairs:
        key = _paths.to_key(path)
        arrays[key] = _host(key, value, rng)
    return memory_header(arrays, {RNG_KEY: json.dumps(rng, sort_keys=True)} if rng else None)


def _host(key: str, value: Any, rng: dict[str, str]) -> np.ndarray:
    """``value`` as a host numpy array (no copy where numpy can view it)."""
    variable = getattr(sys.modules.get("flax.nnx"), "Variable", None)
    if variable is not None and isinstance(value, variable):
        value = value.get_value()
    if isinstance(value, (bool, int, float, np.ndarray, np.generic)):
        return np.asarray(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return torch_to_numpy(value, key, Path(MEMORY))
    if "jax" in sys.modules:
        import jax

        if isinstance(value, jax.Array):
            return _jax_host(key, value, rng)
    kind = "None" if value is None else f"a {type(value).__name__} ({short_repr(value, 40)})"
    raise UnsupportedValueError(
        f"{key}: the state dict holds {kind}; a state dict's values must be arrays (numpy, jax, torch) or numbers",
        key,
    )


def _jax_host(key: str, value: Any, rng: dict[str, str]) -> np.ndarray:
    import jax

    if value.is_deleted():
        raise UnsupportedValueError(f"{key}: the jax array has been deleted (donated, or .delete()d)", key)
    if not value.is_fully_addressable:
        raise UnsupportedValueError(
            f"{key}: a jax array spanning processes cannot be read on one host; load from a file, "
            "or reshard the array onto this process's devices",
            key,
        )
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        rng[key] = str(jax.random.key_impl(value))
        value = jax.random.key_data(value)
    return np.asarray(value)
