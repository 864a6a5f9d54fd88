"""The one registry of layouts, for reading and for writing.

Reading, :func:`read_header` tells a source by its content: a local file by its bytes
(a safetensors header, or a JSON object with a ``weight_map``: an index named itself),
a URL by the response (an object there is a file or an index; none, a directory whose
index or ``model.safetensors`` is joined by the URL's rules, query string kept), and a
directory by its records (:data:`RECORDS`: a pod manifest, an HF index; a directory two
layouts claim is refused with a :class:`~nnx_save.errors.HeaderError` (``check="layout"``), never
resolved in silence), else its ``*.safetensors`` files. A :class:`Header` of local files
keeps each file open, so a load reads the very files it validated.

Writing, :func:`writer` picks the layout (one file, an HF index with ``max_shard_size``,
a pod) and :class:`Write` runs it: the layout chooses by process count and transport,
commits its record, and, the one commit done, the registry retires any other layout
the directory held (its record first, then the files provably its own), so one is left.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .._options import path_arg
from ..errors import NotSafetensorsError, OptionError, RemoteError, SaveError, SourceNotFoundError
from ..format._formats import foreign_directory
from ..io import _files, _storage
from ..io._lock import STORE_RECORD, one_writer
from ..io._reader import Reader
from ..load._source import Header, gc_paused
from ..save._entry import Entry
from ..save._options import SaveOptions
from . import _file, _index
from ._directory import DirectoryLayout, read_list
from ._file import FileLayout
from ._index import INDEX_NAME, IndexLayout
from ._layout import SINGLE, Layout, Writable, Written, conflict
from ._pod import FORMAT as POD_FORMAT
from ._pod import PodLayout

if TYPE_CHECKING:
    from ..save._background import SaveHandle

__all__ = ["INDEX", "POD", "RECORDS", "Write", "layout_of", "read_header", "reader_factory", "save", "writer"]

PathLike = str | os.PathLike
POD, INDEX, FILE = PodLayout(), IndexLayout(), FileLayout()
RECORDS: tuple[PodLayout | IndexLayout, ...] = (POD, INDEX)
"""The layouts a directory holds by their record; two that claim one directory conflict."""
_DIRECTORY = DirectoryLayout()
_WHAT = {"index": "a multi-file save", "pod": "save_pod"}  # the holder, as a refused writer reads it
_DEFAULTS = SaveOptions()


def read_header(source: PathLike | Sequence[PathLike] | Header) -> Header:
    """Read and validate the header(s) of a checkpoint, reading no tensor data.

    Args:
        source: a ``.safetensors`` file, an index file, a directory (an HF index, a
            pod, or plain ``*.safetensors`` files), a list of files, or a URL.

    Returns:
        A :class:`Header`: every tensor's dtype, shape, file and byte range.

    Raises:
        HeaderError: a malformed file or index (the subclass names the check).
        NotSafetensorsError: another format, told by its bytes (a JSON file that is
            no index, a PyTorch pickle ...).
        HeaderError: ``check="layout"``: a directory holding the records of two layouts.
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


def _check_source(source: object) -> None:
    """Refuse, with an :class:`OptionError` naming ``source``, what is neither a path, a
    URL, nor a list or tuple of paths."""
    if isinstance(source, (list, tuple)):  # an empty one: refused below, saying why
        for item in source:
            path_arg(item, "source", "read_header")
    else:
        path_arg(source, "source", "read_header")


def _read(source: PathLike | Sequence[PathLike]) -> Header:
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    if isinstance(name, str) and _as_path_spells_it(name) and not _storage.is_url(name):
        try:  # a local file, the common case, in one open and one fstat
            local = _file.read_local(name)
        except FileNotFoundError:
            local = None  # the layout below says what is missing, in its words
        except NotSafetensorsError as e:
            if e.format != "json":
                raise
            return INDEX.read_named(Path(name), e)
        if local is not None:
            return local
    with gc_paused():
        if isinstance(source, str) and _storage.is_url(source):
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


def reader_factory(header: Header) -> Callable[[str], Reader]:
    """``open_reader(file)`` for the engine, of the header's own (pinned) files."""
    return header.placement.open_reader


