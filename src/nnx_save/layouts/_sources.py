"""Where bytes come from: one view of "tensors at (file, offset)" for every source.

A source is one ``.safetensors`` file, a directory with a HuggingFace
``model.safetensors.index.json``, a directory of ``*.safetensors`` files, or an
explicit list of files. :func:`read_header` validates every file's header (each is
read with two positioned reads: the 8-byte prefix, then the JSON) and checks the
index against them before any tensor byte is read.

A :class:`Header` of local files keeps each file open (one descriptor per file, up
to 256, closed when the Header is garbage collected), and loads from it read
through those descriptors: when a writer replaces a file (``save_file`` renames a new one over
it) between the header read and the data reads, the load still reads the file
whose header it validated, never the header of one version with the bytes of
another.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import stat
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import (
    DuplicateKeyError,
    HeaderError,
    HeaderTooSmallError,
    IndexFileError,
    NnxSaveError,
    SourceError,
    TruncatedFileError,
)
from ..format import _formats
from ..format._header import FileHeader, TensorInfo, header_size, parse_header, unique_pairs
from ..io import _remote
from ..load._execute import LocalReader, Reader
from . import _pieces, _versions
from ._pieces import Piece

__all__ = ["INDEX_NAME", "Header", "pread_exact", "read_file_header", "read_header"]

INDEX_NAME = "model.safetensors.index.json"
# DeepSeek-scale indexes (tens of thousands of tensors) are a few MiB.
MAX_INDEX_BYTES = 64 << 20
_NOT_IN_FILE_NAMES = ("%", "\\", "?", "#", "\x00", ":")
PathLike = str | os.PathLike


@dataclass(frozen=True)
class Header:
    """The validated headers of a checkpoint (one file or several).

    Attributes:
        tensors: every tensor by name, each knowing its file and byte range.
        metadata: the ``__metadata__`` of a single file; for several files, the
            index's ``metadata`` merged over the first file's.
        files: each file's own header, in read order.
        kind: ``"file"``, ``"index"``, ``"directory"``, ``"list"`` or ``"pod"``.
        pieces: for a pod directory, each tensor's pieces in its shard files (the
            ``file`` of a pod tensor is its manifest); empty for the other layouts,
            whose tensors are one whole piece each (see :meth:`pieces_of`).
        missing_files: pod shard files the manifest names that are not present.
        num_processes: the processes that wrote a pod directory.
    """

    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str] = field(default_factory=dict)
    files: tuple[FileHeader, ...] = ()
    kind: str = "file"
    remote: Any = None  # _remote.RemoteStats shared by this checkpoint's remote readers
    identity: Mapping[str, tuple[int, str | None]] = field(default_factory=dict)  # url -> (size, ETag)
    pinned: Any = field(default=None, repr=False, compare=False)  # _Pinned: local file -> open descriptor
    pieces: Mapping[str, tuple[Piece, ...]] = field(default_factory=dict)
    missing_files: tuple[str, ...] = ()
    num_processes: int = 1

    def pieces_of(self, key: str) -> tuple[Piece, ...]:
        """Where tensor ``key``'s bytes are: pieces at (file, byte range, box)."""
        found = self.pieces.get(key)
        if found is not None:
            return found
        info = self.tensors[key]
        return (Piece(_pieces.whole(info.shape), info),)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data over all files."""
        return sum(t.nbytes for t in self.tensors.values())


def pread_exact(fd: int, size: int, offset: int, file: str) -> bytes:
    """Read exactly ``size`` bytes at ``offset``.

    Raises:
        TruncatedFileError: the file ends first; names the file and both offsets.
    """
    chunks, got = [], 0
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            raise TruncatedFileError(
                f"{file}: expected {size} bytes at byte {offset}, the file ends at byte {offset + got}",
                file,
                offset + got,
            )
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"not a regular file (mode {mode:o})"


def open_regular(name: str) -> int:
    """Open ``name`` for reading, refusing anything but a regular file.

    Opened without blocking (a FIFO would otherwise wait for a writer forever), then
    checked with ``fstat`` on the descriptor itself, then set back to blocking.

    Raises:
        SourceError: a directory, FIFO, device or socket, or an unreadable path.
        FileNotFoundError: no such file.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SourceError(f"{name}: cannot open the file ({e.strerror})", name) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SourceError(f"{name}: is {_kind(mode)}, not a regular file; checkpoint files must be regular files", name)
    os.set_blocking(fd, True)
    return fd


def _read_prefix_and_header(fd: int, size: int, name: str) -> FileHeader:
    # The size is checked before any read: /proc files report 0 and some (/proc/self/mem) fail to read.
    prefix = os.pread(fd, 8, 0) if size >= 8 else b""
    _formats.refuse_file(name, prefix, lambda n, at: os.pread(fd, n, at))  # torch zip / pickle: say so
    n = header_size(prefix, size, file=name)
    try:
        raw = pread_exact(fd, n, 8, name)
    except TruncatedFileError as e:  # shorter than its own header: a header error, not a data one
        raise HeaderTooSmallError(str(e)) from None
    return parse_header(raw, size, file=name)


