"""Writing a pod directory (:mod:`nnx_save.layouts._pod` owns the format): every process
writes one shard file with every distinct box its devices hold, then the primary
commits the manifest, last and atomically, and only then removes earlier saves' shard
files. The steps run over :class:`~nnx_save.io._kv.Sync`; the save token is new for
every save, so a crash leaves the previous manifest and its files intact, and any
failure raises the same :class:`SaveError` on every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import SaveError
from ..format import _dtypes
from ..format._boxes import Box, extents, of_index, whole
from ..format._header import encode_header
from ..io._kv import Outcome, Sync
from ..io._write import make_directory
from ..save._collective import agree
from ..save._entry import Entry, order_entries, spans_processes
from ..save._write import write_file
from ._pod import commit_manifest, piece_name, shard_name

__all__ = ["PodWriter"]


@dataclasses.dataclass(frozen=True)
class PodWriter:
    """The pod writer of :func:`~nnx_save.layouts._dispatch.writer`. Its :meth:`pieces`
    are taken when the save is called, before any host snapshot: a process writes
    every distinct box it holds, whatever its replica."""

    metadata: dict[str, str]

    def pieces(
        self, directory: str | os.PathLike, entries: Sequence[Entry]
    ) -> tuple[list[Entry], Callable[[str | os.PathLike, Sequence[Entry]], None]]:
        """Create ``directory``; this process's pieces of ``entries`` (global
        tensors), and the writer of those pieces."""
        make_directory(directory)
        entries = order_entries(entries)
        local, listing, shardings = [], [], {}
        for e in entries:
            shardings[e.key], pieces = _pieces_of(e)
            for box, piece in pieces:
                name = piece_name(e.key, box, e.shape)
                local.append(dataclasses.replace(piece, key=name, shape=extents(box)))
                listing.append([e.key, name, [list(b) for b in box]])
        names = [(e.key, e.code, e.shape) for e in entries]
        posted = {"pieces": listing, "shardings": shardings}
        return local, functools.partial(_write, names=names, meta=self.metadata, posted=posted)

    def __call__(self, directory: str | os.PathLike, entries: Sequence[Entry]) -> None:
        local, write = self.pieces(directory, entries)
        write(directory, local)


def _describe_sharding(array: Any) -> str:
    sharding = getattr(array, "sharding", None)
    if sharding is None:
        return "host"
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        return f"NamedSharding(mesh={dict(mesh.shape)}, spec={spec})"
    return type(sharding).__name__


def _pieces_of(e: Entry) -> tuple[str, list[tuple[Box, Any]]]:
    """This process's pieces of one entry: ``(sharding text, [(box, entry of the piece's value)])``."""
    array = e.array
    if array is None or not spans_processes(array):
        return _describe_sharding(array), [(whole(e.shape), e)]
    if not _dtypes.DTYPES[e.code].byte_aligned:
        raise SaveError(
            f"{e.key}: a {e.code} tensor packs several elements per byte; it cannot be saved "
            "in pieces. Replicate it before saving",
            key_path=e.key,
        )
    boxes: dict[Box, Any] = {}
    for shard in array.addressable_shards:  # every distinct box held here, whatever its replica
        box = of_index(shard.index, e.shape)
        boxes.setdefault(box, Entry.of(e.key, e.code, extents(box), shard.data))  # staged, snapshotted as any
    return _describe_sharding(array), sorted(boxes.items())


def _write(
    path: str | os.PathLike, local: Sequence[Entry], *, names: list, meta: dict[str, str], posted: dict[str, Any]
) -> None:
    """Every process: agree, write this process's shard file, let the primary commit."""
    directory = Path(path)
    sync = Sync.open(directory, what="pod save", intact="the previous save in it, if any, is intact")
    if sync.n > 1:
        head, offsets = encode_header(names, meta)
        agree(sync, head, len(names), offsets[-1][1] if offsets else 0)
    token = sync.on_primary("token", lambda: secrets.token_hex(4))
    mine = directory / shard_name(sync.pid, sync.n, token)

    def write_mine() -> dict[str, Any]:
        write_file(mine, local, meta)
        return posted

    try:
        pieces = sync.step("pieces", Outcome.of(write_mine))
        sync.step("commit", commit_manifest(directory, names, meta, pieces, token) if sync.pid == 0 else None, only=0)
    except SaveError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mine)
        raise
