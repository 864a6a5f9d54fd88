"""The NNX bridge: :func:`save_model` and :func:`load_model`.

Loading is driven by the model's abstract state (a builder's comes from
``nnx.eval_shape``, so the random model never exists). On load the model's declaration
decides a Python scalar's type (a builder's are read off its ``eval_shape`` trace), so
files without this library's ``__metadata__`` records load the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Unpack

import jax
import numpy as np
from flax import nnx

from .._options import DEFAULT, merge, path_arg
from .._version import __version__
from ..errors import HeaderError, OptionError, ShardingError, UnsupportedValueError, short_repr
from ..format import _paths
from ..format._header import strict_json
from ..layouts import _registry
from ..layouts._registry import reader_factory
from ..load._engine import load_targets
from ..load._options import LoadOptions
from ..load._report import LoadReport
from ..load._source import Header, gc_paused
from ..load._target import Target, warn_single_device
from ..save import _background
from ..save._entry import Entry
from ..save._options import SaveOptions
from ._axes import is_missing_axis, missing_axes_error
from ._leaves import LoadKeywords, check_metadata, leaf_entries, load_options
from ._state_dict import RNG_KEY, source_header  # RNG_KEY: {path: PRNG implementation name}

if TYPE_CHECKING:
    from ..porting import Rules

__all__ = ["RNG_KEY", "SCALAR_KEY", "load_model", "save_model", "state_entries"]

SCALAR_KEY = "nnx_save.scalars"  # {path: "int" | "float" | "bool"}
_PY_SCALARS = {"int": int, "float": float, "bool": bool}
_KIND_OF = {typ: kind for kind, typ in _PY_SCALARS.items()}
_SCALAR_DTYPES = {"int": np.int64, "float": np.float64, "bool": np.bool_}
_SCALAR_KINDS = {"int": "iu", "float": "f", "bool": "b"}  # numpy dtype kinds that hold each losslessly


def _is_key(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _impl_name(value: Any) -> str:
    """The PRNG implementation of a typed key array or its ShapeDtypeStruct (traced:
    ``jax.random.key_impl`` takes arrays only)."""
    if isinstance(value, jax.Array):
        return str(jax.random.key_impl(value))
    names: list[str] = []
    jax.eval_shape(lambda key: names.append(str(jax.random.key_impl(key))), value)
    return names[0]


def _keyed(state: Any) -> list[tuple[tuple, str, Any]]:
    """``(path, file key, variable)`` for every leaf of an NNX state."""
    paths = [(tuple(p), v) for p, v in nnx.to_flat_state(state)]
    return [(p, k, v) for (p, v), k in zip(paths, _paths.to_keys([p for p, _ in paths]), strict=True)]


def _held(leaf: Any) -> Any:
    """A state leaf's value: a ``Variable``'s, or the leaf itself (a plain array a flax
    module keeps outside any ``Variable``, as ``nnx.WeightNorm`` keeps its ``scales``)."""
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def _with_value(leaf: Any, value: Any) -> Any:
    """The state leaf ``leaf`` holding ``value`` instead (see :func:`_held`)."""
    return leaf.replace(value) if isinstance(leaf, nnx.Variable) else value


def _scalar_kind(value: Any) -> str | None:
    return _KIND_OF.get(type(value))  # exactly these types: numpy scalars and arrays are not Python scalars


def _refuse_unstorable(key: str, value: Any) -> None:
    """Strings and ``None`` have no tensor form: refused, on save and on load alike."""
    if value is None or isinstance(value, (str, bytes)):
        what = "None" if value is None else f"a {type(value).__name__} ({short_repr(value, 40)})"
        raise UnsupportedValueError(
            f"{key}: the model holds {what}; safetensors stores arrays and numbers only. "
            "Keep such values out of nnx.Variable, or pass filter= to skip them",
            key,
        )


def _storable(path: tuple, key: str, value: Any, rng: dict, scalars: dict) -> tuple[tuple, Any, str]:
    """``(path, value, key)`` of one state leaf, as :func:`leaf_entries` takes it: a
    scalar as a 0-d array (its kind in ``scalars``), an rng key as its key data (its
    implementation in ``rng``)."""
    _refuse_unstorable(key, value)
    kind = _scalar_kind(value)
    if kind is not None:
        scalars[key] = kind
        try:
            value = np.asarray(value, _SCALAR_DTYPES[kind])
        except OverflowError:  # an int past int64
            raise UnsupportedValueError(
                f"{key}: the int {short_repr(value)} does not fit in {_SCALAR_DTYPES[kind]}", key
            ) from None
    elif _is_key(value):
        rng[key] = str(jax.random.key_impl(value))
        value = jax.random.key_data(value)
    return path, value, key


def model_metadata(metadata: Mapping[str, str] | None, rng: dict, scalars: dict) -> dict[str, str]:
    """The file metadata of a model save: the caller's, checked, plus the rng / scalar records."""
    check_metadata(metadata)
    out = dict(metadata or {})
    reserved = sorted(k for k in out if k.startswith("nnx_save."))
    if reserved:
        raise UnsupportedValueError(
            f"metadata keys {reserved} are reserved: the 'nnx_save.' prefix holds what load_model "
            "needs to rebuild rng keys and scalars; use another name",
            "__metadata__",
        )
    out.setdefault("format", "nnx_save")
    out["nnx_save.version"] = __version__
    if rng:
        out[RNG_KEY] = json.dumps(rng, sort_keys=True)
    if scalars:
        out[SCALAR_KEY] = json.dumps(scalars, sort_keys=True)
    return out


