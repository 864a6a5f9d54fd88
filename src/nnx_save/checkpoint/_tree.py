"""Pytree leaves as the checkpoint sees them: paths, storable kinds, dtypes.

A leaf path is a tuple of ``str`` segments as Orbax names them (``nnx.List`` index ``0``
is ``"0"``), so template, dtype-record and Orbax paths compare directly.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from ..errors import KeyPathError, OptionError, UnsupportedValueError
from ..format import _paths
from ..format._paths import format_path
from ..save._entry import check_storable
from ._errors import UnsupportedCheckpointError
from ._format import DTYPES_FORMAT, ITEM_NAMES

__all__ = [
    "Path",
    "Recorded",
    "Spec",
    "check_item",
    "flatten",
    "is_array",
    "is_key_dtype",
    "leaf_spec",
    "parse_dtype_record",
    "parse_leaf_record",
    "python_kind",
    "record_of",
    "segment",
    "show",
]

Path = tuple[str, ...]

_INT64 = np.iinfo(np.int64)


class Spec(NamedTuple):
    """The shape and dtype of an array leaf as stored (typed keys: their key data)."""

    shape: tuple[int, ...]
    dtype: str


def segment(entry: Any) -> str:
    """One path segment, named as Orbax names it: the package's one segment rule
    (:func:`nnx_save.format._paths.segment`), as text."""
    return str(_paths.segment(entry))


def flatten(tree: Any) -> list[tuple[Path, Any]]:
    """``(path, leaf)`` pairs in pytree order, paths as Orbax names them."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(segment(e) for e in keypath), leaf) for keypath, leaf in pairs]


def show(path: Path) -> str:
    """A leaf path for messages (``"<root>"`` for a bare array item)."""
    return format_path(path) if path else "<root>"


def is_array(leaf: Any) -> bool:
    """True for leaves that carry a shape and a dtype (arrays and templates)."""
    return isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def leaf_spec(leaf: Any) -> Spec | None:
    """The stored shape and dtype of an array leaf; ``None`` for Python leaves."""
    if not is_array(leaf):
        return None
    name = _dtype_name(leaf.dtype)
    if name is None:  # a typed PRNG key: stored as its key data
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return Spec(tuple(data.shape), str(data.dtype))
    return Spec(tuple(leaf.shape), name)


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: Any) -> str | None:
    """A dtype's name as stored (``"float32"``), None for a typed-key dtype. Cached: numpy's
    ``str(dtype)`` and jax's ``issubdtype`` cost microseconds each, paid per leaf on every
    save and restore of thousands of leaves that share a few dtypes."""
    return None if is_key_dtype(dtype) else str(np.dtype(dtype).newbyteorder("="))  # ">i2": its values, int16


@functools.lru_cache(maxsize=256)
def is_key_dtype(dtype: Any) -> bool:
    """True for a typed PRNG key's dtype (cached per dtype, as :func:`leaf_spec`'s name)."""
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def unknown_item(name: object) -> str:
    """The message refusing an item name a step cannot hold: it names the way.

    Examples:
        >>> print(unknown_item("ema"))  # doctest: +NORMALIZE_WHITESPACE
        unknown item name 'ema'; expected one of model, optimizer, rng, data_iterator,
        extensions; put other state in extensions, e.g. items={'extensions': {'ema': ...}}
    """
    return (
        f"unknown item name {name!r}; expected one of {', '.join(ITEM_NAMES)}; "
        f"put other state in extensions, e.g. items={{'extensions': {{{name!r}: ...}}}}"
    )


def check_item(name: str, tree: Any) -> tuple[list[Any], list[Any]]:
    """Refuse an item Orbax could not store exactly, before anything is written: an
    unknown name (``OptionError``), a leaf that is no array, typed key, int, float, bool or
    str, an int past int64, an empty or deleted array (``UnsupportedValueError``), or two
    leaves Orbax would name alike, ``{"a.b": x}`` and ``{"a": {"b": y}}`` (``KeyPathError``).

    Returns:
        The item's rows of the dtype record (``items`` and ``leaves``, see
        :func:`record_of`), made in the same pass over the leaves.
    """
    if name not in ITEM_NAMES:
        raise OptionError(unknown_item(name), "items")
    names: dict[str, Path] = {}
    dtypes: list[Any] = []
    leaves: list[Any] = []
    for path, leaf in flatten(tree):
        _check_leaf(name, path, leaf)
        dotted = ".".join(path)
        if dotted in names:
            raise KeyPathError(
                f"{name}/{show(path)} and {name}/{show(names[dotted])} are both stored by Orbax "
                f"as {dotted!r}, so one would overwrite the other; rename one of the keys",
                f"{name}/{show(path)}",
            )
        names[dotted] = path
        spec = leaf_spec(leaf)
        if spec is None:
            leaves.append([list(path), python_kind(leaf)])
        else:
            dtypes.append([list(path), spec.dtype])
            leaves.append([list(path), spec.dtype, list(spec.shape)])
    return dtypes, leaves


def _check_leaf(item: str, path: Path, leaf: Any) -> None:
    problem = _leaf_problem(leaf)
    if problem is not None:  # the path is formatted only for a refusal: a save checks every leaf
        where = f"{item}/{show(path)}"
        raise UnsupportedValueError(f"{where}: {problem}", where)
    if isinstance(leaf, (jax.Array, np.ndarray)) and leaf.dtype == np.bool_:  # bytes a restore refuses
        check_storable(f"{item}/{show(path)}", leaf)


