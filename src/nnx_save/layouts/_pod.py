"""The pod layout: one shard file per process and a manifest, for saves that
should not funnel a whole model through one file.

A pod directory holds::

    manifest.json                               what every tensor is, and where its pieces are
    shard_00000-of-00002.<token>.safetensors    process 0's pieces
    shard_00001-of-00002.<token>.safetensors    process 1's pieces

Each shard file is a standard safetensors file (validated header, checksums): its
tensors are *pieces*, each one box of a global tensor (``embed[0:32,0:64]``), or a
whole tensor. A process writes every distinct box its own devices hold (for arrays
split across processes) and every value it holds whole (host arrays, scalars), so
a load on the same process layout reads only its own file. The shard file's header
is the process's sidecar: after every process has written its file, the primary
merges the piece lists into ``manifest.json`` (written last, atomically) and removes
shard files of earlier saves. The ``<token>`` is new for every save, so a crash
leaves the previous manifest and the files it names intact.

Saving shares the multi-process writer's step protocol
(:class:`~nnx_save.save._collective.Sync`, structured JSON outcomes): agree on the tensors,
take the primary's save token, write and post the piece lists, let the primary commit
the manifest; any failure raises the same :class:`SaveError` on every process.

Loading is the one loading engine's: the manifest (read and validated by
:mod:`nnx_save.layouts._pieces`, its pieces checked to tile every tensor) says which pieces
of which shard files make each tensor; each box a target sharding needs is filled
in place from the pieces it overlaps, this process's own file first; a needed
piece in a file that is not there (a host-local disk) is an error naming that file.

``manifest.json``::

    {"format": "nnx_save.pod", "version": 1, "num_processes": 2, "metadata": {...},
     "tensors": {"embed": {"dtype": "F32", "shape": [64, 32],
                           "sharding": "NamedSharding(mesh={'a': 2}, spec=P('a', None))",
                           "pieces": [{"file": "shard_00000-of-00002.1a2b3c4d.safetensors",
                                       "name": "embed[0:32,0:32]", "box": [[0, 32], [0, 32]],
                                       "process": 0}, ...]}}}
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _nnx
from .._pytree import flatten, leaf_entry
from ..errors import SaveError
from ..format import _dtypes, _paths
from ..format._header import encode_header
from ..save._collective import Outcome, Sync, agree
from ..save._stage import HostValue, spans_processes
from ..save._write import Entry, atomic_file, order_entries, write_file
from ._pieces import FORMAT as POD_FORMAT
from ._pieces import MANIFEST, VERSION, Box
from ._pieces import SHARD_FILE as _SHARD

__all__ = ["MANIFEST", "save_pod"]


def _shard_name(p: int, n: int, token: str) -> str:
    return f"shard_{p:05d}-of-{n:05d}.{token}.safetensors"


def _piece_name(key: str, box: Box, shape: tuple[int, ...]) -> str:
    if box == tuple((0, d) for d in shape):
        return key
    return f"{key}[{','.join(f'{lo}:{hi}' for lo, hi in box)}]"


def _describe_sharding(array: Any) -> str:
    sharding = getattr(array, "sharding", None)
    if sharding is None:
        return "host"
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        return f"NamedSharding(mesh={dict(mesh.shape)}, spec={spec})"
    return type(sharding).__name__


def _pieces_of(e: Entry) -> tuple[str, list[tuple[Box, Any]]]:
    """This process's pieces of one entry: ``(sharding text, [(box, host value thunk)])``."""
    array = e.value.array if isinstance(e.value, HostValue) else None
    whole = tuple((0, d) for d in e.shape)
    if array is None or not spans_processes(array):
        return _describe_sharding(array), [(whole, e.value)]
    if not _dtypes.DTYPES[e.code].byte_aligned:
        raise SaveError(
            f"{e.key}: a {e.code} tensor packs several elements per byte; it cannot be saved "
            "in pieces. Replicate it before saving",
            key_path=e.key,
        )
    boxes: dict[Box, Any] = {}
    for shard in array.addressable_shards:  # every distinct box held here, whatever its replica
        box = tuple(s.indices(d)[:2] for s, d in zip(shard.index, e.shape, strict=False))
        boxes.setdefault(box, lambda data=shard.data: np.asarray(data))
    return _describe_sharding(array), sorted(boxes.items())


