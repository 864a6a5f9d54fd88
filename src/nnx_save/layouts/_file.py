"""The single-file layout: one ``.safetensors`` file, local or at a URL, told by its
bytes (a valid header; a JSON file is said to be one), its header read in two
positioned reads (a URL: at most two ranged requests) and validated whole before any
tensor byte; every tensor is one whole piece of it. Written into its
location by :func:`~nnx_save.save._destination.write_one` (from one process, from several
into one shared file, or uploaded whole to an object store); the file is its own record.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import HeaderError, NnxSaveError, SourceNotFoundError
from ..format._header import FileHeader, parse_header
from ..io import _storage
from ..io._storage import Location, Where
from ..load._source import Header, LocalFiles, RemoteFiles
from ._layout import SINGLE, Committed, Metadata
from ._local import as_header, checked_size, not_safetensors, read_file_header

if TYPE_CHECKING:  # the writers' types: reading a file does not import them
    from pathlib import Path

    from ..save._entry import Entry
    from ..save._options import SaveOptions

__all__ = ["FileLayout", "member_header", "object_header", "read_remote", "remote_file_header"]


def remote_file_header(
    url: str, stats: Any, opened: tuple[Any, bytes] | None = None
) -> tuple[FileHeader, tuple[int, str | None]]:
    """A remote file's header and its ``(size, ETag)`` in at most two requests: a
    speculative first range (or ``opened``: a reader and the bytes it probed), then the
    rest of the header if it is larger."""
    if opened is None:
        first = _storage.open_remote(url, stats)
        opened = (first, first.probe())
    return object_header(url, *opened)


def member_header(location: _storage.Location, name: str) -> FileHeader:
    """The header of file ``name`` of ``location``, read as :func:`remote_file_header` reads one."""
    reader = location.open_reader(name)
    return object_header(str(location.member(name)), reader, reader.probe())[0]


def object_header(url: str, reader: Any, head: bytes) -> tuple[FileHeader, tuple[int, str | None]]:
    """The header of the object ``reader`` reads (``head``: its first bytes, probed), and its
    identity. An object refused as safetensors is then asked whether it is another format
    (:func:`~nnx_save.layouts._local.not_safetensors`)."""
    try:
        n = checked_size(head[:8], reader.size, url)
        raw = head[8 : 8 + n]
        if len(raw) < n:
            raw += reader.read(len(head), 8 + n - len(head))
        return parse_header(raw, reader.size, file=url), reader.identity
    except HeaderError as e:
        refused = e
    not_safetensors(refused, url, head[:8], lambda n, at: head[at : at + n])


def read_remote(url: str, stats: Any, opened: tuple[Any, bytes] | None = None) -> Header:
    """The header of the single file at ``url`` (``opened``: as :func:`remote_file_header` takes it)."""
    fh, ident = remote_file_header(url, stats, opened)
    return as_header(fh, RemoteFiles(stats, {url: ident}))


class FileLayout:
    """One safetensors file (its bytes say so); in a directory, its ``model.safetensors``."""

    name = "file"

    def claims(self, location: Location, names: Collection[str]) -> bool:
        return SINGLE in names

    def write(self, path: Where, entries: Sequence[Entry], metadata: Metadata, options: SaveOptions) -> Committed:
        """One file, from this process, from every process of the job, or to an object store."""
        from ..save import _destination  # the writers: a read never loads them

        location, name = _storage.locate_file(path)
        _destination.write_one(location, name, entries, metadata, options.progress)
        return Committed(path, (path,))

    def check_target(self, path: str | os.PathLike) -> None:
        """Any path will do: the file's own write says what is wrong with it."""

    def retire(self, directory: Location, keep: Collection[str]) -> None:
        """Remove ``directory``'s single-file checkpoint, a safetensors file by its bytes."""
        if SINGLE not in keep:
            try:
                member_header(directory, SINGLE)
            except (OSError, NnxSaveError):
                return  # not a safetensors file: not a checkpoint's, not ours to remove
            directory.remove(SINGLE)

    def read(self, path: Path) -> Header:
        if not path.exists():
            raise SourceNotFoundError(f"{path}: no such checkpoint file or directory", str(path))
        placement = LocalFiles()
        return as_header(read_file_header(path, placement.pinned), placement)