def read_file_header(path: PathLike, pinned: _Pinned | None = None) -> FileHeader:
    """Read and validate one file's header (two positioned reads). With ``pinned``,
    the file stays open there (see :class:`_Pinned`)."""
    name = os.fspath(path)
    fd = open_regular(name)
    try:
        header = _read_prefix_and_header(fd, os.fstat(fd).st_size, name)
    except OSError as e:
        os.close(fd)
        raise SourceError(f"{name}: reading the header failed ({e.strerror or e})", name) from None
    except BaseException:
        os.close(fd)
        raise
    if pinned is None:
        os.close(fd)
    else:
        pinned.keep(name, fd)
    return header


def _max_pinned() -> int:
    """Files one Header keeps open: a quarter of the descriptor limit, at most 256."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    return 256 if soft == resource.RLIM_INFINITY else max(0, min(256, soft // 4))


class _Pinned:
    """Open descriptors of the files whose headers a :class:`Header` holds, closed
    when the Header (its only owner) is garbage collected. Beyond
    :func:`_max_pinned` files (a directory of thousands of files), the rest are
    reopened by name when read, as if not pinned."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.limit = _max_pinned()
        self._finalizer = weakref.finalize(self, _close_all, self.fds)

    def keep(self, name: str, fd: int) -> None:
        if name in self.fds or len(self.fds) >= self.limit:  # named twice, or too many
            os.close(fd)
        else:
            self.fds[name] = fd


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _merge(files: Sequence[FileHeader], where: str) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for fh in files:
        for name, info in fh.tensors.items():
            if name in tensors:
                raise IndexFileError(
                    f"{where}: tensor {name!r} appears in two files: {tensors[name].file} and {info.file}"
                )
            tensors[name] = info
    return tensors


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


