"""The pytree bridge: :func:`save_file` and :func:`load_file` for any tree of arrays."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import numpy as np

from .._options import DEFAULT, merge, path_arg
from ..errors import KeyMismatchError, NnxSaveError, ShapeMismatchError, UnsupportedValueError
from ..format import _paths
from ..io._storage import Where
from ..layouts import _registry
from ..layouts._registry import reader_factory
from ..load import _match
from ..load._engine import load_targets
from ..load._options import LoadOptions
from ..load._report import ShapeMismatch, matches_any
from ..load._source import Header, gc_paused
from ..load._target import Target, warn_single_device
from ..save import _background
from ..save._options import SaveOptions
from ._leaves import (
    LoadKeywords,
    check_metadata,
    describe,
    flatten_keys,
    leaf_entry,
    load_options,
    tree_pairs,
    variable_class,
)

__all__ = ["load_file", "save_file"]

_SHAPE, _DTYPE, _SHARDING, _PATH, _SOURCES = map(operator.attrgetter, ("shape", "dtype", "sharding", "path", "sources"))


def save_file(
    tree: Any,
    path: Where,
    *,
    metadata: Mapping[str, str] | None = None,
    progress: bool | None = DEFAULT,
    blocking: bool = DEFAULT,
    max_shard_size: int | str | None = DEFAULT,
    options: SaveOptions | None = None,
) -> _background.SaveHandle | None:
    """Save a pytree of arrays as one ``.safetensors`` file (or, with ``max_shard_size``,
    a HuggingFace multi-file checkpoint), atomically.

    Keys are the tree paths joined with ``/`` (list indices in decimal); a flat mapping
    of file keys (what :func:`load_file` returns: ``{"layers/0/bias": ...}``) is written
    under those keys, and NNX state (``nnx.state(model)``, or ``nnx.Variable`` leaves
    anywhere in ``tree``) as :func:`save_model` writes it: the model's keys, with typed
    rng keys and Python scalars recorded, so :func:`load_model` reads it. The file appears
    under ``path`` only once complete and fsynced, with every tensor's xxh3_64 checksum
    in ``__metadata__``. ``tree`` is not modified.

    Args:
        tree: nested dicts / lists / tuples (any jax pytree) of jax or numpy arrays,
            a flat mapping of file keys to arrays, or NNX state.
        path: the file to write; its directory must exist. An fsspec URL (``s3://``,
            ``memory://`` ...) is streamed to a temporary object and moved into place.
        metadata: string -> string pairs stored in ``__metadata__``.
        progress: a progress bar on stderr.
        blocking: ``False`` writes in the background and returns a :class:`SaveHandle`.
        max_shard_size: write a HuggingFace multi-file checkpoint in directory ``path``.
        options: a :class:`SaveOptions` (it explains the three keywords above, its shortcuts).

    Raises:
        UnsupportedValueError: a leaf that is not an array (names its path).
        KeyPathError: a key containing ``/`` (in a nested tree), an empty name, or two
            paths making the same key.
        SaveError: the write failed; the previous file at ``path`` is intact.
        DirectoryLockedError: with ``max_shard_size``, another save (or store) is writing
            directory ``path``, named with its host and process; nothing was written.
        OptionError: an option out of range (``max_shard_size`` not a size), or given
            both as a keyword and in ``options`` (names it).

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> nnx_save.save_file({"layers": [{"w": np.ones((2, 2), np.float32)}]}, path)
        >>> sorted(nnx_save.load_file(path))
        ['layers/0/w']
    """
    how = merge(SaveOptions, options, "save_file", locals())  # first: locals() are the arguments
    path = path_arg(path, "path", "save_file")
    pairs = tree_pairs(tree)
    keys = _paths.check_unique([p for p, _ in pairs])  # {key: path}, in the pairs' order
    variable = variable_class()
    meta: dict[str, str] | None
    if variable is not None and any(isinstance(v, variable) for _, v in pairs):
        from ._nnx import state_entries  # an NNX state: flax is imported already

        entries, meta = state_entries(pairs, metadata)
    else:
        entries = [leaf_entry(p, v, k) for k, (p, v) in zip(keys, pairs, strict=True)]
        check_metadata(metadata)
        meta = None if metadata is None else dict(metadata)  # the caller may change theirs after an async return
    return _registry.run_save(path, entries, _registry.plan_save(meta, how))


def _abstract_targets(abstract: Any) -> tuple[list[Target], Any, list[Any]]:
    import jax

    keys, leaves, treedef = flatten_keys(abstract)  # a jax.ShapeDtypeStruct is a leaf: no node type of jax's
    if set(map(type, leaves)) == {jax.ShapeDtypeStruct}:  # a plain abstract tree: made in bulk
        shardings = list(map(_SHARDING, leaves))
        if not any(map(operator.is_, shardings, itertools.repeat(None))):
            dtypes = {d: np.dtype(d) for d in set(map(_DTYPE, leaves))}
            shapes = list(map(tuple, map(_SHAPE, leaves)))
            return (
                Target.many(keys, shapes, list(map(dtypes.__getitem__, map(_DTYPE, leaves))), shardings),
                treedef,
                leaves,
            )
    targets, unsharded = [], []
    for key, leaf in zip(keys, leaves, strict=True):
        if leaf is None or not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise UnsupportedValueError(
                f"{key}: abstract leaves must be arrays or jax.ShapeDtypeStruct, found {describe(leaf)}", key
            )
        sharding = getattr(leaf, "sharding", None)
        if sharding is None and not isinstance(leaf, np.ndarray):
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            unsharded.append(key)
        targets.append(Target(key, tuple(leaf.shape), np.dtype(leaf.dtype), sharding, (key,)))
    fix = (
        "Give each jax.ShapeDtypeStruct a sharding (NamedSharding(mesh, spec) to spread it, or "
        "SingleDeviceSharding(device) to mean one device), or pass numpy arrays to load on the host"
    )
    warn_single_device(unsharded, jax.local_devices(), fix, stacklevel=3)
    return targets, treedef, leaves


def _refuse_shape_mismatches(
    header: Header, targets: list[Target], leaves: list[Any], allowed: Sequence[str], strict: bool
) -> bool:
    """One :class:`ShapeMismatchError` before any read for the reshaped leaves left without
    a value: not allowed (``strict``'s LoadError lists those), or a ``ShapeDtypeStruct``.
    Returns whether every leaf's path is a tensor of its shape (asked of them all at
    once first: then there is nothing to refuse, nor any leaf missing)."""
    import jax

    if _all_shaped(header, targets):
        return True
    lines, refused = [], []
    for t, leaf in zip(targets, leaves, strict=True):
        info = header.tensors.get(t.path)
        if info is None or tuple(info.shape) == tuple(t.shape):
            continue
        ok = matches_any(t.path, allowed)
        if ok and not isinstance(leaf, (np.ndarray, jax.Array)):
            refused.append(t.path)
            lines.append(
                f"{ShapeMismatch(t.path, t.shape, info.shape)} (allowed, but the leaf is a "
                f"{type(leaf).__name__} with no value to keep)"
            )
        elif not ok and not strict:
            refused.append(t.path)
            lines.append(str(ShapeMismatch(t.path, t.shape, info.shape)))
    if lines:
        raise ShapeMismatchError(
            f"{_source_name(header)}: {len(lines)} shape mismatch(es), nothing was read:\n  "
            + "\n  ".join(lines)
            + f"\nTo keep the abstract tree's values there, give those leaves as arrays and pass "
            f"allow_shape_mismatch={sorted(refused)[:5]!r}"
        )
    return False


def _all_shaped(header: Header, targets: list[Target]) -> bool:
    """Whether every target's path is a tensor of its shape, asked of them all at once."""
    paths = list(map(_PATH, targets))
    if not all(map(header.tensors.__contains__, paths)):
        return False
    held = map(tuple, map(_SHAPE, map(header.tensors.__getitem__, paths)))
    return list(held) == list(map(tuple, map(_SHAPE, targets)))


def _source_name(header: Header) -> str:
    return header.files[0].file if len(header.files) == 1 else f"{len(header.files)} files ({header.kind})"


def _refuse_missing(header: Header, targets: list[Target]) -> None:
    """Refuse, before any read, leaves the checkpoint has no tensor for: a tree has no holes."""
    if set(itertools.chain.from_iterable(map(_SOURCES, targets))).issubset(header.tensors):
        return
    missing = [t.path for t in targets if any(s not in header.tensors for s in t.sources)]
    if missing:
        raise KeyMismatchError(
            f"{_source_name(header)}: {len(missing)} leaves of the abstract tree have no tensor in the checkpoint: {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}; load_file returns the whole tree, so drop these leaves from "
            "abstract (allow_missing cannot give them a value), or use load_model, which keeps a model's own "
            "values where the file has none. Nothing was read."
        )


def load_file(
    source: Where | Sequence[Where] | Header | Mapping[str, Any],
    abstract: Any = None,
    *,
    strict: bool = False,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
    allow_shape_mismatch: Sequence[str] = (),
    allow_casts: str | Sequence[str] = (),
    return_report: bool = False,
    options: LoadOptions | None = None,
    **keywords: Unpack[LoadKeywords],
) -> Any:
    """Load a checkpoint: into the structure of ``abstract``, or as a flat dict.

    Args:
        source: a ``.safetensors`` file, a directory (HF index or ``*.safetensors``),
            a list of files, an ``http(s)://`` or fsspec URL, a :class:`Header`, or a
            state dict in memory (as :func:`load_model` takes it).
        abstract: a pytree of ``jax.ShapeDtypeStruct`` (with a ``sharding``) or arrays,
            whose shape, dtype and sharding are adopted (numpy leaves load as numpy;
            each process reads only its devices' bytes). ``None``: a flat ``{key: np.ndarray}``.
        strict: refuse (before reading) on any missing, unexpected, reshaped or
            cast tensor; otherwise those are reported in one ``LoadWarning``.
        allow_missing / allow_unexpected: patterns (glob or regex) the caller expects.
        allow_shape_mismatch: patterns of paths whose file shape may differ: those
            leaves keep the value ``abstract`` gives them (an array) and are listed in
            ``report.allowed_shape_mismatches``.
        allow_casts: dtype casts accepted under ``strict=True`` (listed in
            ``report.allowed_casts``): ``"lossless"`` (every cast that cannot change a
            value, such as bfloat16 into float32) or path patterns (lossy casts included).
        return_report: also return the :class:`LoadReport`.
        options: a :class:`LoadOptions` (it explains each field); these are its shortcuts:
        max_over_read_ratio: cap on bytes read / bytes needed when merging reads.
        read_chunk_bytes: the largest single read (``None``: set by the source).
        max_inflight_bytes: bytes being read (and staged) at once, never exceeded.
        num_threads: concurrent reads (``None``: set by the source).
        verify: check each tensor read in full against its recorded checksum.
        progress: a progress bar on stderr.
        stream: stream through staging buffers (``None``: except on the CPU backend).
        staging: the streaming path's memory: ``"pinned"``, ``"pageable"`` or ``"auto"``.
        share_reads: read what several JAX processes need once, and share it.

    Returns:
        The loaded tree (same structure as ``abstract``), or ``(tree, report)``.

    Raises:
        HeaderError: a malformed file or index, before any data is read.
        LoadError: ``strict=True`` and a mismatch, or no tensor of the source fits
            ``abstract``.
        KeyMismatchError: without ``strict``, before any read, a leaf of ``abstract``
            the checkpoint has no tensor for (a tree has no value to give it).
        ShapeMismatchError: without ``strict``, before any read, a reshaped leaf that
            no ``allow_shape_mismatch`` pattern (with an array to keep) accepts.
        ChecksumError: ``verify=True`` and a tensor's bytes do not match its checksum.
        OptionError: an option out of range, or given both as a keyword and in
            ``options`` (names it).

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> nnx_save.save_file({"w": np.arange(4, dtype=np.float32)}, path)
        >>> nnx_save.load_file(path)["w"]
        array([0., 1., 2., 3.], dtype=float32)
    """
    how = load_options("load_file", options, keywords)
    import jax

    from ._state_dict import source_header

    with gc_paused():  # flattening and making targets allocate per leaf too (see gc_paused)
        header = source_header(source)
        if abstract is None:
            if jax.process_count() > 1:
                raise NnxSaveError(
                    f"load_file({header.files[0].file if header.files else source!r}) without an abstract tree in a "
                    f"{jax.process_count()}-process run would read every tensor on every host; pass abstract= with "
                    "the shardings each process should load"
                )
            keys, infos = list(header.tensors), list(header.tensors.values())
            targets: list[Target] = Target.many(
                keys, list(map(_SHAPE, infos)), [i.dtype.numpy for i in infos], [None] * len(keys)
            )
            leaves: list[Any] = []
        else:
            targets, treedef, leaves = _abstract_targets(abstract)
            plain = _match.whole_reads(header.tensors, targets, jax.config.jax_enable_x64)  # type: ignore[attr-defined]
            if plain is not None:  # each leaf reads its tensor as stored: nothing to refuse, asked once
                targets = plain
            elif not _refuse_shape_mismatches(header, targets, leaves, allow_shape_mismatch, strict) and not strict:
                _refuse_missing(header, targets)  # strict raises LoadError with the whole report instead
        values, report = load_targets(
            header,
            targets,
            how,
            open_reader=reader_factory(header),
            strict=strict,
            allow_missing=allow_missing,
            allow_unexpected=allow_unexpected,
            allow_shape_mismatch=allow_shape_mismatch,
            allow_casts=allow_casts,
            progress=how.progress,
        )
        if abstract is None:
            result = {k: values[k] for k in header.tensors}
        else:
            kept = {m.path for m in report.allowed_shape_mismatches}
            if kept:
                values = {**values, **{t.path: leaf for t, leaf in zip(targets, leaves, strict=True) if t.path in kept}}
            result = jax.tree_util.tree_unflatten(treedef, list(map(values.__getitem__, map(_PATH, targets))))
        out = (result, report) if return_report else result
        # freed here, while collection is paused (a hundred thousand targets and tensor
        # records for as many leaves), and nothing allocated after: the collection the
        # pause put off runs in the caller and walks only what is returned
        del header, targets, leaves, values, result, report
    return out
