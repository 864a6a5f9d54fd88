"""A tree's leaves as the file sees them, shared by every bridge: paths flattened to keys,
leaves to entries, the load keywords and the metadata check. Below _pytree, _nnx and
_state_dict, so that none of those imports another to reach them."""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict

import numpy as np

from .._options import merge
from ..errors import KeyPathError, UnsupportedValueError, short_repr
from ..format import _dtypes, _paths
from ..load._options import LoadOptions
from ..save._entry import Entry, HostValue, check_storable

__all__ = [
    "LoadKeywords",
    "check_metadata",
    "describe",
    "flat_file_keys",
    "flatten",
    "flatten_keys",
    "leaf_entries",
    "leaf_entry",
    "load_options",
    "tree_entries",
    "tree_pairs",
    "variable_class",
]


_KEY = operator.attrgetter("key")
_STR_TYPE = {str}
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


class LoadKeywords(TypedDict, total=False):
    """The :class:`LoadOptions` fields that :func:`load_file` and :func:`load_model` take as keywords."""

    max_over_read_ratio: float | None
    read_chunk_bytes: int | None
    max_inflight_bytes: int
    num_threads: int | None
    verify: bool
    progress: bool | None
    stream: bool | None
    staging: str
    share_reads: bool | None


def load_options(call: str, options: LoadOptions | None, keywords: Mapping[str, Any]) -> LoadOptions:
    """``options`` with the keyword shortcuts applied (:func:`merge`); a keyword that is
    not one of :class:`LoadKeywords` is a ``TypeError``, as for any other function."""
    for name in keywords:
        if name not in LoadKeywords.__annotations__:
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}")
    return merge(LoadOptions, options, call, keywords)


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[tuple[tuple, Any]], Any]:
    """``[(path, leaf)]`` and the treedef, with ``None`` kept as a leaf so it can be refused."""
    keypaths, leaves, treedef = _flatten_with_path(tree, is_leaf)
    return list(zip(segments(keypaths), leaves, strict=True)), treedef


def flatten_keys(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[str], list[Any], Any]:
    """``(keys, leaves, treedef)``: :func:`flatten` with each path made its file key
    (:func:`~nnx_save.format._paths.to_keys`), a flat dict's names taken as they are."""
    flat = _flat_dict(tree) if is_leaf is None else None
    if flat is not None:
        return flat
    keypaths, leaves, treedef = _flatten_with_path(tree, is_leaf)
    values = _segment_values(keypaths)
    if values is not None and len(values) == len(keypaths) and set(map(len, keypaths)) <= {1}:
        return _paths.names_to_keys(values), leaves, treedef
    return _paths.to_keys(segments(keypaths)), leaves, treedef


def _flat_dict(tree: Any) -> tuple[list[str], list[Any], Any] | None:
    """:func:`flatten_keys` of a plain dict whose every value is one leaf, its keys str
    (the abstract tree of a load of many tensors): jax's flatten without key paths
    (which makes an entry object and a tuple per leaf) and the names sorted as jax
    sorts them; ``None`` for any other tree."""
    if type(tree) is not dict or not tree or set(map(type, tree)) != _STR_TYPE:
        return None
    import jax

    if not jax.tree_util.all_leaves(tree.values()):  # a None, or a container
        return None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return _paths.names_to_keys(sorted(tree)), leaves, treedef


def _flatten_with_path(tree: Any, is_leaf: Callable[[Any], bool] | None) -> tuple[list[tuple], list[Any], Any]:
    """jax's key paths, the leaves (``None`` kept as one) and the treedef of ``tree``."""
    import jax

    def leaf(_: Any, x: Any) -> bool:
        return x is None or (is_leaf is not None and is_leaf(x))

    try:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf, is_leaf_takes_path=True)
    except ValueError:  # jax sorts dict keys: {0: .., "0": ..} cannot be flattened
        _refuse_mixed_keys(tree, ())
        raise
    return list(map(_FIRST, pairs)), list(map(_SECOND, pairs)), treedef


