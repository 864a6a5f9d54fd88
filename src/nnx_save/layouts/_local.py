"""A local safetensors file's header, read in one ``open`` and two positioned reads and
validated whole before any tensor byte, as a :class:`~nnx_save.load._source.Header` whose
files stay pinned (:class:`~nnx_save.io._files.Pinned`). The single-file layout
(:mod:`nnx_save.layouts._file`) and the others read local headers through it, and a lazy
handle's ``safe_open`` of a local file imports it alone: none of the layouts' writers,
the storage layer or the engine.
"""

from __future__ import annotations

import contextlib
import gc
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from ..errors import HeaderError, NotSafetensorsError, SourceError, TruncatedFileError
from ..format._header import FileHeader, header_size, parse_header
from ..io import _files
from ..load._source import Header, LocalFiles

__all__ = [
    "as_header",
    "checked_size",
    "pinned_headers",
    "read_file_header",
    "read_file_headers",
    "read_local",
    "spelled_as_path",
]


def _parse_head(fd: int, size: int, name: str, prefix: bytes, raw: bytes | None) -> FileHeader:
    """The header of the file open as ``fd``: ``prefix`` its first 8 bytes, ``raw`` the
    header they declare when already read (else read here, once the size is checked).

    A file refused as safetensors is then asked whether it is another format (a torch zip
    or pickle: :class:`NotSafetensorsError` says which, and what to run); a file whose
    header parses is none, so a load never imports the format sniffers."""
    try:
        n = checked_size(prefix, size, name)
        if raw is None or len(raw) != n:
            try:
                raw = _files.pread_exact(fd, n, 8, name)
            except TruncatedFileError as e:  # shorter than its own header: a header error, not a data one
                raise HeaderError(str(e), check="too_small") from None
        return parse_header(raw, size, file=name)
    except HeaderError as e:
        refused = e
    not_safetensors(refused, name, prefix, lambda n, at: os.pread(fd, n, at), size)


def not_safetensors(
    refused: HeaderError, name: str, prefix: bytes, read: Callable[[int, int], bytes], size: int | None = None
) -> NoReturn:
    """Raise :class:`NotSafetensorsError` where a file refused as safetensors (``refused``)
    is another format, told by its first bytes (a torch zip or pickle: it says which, and
    what to run); else ``refused`` itself. Called outside the ``except`` that caught
    ``refused``, so the one error raised is the whole story. The sniffers load here only:
    a file whose header parses never needs them."""
    from ..format import _formats

    _formats.refuse_file(name, prefix, read, size)
    raise refused


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
    return as_header(fh, placement)


def as_header(fh: FileHeader, placement: LocalFiles) -> Header:
    return Header(dict(fh.tensors), dict(fh.metadata), (fh,), "file", placement)