def parse_index(raw: bytes, where: str) -> tuple[dict[str, str], dict[str, str]]:
    """Validate an index's bytes: ``(weight_map, metadata)``. The one validator of
    local and remote indexes: at most :data:`MAX_INDEX_BYTES`, JSON without a
    repeated key at any level, a ``weight_map`` of tensor name -> file name.

    Raises:
        IndexFileError: naming ``where`` and the failed check.
    """
    if len(raw) > MAX_INDEX_BYTES:
        raise IndexFileError(f"{where}: index of {len(raw)} bytes exceeds the cap of {MAX_INDEX_BYTES} bytes")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs)
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
    except DuplicateKeyError as e:  # a tensor listed twice: json.loads would keep the last in silence
        raise IndexFileError(f"{where}: {e} in the index JSON") from None
    except RecursionError:
        raise IndexFileError(f"{where}: not a valid JSON index: nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise IndexFileError(f"{where}: not a valid JSON index: {e}") from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise IndexFileError(f"{where}: expected an object with a 'weight_map' of tensor name -> file name")
    return weight_map, meta


def _read_json_file(path: Path, what: str, error: type[NnxSaveError]) -> bytes:
    """The bytes of an index or manifest: a regular file (never a FIFO or device) of
    at most :data:`MAX_INDEX_BYTES`, sized before it is read."""
    name = os.fspath(path)
    fd = open_regular(name)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_INDEX_BYTES:
            raise error(f"{name}: {what} of {size} bytes exceeds the cap of {MAX_INDEX_BYTES} bytes")
        return pread_exact(fd, size, 0, name)
    finally:
        os.close(fd)


def _index_tensors(weight_map: Mapping[str, str], files: Sequence[FileHeader], file_of: Mapping[str, str], where: str):
    """Every tensor of ``files``, checked against the weight map both ways."""
    tensors = _merge(files, where)
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


def _index_header(directory: Path) -> Header:
    return _versions.one_version(directory / INDEX_NAME, lambda: _read_index(directory, directory / INDEX_NAME))


def _read_index(directory: Path, index: Path) -> Header:
    weight_map, meta = parse_index(_read_json_file(index, "index", IndexFileError), str(index))
    file_of = {n: _inside(directory, n, str(index)) for n in sorted(set(weight_map.values()))}
    pinned = _Pinned()
    files = tuple(read_file_header(f, pinned) for f in file_of.values())
    _versions.check_one_version(str(index), meta, files)
    tensors = _index_tensors(weight_map, files, file_of, str(index))
    return Header(tensors, {**files[0].metadata, **meta} if files else meta, files, "index", pinned=pinned)


def _many(paths: Sequence[Path], kind: str, where: str) -> Header:
    pinned = _Pinned()
    files = tuple(read_file_header(p, pinned) for p in paths)
    meta = dict(files[0].metadata) if files else {}
    try:
        tensors = _merge(files, where)
    except IndexFileError as e:
        if kind != "directory":
            raise
        raise IndexFileError(
            f"{e}. {where} has no {INDEX_NAME}, so all its *.safetensors files are read as the parts of one "
            "checkpoint; files holding the same tensor names are separate checkpoints (copies, or different "
            f"steps): load one file, move the others out, or write the {INDEX_NAME} of a sharded checkpoint"
        ) from None
    return Header(tensors, meta, files, kind, pinned=pinned)


def read_header(source: PathLike | Sequence[PathLike] | Header) -> Header:
    """Read and validate the header(s) of a checkpoint, reading no tensor data.

    Args:
        source: a ``.safetensors`` file, a directory (with or without
            ``model.safetensors.index.json``) or a list of files.

    Returns:
        A :class:`Header`: every tensor's dtype, shape, file and byte range.

    Raises:
        HeaderError: a malformed file or index (the subclass names the check).
        FileNotFoundError: the source does not exist.

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> nnx_save.save_file({"w": np.zeros((2, 3), np.float32)}, path)
        >>> nnx_save.read_header(path)["w"].shape
        (2, 3)
    """
    if isinstance(source, Header):
        return source
    if isinstance(source, str) and _remote.is_url(source):
        return _remote_header(source)
    if isinstance(source, (list, tuple)):
        return _many([Path(p) for p in source], "list", "file list")
    path = Path(source)  # type: ignore[arg-type]  # a list or tuple returned above; mypy cannot narrow str from Sequence
    if path.is_dir():
        if os.path.lexists(path / _pieces.MANIFEST):  # a pod directory (nnx_save.save_pod); its kind is checked on open
            return _pod_header(path)
        if (path / INDEX_NAME).is_file():
            return _index_header(path)
        _formats.refuse_directory(path)  # Orbax / TensorStore: say what it is and what to run
        found = sorted(path.glob("*.safetensors"))
        if not found:
            raise HeaderError(f"{path}: directory holds neither {INDEX_NAME} nor any *.safetensors file")
        return _many(found, "directory", str(path))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    pinned = _Pinned()
    fh = read_file_header(path, pinned)
    return Header(dict(fh.tensors), dict(fh.metadata), (fh,), "file", pinned=pinned)


# --------------------------------------------------------------------------- remote


def _remote_file_header(url: str, stats: Any) -> tuple[FileHeader, tuple[int, str | None]]:
    """A remote file's header in at most two requests: a speculative first range,
    then the rest of the header if it is larger."""
    reader = _remote.open_remote(url, stats)
    head = reader.probe()
    _formats.refuse_file(url, head[:8], lambda n, at: head[at : at + n])
    n = header_size(head[:8], reader.size, file=url)
    raw = head[8 : 8 + n]
    if len(raw) < n:
        raw += reader.read(len(head), 8 + n - len(head))
    return parse_header(raw, reader.size, file=url), reader.identity


def _remote_member_header(name: str, member: str, stats: Any, index: str):
    try:
        return _remote_file_header(member, stats)
    except FileNotFoundError:  # as for a local index: the index is what is wrong
        raise IndexFileError(f"{index}: names file {name!r}, which does not exist at {member}") from None


def _remote_index(url: str, stats: Any) -> Header:
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
    return Header(
        tensors,
        {**files[0].metadata, **meta} if files else meta,
        files,
        "index",
        stats,
        {fh.file: ident for fh, ident in pairs},
    )


def _remote_header(url: str) -> Header:
    stats = _remote.RemoteStats()
    if url.endswith(".json"):
        return _remote_index(url, stats)
    if not url.endswith(".safetensors"):
        try:
            return _remote_index(url.rstrip("/") + "/" + INDEX_NAME, stats)
        except FileNotFoundError:
            url = url.rstrip("/") + "/model.safetensors"
    fh, ident = _remote_file_header(url, stats)
    return Header(dict(fh.tensors), dict(fh.metadata), (fh,), "file", stats, {url: ident})


def _pod_header(directory: Path) -> Header:
    """A pod directory: the validated manifest, and the header of every shard file
    present (a shard file that is not there is only an error if a load needs it)."""
    where = directory / _pieces.MANIFEST
    manifest = _pieces.parse_manifest(_read_json_file(where, "manifest", HeaderError), where)
    pinned = _Pinned()
    files = {f: read_file_header(directory / f, pinned) if (directory / f).is_file() else None for f in manifest.files}
    tensors, pieces = _pieces.pod_tensors(manifest, files)
    return Header(
        tensors,
        dict(manifest.metadata),
        tuple(fh for _, fh in sorted(files.items()) if fh is not None),
        "pod",
        pinned=pinned,
        pieces=pieces,
        missing_files=tuple(sorted(f for f, fh in files.items() if fh is None)),
        num_processes=manifest.num_processes,
    )


def reader_factory(header: Header) -> Callable[[str], Reader]:
    """``open_reader(file)`` for the engine: local files, or remote readers pinned to
    the size and version seen when the header was read."""

    def open_reader(file: str) -> Reader:
        if header.remote is not None and file in header.identity:
            return _remote.open_remote(file, header.remote, header.identity[file])
        pinned = header.pinned.fds.get(file) if header.pinned is not None else None
        return LocalReader(file, pinned)

    return open_reader