def _leaf_problem(leaf: Any) -> str | None:
    """Why Orbax could not store ``leaf`` exactly, or None."""
    if isinstance(leaf, (jax.Array, np.ndarray)):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            return (
                "the jax array has been deleted (donated to a jitted call, or .delete()d); "
                "save it before the call that donates it"
            )
        return f"Orbax cannot store the empty array of shape {leaf.shape}" if leaf.size == 0 else None
    if isinstance(leaf, np.generic):
        return (
            f"a numpy scalar {type(leaf).__name__} would come back as a Python value; "
            "store leaf.item() or np.asarray(leaf)"
        )
    if isinstance(leaf, int) and not isinstance(leaf, bool) and not _INT64.min <= leaf <= _INT64.max:
        return f"the int {leaf} does not fit in int64"
    if not isinstance(leaf, (int, float, str)):
        return (
            f"a {type(leaf).__name__} cannot be stored; leaves must be arrays, typed PRNG keys, "
            "ints, floats, bools or strings"
        )
    return None


def record_of(rows: Mapping[str, tuple[list[Any], list[Any]]]) -> dict[str, Any]:
    """The dtype record of items whose rows :func:`check_item` made, in ``rows``' order:
    ``items`` the dtype of each array (what the dtype guard compares), ``leaves`` each
    leaf's stored shape and dtype, or its Python type (what a templated restore compares,
    without asking Orbax for the metadata of every array).

    Examples:
        >>> items = {"rng": jax.random.key(0), "model": {"w": np.zeros(2, np.float16), "n": 3}}
        >>> record = record_of({name: check_item(name, tree) for name, tree in items.items()})
        >>> record["items"]
        {'rng': [[[], 'uint32']], 'model': [[['w'], 'float16']]}
        >>> record["leaves"]["model"]
        [[['n'], 'int'], [['w'], 'float16', [2]]]
    """
    return {
        "format": DTYPES_FORMAT,
        "items": {name: dtypes for name, (dtypes, _) in rows.items()},
        "leaves": {name: leaves for name, (_, leaves) in rows.items()},
    }


def python_kind(leaf: Any) -> str:
    """``"bool"``, ``"int"``, ``"float"`` or ``"str"``: the kind of a stored Python leaf."""
    for kind in (bool, int, float, str):
        if isinstance(leaf, kind):
            return kind.__name__
    raise UnsupportedValueError(f"a {type(leaf).__name__} is not a storable Python leaf")


class Recorded(NamedTuple):
    """An item's leaves as its record gives them: array specs (None for a Python leaf),
    and the kinds of the Python leaves (the neutral forms :mod:`._orbax` makes of Orbax's metadata)."""

    specs: dict[Path, Spec | None]
    kinds: dict[Path, str]


def parse_dtype_record(data: Any) -> dict[str, dict[Path, str]]:
    """Read a dtype record back as ``{item: {path: dtype}}`` (or refuse it:
    :class:`UnsupportedCheckpointError`)."""
    items = data.get("items") if isinstance(data, Mapping) and data.get("format") == DTYPES_FORMAT else None
    if not isinstance(items, Mapping) or not all(_is_pairs(pairs) for pairs in items.values()):
        raise UnsupportedCheckpointError(f"a malformed dtype record {str(data)[:200]!r}")
    return {name: {tuple(path): dtype for path, dtype in pairs} for name, pairs in items.items()}


def parse_leaf_record(data: Any) -> dict[str, Recorded] | None:
    """The ``leaves`` of a dtype record (None for a record written before they were;
    :class:`UnsupportedCheckpointError` for malformed ones)."""
    leaves = data.get("leaves") if isinstance(data, Mapping) else None
    if leaves is None:
        return None
    if not isinstance(leaves, Mapping) or not all(isinstance(rows, list) for rows in leaves.values()):
        raise UnsupportedCheckpointError(f"a malformed leaf record {str(leaves)[:200]!r}")
    return {name: _recorded(rows) for name, rows in leaves.items()}


def _recorded(rows: list[Any]) -> Recorded:
    specs: dict[Path, Spec | None] = {}
    kinds: dict[Path, str] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) in (2, 3) and _is_path(row[0]) and isinstance(row[1], str)):
            raise UnsupportedCheckpointError(f"a malformed leaf record entry {str(row)[:200]!r}")
        path = tuple(row[0])
        if len(row) == 2 and row[1] in ("bool", "int", "float", "str"):
            specs[path], kinds[path] = None, row[1]
        elif len(row) == 3 and _is_shape(row[2]):
            specs[path] = Spec(tuple(row[2]), row[1])
        else:
            raise UnsupportedCheckpointError(f"a malformed leaf record entry {str(row)[:200]!r}")
    return Recorded(specs, kinds)


# The record's checks run once per leaf on every read of a step: types are compared as sets
# (one C-level pass per list) rather than with a generator per row. JSON gives exact types.
_STR, _INT = frozenset({str}), frozenset({int})


def _is_path(path: Any) -> bool:
    """True for ``["path", "segments"]`` (empty: a bare array item)."""
    return isinstance(path, list) and set(map(type, path)) <= _STR


def _is_shape(shape: Any) -> bool:
    """True for a list of non-negative ints (not bools)."""
    return isinstance(shape, list) and set(map(type, shape)) <= _INT and (not shape or min(shape) >= 0)


def _is_pairs(pairs: Any) -> bool:
    """True for ``[[["path", "segments"], "dtype"], ...]``."""
    return isinstance(pairs, list) and all(
        isinstance(pair, list) and len(pair) == 2 and _is_path(pair[0]) and isinstance(pair[1], str) for pair in pairs
    )
