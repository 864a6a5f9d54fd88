"""The HuggingFace index layout: ``model.safetensors.index.json`` and the files it
names, local or at a URL, read and written here.

Reading, the index (:func:`parse_index`: a JSON object with a ``weight_map``, also
when the index file itself is named), every file's header, and the index against the
files both ways are validated before any tensor byte is read.

Writing follows the one commit rule: the data files first, under names no committed
file has; then the index, replaced atomically; only then the files provably of the
version it replaced (:func:`~nnx_save.layouts._layout.owned`: this layout's names,
the save id of the index in their metadata), never another file the old index named.
The save id in the index and every file lets a reader tell a mix of two saves
(:func:`~nnx_save.layouts._layout.check_one_version`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import posixpath
import re
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import HeaderError, NotSafetensorsError, OptionError, short_repr
from ..format import _dtypes
from ..format._header import FileHeader
from ..format._units import parse_size
from ..io import _files, _storage
from ..io._kv import Sync
from ..io._storage import Location, Staged, Where
from ..load._source import Header, LocalFiles, RemoteFiles
from ..save._entry import Entry, order_entries
from ..save._options import SaveOptions
from . import _layout
from ._file import member_header, remote_file_header
from ._layout import SAVE_ID_KEY, Committed, Metadata, Shards
from ._local import pinned_headers

__all__ = ["INDEX_NAME", "MAX_INDEX_BYTES", "IndexLayout", "is_index", "join_url", "read_remote", "write_sharded"]

INDEX_NAME = "model.safetensors.index.json"
# DeepSeek-scale indexes (tens of thousands of tensors) are a few MiB.
MAX_INDEX_BYTES = 64 << 20
HEADER_PROBES = 16  # member headers probed at once over a network
_NOT_IN_FILE_NAMES = ("%", "\\", "?", "#", "\x00", ":")
_bad = functools.partial(HeaderError, check="index")
OURS = re.compile(r"model(-\d{5}-of-\d{5})?(\.(?P<id>[0-9a-f]{8}))?\.safetensors")
"""The names this layout writes (:func:`file_names`); ``id`` is the save id in a name."""


def _check_file_name(name: str, base: str, where: str) -> None:
    """A weight-map file name must be a plain relative path under the index's
    directory: no ``..``, no absolute name, no ``%`` (a URL would decode it), ``\\``,
    ``?``, ``#``, ``:`` or NUL. The same rule for local and remote indexes."""
    parts = name.split("/")
    if name.startswith("/") or ".." in parts:
        raise _bad(f"{where}: file {name!r} points outside the checkpoint directory {base}")
    bad = [c for c in _NOT_IN_FILE_NAMES if c in name]
    if bad or "" in parts or "." in parts:
        what = f"contains {bad[0]!r}" if bad else "has an empty or '.' path segment"
        raise _bad(f"{where}: file name {name!r} {what}; weight-map entries must be plain relative paths")


def _inside(directory: Path, relative: str, index: str) -> str:
    # A file may be a symlink anywhere: the HuggingFace cache keeps every file of a
    # snapshot as a symlink into ../../blobs, and that is fine. The directories on the way
    # to it may be links only within the checkpoint directory: a subdirectory linking out
    # would let an index read a whole tree it does not hold.
    _check_file_name(relative, str(directory), index)
    candidate = Path(os.path.normpath(os.path.join(directory, relative)))
    if not candidate.is_relative_to(os.path.normpath(directory)):
        raise _bad(f"{index}: file {relative!r} points outside the checkpoint directory {directory}")
    if "/" in relative:
        _refuse_linked_out(directory, relative, index)
    if not os.path.lexists(candidate):
        raise _bad(f"{index}: names file {relative!r}, which does not exist in {directory}")
    return os.fspath(directory / relative)