def _as_path_spells_it(name: str) -> bool:
    """Whether ``str(Path(name)) == name`` surely holds, so the fast path names files
    as the layouts below do (``a//b``, ``./a``, ``a/`` take that way)."""
    return bool(name) and "//" not in name and "/." not in name and not name.startswith("./") and name[-1] != "/"


def layout_of(path: Path) -> Layout:
    """The layout of local ``path``: the one record-keeping layout that claims it,
    else a directory of files, else one file.

    Raises:
        HeaderError: ``check="layout"``: two layouts claim ``path``, naming both.
    """
    claimed = [layout for layout in RECORDS if layout.claims(path)] if path.is_dir() else []
    if len(claimed) > 1:
        raise conflict(path, [f"{layout.record} ({layout.name})" for layout in claimed])
    if not claimed and os.path.lexists(path / POD.record):
        claimed = [POD]  # another tool's manifest.json, and nothing else: reading it says what it is
    return claimed[0] if claimed else _DIRECTORY if path.is_dir() else FILE


def _remote_header(url: str) -> Header:
    """By the response: the object at ``url`` (a file, or an index by its JSON), else
    ``url`` as a directory: its index, else its ``model.safetensors``; if neither is
    there, why the object was not.

    Raises:
        FileNotFoundError, RemoteError: nothing readable there, as the object at ``url`` said.
    """
    stats = _storage.RemoteStats()
    try:
        return _remote_object(url, stats)
    except (FileNotFoundError, IsADirectoryError, RemoteError) as e:
        first = e  # a server may answer a directory with 403 or a redirect to a listing
    for name in (INDEX_NAME, SINGLE):
        try:
            return _remote_object(_index.join_url(url, name), stats)
        except (FileNotFoundError, IsADirectoryError, RemoteError):
            continue
    raise first


def _remote_object(url: str, stats: _storage.RemoteStats) -> Header:
    """The object at ``url``: a safetensors file, or an index by its JSON; one probe decides."""
    reader = _storage.open_remote(url, stats)
    head = reader.probe()
    try:
        return _file.read_remote(url, stats, (reader, head))
    except NotSafetensorsError as e:
        if e.format != "json":
            raise
        if reader.size <= _index.MAX_INDEX_BYTES:  # a larger one: the index reader says so, reading no more
            head += reader.read(len(head), reader.size - len(head)) if len(head) < reader.size else b""
            if not _index.is_index(head):
                raise NotSafetensorsError(f"{e}, nor an index (no 'weight_map' object)", "json") from None
        return _index.read_remote(url, stats, reader, head)


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class Write:
    """A save's layout, metadata and options: ``write(path, entries)`` writes, commits,
    and retires any other layout of the directory (on the process that committed)."""

    layout: Writable
    metadata: Mapping[str, str] | None
    options: SaveOptions = _DEFAULTS

    def __call__(self, path: PathLike, entries: Sequence[Entry]) -> Written | None:
        return self.run(path, lambda p, e: self.layout.write(p, e, self.metadata, self.options), entries)

    def run(
        self, path: PathLike, write: Callable[[PathLike, Sequence[Entry]], Written | None], entries: Sequence[Entry]
    ) -> Written | None:
        """``write(path, entries)`` (this layout's write) and :meth:`committed`, as the one
        writer of directory ``path`` (:func:`~nnx_save.io._lock.one_writer`): a multi-file or
        pod save into a local directory holds its lock from before the first step until the
        other layouts are retired, so two saves never interleave files or remove each
        other's. One file needs none (its rename is the commit); a URL has no ``flock``.

        Raises:
            DirectoryLockedError: another save or store holds the directory (named).
        """
        # ``entries`` travel as an argument, never in a closure: an asynchronous save's kept
        # error clears its frames' locals, not a function's cells (the snapshot would stay).
        if isinstance(self.layout, FileLayout) or _storage.is_url(path):
            return self.committed(path, write(path, entries))
        self.layout.check_target(path)
        _refuse_foreign(Path(path), _WHAT[self.layout.name])
        _refuse_not_ours(Path(path), self.layout.name, _WHAT[self.layout.name])
        with one_writer(path, _WHAT[self.layout.name]):
            return self.committed(path, write(path, entries))

    def committed(self, path: PathLike, written: Written | None) -> Written | None:
        """After ``layout``'s commit in directory ``path``: retire the other layouts there."""
        if written is not None and not isinstance(self.layout, FileLayout) and not _storage.is_url(path):
            keep = {Path(f).name for f in written.files}
            for other in (*RECORDS, FILE):
                if other.name != self.layout.name and (other is FILE or other.claims(Path(path))):
                    other.retire(Path(path), keep)
        return written