def state_entries(pairs: Sequence[tuple[tuple, Any]], metadata: Mapping[str, str] | None) -> tuple[list[Entry], dict]:
    """:func:`save_file` of a tree holding NNX ``Variable`` leaves (``nnx.state(model)``,
    a model, a dict of states): each variable written as :func:`save_model` writes it,
    under the model's key, with the rng / scalar records; other leaves as arrays."""
    rng: dict[str, str] = {}
    scalars: dict[str, str] = {}
    leaves = [
        _storable(p, key, v.get_value(), rng, scalars) if isinstance(v, nnx.Variable) else (p, v, key)
        for p, v in pairs
        for key in (_paths.to_key(p),)
    ]
    return leaf_entries(leaves), model_metadata(metadata, rng, scalars)


def is_model(value: Any) -> bool:
    """An NNX object (module, ``nnx.Dict``, ...) rather than a plain pytree."""
    return isinstance(value, nnx.Pytree)


def model_entries(model: Any, filter: Any = ...) -> tuple[list[Entry], dict, dict]:
    """The model's state as writer entries (nothing copied yet), with rng/scalar records."""
    rng: dict[str, str] = {}
    scalars: dict[str, str] = {}
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(model, filter))]
    keys = _paths.check_unique([p for p, _ in flat])  # {key: path}, in flat's order
    leaves = [_storable(p, k, _held(v), rng, scalars) for k, (p, v) in zip(keys, flat, strict=True)]
    return leaf_entries(leaves), rng, scalars