def _refuse_linked_out(directory: Path, relative: str, index: str) -> None:
    """Refuse a file whose directory (``a/b`` of ``a/b/x.safetensors``) resolves, through
    symbolic links, outside the checkpoint directory."""
    parent = relative.rsplit("/", 1)[0]
    root = os.path.realpath(directory)
    where = os.path.realpath(os.path.join(directory, parent))
    if os.path.commonpath([root, where]) != root:
        raise _bad(
            f"{index}: file {relative!r} is in {parent!r}, a directory that links outside the checkpoint "
            f"directory {directory} (to {where}); only a file itself may be a link (as in the HuggingFace cache)"
        )


def join_url(url: str, name: str, *, beside: bool = False) -> str:
    """``name`` inside directory ``url`` (``beside``: next to the object ``url``) by the
    URL's rules: the path joined, the query string (a presigned URL's) kept, the fragment dropped."""
    if not url.lower().startswith(("http://", "https://")):  # fsspec URLs are paths: an object key may hold a "?"
        base, query = url, ""
    else:
        base, _, query = url.partition("#")[0].partition("?")
    base = base.rsplit("/", 1)[0] if beside else base.rstrip("/")
    return f"{base}/{name}" + (f"?{query}" if query else "")


def _member_url(index_url: str, name: str) -> str:
    """File ``name`` of the index at ``index_url``, checked again after
    percent-decoding and normalising: still under the index's directory, same host."""
    base = join_url(index_url, "", beside=True)
    _check_file_name(name, base, index_url)
    url = join_url(index_url, name, beside=True)
    got, want = urlsplit(url), urlsplit(base)
    path = posixpath.normpath(unquote(got.path))
    if (got.scheme, got.netloc) != (want.scheme, want.netloc) or not path.startswith(unquote(want.path)):
        raise _bad(f"{index_url}: file {name!r} points outside the checkpoint directory {base}")
    return url


def file_names(count: int, prefix: str, taken: set[str], save_id: str) -> list[str]:
    """The files' names: HuggingFace's when none is taken, else with the save id."""
    stems = [prefix] if count == 1 else [f"{prefix}-{i:05d}-of-{count:05d}" for i in range(1, count + 1)]
    plain = [f"{s}.safetensors" for s in stems]
    return plain if taken.isdisjoint(plain) else [f"{s}.{save_id}.safetensors" for s in stems]


