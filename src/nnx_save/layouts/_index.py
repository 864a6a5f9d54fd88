"""The HuggingFace index layout: ``model.safetensors.index.json`` and the files it
names, local or at a URL (written by :mod:`nnx_save.layouts._index_save`). The index
(:func:`parse_index`), every file's header, and the index against the files both
ways are validated before any tensor byte is read.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import IndexFileError
from ..format._header import FileHeader
from ..io import _files, _remote
from ..load._source import Header, LocalFiles, RemoteFiles
from . import _versions
from ._file import read_file_header, remote_file_header
from ._layout import load_record, merge
from ._versions import SAVE_ID_KEY

__all__ = ["INDEX_NAME", "MAX_INDEX_BYTES", "IndexLayout", "file_names", "index_record", "parse_index", "read_remote"]

INDEX_NAME = "model.safetensors.index.json"
# DeepSeek-scale indexes (tens of thousands of tensors) are a few MiB.
MAX_INDEX_BYTES = 64 << 20
_NOT_IN_FILE_NAMES = ("%", "\\", "?", "#", "\x00", ":")


def _check_file_name(name: str, base: str, where: str) -> None:
    """A weight-map file name must be a plain relative path under the index's
    directory: no ``..``, no absolute name, no ``%`` (a URL would decode it), ``\\``,
    ``?``, ``#``, ``:`` or NUL. The same rule for local and remote indexes."""
    parts = name.split("/")
    if name.startswith("/") or ".." in parts:
        raise IndexFileError(f"{where}: file {name!r} points outside the checkpoint directory {base}")
    bad = [c for c in _NOT_IN_FILE_NAMES if c in name]
    if bad or "" in parts or "." in parts:
        what = f"contains {bad[0]!r}" if bad else "has an empty or '.' path segment"
        raise IndexFileError(f"{where}: file name {name!r} {what}; weight-map entries must be plain relative paths")


def _inside(directory: Path, relative: str, index: str) -> str:
    # Judged on the name, not on where symlinks lead: the HuggingFace cache keeps
    # every file of a snapshot as a symlink into ../../blobs, and that is fine.
    # What an index must not do is name a file outside its directory.
    _check_file_name(relative, str(directory), index)
    candidate = Path(os.path.normpath(os.path.join(directory, relative)))
    if not candidate.is_relative_to(os.path.normpath(directory)):
        raise IndexFileError(f"{index}: file {relative!r} points outside the checkpoint directory {directory}")
    if not os.path.lexists(candidate):
        raise IndexFileError(f"{index}: names file {relative!r}, which does not exist in {directory}")
    return os.fspath(directory / relative)


def _member_url(base: str, name: str, index: str) -> str:
    """``base/name``, checked again after percent-decoding and normalising: still
    under ``base``, on the same host."""
    _check_file_name(name, base + "/", index)
    url = f"{base}/{name}"
    got, want = urlsplit(url), urlsplit(base + "/")
    path = posixpath.normpath(unquote(got.path))
    if (got.scheme, got.netloc) != (want.scheme, want.netloc) or not path.startswith(unquote(want.path)):
        raise IndexFileError(f"{index}: file {name!r} points outside the checkpoint directory {base}/")
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


def parse_index(raw: bytes, where: str) -> tuple[dict[str, str], dict[str, str]]:
    """Validate an index's bytes: ``(weight_map, metadata)``. The one validator of
    local and remote indexes: at most :data:`MAX_INDEX_BYTES`, JSON without a
    repeated key at any level, a ``weight_map`` of tensor name -> file name.

    Raises:
        IndexFileError: naming ``where`` and the failed check.
    """
    if len(raw) > MAX_INDEX_BYTES:
        raise IndexFileError(f"{where}: index of {len(raw)} bytes exceeds the cap of {MAX_INDEX_BYTES} bytes")
    obj = load_record(raw, where, "index", IndexFileError)
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise IndexFileError(f"{where}: expected an object with a 'weight_map' of tensor name -> file name")
    return weight_map, meta


def _index_tensors(weight_map: Mapping[str, str], files: Sequence[FileHeader], file_of: Mapping[str, str], where: str):
    """Every tensor of ``files``, checked against the weight map both ways."""
    tensors = merge(files, where)
    for tensor, fname in weight_map.items():
        info = tensors.get(tensor)
        if info is None:
            raise IndexFileError(f"{where}: names tensor {tensor!r} in {fname}, which does not hold it")
        if info.file != file_of[fname]:
            raise IndexFileError(f"{where}: places tensor {tensor!r} in {fname}, but it is in {info.file}")
    extra = sorted(set(tensors) - set(weight_map))
    if extra:
        raise IndexFileError(f"{where}: files hold tensors the index does not name: {extra[:5]}")
    return tensors


def _remote_member_header(name: str, member: str, stats: Any, index: str):
    try:
        return remote_file_header(member, stats)
    except FileNotFoundError:  # as for a local index: the index is what is wrong
        raise IndexFileError(f"{index}: names file {name!r}, which does not exist at {member}") from None


def read_remote(url: str, stats: Any) -> Header:
    """The header of the index at ``url`` and of every file it names."""
    base = url.rsplit("/", 1)[0]
    reader = _remote.open_remote(url, stats)
    raw = reader.probe()
    if reader.size > MAX_INDEX_BYTES:
        raise IndexFileError(f"{url}: index of {reader.size} bytes exceeds the cap of {MAX_INDEX_BYTES} bytes")
    if len(raw) < reader.size:
        raw += reader.read(len(raw), reader.size - len(raw))
    weight_map, meta = parse_index(raw, url)
    file_of = {n: _member_url(base, n, url) for n in sorted(set(weight_map.values()))}
    pairs = [_remote_member_header(name, f, stats, url) for name, f in file_of.items()]
    files = tuple(fh for fh, _ in pairs)
    _versions.check_one_version(url, meta, files)
    tensors = _index_tensors(weight_map, files, file_of, url)
    placement = RemoteFiles(stats, {fh.file: ident for fh, ident in pairs})
    return Header(tensors, {**files[0].metadata, **meta} if files else meta, files, "index", placement)


class IndexLayout:
    """A directory with a ``model.safetensors.index.json``."""

    name = "index"

    def claims(self, path: Path) -> bool:
        return (path / INDEX_NAME).is_file()

    def read(self, path: Path) -> Header:
        return _versions.one_version(path / INDEX_NAME, lambda: self._read(path))

    def _read(self, path: Path) -> Header:
        index = path / INDEX_NAME
        raw = _files.read_capped(os.fspath(index), "index", MAX_INDEX_BYTES, IndexFileError)
        weight_map, meta = parse_index(raw, str(index))
        file_of = {n: _inside(path, n, str(index)) for n in sorted(set(weight_map.values()))}
        placement = LocalFiles()
        files = tuple(read_file_header(f, placement.pinned) for f in file_of.values())
        _versions.check_one_version(str(index), meta, files)
        tensors = _index_tensors(weight_map, files, file_of, str(index))
        return Header(tensors, {**files[0].metadata, **meta} if files else meta, files, "index", placement)