def save_model(
    model: Any,
    path: str | os.PathLike,
    *,
    filter: Any = ...,
    metadata: Mapping[str, str] | None = None,
    rules: Rules | None = None,
    max_shard_size: int | str | None = DEFAULT,
    progress: bool | None = DEFAULT,
    blocking: bool = DEFAULT,
    options: SaveOptions | None = None,
) -> _background.SaveHandle | None:
    """Save an NNX model's state (or the part ``filter`` selects) as safetensors.

    Keys are the state paths joined with ``/`` (``nnx.List`` indices in decimal); typed
    PRNG keys and Python scalars round-trip exactly (docs/models.md). The model is not
    modified; the file is written as :func:`save_file` writes it.

    Args:
        model: any NNX object graph (``nnx.Module``, ``nnx.Optimizer``, ...).
        path: the file to write (or, with ``max_shard_size``, a directory).
        filter: an NNX filter (``nnx.Param`` saves parameters only).
        metadata: extra string -> string pairs for ``__metadata__``.
        rules: porting rules applied on the way out (``rules.inverse()`` of an
            import table writes HuggingFace names and layouts).
        max_shard_size: write a HuggingFace multi-file checkpoint in directory ``path``.
        progress: a progress bar on stderr.
        blocking: ``False`` writes in the background and returns a :class:`SaveHandle`.
        options: a :class:`SaveOptions` (it explains the three keywords above, its shortcuts).

    Raises:
        UnsupportedValueError: a string or ``None`` in the state (names the path).
        KeyPathError: ``/`` inside an attribute name.
        SaveError: the write failed; the previous file is intact.
        DirectoryLockedError: with ``max_shard_size``, another save (or store) is writing
            directory ``path``, named with its host and process; nothing was written.
        OptionError: an option out of range (``max_shard_size`` not a size), or given
            both as a keyword and in ``options`` (names it).

    Examples:
        >>> from flax import nnx
        >>> import nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> nnx_save.save_model(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), path)
        >>> sorted(nnx_save.read_header(path))
        ['bias', 'kernel']
    """
    how = merge(SaveOptions, options, "save_model", locals())  # first: locals() are the arguments
    if not is_model(model):
        raise OptionError(
            f"save_model: model must be an NNX object (an nnx.Module, nnx.Dict, ...), got {type(model).__name__}"
            + ("; the arguments are (model, path)" if isinstance(model, (str, os.PathLike)) else "")
            + "; a pytree of arrays is saved with save_file",
            "model",
        )
    path = path_arg(path, "path", "save_model")
    entries, rng, scalars = model_entries(model, filter)
    meta = model_metadata(metadata, rng, scalars)
    if rules is not None:
        from ._porting import export_entries

        entries = export_entries(rules, entries)
        if "format" not in (metadata or {}):
            meta["format"] = "pt"  # transformers refuses safetensors files without it

    return _registry.run_save(path, entries, _registry.plan_save(meta, how))


@dataclass(frozen=True)
class _Leaf:
    path: tuple
    key: str
    variable: Any  # the abstract or concrete Variable
    value: Any  # its value (array, ShapeDtypeStruct, python scalar, typed key)


def _concrete(sharding: Any, mesh: Any, key: str) -> Any:
    """Resolve a sharding on an abstract mesh against a concrete one."""
    if sharding is None or not isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
        return sharding
    if mesh is None:
        mesh = jax.sharding.get_mesh()
        if mesh.empty:
            raise ShardingError(
                f"{key}: the builder annotates a sharding ({sharding.spec}) on an abstract mesh "
                f"{dict(sharding.mesh.shape)}; pass mesh= to load_model or call it under jax.set_mesh(mesh)"
            )
    return jax.sharding.NamedSharding(mesh, sharding.spec)


def _unsharded(leaf: _Leaf, mesh: Any) -> bool:
    """A device array the model gives no sharding (it then lands on the first device)."""
    value = leaf.value
    if _scalar_kind(value) is not None or isinstance(value, (np.ndarray, np.generic)):
        return False
    return _concrete(getattr(value, "sharding", None), mesh, leaf.key) is None


def _key_data_sharding(sharding: Any, ndim: int) -> Any:
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim + 1 - len(tuple(sharding.spec)))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return sharding  # single-device / replicated shardings extend unchanged


def _scalar_dtype(kind: str, info: Any) -> np.dtype:
    """The file's dtype when it holds the declared kind of number (no cast to
    report), else the kind's canonical dtype (the report then shows the cast)."""
    if info is not None and info.dtype.numpy.kind in _SCALAR_KINDS[kind]:
        return info.dtype.numpy
    return np.dtype(_SCALAR_DTYPES[kind])


