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
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _formats, _remote
from ._errors import DuplicateKeyError, HeaderError, HeaderTooSmallError, IndexFileError, TruncatedFileError
from ._header import FileHeader, TensorInfo, header_size, parse_header, unique_pairs

__all__ = ["INDEX_NAME", "Header", "pread_exact", "read_file_header", "read_header"]

INDEX_NAME = "model.safetensors.index.json"
PathLike = str | os.PathLike


@dataclass(frozen=True)
class Header:
    """The validated headers of a checkpoint (one file or several).

    Attributes:
        tensors: every tensor by name, each knowing its file and byte range.
        metadata: the ``__metadata__`` of a single file; for several files, the
            index's ``metadata`` merged over the first file's.
        files: each file's own header, in read order.
        kind: ``"file"``, ``"index"``, ``"directory"`` or ``"list"``.
    """

    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str] = field(default_factory=dict)
    files: tuple[FileHeader, ...] = ()
    kind: str = "file"
    remote: Any = None  # _remote.RemoteStats shared by this checkpoint's remote readers
    identity: Mapping[str, tuple[int, str | None]] = field(default_factory=dict)  # url -> (size, ETag)
    pinned: Any = field(default=None, repr=False, compare=False)  # _Pinned: local file -> open descriptor

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


def read_file_header(path: PathLike, pinned: _Pinned | None = None) -> FileHeader:
    """Read and validate one file's header (two positioned reads). With ``pinned``,
    the file stays open there (see :class:`_Pinned`)."""
    name = os.fspath(path)
    fd = os.open(name, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        _formats.refuse_file(name, prefix, lambda n, at: os.pread(fd, n, at))  # torch zip / pickle: say so
        n = header_size(prefix, size, file=name)
        try:
            raw = pread_exact(fd, n, 8, name)
        except TruncatedFileError as e:  # shorter than its own header: a header error, not a data one
            raise HeaderTooSmallError(str(e)) from None
        header = parse_header(raw, size, file=name)
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


def _inside(directory: Path, relative: str, index: str) -> Path:
    # Judged on the name, not on where symlinks lead: the HuggingFace cache keeps
    # every file of a snapshot as a symlink into ../../blobs, and that is fine.
    # What an index must not do is name a file outside its directory.
    candidate = Path(os.path.normpath(os.path.join(directory, relative)))
    if Path(relative).is_absolute() or not candidate.is_relative_to(os.path.normpath(directory)):
        raise IndexFileError(f"{index}: file {relative!r} points outside the checkpoint directory {directory}")
    if not candidate.is_file():
        raise IndexFileError(f"{index}: names file {relative!r}, which does not exist in {directory}")
    return directory / relative


def _read_index(index: Path) -> tuple[dict[str, str], dict[str, str]]:
    try:
        obj = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=unique_pairs)
    except DuplicateKeyError as e:  # a tensor listed twice
        raise IndexFileError(f"{index}: {e} in the index JSON") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise IndexFileError(f"{index}: not a valid JSON index: {e}") from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise IndexFileError(f"{index}: expected an object with a 'weight_map' of tensor name -> file name")
    meta = obj.get("metadata") or {}
    return weight_map, {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def _index_header(directory: Path) -> Header:
    index = directory / INDEX_NAME
    weight_map, meta = _read_index(index)
    names = sorted(set(weight_map.values()))
    pinned = _Pinned()
    files = tuple(read_file_header(_inside(directory, n, str(index)), pinned) for n in names)
    tensors = _merge(files, str(index))
    for tensor, fname in weight_map.items():
        info = tensors.get(tensor)
        if info is None:
            raise IndexFileError(f"{index}: names tensor {tensor!r} in {fname}, which does not hold it")
        if Path(info.file).name != Path(fname).name:
            raise IndexFileError(f"{index}: places tensor {tensor!r} in {fname}, but it is in {info.file}")
    extra = sorted(set(tensors) - set(weight_map))
    if extra:
        raise IndexFileError(f"{index}: files hold tensors the index does not name: {extra[:5]}")
    return Header(tensors, {**files[0].metadata, **meta} if files else meta, files, "index", pinned=pinned)


def _many(paths: Sequence[Path], kind: str, where: str) -> Header:
    pinned = _Pinned()
    files = tuple(read_file_header(p, pinned) for p in paths)
    meta = dict(files[0].metadata) if files else {}
    return Header(_merge(files, where), meta, files, kind, pinned=pinned)


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
        if (path / "manifest.json").is_file():  # a pod directory (nnx_save.save_pod)
            from ._pod import read_pod

            return read_pod(path)
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
    return parse_header(raw, reader.size, file=url), (reader.size, getattr(reader, "etag", None))


def _remote_index(url: str, stats: Any) -> Header:
    base = url.rsplit("/", 1)[0]
    reader = _remote.open_remote(url, stats)
    reader.probe()
    if reader.size > _remote.SPECULATIVE_HEADER_BYTES:
        raise IndexFileError(f"{url}: index of {reader.size} bytes is larger than any real index")
    try:
        obj = json.loads(reader.read(0, reader.size).decode("utf-8"))
    except ValueError as e:
        raise IndexFileError(f"{url}: not a valid JSON index: {e}") from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise IndexFileError(f"{url}: expected an object with a 'weight_map' of tensor name -> file name")
    for name in set(weight_map.values()):
        if "://" in name or name.startswith("/") or ".." in name.split("/"):
            raise IndexFileError(f"{url}: file {name!r} points outside the checkpoint directory {base}/")
    pairs = [_remote_file_header(f"{base}/{n}", stats) for n in sorted(set(weight_map.values()))]
    files = tuple(fh for fh, _ in pairs)
    tensors = _merge(files, url)
    for tensor, fname in weight_map.items():
        if tensor not in tensors or not tensors[tensor].file.endswith("/" + fname):
            raise IndexFileError(f"{url}: names tensor {tensor!r} in {fname}, which does not hold it")
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return Header(
        tensors,
        {**files[0].metadata, **{str(k): str(v) for k, v in meta.items()}} if files else {},
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


def reader_factory(header: Header):
    """``open_reader(file)`` for the engine: local files, or remote readers pinned to
    the size and ETag seen when the header was read."""
    from ._read import LocalReader

    def open_reader(file: str):
        if header.remote is not None and file in header.identity:
            size, etag = header.identity[file]
            if file.startswith(("http://", "https://")):
                return _remote.HttpReader(file, stats=header.remote, size=size, etag=etag)
            return _remote.FsspecReader(file, stats=header.remote)
        pinned = header.pinned.fds.get(file) if header.pinned is not None else None
        return LocalReader(file, pinned)

    return open_reader