def segments(keypaths: list[tuple]) -> list[tuple]:
    """Each jax key path as a path of segments (:func:`~nnx_save.format._paths.segment`
    of each entry): in bulk where every entry is one of jax's key classes holding a
    name or an int (a model's, a dict's), else entry by entry."""
    values = _segment_values(keypaths)
    if values is None:
        return [tuple(_paths.segment(k, p[:i]) for i, k in enumerate(p)) for p in keypaths]
    lengths = set(map(len, keypaths))
    flat = iter(values)
    if len(lengths) == 1 and 0 not in lengths:
        return list(zip(*[flat] * lengths.pop(), strict=True))  # consecutive values, a path's length at a time
    return [tuple(itertools.islice(flat, len(p))) for p in keypaths]


def _segment_values(keypaths: list[tuple]) -> list[str | int] | None:
    """Every entry of ``keypaths``, in order, as its segment, when each is one of jax's
    key classes holding a name or an int; else ``None``."""
    from jax import tree_util

    entries = list(itertools.chain.from_iterable(keypaths))
    kinds = set(map(type, entries))
    if kinds <= {tree_util.DictKey}:
        values = list(map(_KEY, entries))
    elif kinds <= {tree_util.DictKey, tree_util.GetAttrKey, tree_util.SequenceKey, tree_util.FlattenedIndexKey}:
        name, index = tree_util.GetAttrKey, tree_util.SequenceKey  # each has one of these attributes
        values = [e.name if type(e) is name else e.idx if type(e) is index else e.key for e in entries]
    else:
        return None
    return values if set(map(type, values)) <= {str, int} else None  # not bool, nor a tuple key


def _refuse_mixed_keys(node: Any, where: tuple) -> None:
    """Raise a :class:`KeyPathError` at the first dict whose keys cannot be sorted."""
    if isinstance(node, Mapping):
        try:
            sorted(node)
        except TypeError:
            keys = sorted(node, key=repr)
            texts = [str(k) for k in keys]
            for k in keys:
                if isinstance(k, int) and texts.count(str(k)) > 1:
                    key = _paths.format_path([*where, k])
                    raise KeyPathError(
                        f"{key}: int key {k!r} and str key {str(k)!r} of the dict at "
                        f"{_paths.format_path(where) or '<root>'} both make the file key {key!r}; rename one of them",
                        key,
                    ) from None
            raise KeyPathError(
                f"{_paths.format_path(where) or '<root>'}: a dict with keys of mixed types {keys[:6]!r}; "
                "jax cannot flatten it. Use keys of one type",
                _paths.format_path(where),
            ) from None
        children: Iterable[tuple[Any, Any]] = node.items()
    elif isinstance(node, (list, tuple)):
        children = enumerate(node)
    else:
        return
    for k, child in children:
        _refuse_mixed_keys(child, (*where, k))


def describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"a numpy array of dtype {value.dtype}"
    return f"a {type(value).__name__} ({short_repr(value, 40)})"


def leaf_entry(path: tuple, value: Any, key: str | None = None) -> Entry:
    """Check one leaf and describe it for the writer, without copying it yet."""
    import jax

    key = _paths.to_key(path) if key is None else key  # made once, where the caller checked keys unique
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, (np.ndarray, jax.Array)):
        raise UnsupportedValueError(
            f"{key}: expected an array, found {describe(value)}; save_file stores arrays only "
            "(use save_model for NNX scalars and rng keys)",
            key,
        )
    if isinstance(value, jax.Array) and value.is_deleted():
        raise UnsupportedValueError(
            f"{key}: the jax array has been deleted (donated to a jitted call, or .delete()d), so its values are "
            "gone; save it before the call that donates it",
            key,
        )
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        raise UnsupportedValueError(
            f"{key}: a typed PRNG key array; store jax.random.key_data(key) or use save_model", key
        )
    if value.dtype.kind in "OUS":
        raise UnsupportedValueError(f"{key}: {describe(value)} has no safetensors dtype", key)
    code = _dtypes.to_code(value.dtype, key).code
    if code == "BOOL":  # bytes a load refuses: asked of bool arrays only
        check_storable(key, value)
    return Entry(key, code, tuple(int(d) for d in value.shape), HostValue(value), value)  # Entry.of, per leaf inline


