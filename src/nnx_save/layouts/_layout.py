"""The layout contract, both ways. Reading, a :class:`Layout` detects its source by
content and reads it into a :class:`~nnx_save.load._source.Header` (every tensor
validated) whose placement says which pieces of which files make each tensor; the one
engine reads pieces for all. Writing, it says which entries go to which file, runs the
save machinery, commits its record, and knows which files are its own (:func:`owned`).

Every save draws a fresh save id (:func:`new_save_id`), recorded in its record and in
each file's ``__metadata__``: the proof of ownership, and one version per load. A reader
that finds files of another save, or a file gone while the index was replaced, raced a
writer: a :class:`~nnx_save.errors.SourceChangedError` tells it to load again, never a
mix. Files of other tools carry no save id and are not checked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..errors import HeaderCheck, HeaderError, NnxSaveError, SourceChangedError, SourceError
from ..format._header import FileHeader, TensorInfo, strict_json
from ..io._storage import Location, Where
from ..load._source import Header

if TYPE_CHECKING:  # the writers' types: reading a file does not import them
    from pathlib import Path

    from ..save._entry import Entry
    from ..save._options import SaveOptions

__all__ = [
    "SAVE_ID_KEY",
    "SINGLE",
    "Committed",
    "Layout",
    "Metadata",
    "SavingLayout",
    "Shards",
    "WriteFiles",
    "check_one_version",
    "conflict",
    "load_record",
    "merge",
    "new_save_id",
    "one_version",
    "owned",
]

Metadata = Mapping[str, str] | None
"""The string metadata a save records (``None``: none)."""
Shards = list[tuple[str, list["Entry"]]]
"""A multi-file save's files: each file's name and the entries it holds."""

SAVE_ID_KEY = "nnx_save.save_id"
SINGLE = "model.safetensors"
"""A directory's single-file checkpoint (HuggingFace's name): a layout of its own beside a record."""


class Committed(NamedTuple):
    """What a layout's write committed: its record (the file itself, the index, the
    manifest; a URL stays a ``str``) and its data files. ``None`` on a process that
    did not commit."""

    record: Any
    files: tuple[Any, ...]


WriteFiles = Callable[[Where, Sequence["Entry"]], Committed | None]
"""``write_files(path, entries)``: a save's writing and commit, as its layout does them."""


class Layout(Protocol):
    """One on-disk layout, as a reader sees it."""

    name: str
    """``"file"``, ``"index"``, ``"directory"`` or ``"pod"``: the :attr:`Header.kind` it reads."""

    def claims(self, location: Location, names: Collection[str]) -> bool:
        """Whether ``location``, whose names are ``names``, holds this layout, judged by its content."""
        ...

    def read(self, path: Path) -> Header:
        """Read and validate every header of ``path``, reading no tensor data.

        Raises:
            HeaderError: the subclass names the failed check and the file.
        """
        ...


class SavingLayout(Layout, Protocol):
    """A layout a save writes in one call, as the registry calls it: one file, an HF
    index. (A pod's save first takes this process's pieces from the caller's arrays,
    :meth:`~nnx_save.layouts._pod.PodLayout.pieces`, which returns its write.)"""

    def check_target(self, path: str | os.PathLike) -> None:
        """Refuse a ``path`` this layout cannot write, before anything is created there.

        Raises:
            OptionError: naming ``path`` and what to give instead.
        """
        ...

    def write(
        self, path: Where, entries: Sequence[Entry], metadata: Metadata, options: SaveOptions
    ) -> Committed | None:
        """Write ``entries`` under the one commit rule, as ``options`` say (the bar);
        what was committed (``None`` on a process that did not commit).

        Raises:
            SaveError: nothing committed; the previous version at ``path`` is intact.
        """
        ...

    def retire(self, directory: Location, keep: Collection[str]) -> None:
        """After another layout's commit in ``directory``: remove this layout's
        record, then the files provably its own (none of ``keep``)."""
        ...


def owned(
    record_id: str | None,
    named: Collection[str],
    listing: Collection[str],
    pattern: re.Pattern[str],
    save_id_of: Callable[[str], str | None],
) -> set[str]:
    """The files provably of a save: each matches ``pattern`` (this layout's names,
    whose ``id`` group is a save id in the name) and carries in its metadata the save id
    of the record that names it (``record_id``, of the files ``named``); a file the
    record does not name (an interrupted save's) carries the id in its name, or, named
    without one, any save id but the record's. A file that merely appears in a record,
    or of another tool (no save id), is never one.
    """
    mine = set()
    for name in set(named) | set(listing):
        m = pattern.fullmatch(name)
        if m is None:
            continue
        got = save_id_of(name)
        if name in named:
            proven = record_id is not None and got == record_id
        else:
            proven = got is not None and (got == m.group("id") if m.group("id") else got != record_id)
        if proven:
            mine.add(name)
    return mine