def _target(leaf: _Leaf, header: Header, rng: dict, mesh: Any) -> Target:
    value, key = leaf.value, leaf.key
    _refuse_unstorable(key, value)
    kind = _scalar_kind(value)
    if kind is not None:
        return Target(key, (), _scalar_dtype(kind, header.tensors.get(key)), None, (key,))
    if isinstance(value, (np.ndarray, np.generic)):  # a host array stays on the host
        return Target(key, tuple(value.shape), value.dtype, None, (key,))
    sharding = _concrete(getattr(value, "sharding", None), mesh, key)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if _is_key(value):
        impl = rng.get(key) or _impl_name(value)
        shape = tuple(value.shape) + jax.random.key_data(jax.random.key(0, impl=impl)).shape
        return Target(key, shape, np.dtype(np.uint32), _key_data_sharding(sharding, len(value.shape)), (key,))
    return Target(key, tuple(value.shape), np.dtype(value.dtype), sharding, (key,))


def _finish(leaf: _Leaf, loaded: Any, rng: dict) -> Any:
    """Turn a loaded array back into what the model declares."""
    kind = _scalar_kind(leaf.value)
    if kind is not None:
        return _PY_SCALARS[kind](np.asarray(loaded).item())
    if isinstance(leaf.value, np.generic):
        return loaded[()]  # a numpy scalar, as declared
    if _is_key(leaf.value) and not _is_key(loaded):
        return jax.random.wrap_key_data(loaded, impl=rng.get(leaf.key) or _impl_name(leaf.value))
    return loaded


def _file_rng(header: Header) -> dict:
    """The file's PRNG implementations by key; both JSON records are checked before any
    read (the scalars' only for validity: the model's declaration decides their type)."""
    where = header.files[0].file if header.files else "the checkpoint"

    def parse(name: str) -> dict:
        try:
            value = strict_json(header.metadata.get(name, "{}"))
        except ValueError as e:  # not JSON, nested too deeply, a duplicate key
            raise HeaderError(f"{where}: __metadata__[{name!r}] is not valid JSON: {e}", check="metadata") from None
        return value if isinstance(value, dict) else {}

    rng = parse(RNG_KEY)
    parse(SCALAR_KEY)
    for key, impl in rng.items():
        _check_impl(where, key, impl)
    return rng


def _check_impl(where: str, key: str, impl: Any) -> None:
    """Refuse a recorded PRNG implementation this jax does not know."""
    try:
        jax.random.key(0, impl=impl if isinstance(impl, str) else repr(impl))
    except (ValueError, TypeError) as e:
        raise HeaderError(
            f"{where}: __metadata__[{RNG_KEY!r}] names the PRNG implementation {impl!r} for {key!r}, "
            f"which this jax does not know ({e})",
            check="metadata",
        ) from None


def _check_model_or_builder(value: Any) -> None:
    """Refuse, naming ``model_or_builder``, what is neither an NNX object nor a callable
    that builds one (a path there: the arguments are ``(model_or_builder, source)``)."""
    if isinstance(value, nnx.Pytree) or (callable(value) and not isinstance(value, (str, os.PathLike))):
        return
    swapped = "; the arguments are (model_or_builder, source)" if isinstance(value, (str, os.PathLike)) else ""
    raise OptionError(
        f"load_model: model_or_builder must be an NNX object or a callable that builds one, "
        f"got {type(value).__name__}{swapped}; a pytree is loaded with load_file",
        "model_or_builder",
    )


