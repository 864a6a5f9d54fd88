"""Conversion to safetensors (what ``nnx-save convert`` runs).

Sources are told apart by their bytes, never by unpickling: PyTorch files load with
``torch.load(weights_only=True)``, TorchScript archives are read as data (none of their
code run), and safetensors sources one tensor at a time, checksums verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shlex
import threading
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._options import path_arg
from ..bridges._pytree import load_file
from ..errors import ConvertError, HeaderError, NnxSaveError, OptionError
from ..format import _dtypes, _formats, _torchscript
from ..format._torch import torch_to_numpy
from ..format._units import parse_size
from ..layouts import _registry
from ..layouts._registry import read_header
from ..load._source import Header, in_batches
from ..save._entry import Entry, order_entries
from ..save._options import SaveOptions
from . import _torch_index
from ._extras import Extras

__all__ = ["Converted", "batches", "convert", "read_many", "read_one"]


@dataclass(frozen=True)
class Converted:
    """What :func:`convert` wrote: the tensor count, the files, and the index (if any);
    with ``key``, the checkpoint's other entries kept in the metadata (``kept``: their
    names) and those dropped (``dropped``: ``"name: why"``)."""

    tensors: int
    files: tuple[Path, ...]
    index: Path | None = None
    kept: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()


def convert(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    max_shard_size: int | None = None,
    key: str | None = None,
) -> Converted:
    """Convert a PyTorch, Orbax or safetensors checkpoint to safetensors, atomically.

    Args:
        source: a PyTorch ``.bin`` / ``.pt`` / ``.pth`` file (a state dict of tensors, or
            one bare tensor, named after the file: ``embedding.pt`` -> ``embedding``), a numpy
            ``.npz`` archive (its arrays by name, read with ``allow_pickle=False``),
            a TorchScript archive (its parameters and buffers, keyed as its
            ``state_dict()``), an Orbax PyTree checkpoint directory or one item of an
            ``OrbaxCheckpointStore`` step (keyed as ``save_model`` keys a model, so
            ``load_model`` reads it), a safetensors file or directory, or an HF PyTorch
            directory of ``pytorch_model-0000i-of-0000n.bin`` files and their index (read
            one tensor at a time; into a directory by default, see ``output``).
        output: a ``.safetensors`` file, or with ``max_shard_size`` a directory that
            gets HuggingFace-style ``model-0000i-of-0000n.safetensors`` files and an index.
            From an HF PyTorch directory, a directory path (no ``.safetensors`` suffix)
            gets shards no larger than the source's largest, the index, and the source
            directory's other files (``config.json``, tokenizer files), so
            ``from_pretrained`` loads it.
        max_shard_size: the most bytes per file (splits the checkpoint over files).
        key: a PyTorch training checkpoint's sub-dict to convert (``"model"``; dots go deeper).
            The checkpoint's other entries that are JSON (``config_dict``, ``global_step``)
            go into the output's metadata under their names, as JSON text; the others
            (optimizer state, objects) are dropped, and named in ``Converted.dropped``.

    Returns:
        A :class:`Converted` naming what was written (every file with fresh checksums).

    Raises:
        ConvertError: a source or output that cannot be converted, with the reason.
        HeaderError: a malformed safetensors source.
        ChecksumError: a safetensors source whose data no longer matches its checksums.
        DirectoryLockedError: with ``max_shard_size``, another save (or store) is writing
            directory ``output`` (named); nothing was written.

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> nnx_save.save_file({"w": np.ones((4, 4), np.float32)}, os.path.join(d, "a.safetensors"))
        >>> done = nnx_save.convert(os.path.join(d, "a.safetensors"), os.path.join(d, "split"), max_shard_size=40)
        >>> done.tensors, len(done.files), done.index.name
        (1, 1, 'model.safetensors.index.json')
    """
    source = Path(path_arg(source, "source", "convert"))
    out = Path(path_arg(output, "output", "convert"))
    if max_shard_size is not None:
        max_shard_size = parse_size(max_shard_size)
    if key is not None and not isinstance(key, str):
        raise OptionError(f"convert: key must be None or a str (a sub-dict's name), got {type(key).__name__}", "key")
    if not source.exists():
        raise ConvertError(f"{source}: no such file or directory")
    if _torch_index.is_torch_index(source):
        return _convert_torch_index(source, out, max_shard_size, key)
    extras = Extras()
    with contextlib.ExitStack() as opened:  # a TorchScript archive stays open while its tensors are written
        entries, meta = _entries(source, key, opened, extras)
        done = _write(out, entries, {**meta, **extras.kept}, max_shard_size)
    return dataclasses.replace(done, kept=tuple(extras.kept), dropped=tuple(extras.dropped))


def _convert_torch_index(source: Path, out: Path, max_shard_size: int | None, key: str | None) -> Converted:
    """An HF PyTorch checkpoint in several files into an HF safetensors directory (shards of
    at most the largest source shard's size unless ``max_shard_size`` says, the index, and
    the directory's other files: config, tokenizer), or one file for an ``out`` named
    ``.safetensors``."""
    if key is not None:
        raise ConvertError(f"{source}: --key picks a sub-dict of one PyTorch file; this is a sharded HF checkpoint")
    if max_shard_size is None and out.suffix != ".safetensors":
        max_shard_size = _torch_index.shard_bytes(source)
    entries, shards = _torch_index.entries(source)
    try:
        done = _write(out, entries, {"format": "pt"}, max_shard_size)
    finally:
        shards.close()
    if done.index is not None:
        _torch_index.copy_companions(source, out)
    return done


def _write(out: Path, entries: list[Entry], meta: dict[str, str], max_shard_size: int | None) -> Converted:
    """``entries`` written by the layout the registry picks, as ``save_file`` writes them."""
    if max_shard_size is None and out.is_dir():
        raise ConvertError(
            f"{out}: is a directory; give a .safetensors file path, or --max-shard-size to write "
            "a multi-file checkpoint into a directory"
        )
    if max_shard_size is not None and out.suffix == ".safetensors":
        raise ConvertError(
            f"{out}: --max-shard-size writes a directory (model-0000i-of-0000n.safetensors and "
            "model.safetensors.index.json); give a directory path"
        )
    written = _registry.plan_save(meta, SaveOptions(max_shard_size=max_shard_size)).write_now(out, entries)
    files = tuple(sorted(Path(f) for f in written.files)) if written is not None else ()
    return Converted(len(entries), files, None if max_shard_size is None or written is None else Path(written.record))


def _entries(
    source: Path, key: str | None, opened: contextlib.ExitStack, extras: Extras
) -> tuple[list[Entry], dict[str, str]]:
    """Writer entries for ``source``; safetensors and TorchScript sources read one tensor at a time."""
    kind = _kind(source)
    if key is not None and kind != "torch":
        raise ConvertError(f"{source}: --key picks a sub-dict of a PyTorch checkpoint; this is a {kind} checkpoint")
    if kind == "TorchScript":
        return _torchscript_entries(source, opened), {"format": "pt"}
    if kind == "npz":
        return _npz_entries(source, opened), {}
    if kind == "safetensors":
        header = read_header(source)
        meta = dict(header.files[0].metadata) if header.files else {}
        verified = _Verified(header)
        entries = [Entry(k, t.dtype.code, t.shape, functools.partial(verified, k)) for k, t in header.tensors.items()]
        verified.expect([e.key for e in order_entries(entries)])  # the order the writer asks them in
        return entries, meta
    if kind == "torch":
        arrays, meta = _torch_tensors(source, key, extras), {"format": "pt"}
    else:
        arrays, meta = _orbax_arrays(source)
    entries = [
        Entry(k, _dtypes.to_code(a.dtype, k).code, tuple(a.shape), functools.partial(np.asarray, a))
        for k, a in arrays.items()
    ]
    return entries, meta


def _torchscript_entries(source: Path, opened: contextlib.ExitStack) -> list[Entry]:
    archive = _torchscript.Archive(source)
    opened.callback(archive.close)
    entries: dict[str, Entry] = {}
    for r in archive.tensors():
        if r.key in entries:
            raise HeaderError(f"{source}: two tensors have the state_dict key {r.key!r}", check="duplicate_key")
        entries[r.key] = Entry(r.key, _dtypes.to_code(r.dtype, r.key).code, r.shape, functools.partial(archive.read, r))
    return list(entries.values())


def _npz_entries(source: Path, opened: contextlib.ExitStack) -> list[Entry]:
    """A numpy ``.npz`` archive's arrays, keyed by their names, read one at a time. The
    archive is read as a zip of ``.npy`` members whose headers are checked first: an object
    array is refused by name, and nothing goes through ``np.load`` (no pickle path)."""
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:  # a damaged or hostile zip
        raise ConvertError(f"{source}: not a readable .npz archive ({type(e).__name__}: {e})") from None
    opened.callback(archive.close)
    entries = []
    for member in archive.namelist():
        name = member.removesuffix(".npy")
        npy = _npy_header(source, archive, member)
        code = _dtypes.to_code(npy[0], name).code
        entries.append(Entry(name, code, npy[1], functools.partial(_npz_member, source, archive, member, npy)))
    return entries


def _npy_header(source: Path, archive: zipfile.ZipFile, member: str) -> tuple[np.dtype, tuple[int, ...], bool]:
    """Member ``member``'s dtype, shape and Fortran order, from its ``.npy`` header (no data read)."""
    with archive.open(member) as f:
        return _read_npy_header(source, member, f)


def _read_npy_header(source: Path, member: str, f: Any) -> tuple[np.dtype, tuple[int, ...], bool]:
    fmt = np.lib.format  # the header is a Python literal, read with ast.literal_eval: never unpickled
    try:
        version = fmt.read_magic(f)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except Exception as e:  # not an .npy member, a bad header
        raise ConvertError(f"{source}: {member}: not a numpy array member ({type(e).__name__}: {e})") from None
    if dtype.hasobject or dtype.names is not None or dtype.kind in "OUSVMm":
        raise ConvertError(
            f"{source}: {member.removesuffix('.npy')}: numpy dtype {dtype} is not a number type; convert takes "
            "numeric arrays (safetensors holds no objects, strings, records or dates)"
        )
    return dtype, tuple(int(d) for d in shape), bool(fortran)


def _npz_member(
    source: Path, archive: zipfile.ZipFile, member: str, npy: tuple[np.dtype, tuple[int, ...], bool]
) -> np.ndarray:
    """The member's array: exactly the bytes its header declares, in C order."""
    dtype, shape, fortran = npy
    nbytes = dtype.itemsize * math.prod(shape)
    with archive.open(member) as f:
        _read_npy_header(source, member, f)
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise ConvertError(f"{source}: {member}: {len(data)} bytes of data, {nbytes} declared by its header")
    array = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")
    return np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<")) if array.dtype.byteorder == ">" else array)


def read_one(header: Header, key: str, *, verify: bool = False) -> tuple[np.ndarray, Any]:
    """Tensor ``key`` of ``header`` as a host array, and the load report; only the files
    holding its pieces are read, so memory stays bounded by one tensor."""
    held = {p.info.file for p in header.pieces_of(key)}
    narrowed = header._replace(
        tensors={key: header.tensors[key]}, files=tuple(fh for fh in header.files if fh.file in held)
    )
    tree, report = load_file(narrowed, verify=verify, progress=False, return_report=True)
    return tree[key], report


def read_many(header: Header, keys: Sequence[str], *, verify: bool = False) -> tuple[dict[str, np.ndarray], Any]:
    """Tensors ``keys`` of ``header`` as host arrays, in one load, and its report: only
    the files holding their pieces are read."""
    held = {p.info.file for key in keys for p in header.pieces_of(key)}
    narrowed = header._replace(
        tensors={key: header.tensors[key] for key in keys},
        files=tuple(fh for fh in header.files if fh.file in held),
    )
    tree, report = load_file(narrowed, verify=verify, progress=False, return_report=True)
    return {key: tree[key] for key in keys}, report


BATCH_BYTES = 64 << 20  # one load reads up to this much (or one tensor): a tool's memory stays bounded


def batches(header: Header, keys: Iterable[str], limit: int = BATCH_BYTES) -> Iterator[list[str]]:
    """``keys`` in order, cut into runs of up to ``limit`` bytes (a larger tensor alone):
    a tool reads a checkpoint of N tensors in about N / batch loads, not N."""
    return in_batches(header, keys, limit)


class _Verified:
    """The tensors of ``header`` for a writer asking them in ``order``, checksum verified
    (a corrupted source must not get fresh checksums), read a batch at a time: each is
    handed out once and dropped."""

    def __init__(self, header: Header) -> None:
        self.header, self.order, self.at = header, list(header.tensors), {k: i for i, k in enumerate(header.tensors)}
        self.ready: dict[str, np.ndarray] = {}
        self.lock = threading.Lock()

    def expect(self, order: Sequence[str]) -> None:
        """The order the writer will ask the tensors in (each batch reads the next ones)."""
        self.order, self.at = list(order), {key: i for i, key in enumerate(order)}

    def __call__(self, key: str) -> np.ndarray:
        with self.lock:
            if key not in self.ready:
                batch = next(batches(self.header, (k for k in self.order[self.at[key] :] if k not in self.ready)))
                self.ready.update(read_many(self.header, batch, verify=True)[0])
            return self.ready.pop(key)


def _orbax_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The arrays of an Orbax checkpoint, keyed as ``save_model`` keys a model's state,
    and the metadata ``load_model`` rebuilds typed rng keys and Python scalars from."""
    advice = _formats.composite_advice(path)  # a store or a step: several items, each its own checkpoint
    if advice is not None:
        raise ConvertError(f"{path}: {advice}")
    from ..bridges._nnx import model_metadata
    from ..checkpoint._arrays import orbax_arrays  # orbax (and jax) only for an Orbax source
    from ..format._paths import to_key

    out: dict[str, np.ndarray] = {}
    rng: dict[str, str] = {}
    scalars: dict[str, str] = {}
    try:
        leaves = orbax_arrays(path)
    except NnxSaveError:
        raise
    except Exception as e:  # a foreign library's errors (JSON, tensorstore, files), reported with the path
        raise ConvertError(f"{path}: Orbax cannot restore this checkpoint ({type(e).__name__}: {e})") from None
    for leaf in leaves:
        key = to_key(leaf.path)
        _add_unique(out, key, leaf.array, path, "'/'")
        if leaf.rng_impl is not None:
            rng[key] = leaf.rng_impl
        if leaf.scalar is not None:
            scalars[key] = leaf.scalar
    return out, model_metadata(None, rng, scalars)


def _kind(source: Path) -> str:
    if source.is_dir():
        return "orbax" if _formats.foreign_directory(source) else "safetensors"
    if not source.is_file():  # a FIFO would block the open below forever, a device never end
        raise ConvertError(f"{source}: not a regular file or directory")
    with open(source, "rb") as f:  # magic bytes decide, whatever the name says
        what = _formats.foreign_file(f.read(8), lambda n, at: (f.seek(at), f.read(n))[1], os.fstat(f.fileno()).st_size)
    if what is not None:
        return "TorchScript" if what.startswith("a TorchScript") else "npz" if "npz" in what else "torch"
    if source.suffix in (".bin", ".pt", ".pth"):
        return "torch"
    if source.suffix == ".safetensors":
        return "safetensors"
    raise ConvertError(
        f"{source}: cannot tell the format from the name; expected a .safetensors file or directory, "
        "a PyTorch .bin/.pt/.pth file, a numpy .npz archive, or an Orbax checkpoint directory"
    )


def _torch_tensors(path: Path, key: str | None = None, extras: Extras | None = None) -> dict[str, np.ndarray]:
    import torch  # only a torch conversion needs torch

    try:
        with warnings.catch_warnings():  # torch's own notices (TypedStorage, sparse "beta"), not the user's concern
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for unsafe or bad files
        raise ConvertError(f"{path}: not a PyTorch state dict that loads with weights_only=True: {e}") from None
    if key is not None:
        picked = _pick(path, state, key)
        if extras is not None:
            extras.collect(state, key)
        state = picked
    out: dict[str, np.ndarray] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, torch.Tensor):
            _add_unique(out, prefix, torch_to_numpy(node, prefix, path), path, "'.'")
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            raise ConvertError(
                f"{path}: {prefix or '<root>'} is a {type(node).__name__}, not a tensor; "
                "convert takes a state dict of tensors (nested dicts are joined with '.')" + _key_hint(state, key)
            )

    walk(state, _bare_name(path) if isinstance(state, torch.Tensor) else "")
    return out


def _bare_name(path: Path) -> str:
    """The key of a ``torch.save``'d bare tensor (no state dict names it): the file's
    stem (``embedding.pt`` -> ``embedding``), or ``tensor``."""
    stem = path.name.split(".", 1)[0]
    return stem if stem else "tensor"


def _add_unique(out: dict[str, np.ndarray], key: str, value: np.ndarray, path: Path, joiner: str) -> None:
    """``out[key] = value``, refusing a key already there: nested keys joined with
    ``joiner`` can meet a flat key (``{"a": {"b": t}, "a.b": u}``)."""
    if key in out:
        raise HeaderError(
            f"{path}: two tensors become the key {key!r} (nested keys are joined with {joiner}); "
            "rename one of them before converting",
            check="duplicate_key",
        )
    out[key] = value


def _key_hint(state: Any, key: str | None) -> str:
    """The ``--key`` hint for a training checkpoint: its top-level dicts holding only tensors (and dicts)."""
    import torch

    def only_tensors(node: Any) -> bool:
        if isinstance(node, dict):
            return bool(node) and all(only_tensors(v) for v in node.values())
        return isinstance(node, torch.Tensor)

    items = state.items() if isinstance(state, dict) else ()
    candidates = [str(k) for k, v in items if isinstance(v, dict) and only_tensors(v)]
    if not candidates:
        return ""
    where = f"--key {key!r}" if key else "The top level"
    return (
        f". {where} is a training checkpoint holding state dicts of tensors under {candidates[:5]}: "
        f"pick one with --key {shlex.quote(candidates[0])}"
    )


def _pick(path: Path, state: Any, key: str) -> Any:
    """``state[key]``, following dots (``--key model.ema``) through nested dicts."""
    node = state
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            keys = sorted(map(str, node)) if isinstance(node, dict) else []
            raise ConvertError(f"{path}: --key {key!r}: no {part!r} here; the dict holds {keys[:20]}")
        node = node[part]
    if not isinstance(node, dict):
        raise ConvertError(f"{path}: --key {key!r} is a {type(node).__name__}, not a dict of tensors")
    return node
