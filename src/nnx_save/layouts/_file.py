"""The single-file layout: one ``.safetensors`` file, local or at a URL, told by its
bytes (a valid header; a JSON file is said to be one), its header read in two
positioned reads (a URL: at most two ranged requests) and validated whole before any
tensor byte; every tensor is one whole piece of it. Written into its
location by :func:`~nnx_save.save._destination.write_one` (from one process, from several
into one shared file, or uploaded whole to an object store); the file is its own record.
"""

from __future__ import annotations

import contextlib
import gc
import os
import stat
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import (
    HeaderError,
    NnxSaveError,
    NotSafetensorsError,
    SourceError,
    SourceNotFoundError,
    TruncatedFileError,
)
from ..format import _formats
from ..format._header import FileHeader, header_size, parse_header
from ..io import _files, _storage
from ..io._storage import Location, Where
from ..load._source import Header, LocalFiles, RemoteFiles
from ._layout import SINGLE, Committed, Metadata

if TYPE_CHECKING:  # the writers' types: reading a file does not import them
    from pathlib import Path

    from ..save._entry import Entry
    from ..save._options import SaveOptions

__all__ = [
    "FileLayout",
    "checked_size",
    "pinned_headers",
    "read_file_header",
    "read_file_headers",
    "read_local",
    "remote_file_header",
]


def _parse_head(fd: int, size: int, name: str, prefix: bytes, raw: bytes | None) -> FileHeader:
    """The header of the file open as ``fd``: ``prefix`` its first 8 bytes, ``raw`` the
    header they declare when already read (else read here, once the size is checked)."""
    _formats.refuse_file(name, prefix, lambda n, at: os.pread(fd, n, at), size)  # torch zip / pickle: say so
    n = checked_size(prefix, size, name)
    if raw is None or len(raw) != n:
        try:
            raw = _files.pread_exact(fd, n, 8, name)
        except TruncatedFileError as e:  # shorter than its own header: a header error, not a data one
            raise HeaderError(str(e), check="too_small") from None
    return parse_header(raw, size, file=name)


def checked_size(prefix: bytes, size: int, name: str) -> int:
    """The header size the first 8 bytes declare; a JSON file (an index named itself,
    a ``config.json``) is said to be one, not a header of absurd size.

    Raises:
        NotSafetensorsError: ``format="json"``, for a JSON text.
        HeaderError: the size does not fit the file.
    """
    try:
        return header_size(prefix, size, file=name)
    except HeaderError:
        if prefix.lstrip()[:1] in (b"{", b"["):
            raise NotSafetensorsError(f"{name}: a JSON file, not a safetensors file", "json") from None
        raise


def read_file_header(path: str | os.PathLike, pinned: _files.Pinned | None = None) -> FileHeader:
    """Read and validate one file's header (:func:`read_file_headers`)."""
    return read_file_headers([path], pinned)[0]


def read_file_headers(paths: Sequence[str | os.PathLike], pinned: _files.Pinned | None) -> tuple[FileHeader, ...]:
    """Read and validate each file's header (:func:`pinned_headers`)."""
    with pinned_headers(paths, pinned) as headers:
        return headers


@contextlib.contextmanager
def pinned_headers(
    paths: Sequence[str | os.PathLike], pinned: _files.Pinned | None
) -> Iterator[tuple[FileHeader, ...]]:
    """Each file's header, read (two positioned reads each, with the open) and
    validated, for the block to check further (a layout's checks across files). With ``pinned``,
    the files stay open there, all kept once the block ends without an error (see
    :class:`nnx_save.io._files.Pinned`); else, or on a failure, closed."""
    names = [os.fspath(p) for p in paths]
    heads = _files.open_heads(names)  # one visit to the transport for every file
    try:
        yield tuple(
            _parse(fd, st.st_size, name, pre, raw) for name, (fd, st, pre, raw) in zip(names, heads, strict=True)
        )
    except BaseException:
        for fd, *_ in heads:
            os.close(fd)
        raise
    if pinned is None:
        for fd, *_ in heads:
            os.close(fd)
    else:
        pinned.keep_all([(name, fd, st) for name, (fd, st, *_) in zip(names, heads, strict=True)])


def _parse(fd: int, size: int, name: str, prefix: bytes, raw: bytes | None) -> FileHeader:
    """:func:`_parse_head`, a failed read named as one."""
    try:
        return _parse_head(fd, size, name, prefix, raw)
    except OSError as e:
        raise SourceError(f"{name}: reading the header failed ({e.strerror or e})", name) from None


def _read_open(fd: int, st: os.stat_result, name: str, pinned: _files.Pinned | None) -> FileHeader:
    """The header of the regular file open as ``fd``; ``fd`` is kept in ``pinned``, or closed."""
    prefix, raw = _files.read_head(fd, st, name)  # the size first: /proc files report 0, some fail to read
    try:
        header = _parse(fd, st.st_size, name, prefix, raw)
    except BaseException:
        os.close(fd)
        raise
    if pinned is None:
        os.close(fd)
    else:
        pinned.keep(name, fd, st)
    return header


def spelled_as_path(name: str) -> bool:
    """Whether ``str(Path(name)) == name`` surely holds, so :func:`read_local` names the
    file as the layouts do (``a//b``, ``./a``, ``a/`` take the registry's way)."""
    return bool(name) and "//" not in name and "/." not in name and not name.startswith("./") and name[-1] != "/"


def read_local(name: str) -> Header | None:
    """The :class:`Header` of local path ``name`` in one ``open`` and one ``fstat``;
    ``None`` for a directory, whose layout the registry picks.

    Raises:
        FileNotFoundError: no such file.
        SourceError: a FIFO, device or socket, or an unreadable path.
        HeaderError: a malformed header.
    """
    fd, st = _files.open_stat(name)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        return None
    _files.require_regular(fd, st, name)
    placement = LocalFiles()
    collecting = gc.isenabled()  # paused as gc_paused() does, without a generator's cost on the per-open path
    gc.disable()
    try:
        fh = _read_open(fd, st, name, placement.pinned)
    finally:
        if collecting:
            gc.enable()
    return _header(fh, placement)


def _header(fh: FileHeader, placement: LocalFiles) -> Header:
    return Header(dict(fh.tensors), dict(fh.metadata), (fh,), "file", placement)


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
    """The header of the object ``reader`` reads (``head``: its first bytes, probed), and its identity."""
    _formats.refuse_file(url, head[:8], lambda n, at: head[at : at + n])
    n = checked_size(head[:8], reader.size, url)
    raw = head[8 : 8 + n]
    if len(raw) < n:
        raw += reader.read(len(head), 8 + n - len(head))
    return parse_header(raw, reader.size, file=url), reader.identity


def read_remote(url: str, stats: Any, opened: tuple[Any, bytes] | None = None) -> Header:
    """The header of the single file at ``url`` (``opened``: as :func:`remote_file_header` takes it)."""
    fh, ident = remote_file_header(url, stats, opened)
    return _header(fh, RemoteFiles(stats, {url: ident}))


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
        return _header(read_file_header(path, placement.pinned), placement)