def _abstract(model_or_builder: Any, mesh: Any) -> tuple[Any, Any, bool, dict[str, Any]]:
    """(graphdef, state, is_builder, the builder's Python scalars): ``eval_shape`` makes
    those ShapeDtypeStructs, so their declared values are recorded during the trace."""
    if isinstance(model_or_builder, nnx.Pytree) or not callable(model_or_builder):
        graphdef, state = nnx.split(model_or_builder)
        return graphdef, state, False, {}
    scalars: dict[str, Any] = {}

    def build() -> Any:
        model = model_or_builder()
        for _, key, variable in _keyed(nnx.state(model)):
            value = _held(variable)
            if _scalar_kind(value) is not None:
                scalars[key] = value
        return model

    try:  # tracing a builder leaves many young cycles: no full collection walks the process meanwhile
        with _under(mesh), gc_paused():
            abstract = nnx.eval_shape(build)
    except ValueError as e:
        if mesh is None or not is_missing_axis(e):
            raise
        raise missing_axes_error(lambda wider: _partitionings(model_or_builder, wider), mesh, e) from None
    graphdef, state = nnx.split(abstract)
    return graphdef, state, True, scalars


def _partitionings(builder: Callable[[], Any], mesh: Any) -> list[tuple[str, tuple]]:
    """``(variable path, the mesh axes it is partitioned over)`` of a builder traced under ``mesh``."""
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(builder)
    out = []
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        meta = variable.get_metadata()
        axes = meta.get("out_sharding") or meta.get("sharding_names")
        if axes:
            out.append(("/".join(map(str, path)), tuple(axes)))
    return out