def conflict(directory: Path, records: Sequence[str]) -> HeaderError:
    """The error for ``directory`` holding the ``records`` of two layouts."""
    return HeaderError(
        f"{directory}: holds both {' and '.join(records)}, so it is two checkpoints and nnx_save will not guess "
        "which one is current. Remove the record of the stale one (the save that did not write last), or "
        "save again into an empty directory",
        check="layout",
        file=str(directory),
    )


def single_beside(directory: Path, record: str, named: Collection[str]) -> None:
    """Refuse a ``model.safetensors`` beside ``record`` that does not name it (a single-file
    checkpoint saved there too: transformers reads it, the record's layout the rest).

    Raises:
        HeaderError: ``check="layout"``, naming both.
    """
    if SINGLE not in named and os.path.isfile(directory / SINGLE):
        raise conflict(directory, [f"{record} ({'pod' if record == 'manifest.json' else 'index'})", f"{SINGLE} (file)"])


def save_id_in(read: Callable[[], FileHeader], key: str) -> str | None:
    """The save id ``key`` in the metadata of the header ``read()`` gives; ``None``
    when it records none or is not a readable safetensors file."""
    try:
        return read().metadata.get(key)
    except (OSError, NnxSaveError):
        return None


def load_record(raw: bytes, where: object, what: str, check: HeaderCheck | None = None) -> Any:
    """The JSON of a layout's record (an index, a manifest), refusing a key repeated
    at any level (``json.loads`` alone keeps the last in silence) and a string that is no
    Unicode text (:func:`~nnx_save.format._header.strict_json`).

    Raises:
        HeaderError: of ``check``, naming ``where`` and what is wrong.
    """
    try:
        return strict_json(raw.decode("utf-8"))
    except HeaderError as e:  # a repeated key, a string that is no text (kept as "encoding")
        why, check = f"{e} in the {what} JSON", "encoding" if e.check == "encoding" else check
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, nested too deeply are ValueErrors
        why = f"not a valid JSON {what}: {e}"
    raise HeaderError(f"{where}: {why}", check=check) from None


def merge(files: Sequence[FileHeader], where: str) -> dict[str, TensorInfo]:
    """Every tensor of ``files``, refusing a name held by two of them."""
    tensors: dict[str, TensorInfo] = {}
    for fh in files:
        for name, info in fh.tensors.items():
            if name in tensors:
                raise HeaderError(
                    f"{where}: tensor {name!r} appears in two files: {tensors[name].file} and {info.file}",
                    check="index",
                )
            tensors[name] = info
    return tensors


def new_save_id() -> str:
    """A fresh save id: eight hex digits, also the suffix of the save's new file names."""
    return os.urandom(4).hex()  # secrets.token_hex(4), without importing secrets (hashlib, hmac)


def check_one_version(where: str, index_metadata: Mapping[str, str], files: Sequence[FileHeader]) -> None:
    """Every file is of the save the index records (when it records one).

    Raises:
        HeaderError: ``check="index"``, naming the first file of another save and both save ids
            (a link to, or a copy of, another checkpoint's file: loading again cannot help;
            :func:`one_version` turns it into :class:`SourceChangedError` when the index was
            replaced while it was read).
    """
    want = index_metadata.get(SAVE_ID_KEY)
    if want is None:
        return
    for fh in files:
        got = fh.metadata.get(SAVE_ID_KEY)
        if got != want:
            raise HeaderError(
                f"{where}: is save {want}, but the file it names {fh.file} is "
                f"{f'save {got}' if got else 'of no recorded save'}: a file of another checkpoint (a link to it, "
                "or a copy) stands under a name of this one; restore this checkpoint's file or save it again",
                check="index",
                file=where,
            )


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def one_version(record: Path, read: Callable[[], Header], checks: Collection[str] = ("index",)) -> Header:
    """``read()`` (a record, an index or a pod's manifest, and the files it names); a
    missing or unreadable file (or a failed check of ``checks``) while the record itself
    was replaced meanwhile is a race with a writer, and so is a header read without some
    of its files (:attr:`~nnx_save.load._source.Header.missing_files`: a pod reads
    without them; a load that needs one would fail later, naming no race).

    Raises:
        SourceChangedError: the record changed during ``read`` and a file it named failed or was gone.
    """
    before = _identity(record)
    try:
        header = read()
    except (FileNotFoundError, HeaderError, SourceError) as e:
        racy = not isinstance(e, SourceChangedError) and getattr(e, "check", "index") in checks
        if not racy or _identity(record) == before:
            raise
        raise _changed(record, str(e)) from e
    if header.missing_files and _identity(record) != before:
        header.close()
        raise _changed(record, f"{', '.join(header.missing_files)} of the version read went meanwhile")
    return header


def _changed(record: Path, why: str) -> SourceChangedError:
    return SourceChangedError(
        f"{record}: was replaced while it was read ({why}); the checkpoint changed under the reader; load it again",
        str(record),
    )