def _local_entries(entries: Sequence[Entry]) -> tuple[list[Entry], list[list[Any]], dict[str, str]]:
    """Entries of this process's shard file, its piece list, and each tensor's sharding."""
    out, listing, shardings = [], [], {}
    for e in entries:
        shardings[e.key], pieces = _pieces_of(e)
        for box, value in pieces:
            name = _piece_name(e.key, box, e.shape)
            out.append(Entry(name, e.code, tuple(hi - lo for lo, hi in box), value))
            listing.append([e.key, name, [list(b) for b in box]])
    return out, listing, shardings


def _entries(tree_or_model: Any, metadata: Mapping[str, str] | None, filter: Any) -> tuple[list[Entry], dict]:
    if _nnx.is_model(tree_or_model):
        entries, rng, scalars = _nnx.model_entries(tree_or_model, filter)
        return entries, _nnx.model_metadata(metadata, rng, scalars)
    pairs, _ = flatten(tree_or_model)
    _paths.check_unique(p for p, _ in pairs)
    return [leaf_entry(p, v) for p, v in pairs], dict(metadata or {})


def save_pod(
    tree_or_model: Any,
    directory: str | os.PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    filter: Any = ...,
) -> Path:
    """Save a pytree of arrays or an NNX model as a pod directory: one shard file per
    process and a ``manifest.json``.

    Call it on every process (with the same tree: global shapes). Each process writes
    only its own file, with every distinct box its devices hold; nothing is gathered.
    The manifest is written last, atomically, so a crash leaves the previous save
    readable. :func:`~nnx_save.load_file` and :func:`~nnx_save.load_model` read the
    directory on any process layout.

    Args:
        tree_or_model: a pytree of jax / numpy arrays, or an NNX object.
        directory: the pod directory (created if needed; must be shared by all processes).
        metadata: string -> string pairs for the manifest and every shard file.
        filter: an NNX filter, for a model (``nnx.Param``: parameters only).

    Returns:
        The path of ``manifest.json``.

    Raises:
        SaveError: a process failed or did not arrive in time; the previous pod
            directory content is intact.

    Examples:
        >>> import numpy as np, nnx_save, tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = nnx_save.save_pod({"w": np.arange(4, dtype=np.float32)}, d)
        >>> nnx_save.load_file(d)["w"]
        array([0., 1., 2., 3.], dtype=float32)
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries, meta = _entries(tree_or_model, metadata, filter)
    entries = order_entries(entries)
    sync = Sync.open(directory, what="pod save", intact="the previous save in it, if any, is intact")
    if sync.n > 1:
        head, offsets = encode_header([(e.key, e.code, e.shape) for e in entries], meta)
        agree(sync, head, len(entries), offsets[-1][1] if offsets else 0)
    token = sync.step("token", Outcome(True, secrets.token_hex(4)) if sync.pid == 0 else None, only=0)[0]
    mine = directory / _shard_name(sync.pid, sync.n, token)

    def write_mine() -> dict[str, Any]:
        local, listing, shardings = _local_entries(entries)
        write_file(mine, local, meta)
        return {"pieces": listing, "shardings": shardings}

    try:
        posted = sync.step("pieces", Outcome.of(write_mine))
        committed = _commit(directory, entries, meta, posted, sync.n, token) if sync.pid == 0 else None
        sync.step("commit", committed, only=0)
    except SaveError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mine)
        raise
    return directory / MANIFEST


def _commit(
    directory: Path,
    entries: Sequence[Entry],
    meta: Mapping[str, str],
    posted: Mapping[int, dict[str, Any]],
    n: int,
    token: str,
) -> Outcome:
    """Primary: merge the piece lists into the manifest, write it, drop stale shard files."""
    shardings = posted[0]["shardings"]  # the same on every process: they agreed on the tensors
    tensors: dict[str, dict[str, Any]] = {
        e.key: {"dtype": e.code, "shape": list(e.shape), "sharding": shardings[e.key], "pieces": []} for e in entries
    }
    for p in sorted(posted):
        for key, name, box in posted[p]["pieces"]:
            tensors[key]["pieces"].append({"file": _shard_name(p, n, token), "name": name, "box": box, "process": p})
    manifest = {
        "format": POD_FORMAT,
        "version": VERSION,
        "num_processes": n,
        "metadata": dict(meta),
        "tensors": tensors,
    }
    try:
        with atomic_file(directory / MANIFEST) as fd:
            os.write(fd, json.dumps(manifest, indent=1).encode() + b"\n")
    except SaveError as e:
        return Outcome(False, error=str(e))
    keep = {_shard_name(p, n, token) for p in range(n)}
    for stale in directory.iterdir():
        if _SHARD.match(stale.name) and stale.name not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
    return Outcome(True)