def leaf_entries(leaves: Sequence[tuple[tuple, Any, str]]) -> list[Entry]:
    """:func:`leaf_entry` of each ``(path, value, key)``, in order."""
    return [leaf_entry(path, value, key) for path, value, key in leaves]


def variable_class() -> type | None:
    """flax's ``nnx.Variable`` if flax is imported (no NNX state exists otherwise), else
    ``None``: this module never imports flax."""
    return getattr(sys.modules.get("flax.nnx"), "Variable", None)


def _is_leaf(value: Any) -> bool:
    """A value jax does not flatten further (an array, a number, a torch tensor), or an
    NNX ``Variable`` (a leaf of a model's state)."""
    import jax

    variable = variable_class()
    return (variable is not None and isinstance(value, variable)) or jax.tree_util.all_leaves([value])


def flat_file_keys(tree: Any) -> list[tuple[tuple, Any]] | None:
    """A flat mapping of file keys to leaves (what :func:`load_file` returns, a torch
    state dict) as ``[(path, value)]``, each key split at ``/`` (so it is written back
    as it is, and validated segment by segment); ``None`` for any other tree."""
    if not isinstance(tree, Mapping) or not tree or not all(isinstance(k, str) for k in tree):
        return None
    if not any("/" in k for k in tree) or not all(_is_leaf(v) for v in tree.values()):
        return None
    for key in tree:
        if "" in key.split("/"):
            raise KeyPathError(
                f"{key!r}: a file key with an empty name (a leading, trailing or doubled '/'); a flat mapping's "
                "keys are written as they are, name by name, and an empty name cannot be read back to one place",
                key,
            )
    return [(tuple(k.split("/")), v) for k, v in tree.items()]


def tree_pairs(tree: Any) -> list[tuple[tuple, Any]]:
    """``[(path, leaf)]`` of what :func:`save_file` writes: a flat mapping's keys as they
    are, NNX ``Variable`` objects as leaves (an ``nnx.State`` keeps the model's keys, not
    ``.../value``), any other pytree's paths."""
    flat = flat_file_keys(tree)
    if flat is not None:
        return flat
    variable = variable_class()
    pairs, _ = flatten(tree, is_leaf=None if variable is None else lambda x: isinstance(x, variable))
    return pairs


def tree_entries(tree: Any) -> list[Entry]:
    """The leaves of ``tree`` as writer entries (nothing copied yet), keys made once.

    Raises:
        KeyPathError: two paths make the same key.
    """
    pairs, _ = flatten(tree)
    keys = _paths.check_unique([p for p, _ in pairs])  # {key: path}, in the pairs' order
    return leaf_entries([(p, v, k) for k, (p, v) in zip(keys, pairs, strict=True)])


def check_metadata(metadata: Any) -> None:
    """``__metadata__`` must be UTF-8 text to text; say which pair is not."""
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise UnsupportedValueError(f"metadata must map str to str, found a {type(metadata).__name__}", "__metadata__")
    for k, v in metadata.items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise UnsupportedValueError(
                f"metadata must map str to str: {k!r}: {short_repr(v, 40)} is {type(k).__name__}: {type(v).__name__}",
                "__metadata__",
            )
        try:
            (k + v).encode("utf-8")
        except UnicodeEncodeError:
            raise UnsupportedValueError(
                f"metadata must map str to str: {k!r}: {short_repr(v, 40)} is not valid Unicode (a lone surrogate)",
                "__metadata__",
            ) from None