def index_record(weight_map: Mapping[str, str], total_size: int, save_id: str) -> bytes:
    """The bytes of the index naming ``weight_map``'s files, of save ``save_id``."""
    record = {
        "metadata": {"total_size": total_size, SAVE_ID_KEY: save_id},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return json.dumps(record, indent=2).encode() + b"\n"


def is_index(raw: bytes) -> bool:
    """Whether the JSON text ``raw`` is an object with a ``weight_map`` (its content
    says it is an index; :func:`parse_index` then validates it)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # a broken index: parse_index says what is wrong with it
        return b'"weight_map"' in raw
    return isinstance(obj, dict) and "weight_map" in obj


def parse_index(raw: bytes, where: str) -> tuple[dict[str, str], dict[str, str]]:
    """Validate an index's bytes: ``(weight_map, metadata)``. The one validator of
    local and remote indexes: at most :data:`MAX_INDEX_BYTES`, JSON without a
    repeated key at any level, a ``weight_map`` of tensor name -> file name.

    Raises:
        HeaderError: ``check="index"``, naming ``where`` and the failed check.
    """
    if len(raw) > MAX_INDEX_BYTES:
        raise _bad(f"{where}: index of {len(raw)} bytes exceeds the cap of {MAX_INDEX_BYTES} bytes")
    obj = _layout.load_record(raw, where, "index", "index")
    meta = _metadata(obj.get("metadata") if isinstance(obj, dict) else None, where)
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _bad(f"{where}: expected an object with a 'weight_map' of tensor name -> file name")
    return weight_map, meta


def _metadata(meta: Any, where: str) -> dict[str, str]:
    """The index's ``metadata`` as strings. Like transformers (which indexes into it), a
    ``metadata`` that is not an object is refused; ``total_size``, when given, must be a
    non-negative integer (or its decimal digits). Its value is not checked against the files: transformers never
    reads it for loading, and tools count it differently (shared tensors, padding).

    Raises:
        HeaderError: ``check="index"``, naming ``where``, the field, what was expected and found.
    """
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise _bad(f"{where}: 'metadata' must be an object, found {type(meta).__name__} {short_repr(meta, 60)}")
    size = meta.get("total_size", 0)
    if not _whole_size(size):
        raise _bad(
            f"{where}: 'metadata'.'total_size' must be a non-negative integer (bytes), found {short_repr(size, 60)}"
        )
    return {str(k): str(v) for k, v in meta.items()}


def _whole_size(size: Any) -> bool:
    """A byte count some tool may have written: an int, a whole float (``1234.0``) or a
    string of decimal digits (``"1234"``), not negative."""
    if type(size) is str:
        return size.isascii() and size.isdigit()
    return (type(size) is int or (type(size) is float and size.is_integer())) and size >= 0


def _index_tensors(weight_map: Mapping[str, str], files: Sequence[FileHeader], file_of: Mapping[str, str], where: str):
    """Every tensor of ``files``, checked against the weight map both ways."""
    tensors = _layout.merge(files, where)
    for tensor, fname in weight_map.items():
        info = tensors.get(tensor)
        if info is None:
            raise _bad(f"{where}: names tensor {tensor!r} in {fname}, which does not hold it")
        if info.file != file_of[fname]:
            raise _bad(f"{where}: places tensor {tensor!r} in {fname}, but it is in {info.file}")
    extra = sorted(set(tensors) - set(weight_map))
    if extra:
        raise _bad(f"{where}: files hold tensors the index does not name: {extra[:5]}")
    return tensors


def _remote_member_header(name: str, member: str, stats: Any, index: str):
    try:
        return remote_file_header(member, stats)
    except FileNotFoundError:  # as for a local index: the index is what is wrong
        raise _bad(f"{index}: names file {name!r}, which does not exist at {member}") from None


def _remote_member_headers(file_of: Mapping[str, str], stats: Any, index: str) -> list:
    """Each member's header, probed at once (a round trip each: on a remote store they
    would add up), at most :data:`HEADER_PROBES` in flight; a failure raises as the first
    failing member in order would."""
    items = list(file_of.items())
    if len(items) <= 1:
        return [_remote_member_header(name, f, stats, index) for name, f in items]
    with ThreadPoolExecutor(min(len(items), HEADER_PROBES), thread_name_prefix="nnx_save-header") as pool:
        return list(pool.map(lambda item: _remote_member_header(item[0], item[1], stats, index), items))


def read_remote(url: str, stats: Any, reader: Any = None, raw: bytes = b"") -> Header:
    """The header of the index at ``url`` (``reader`` open there, its first bytes
    ``raw`` probed already) and of every file it names."""
    if reader is None:
        reader = _storage.open_remote(url, stats)
        raw = reader.probe()
    if reader.size > MAX_INDEX_BYTES:
        raise _bad(f"{url}: index of {reader.size} bytes exceeds the cap of {MAX_INDEX_BYTES} bytes")
    if len(raw) < reader.size:
        raw += reader.read(len(raw), reader.size - len(raw))
    weight_map, meta = parse_index(raw, url)
    file_of = {n: _member_url(url, n) for n in sorted(set(weight_map.values()))}
    pairs = _remote_member_headers(file_of, stats, url)
    files = tuple(fh for fh, _ in pairs)
    _layout.check_one_version(url, meta, files)
    tensors = _index_tensors(weight_map, files, file_of, url)
    placement = RemoteFiles(stats, {fh.file: ident for fh, ident in pairs})
    return Header(tensors, {**files[0].metadata, **meta} if files else meta, files, "index", placement)


class IndexLayout:
    """A directory with a ``model.safetensors.index.json``, or that file named itself."""

    name = "index"
    record = INDEX_NAME

    def claims(self, location: Location, names: Collection[str]) -> bool:
        """An index file among ``names``; on a filesystem a regular file (a FIFO or a
        directory under its name claims nothing: reading it could block, or fail)."""
        local = location.directory
        return INDEX_NAME in names and (local is None or (local / INDEX_NAME).is_file())

    def read(self, path: Path, index: Path | None = None) -> Header:
        index = path / INDEX_NAME if index is None else index
        return _layout.one_version(index, lambda: self._read(index.parent, index))

    def read_named(self, index: Path, not_file: NotSafetensorsError) -> Header:
        """The index file ``index`` named itself; ``not_file`` if its JSON is no index."""
        if not is_index(_files.read_capped(os.fspath(index), "index", MAX_INDEX_BYTES, _bad)):
            raise NotSafetensorsError(f"{not_file}, nor an index (no 'weight_map' object)", "json")
        return self.read(index.parent, index)

    def _read(self, path: Path, index: Path) -> Header:
        placement = LocalFiles()  # holds nothing until the files' headers are valid
        raw = _files.read_capped(os.fspath(index), "index", MAX_INDEX_BYTES, _bad)
        weight_map, meta = parse_index(raw, str(index))
        _layout.single_beside(path, INDEX_NAME, set(weight_map.values()))
        file_of = {n: _inside(path, n, str(index)) for n in sorted(set(weight_map.values()))}
        with pinned_headers(list(file_of.values()), placement.pinned) as files:  # kept once all of this holds
            _layout.check_one_version(str(index), meta, files)
            tensors = _index_tensors(weight_map, files, file_of, str(index))
        return Header(tensors, {**files[0].metadata, **meta} if files else meta, files, "index", placement)

    def __init__(self, max_shard_size: int | str | None = None) -> None:
        self.max_shard_size = None if max_shard_size is None else parse_size(max_shard_size)

    def write(
        self, path: Where, entries: Sequence[Entry], metadata: Metadata, options: SaveOptions
    ) -> Committed | None:
        """Write ``entries`` as files of at most ``max_shard_size`` bytes and their index
        in directory ``path`` (a path or an fsspec URL); from several processes each
        file is written by all of them together and the primary commits the index.

        Raises:
            SaveError: a file or the index could not be written; the previous
                checkpoint there is intact and this save's files are removed.
            OptionError: ``path`` names a ``.safetensors`` file.
        """
        self.check_target(path)
        return write_sharded(path, entries, metadata, self.max_shard_size or 0, options.progress)

    def check_target(self, path: str | os.PathLike) -> None:
        """Refuse a ``.safetensors`` name: this layout writes a directory.

        Raises:
            OptionError: naming ``path``.
        """
        if str(path).rstrip("/").endswith(".safetensors"):
            raise OptionError(
                f"{path}: max_shard_size writes a directory (model-0000i-of-0000n.safetensors and {INDEX_NAME}); "
                "give a directory path, or no max_shard_size for one file",
                "max_shard_size",
            )

    def retire(self, directory: Location, keep: Collection[str]) -> None:
        files = _owned(directory, directory.names()) - set(keep)
        directory.remove(INDEX_NAME)
        for name in sorted(files):
            directory.remove(name)


def shard_groups(entries: Sequence[Entry], max_shard_size: int | str) -> tuple[list[list[Entry]], int]:
    """Pack entries in order into groups of at most ``max_shard_size`` bytes (a
    tensor larger than the limit gets a file of its own, as transformers does); and
    the bytes of all."""
    limit = parse_size(max_shard_size)
    groups: list[list[Entry]] = [[]]
    size = total = 0
    for e in entries:
        n = _dtypes.nbytes_for(_dtypes.DTYPES[e.code], math.prod(e.shape))
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
        total += n
    return groups, total


def _owned(target: Location, listing: Collection[str]) -> set[str]:
    """The files of ``target`` (which holds ``listing``) provably of the committed
    version or of interrupted saves (:func:`~nnx_save.layouts._layout.owned`)."""
    weight_map: Mapping[str, str] = {}
    meta: Mapping[str, str] = {}
    if INDEX_NAME in listing:
        with contextlib.suppress(OSError, HeaderError):
            weight_map, meta = parse_index(target.read_bytes(INDEX_NAME, "index", MAX_INDEX_BYTES, _bad), INDEX_NAME)
    record_id = meta.get(SAVE_ID_KEY)
    read = lambda name: _layout.save_id_in(lambda: member_header(target, name), SAVE_ID_KEY)  # noqa: E731
    return _layout.owned(record_id, set(weight_map.values()), listing, OURS, read)


def _commit_index(target: Location, staged: Staged, index: bytes) -> None:
    """The commit: the staged data files moved into place, then the index replaced atomically."""
    target.commit(staged, INDEX_NAME, index)


def write_sharded(
    directory: str | os.PathLike,
    entries: Sequence[Entry],
    metadata: Mapping[str, str] | None,
    max_shard_size: int,
    progress: bool | None = None,
) -> Committed | None:
    """Write ``entries`` as a HuggingFace multi-file checkpoint in ``directory`` (a
    path or an fsspec URL); what the primary committed (the index: a URL stays a ``str``).
    ``progress`` as in :func:`nnx_save._progress.bar`, per file."""
    groups, total = shard_groups(order_entries(entries), max_shard_size)
    target = _storage.locate(directory)
    target.prepare()
    listing = target.names()  # the primary's plan reads it: this save holds the directory's lock
    sync = Sync.open(Path(str(directory)), "multi-file save", "the previous checkpoint there, if any, is intact")

    def plan() -> dict[str, Any]:
        save_id, previous = _layout.new_save_id(), _owned(target, listing)
        names = file_names(len(groups), "model", previous | set(listing), save_id)
        return {"id": save_id, "previous": sorted(previous), "names": names}

    agreed = sync.on_primary("plan", plan)
    names, meta = agreed["names"], {**(metadata or {}), SAVE_ID_KEY: agreed["id"]}
    weight_map = {e.key: name for name, group in zip(names, groups, strict=True) for e in group}
    index = index_record(weight_map, total, agreed["id"])
    written: list[str] = []
    staged: Staged = []  # complete data files, committed together before the index
    try:
        _write_files(target, list(zip(names, groups, strict=True)), meta, sync.n, staged, written, progress)
        sync.on_primary("index", lambda: _commit_index(target, staged, index))
    except BaseException:
        target.discard(staged)
        for name in written if sync.pid == 0 else ():
            target.remove(name)
        raise
    if sync.pid != 0:
        return None
    # After the commit: the files provably of the version replaced or of interrupted saves,
    # and temporary files of this layout's names whose process is dead.
    target.sweep(lambda name: OURS.fullmatch(name) is not None)
    for name in sorted(set(agreed["previous"]) - set(names)):
        target.remove(name)
    return Committed(target.member(INDEX_NAME), target.members(names))


def _write_files(
    target: Location, files: Shards, meta: Mapping[str, str], n: int, staged: Staged, written: list[str], progress
) -> None:
    """This process's part of the data files: all of them, or with ``n`` processes its
    shards of each file's tensors (:func:`~nnx_save.save._collective.write_collective`)."""
    if n == 1:
        from ..save import _destination  # the writers: a read never loads them

        _destination.write_at(target, files, meta, staged=staged, progress=progress, written=written)
        return
    from ..save._collective import write_collective

    for name, group in files:
        write_collective(target.member(name), group, meta)
        written.append(name)
