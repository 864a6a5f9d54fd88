"""The layout registry: which layout a source is, and its validated header.

:func:`read_header` asks, in order: :data:`RECORDS` (layouts a directory names by one
record, a pod manifest or an HF index; a directory two of them claim is refused with
:class:`~nnx_save.errors.LayoutConflictError`, never resolved in silence), then any
other directory's ``*.safetensors`` files, then one file or URL. A :class:`Header` of
local files keeps each file open, so a load reads the very files it validated.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .._options import path_arg
from ..errors import LayoutConflictError, OptionError, SourceNotFoundError
from ..io import _remote
from ..io._reader import Reader
from ..load._source import Header, gc_paused
from . import _file, _index
from ._directory import DirectoryLayout, read_list
from ._file import FileLayout
from ._index import INDEX_NAME, IndexLayout
from ._layout import Layout
from ._pod import MANIFEST, PodLayout

__all__ = ["RECORDS", "Header", "layout_of", "read_header", "reader_factory"]

PathLike = str | os.PathLike
RECORDS: tuple[Layout, ...] = (PodLayout(), IndexLayout())
_FALLBACKS: tuple[Layout, ...] = (DirectoryLayout(), FileLayout())
_RECORD_FILES = {"pod": MANIFEST, "index": INDEX_NAME}


def read_header(source: PathLike | Sequence[PathLike] | Header) -> Header:
    """Read and validate the header(s) of a checkpoint, reading no tensor data.

    Args:
        source: a ``.safetensors`` file, a directory (an HF index, a pod, or plain
            ``*.safetensors`` files), a list of files, or a URL.

    Returns:
        A :class:`Header`: every tensor's dtype, shape, file and byte range.

    Raises:
        HeaderError: a malformed file or index (the subclass names the check).
        OptionError: ``source`` is not a path, a URL or a list of paths.
        LayoutConflictError: a directory holding both an HF index and a pod manifest.
        SourceNotFoundError: the source does not exist (a ``FileNotFoundError``).
        OptionError: ``source`` is not a path, a URL or a non-empty list of paths.

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> nnx_save.save_file({"w": np.zeros((2, 3), np.float32)}, path)
        >>> nnx_save.read_header(path)["w"].shape
        (2, 3)
    """
    if isinstance(source, Header):
        return source
    _check_source(source)
    try:
        return _read(source)
    except SourceNotFoundError:
        raise
    except FileNotFoundError as e:  # a file of a list, a URL's 404: the one error a missing source gives
        missing = e.filename if e.filename is not None else _describe_source(source)
        raise SourceNotFoundError(
            f"{missing}: no such checkpoint file or directory ({e.strerror or e})", str(missing)
        ) from None


def _describe_source(source: PathLike | Sequence[PathLike]) -> str:
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else f"{len(source)} files"


def _read(source: PathLike | Sequence[PathLike]) -> Header:
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    if isinstance(name, str) and _as_path_spells_it(name) and not _remote.is_url(name):
        try:  # a local file, the common case, in one open and one fstat
            local = _file.read_local(name)
        except FileNotFoundError:
            local = None  # the layout below says what is missing, in its words
        if local is not None:
            return local
    with gc_paused():
        if isinstance(source, str) and _remote.is_url(source):
            return _remote_header(source)
        if isinstance(source, (list, tuple)):
            if not source:  # a glob that matched nothing: loading "nothing" is never what was meant
                raise OptionError(
                    "source: an empty list of files, so there is nothing to read; give at least one "
                    ".safetensors file (a glob that matched nothing?), or the checkpoint's directory",
                    "source",
                )
            return read_list([Path(p) for p in source])
        path = Path(source)  # type: ignore[arg-type]  # list and tuple returned above; mypy cannot narrow str
        return layout_of(path).read(path)


def _check_source(source: object) -> None:
    """Refuse, with an :class:`OptionError` naming ``source``, what is neither a path, a
    URL, nor a list or tuple of paths."""
    if isinstance(source, (list, tuple)):  # an empty one: refused below, saying why
        for item in source:
            path_arg(item, "source", "read_header")
    else:
        path_arg(source, "source", "read_header")


def _as_path_spells_it(name: str) -> bool:
    """Whether ``str(Path(name)) == name`` surely holds, so the fast path names files
    as the layouts below do (``a//b``, ``./a``, ``a/`` take that way)."""
    return bool(name) and "//" not in name and "/." not in name and not name.startswith("./") and name[-1] != "/"


def layout_of(path: Path) -> Layout:
    """The layout of local ``path``, asked in the documented order."""
    claimed = [layout for layout in RECORDS if layout.claims(path)] if path.is_dir() else []
    if len(claimed) > 1:
        names = [f"{_RECORD_FILES[layout.name]} ({layout.name})" for layout in claimed]
        raise LayoutConflictError(
            f"{path}: holds both {' and '.join(names)}, so it is two checkpoints and nnx_save will not guess "
            "which one is current. Remove the record of the stale one (the save that did not write last), or "
            "save again into an empty directory",
            str(path),
        )
    return next(layout for layout in (*claimed, *_FALLBACKS) if layout.claims(path))


def _remote_header(url: str) -> Header:
    stats = _remote.RemoteStats()
    name, query = _split_query(url)
    if name.endswith(".json"):
        return _index.read_remote(url, stats)
    if not name.endswith(".safetensors"):
        try:
            return _index.read_remote(name.rstrip("/") + "/" + INDEX_NAME + query, stats)
        except FileNotFoundError:
            url = name.rstrip("/") + "/model.safetensors" + query
    return _file.read_remote(url, stats)


def _split_query(url: str) -> tuple[str, str]:
    """``(url up to its query string, "?query" or "")`` of an HTTP URL: a presigned URL
    names its file before the ``?`` that starts its signature. fsspec URLs are paths
    (an object key may hold a ``?``) and stay whole.

    Examples:
        >>> _split_query("https://b.s3.amazonaws.com/run/model.safetensors?X-Amz-Signature=ab")
        ('https://b.s3.amazonaws.com/run/model.safetensors', '?X-Amz-Signature=ab')
        >>> _split_query("s3://bucket/odd?name.safetensors")
        ('s3://bucket/odd?name.safetensors', '')
    """
    if not url.lower().startswith(("http://", "https://")):
        return url, ""
    name, mark, query = url.partition("?")
    return name, mark + query


def reader_factory(header: Header) -> Callable[[str], Reader]:
    """``open_reader(file)`` for the engine, of the header's own (pinned) files."""
    return header.placement.open_reader