def _refuse_foreign(directory: Path, what: str) -> None:
    """Refuse a multi-file or pod save into a directory that a step store or an Orbax
    checkpoint owns: its files would mix with theirs, and a loader would read the one and
    hide the other.

    Raises:
        SaveError: naming ``directory`` and what owns it; nothing was written.
    """
    try:
        owner = (
            f"the directory of a step store (it holds {STORE_RECORD}: nnx_save.checkpoint)"
            if (directory / STORE_RECORD).exists()
            else foreign_directory(directory)
        )
    except OSError:  # absent, or not a directory: the save itself says what is wrong
        return
    if owner is not None:
        raise SaveError(
            f"{directory}: is {owner}; {what} into it would mix two checkpoints in one directory, so "
            "nothing was written: save to another directory",
            str(directory),
        )


def _refuse_not_ours(directory: Path, layout: str, what: str) -> None:
    """Refuse a save that would replace its record, or retire another layout's, where the
    name holds a file that is not such a record (another tool's ``manifest.json``, a
    directory): a save replaces only records of its formats.

    Raises:
        SaveError: naming the file and what it is; nothing was written.
    """
    for other in RECORDS:
        where = directory / other.record
        if not os.path.lexists(where) or (other.name != layout and not other.claims(directory)):
            continue
        found = _not_a_record(where, other.name)
        if found is not None:
            raise SaveError(
                f"{where}: is {found}; {what} would replace it, so nothing was written: move it away, "
                "or save into another directory",
                str(where),
            )


def _not_a_record(where: Path, layout: str) -> str | None:
    """What the file ``where`` is, when it is not a record of ``layout`` (else ``None``)."""
    if not where.is_file():
        return "not a regular file"
    try:
        raw = _files.read_capped(os.fspath(where), "record", _index.MAX_INDEX_BYTES, SaveError)
    except (OSError, SaveError) as error:
        return f"unreadable ({getattr(error, 'strerror', None) or error})"
    if layout == "index":
        return None if _index.is_index(raw) else "not a HuggingFace index (no 'weight_map' object)"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict) and obj.get("format") == POD_FORMAT and isinstance(obj.get("save_id"), str):
        return None
    return f"not a pod manifest of nnx_save (no format {POD_FORMAT!r} with a save id: another tool's file?)"


def writer(metadata: Mapping[str, str] | None, options: SaveOptions = _DEFAULTS, *, pod: bool = False) -> Write:
    """The writer for a save: ``writer(path, entries)``. ``options.max_shard_size`` asks
    for an HF multi-file checkpoint, ``pod`` for a pod directory (``metadata`` then is the
    manifest's and every shard file's); else one file. ``options`` travel with it.
    """
    if pod:
        return Write(POD, dict(metadata or {}), options)
    if options.max_shard_size is None:
        return Write(FILE, metadata, options)
    return Write(IndexLayout(options.max_shard_size), metadata, options)


def save(path: PathLike, entries: Sequence[Entry], write: Write) -> SaveHandle | None:
    """Run ``write(path, entries)``: now (``write.options.blocking``), or on a host
    snapshot in the background with no bar drawn over the caller's output (see
    :mod:`nnx_save.save._background`). A pod's pieces are taken first, from the
    caller's arrays."""
    blocking = write.options.blocking
    if not blocking:
        write = dataclasses.replace(write, options=dataclasses.replace(write.options, progress=False))
    run: Callable[[PathLike, Sequence[Entry]], object] = write
    if isinstance(write.layout, PodLayout):
        entries, pod_write = write.layout.pieces(path, entries, write.metadata, write.options)
        run = lambda p, e: write.run(p, pod_write, e)  # noqa: E731
    from ..save import _background  # the save machinery: a read never loads it

    return _background.save(path, entries, run, blocking=blocking)
