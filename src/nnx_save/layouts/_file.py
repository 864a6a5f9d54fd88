"""The single-file layout: one ``.safetensors`` file, local or at a URL, its header
read in two positioned reads (a URL: at most two ranged requests) and validated
whole before any tensor byte; every tensor is one whole piece of it.
"""

from __future__ import annotations

import gc
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import HeaderError, SourceError, SourceNotFoundError, TruncatedFileError
from ..format import _formats
from ..format._header import FileHeader, header_size, parse_header
from ..io import _files, _remote
from ..load._source import Header, LocalFiles, RemoteFiles

__all__ = ["FileLayout", "read_file_header", "read_local", "remote_file_header"]


def _read_prefix_and_header(fd: int, size: int, name: str) -> FileHeader:
    # The size is checked before any read: /proc files report 0 and some (/proc/self/mem) fail to read.
    prefix = os.pread(fd, 8, 0) if size >= 8 else b""
    _formats.refuse_file(name, prefix, lambda n, at: os.pread(fd, n, at), size)  # torch zip / pickle: say so
    n = header_size(prefix, size, file=name)
    try:
        raw = _files.pread_exact(fd, n, 8, name)
    except TruncatedFileError as e:  # shorter than its own header: a header error, not a data one
        raise HeaderError(str(e), check="too_small") from None
    return parse_header(raw, size, file=name)


def read_file_header(path: str | os.PathLike, pinned: _files.Pinned | None = None) -> FileHeader:
    """Read and validate one file's header (two positioned reads). With ``pinned``,
    the file stays open there (see :class:`nnx_save.io._files.Pinned`)."""
    name = os.fspath(path)
    fd, st = _files.open_stat(name)
    _files.require_regular(fd, st, name)
    return _read_open(fd, st, name, pinned)


def _read_open(fd: int, st: os.stat_result, name: str, pinned: _files.Pinned | None) -> FileHeader:
    """The header of the regular file open as ``fd``; ``fd`` is kept in ``pinned``, or closed."""
    try:
        header = _read_prefix_and_header(fd, st.st_size, name)
    except OSError as e:
        os.close(fd)
        raise SourceError(f"{name}: reading the header failed ({e.strerror or e})", name) from None
    except BaseException:
        os.close(fd)
        raise
    if pinned is None:
        os.close(fd)
    else:
        pinned.keep(name, fd, st)
    return header


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


def remote_file_header(url: str, stats: Any) -> tuple[FileHeader, tuple[int, str | None]]:
    """A remote file's header and its ``(size, ETag)`` in at most two requests: a
    speculative first range, then the rest of the header if it is larger."""
    reader = _remote.open_remote(url, stats)
    head = reader.probe()
    _formats.refuse_file(url, head[:8], lambda n, at: head[at : at + n])
    n = header_size(head[:8], reader.size, file=url)
    raw = head[8 : 8 + n]
    if len(raw) < n:
        raw += reader.read(len(head), 8 + n - len(head))
    return parse_header(raw, reader.size, file=url), reader.identity


def read_remote(url: str, stats: Any) -> Header:
    """The header of the single file at ``url``."""
    fh, ident = remote_file_header(url, stats)
    return _header(fh, RemoteFiles(stats, {url: ident}))


class FileLayout:
    """A path that is not a directory: one safetensors file."""

    name = "file"

    def claims(self, path: Path) -> bool:
        return not path.is_dir()

    def read(self, path: Path) -> Header:
        if not path.exists():
            raise SourceNotFoundError(f"{path}: no such checkpoint file or directory", str(path))
        placement = LocalFiles()
        return _header(read_file_header(path, placement.pinned), placement)