def _under(mesh: Any) -> Any:
    """``jax.set_mesh(mesh)``, or nothing without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _leaves(state: Any, scalars: dict[str, Any]) -> list[_Leaf]:
    """The state's leaves; a builder's Python scalars keep their declared value."""
    return [_Leaf(path, key, v, scalars.get(key, _held(v))) for path, key, v in _keyed(state)]


def _init_missing(builder: Callable, leaves: list[_Leaf], targets: dict[str, Target], mesh: Any) -> dict[str, Any]:
    """Initialise only the leaves the file lacks: the builder runs under jit and
    everything else is dead code that XLA drops, so the random model never exists."""
    keys = {leaf.key for leaf in leaves}

    def init():
        return {k: _held(v) for _, k, v in _keyed(nnx.state(builder())) if k in keys}

    if mesh is not None:
        with jax.set_mesh(mesh):
            return jax.jit(init)()
    values = jax.jit(init)()
    return {k: _reshard(v, targets.get(k)) for k, v in values.items()}


def _reshard(value: Any, target: Target | None) -> Any:
    if target is None or target.sharding is None or _is_key(value) or not isinstance(value, jax.Array):
        return value
    return jax.device_put(value, target.sharding)


def load_model(
    model_or_builder: Any,
    source: str | os.PathLike | Sequence[str | os.PathLike] | Header | Mapping[str, Any],
    *,
    strict: bool = False,
    filter: Any = ...,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
    allow_shape_mismatch: Sequence[str] = (),
    allow_casts: str | Sequence[str] = (),
    rules: Rules | None = None,
    mesh: Any = None,
    options: LoadOptions | None = None,
    **keywords: Unpack[LoadKeywords],
) -> tuple[Any, LoadReport]:
    """Load a checkpoint into an NNX model, driven by the model's own structure.

    Args:
        model_or_builder: a model instance (filled in place and returned) or a
            zero-argument builder (evaluated with ``nnx.eval_shape``: only the
            loaded arrays are ever allocated; its sharding annotations are honoured).
        source: a file, a HuggingFace multi-file directory, a list of files, a URL, or a
            state dict already in memory (``{key: array}``: numpy or jax arrays, torch
            tensors, NNX variables; flat or nested), loaded with the same matching,
            ``rules``, report and ``strict`` as a file.
        strict: raise :class:`~nnx_save.LoadError` on any mismatch, before
            reading anything and without touching the model.
        filter: the NNX filter of the state to load (``nnx.Param``: parameters
            only; other state in the file is then not "unexpected").
        allow_missing / allow_unexpected: path patterns (glob or regex) the caller
            expects to be missing (a new head) or unused.
        allow_shape_mismatch: path patterns whose file shape may differ (a new head
            of another size): those keep the model's values (a builder's initialisation).
        allow_casts: dtype casts accepted under ``strict=True`` (as for :func:`load_file`).
        rules: porting rules (:mod:`nnx_save.porting`) mapping file keys to paths.
        mesh: the concrete mesh for a builder's sharding annotations.
        options: a :class:`LoadOptions`; its fields are also keywords, as for
            :func:`load_file`: ``max_over_read_ratio``, ``read_chunk_bytes``,
            ``max_inflight_bytes``, ``num_threads``, ``verify``, ``progress``,
            ``stream``, ``staging`` and ``share_reads``.

    Returns:
        ``(model, report)``.

    Raises:
        HeaderError: a malformed file or index, before any data is read.
        LoadError: ``strict=True`` and a mismatch, or (strict or not) no tensor of the
            source fits the model (none of its paths, or only other shapes); the model
            is not touched.
        HeaderError: the file's PRNG or scalar record is not valid JSON, or names
            a PRNG implementation this jax does not know.
        ShardingError: a builder's sharding is on an abstract mesh and no mesh is given or set.
        ChecksumError: ``verify=True`` and a tensor's bytes do not match its checksum.
        OptionError: an option out of range, or given both ways (names it), or
            ``source`` an empty list of files.

    Examples:
        >>> from flax import nnx
        >>> import nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> nnx_save.save_model(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), path)
        >>> model, report = nnx_save.load_model(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(1)), path)
        >>> report.clean, model.kernel.shape
        (True, (2, 3))
    """
    how = load_options("load_model", options, keywords)
    _check_model_or_builder(model_or_builder)
    header = source_header(source)
    rng = _file_rng(header)
    graphdef, full_state, is_builder, scalars = _abstract(model_or_builder, mesh)
    selected = nnx.state(nnx.merge(graphdef, full_state), filter) if filter is not ... else full_state
    leaves = _leaves(selected, scalars)
    _paths.check_unique([leaf.path for leaf in leaves])
    targets = {leaf.key: _target(leaf, header, rng, mesh) for leaf in leaves}
    fix = (
        "Annotate the builder's parameters with shardings (nnx.with_partitioning) and pass mesh=, "
        "or load into a model instance already placed where you want it"
    )
    warn_single_device([leaf.key for leaf in leaves if _unsharded(leaf, mesh)], jax.local_devices(), fix, stacklevel=2)
    ignore = frozenset(key for _, key, _ in _keyed(full_state)) - set(targets)
    target_list, renamed = list(targets.values()), None
    if rules is not None:
        from ._porting import load_targets_for

        target_list, ignored, renamed = load_targets_for(rules, header, target_list, strict)
        ignore = ignore | ignored
    values, report = load_targets(
        header,
        target_list,
        how,
        strict=strict,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        allow_shape_mismatch=allow_shape_mismatch,
        allow_casts=allow_casts,
        ignore_unexpected=ignore,
        renamed=renamed,
        open_reader=reader_factory(header),
        progress=how.progress,
    )
    if is_builder:
        # Leaves the file lacks, and those the filter left out, get their initial
        # values; nothing else of the random model is ever computed.
        everything = _leaves(full_state, scalars)
        values = {**values, **{k: v for k, v in scalars.items() if k not in values}}
        absent = [leaf for leaf in everything if leaf.key not in values]
        if absent:
            values = {**values, **_init_missing(model_or_builder, absent, targets, mesh)}
        leaves = everything
    updates = [
        (leaf.path, _with_value(leaf.variable, _finish(leaf, values[leaf.key], rng)))
        for leaf in leaves
        if leaf.key in values
    ]
    if is_builder:
        return nnx.merge(graphdef, nnx.from_flat_state(updates)), report
    nnx.update(model_or_builder, nnx.from_flat_state(updates))
    return model_or_builder, report
