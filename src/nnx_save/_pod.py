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

Loading is the one loading engine's: the manifest (read and validated by
:mod:`nnx_save._layout`, its pieces checked to tile every tensor) says which pieces
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

from . import _dtypes
from ._errors import SaveError
from ._layout import FORMAT, MANIFEST, VERSION, Box
from ._layout import SHARD_FILE as _SHARD
from ._write import Entry, atomic_file, order_entries, write_file

__all__ = ["MANIFEST", "save_pod"]


# --------------------------------------------------------------------------- saving


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
    from ._collective import HostValue, _spans_processes

    array = e.value.array if isinstance(e.value, HostValue) else None
    whole = tuple((0, d) for d in e.shape)
    if array is None or not _spans_processes(array):
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
    from flax import nnx

    if isinstance(tree_or_model, nnx.Pytree):
        from ._nnx import _model_metadata, model_entries

        entries, rng, scalars = model_entries(tree_or_model, filter)
        return entries, _model_metadata(metadata, rng, scalars)
    from . import _paths
    from ._tree import flatten, leaf_entry

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
    import jax

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries, meta = _entries(tree_or_model, metadata, filter)
    entries = order_entries(entries)
    pid, n = jax.process_index(), jax.process_count()
    sync = _start(directory, entries, meta, n)
    token = (
        secrets.token_hex(4)
        if sync is None
        else sync.gather("token", secrets.token_hex(4) if pid == 0 else None, only=0)[0]
    )
    mine = directory / _shard_name(pid, n, token)
    try:
        local, listing, shardings = _local_entries(entries)
        write_file(mine, local, meta)
        posted = "ok " + json.dumps(listing)
    except Exception as e:  # reported to every process, raised on all of them below
        posted = f"error {type(e).__name__}: {e}"
    lists = {0: posted} if sync is None else sync.gather("pieces", posted)
    failures = {p: v[len("error ") :] for p, v in lists.items() if not v.startswith("ok ")}
    outcome = "ok"
    if not failures and pid == 0:
        outcome = _commit(
            directory, entries, meta, shardings, {p: json.loads(v[3:]) for p, v in lists.items()}, n, token
        )
    if sync is not None:
        outcome = sync.gather("commit", outcome if pid == 0 else None, only=0)[0]
    if failures or outcome != "ok":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mine)
        detail = "; ".join(f"process {p}: {m}" for p, m in failures.items()) or outcome[len("error ") :]
        raise SaveError(
            f"{directory}: the pod save failed ({detail}); the previous save in it, if any, is intact", str(directory)
        )
    return directory / MANIFEST


def _start(directory: Path, entries: Sequence[Entry], meta: Mapping[str, str], n: int):
    """With several processes: agree on the tensors and metadata (bounded)."""
    if n == 1:
        return None
    from . import _collective
    from ._header import encode_header

    sync = _collective._Sync(directory / MANIFEST)
    head, offsets = encode_header([(e.key, e.code, e.shape) for e in entries], meta)
    _collective._agree(sync, head, len(entries), offsets[-1][1] if offsets else 0)
    return sync


def _commit(
    directory: Path,
    entries: Sequence[Entry],
    meta: Mapping[str, str],
    shardings: Mapping[str, str],
    lists: Mapping[int, list],
    n: int,
    token: str,
) -> str:
    """Primary: merge the piece lists into the manifest, write it, drop stale shard files."""
    tensors: dict[str, dict[str, Any]] = {
        e.key: {"dtype": e.code, "shape": list(e.shape), "sharding": shardings[e.key], "pieces": []} for e in entries
    }
    for p in sorted(lists):
        for key, name, box in lists[p]:
            tensors[key]["pieces"].append({"file": _shard_name(p, n, token), "name": name, "box": box, "process": p})
    manifest = {"format": FORMAT, "version": VERSION, "num_processes": n, "metadata": dict(meta), "tensors": tensors}
    try:
        with atomic_file(directory / MANIFEST) as fd:
            os.write(fd, json.dumps(manifest, indent=1).encode() + b"\n")
    except SaveError as e:
        return f"error {e}"
    keep = {_shard_name(p, n, token) for p in range(n)}
    for stale in directory.iterdir():
        if _SHARD.match(stale.name) and stale.name not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
    return "ok"
