"""The one registry of layouts, for reading and for writing.

Reading, :func:`read_header` tells a source by its content: a local file by its bytes
(a safetensors header, or a JSON object with a ``weight_map``: an index named itself),
a URL by the response (an object there is a file or an index; none, a directory whose
index or ``model.safetensors`` is joined by the URL's rules, query string kept), and a
directory by its records (:data:`RECORDS`: a pod manifest, an HF index; a directory two
layouts claim is refused with a :class:`~nnx_save.errors.HeaderError` (``check="layout"``), never
resolved in silence), else its ``*.safetensors`` files. A :class:`Header` of local files
keeps each file open, so a load reads the very files it validated.

Writing, :func:`plan_save` picks the layout (one file, an HF index with ``max_shard_size``,
a pod) into a :class:`SavePlan`, and :func:`run_save` carries it out, now or in the
background: the layout chooses by process count and transport, commits its record, and,
the one commit done, the plan retires any other layout the directory held (its record
first, then the files provably its own), so one is left.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

from .._options import path_arg
from ..errors import NotSafetensorsError, OptionError, RemoteError, SaveError, SourceNotFoundError
from ..format._formats import foreign_directory
from ..io import _storage
from ..io._lock import STORE_RECORD
from ..io._reader import Reader
from ..io._storage import LocalDirectory, Location, Where
from ..load._source import Header, gc_paused
from ..save._entry import Entry
from ..save._options import DEFAULT_SHARD_SIZE, SaveOptions
from . import _file, _index, _local
from ._directory import DirectoryLayout, read_list
from ._file import FileLayout
from ._index import INDEX_NAME, IndexLayout
from ._layout import SINGLE, Committed, Layout, SavingLayout, WriteFiles, conflict
from ._pod import FORMAT as POD_FORMAT
from ._pod import PodLayout

if TYPE_CHECKING:
    from ..save._background import SaveHandle

__all__ = [
    "INDEX",
    "POD",
    "RECORDS",
    "Owner",
    "SavePlan",
    "layout_of",
    "owners",
    "plan_save",
    "read_header",
    "reader_factory",
    "run_save",
]

POD, INDEX, FILE = PodLayout(), IndexLayout(), FileLayout()
RECORDS: tuple[PodLayout | IndexLayout, ...] = (POD, INDEX)
"""The layouts a directory holds by their record; two that claim one directory conflict."""
_DIRECTORY = DirectoryLayout()
_WHAT = {"index": "a multi-file save", "pod": "save_pod"}  # the holder, as a refused writer reads it
_DEFAULTS = SaveOptions()


def read_header(source: Where | Sequence[Where] | Header) -> Header:
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


def _describe_source(source: Where | Sequence[Where]) -> str:
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else f"{len(source)} files"


def _check_source(source: object) -> None:
    """Refuse, with an :class:`OptionError` naming ``source``, what is neither a path, a
    URL, nor a list or tuple of paths."""
    if isinstance(source, (list, tuple)):  # an empty one: refused below, saying why
        for item in source:
            path_arg(item, "source", "read_header")
    else:
        path_arg(source, "source", "read_header")


def _read(source: Where | Sequence[Where]) -> Header:
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    if isinstance(name, str) and _local.spelled_as_path(name):  # never a URL: "scheme://" has a "//"
        try:  # a local file, the common case, in one open and one fstat
            local = _local.read_local(name)
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


def layout_of(path: Path) -> Layout:
    """The layout of local ``path``: the one record-keeping layout that claims it,
    else a directory of files, else one file.

    Raises:
        HeaderError: ``check="layout"``: two layouts claim ``path``, naming both.
    """
    location = LocalDirectory(path)  # a value: reading a local directory lists it here
    names = set(os.listdir(path)) if path.is_dir() else set()
    claimed = [layout for layout in RECORDS if layout.claims(location, names)]
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


class Owner(NamedTuple):
    """One claim on a directory: who (``kind``) and by what it holds (``what``, for messages)."""

    kind: Literal["store", "foreign", "pod", "index", "files"]
    what: str


def owners(location: Location, names: Collection[str]) -> list[Owner]:
    """Who owns directory ``location``, judged by what it holds, in this order: a step
    store (its record), another tool's checkpoint (Orbax, TensorStore: their markers, on a
    filesystem), the layouts that claim it by their record's content (:data:`RECORDS`),
    and plain ``*.safetensors`` files; ``names``: what it holds (its
    :meth:`~nnx_save.io._storage.Location.names`). Empty when it holds none of these.
    Each writer refuses the owners it cannot share a directory with: a save the store
    and other tools, the store the layouts.

    Examples:
        >>> import os, tempfile, numpy as np, nnx_save
        >>> from nnx_save.io._storage import locate
        >>> d = tempfile.mkdtemp()
        >>> nnx_save.save_file({"w": np.zeros(4, np.float32)}, d, max_shard_size=8)
        >>> [o.kind for o in owners(locate(d), os.listdir(d))]
        ['index', 'files']
    """
    if not names:
        return []
    found = []
    if STORE_RECORD in names:
        found.append(Owner("store", f"the directory of a step store (it holds {STORE_RECORD}: nnx_save.checkpoint)"))
    root = location.directory
    try:
        foreign = foreign_directory(root) if root is not None else None  # Orbax's markers, read on a filesystem
    except OSError:  # gone or unreadable meanwhile: the save itself says what is wrong
        foreign = None
    if foreign is not None:
        found.append(Owner("foreign", foreign))
    found += [Owner(layout.name, layout.record) for layout in RECORDS if layout.claims(location, names)]  # type: ignore[arg-type]  # "pod", "index"
    files = sorted(n for n in names if n.endswith(".safetensors") and not n.startswith("."))
    if files:
        found.append(Owner("files", f"{len(files)} .safetensors files ({', '.join(files[:3])})"))
    return found


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """A save's layout, metadata and options: :meth:`write_now` writes, commits, and
    retires any other layout of the directory (on the process that committed)."""

    layout: SavingLayout | PodLayout
    metadata: Mapping[str, str] | None
    options: SaveOptions = _DEFAULTS

    def write_now(self, path: Where, entries: Sequence[Entry]) -> Committed | None:
        """Carry the plan out in this thread (no wait for earlier asynchronous saves)."""
        entries, write_files = self.take(path, entries)
        return self.write_and_retire(path, entries, write_files)

    def take(self, path: Where, entries: Sequence[Entry]) -> tuple[Sequence[Entry], WriteFiles]:
        """The entries to write and what writes them: for a pod, this process's pieces,
        taken now from the caller's arrays; else ``entries`` and the layout's ``write``."""
        if isinstance(self.layout, PodLayout):
            return self.layout.pieces(path, entries, self.metadata, self.options)
        return entries, functools.partial(self.layout.write, metadata=self.metadata, options=self.options)

    def write_and_retire(self, path: Where, entries: Sequence[Entry], write_files: WriteFiles) -> Committed | None:
        """``write_files(path, entries)`` and the retirement of the other layouts, as the
        one writer of directory ``path`` (its location's
        :meth:`~nnx_save.io._storage.Location.one_writer`): a multi-file or pod save holds
        it from before the first step until the other layouts are retired, so two saves
        never interleave files or remove each other's. One file needs none (its replace
        is the commit).

        Raises:
            DirectoryLockedError: another save or store holds the directory (named).
            SaveError: the directory is a step store's or another tool's checkpoint.
        """
        # ``entries`` travel as an argument, never in a closure: an asynchronous save's kept
        # error clears its frames' locals, not a function's cells (the snapshot would stay).
        if isinstance(self.layout, FileLayout):
            return write_files(path, entries)
        self.layout.check_target(path)
        location = _storage.locate(path)
        names, what = location.names(), _WHAT[self.layout.name]
        if names:  # an empty or new directory has no owner, and no layout to retire
            _refuse_foreign(location, owners(location, names), what)
            _refuse_not_ours(location, names, self.layout.name, what)
        with location.one_writer(what):
            committed = write_files(path, entries)
            if committed is not None and names:
                self._retire_others(location, names, committed)
            return committed

    def _retire_others(self, location: Location, names: Collection[str], committed: Committed) -> None:
        """After this layout's commit: retire the layouts the directory held before it
        (``names``: what it held)."""
        keep = {str(f).rsplit("/", 1)[-1] for f in committed.files}
        for other in (*RECORDS, FILE):
            if other.name != self.layout.name and other.claims(location, names):
                other.retire(location, keep)


def _refuse_foreign(location: Location, found: Sequence[Owner], what: str) -> None:
    """Refuse a multi-file or pod save into a directory that a step store or another
    tool's checkpoint owns: its files would mix with theirs, and a loader would read the
    one and hide the other.

    Raises:
        SaveError: naming the directory and what owns it; nothing was written.
    """
    for owner in found:
        if owner.kind in ("store", "foreign"):
            raise SaveError(
                f"{location}: is {owner.what}; {what} into it would mix two checkpoints in one directory, so "
                "nothing was written: save to another directory",
                str(location),
            )


def _refuse_not_ours(location: Location, names: Collection[str], layout: str, what: str) -> None:
    """Refuse a save that would replace its record, or retire another layout's, where the
    name holds what is not such a record (another tool's ``manifest.json``, a
    directory): a save replaces only records of its formats.

    Raises:
        SaveError: naming the file and what it is; nothing was written.
    """
    for other in RECORDS:
        if other.record not in names or (other.name != layout and not other.claims(location, names)):
            continue
        found = _not_a_record(location, other.record, other.name)
        if found is not None:
            where = location.member(other.record)
            raise SaveError(
                f"{where}: is {found}; {what} would replace it, so nothing was written: move it away, "
                "or save into another directory",
                str(where),
            )


def _not_a_record(location: Location, name: str, layout: str) -> str | None:
    """What ``name`` in ``location`` is, when it is not a record of ``layout`` (else ``None``)."""
    local = location.directory
    if local is not None and not (local / name).is_file():
        return "not a regular file"
    try:
        raw = location.read_bytes(name, "record", _index.MAX_INDEX_BYTES, SaveError)
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


def plan_save(metadata: Mapping[str, str] | None, options: SaveOptions = _DEFAULTS) -> SavePlan:
    """The plan of a save, of the layout ``options.layout`` names (by default
    ``"index"`` when ``options.max_shard_size`` is given, else ``"file"``): one file, an
    HF index of files of at most ``options.max_shard_size`` bytes, or a pod directory
    (``metadata`` then is the manifest's and every shard file's). ``options`` travel with it.
    """
    layout = options.layout or ("file" if options.max_shard_size is None else "index")
    if layout == "pod":
        return SavePlan(POD, dict(metadata or {}), options)
    if layout == "file":
        return SavePlan(FILE, metadata, options)
    return SavePlan(IndexLayout(options.max_shard_size or DEFAULT_SHARD_SIZE), metadata, options)


def run_save(path: Where, entries: Sequence[Entry], plan: SavePlan) -> SaveHandle | None:
    """Carry ``plan`` out for ``entries`` at ``path``: now, once earlier asynchronous
    saves are done (``plan.options.blocking``), or on a host snapshot in the background
    with no bar drawn over the caller's output (see :mod:`nnx_save.save._background`). A
    pod's pieces are taken first, from the caller's arrays."""
    from ..save import _background  # the save machinery: a read never loads it

    if not plan.options.blocking:
        plan = dataclasses.replace(plan, options=dataclasses.replace(plan.options, progress=False))
    entries, write_files = plan.take(path, entries)
    if not plan.options.blocking:
        return _background.start(path, entries, functools.partial(plan.write_and_retire, write_files=write_files))
    _background.wait_earlier()
    plan.write_and_retire(path, entries, write_files)
    return None
