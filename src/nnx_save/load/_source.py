"""What a layout hands the load engine: a validated :class:`Header` whose
:class:`Placement` says which pieces of which files make each tensor and how to open
them. Layouts (nnx_save.layouts) build these; the engine only reads them.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .._frozen import Frozen
from ..format._header import FileHeader, TensorInfo
from ..io import _files
from ..io._reader import LocalReader, Reader

if TYPE_CHECKING:
    from ._pieces import Piece

__all__ = ["Header", "LocalFiles", "Placement", "RemoteFiles", "gc_paused", "in_batches"]


class Placement(Protocol):
    """Where one checkpoint's bytes are, as its layout read them."""

    processes: int
    """The processes that wrote it (a pod); pieces name theirs, 1 for the other layouts."""
    missing: tuple[str, ...]
    """Files it names that are not present (a pod's shard files on another host)."""
    remote: bool
    """Whether its files are read over a network (each read a request)."""

    def pieces_of(self, key: str, info: TensorInfo) -> tuple[Piece, ...]:
        """Tensor ``key`` (validated as ``info``) as pieces at (file, byte range, box)."""
        ...

    def open_reader(self, file: str) -> Reader:
        """A reader of ``file``, the very version whose header was validated."""
        ...

    def is_remote(self, file: str) -> bool:
        """Whether ``file`` is read over a network (it cannot be memory-mapped)."""
        ...

    def unpinned(self) -> frozenset[str]:
        """Its remote files whose server gave no validator (no ETag, no Last-Modified):
        only their size pins them, so two requests may see two versions."""
        ...

    def local_files(self) -> _files.Pinned | None:
        """The pinned descriptors of its validated local files, for a lazy handle's direct
        reads, when every tensor is one whole piece of one file; ``None`` otherwise."""
        ...

    def retries(self) -> int:
        """Requests retried so far (remote transports; 0 for local files)."""
        ...

    def close(self) -> None:
        """Release what it holds open; readers opened later reopen by name."""
        ...


def _piece(box: tuple[tuple[int, int], ...], info: TensorInfo) -> Piece:
    """``Piece(box, info)``, its module imported on first use (by the engine's first read:
    a lazy handle's small reads never ask); this function then rebinds itself to the class,
    so later calls cost no more than the constructor."""
    global _piece
    from ._pieces import Piece

    _piece = Piece
    return Piece(box, info)


class LocalFiles:
    """Local files whose descriptors are pinned (:class:`nnx_save.io._files.Pinned`);
    every tensor is one whole piece."""

    processes = 1
    missing: tuple[str, ...] = ()
    remote = False

    def __init__(self) -> None:
        self.pinned = _files.Pinned()

    def pieces_of(self, key: str, info: TensorInfo) -> tuple[Piece, ...]:
        return (_piece(tuple((0, d) for d in info.shape), info),)  # whole(info.shape), per tensor inline

    def open_reader(self, file: str) -> Reader:
        fd = self.pinned.open(file)
        try:
            return LocalReader(file, fd, self.pinned.seen.get(file))
        finally:
            os.close(fd)  # the reader holds its own duplicate

    def is_remote(self, file: str) -> bool:
        return False

    def unpinned(self) -> frozenset[str]:
        return frozenset()

    def local_files(self) -> _files.Pinned | None:
        return self.pinned

    def retries(self) -> int:
        return 0

    def close(self) -> None:
        self.pinned.close()


class RemoteFiles(LocalFiles):
    """Remote files, each read pinned to the size and version (ETag) its header had."""

    remote = True

    def __init__(self, stats: Any, identity: Mapping[str, tuple[int, str | None]]) -> None:
        super().__init__()
        self.stats, self.identity = stats, identity

    def is_remote(self, file: str) -> bool:
        return file in self.identity

    def unpinned(self) -> frozenset[str]:
        return frozenset(f for f, (_, version) in self.identity.items() if version is None)

    def open_reader(self, file: str) -> Reader:
        if file in self.identity:
            from ..io._storage import open_remote  # the transports: imported by the first remote read

            return open_remote(file, self.stats, self.identity[file])
        return super().open_reader(file)

    def retries(self) -> int:
        return self.stats.retries


class Header(Frozen):
    """The validated headers of a checkpoint (one file or several).

    Attributes:
        tensors: every tensor by name, each knowing its file and byte range (the
            ``file`` of a pod tensor is its manifest).
        metadata: the ``__metadata__`` of a single file; for several files, the
            index's ``metadata`` merged over the first file's.
        files: each file's own header, in read order.
        kind: ``"file"``, ``"index"``, ``"directory"``, ``"list"`` or ``"pod"``.
        placement: where each tensor's bytes are, and how to open its files.
    """

    __slots__ = ("files", "kind", "metadata", "placement", "tensors")
    _fields = ("tensors", "metadata", "files", "kind", "placement")
    _shown = _compared = ("tensors", "metadata", "files", "kind")
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    files: tuple[FileHeader, ...]
    kind: str
    placement: Placement

    def __init__(
        self,
        tensors: Mapping[str, TensorInfo],
        metadata: Mapping[str, str] | None = None,
        files: tuple[FileHeader, ...] = (),
        kind: str = "file",
        placement: Placement | None = None,
    ) -> None:
        set_field = object.__setattr__
        set_field(self, "tensors", tensors)
        set_field(self, "metadata", {} if metadata is None else metadata)
        set_field(self, "files", files)
        set_field(self, "kind", kind)
        set_field(self, "placement", LocalFiles() if placement is None else placement)

    def pieces_of(self, key: str) -> tuple[Piece, ...]:
        """Where tensor ``key``'s bytes are: pieces at (file, byte range, box)."""
        return self.placement.pieces_of(key, self.tensors[key])

    @property
    def missing_files(self) -> tuple[str, ...]:
        """Files the checkpoint names that are not present (pod shard files)."""
        return self.placement.missing

    @property
    def num_processes(self) -> int:
        """The processes that wrote the checkpoint."""
        return self.placement.processes

    def close(self) -> None:
        """Release the files this header keeps open (later loads reopen them by
        name, and refuse a file replaced since)."""
        self.placement.close()

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


class gc_paused:  # lower case: used as a function, `with gc_paused():`
    """No cyclic garbage collection inside the block: reading many tensors or pieces
    allocates enough small objects to trigger full collections, each walking every
    live object of the process; reference counting frees what the block allocates.

    A class, not a generator: leaving the block allocates nothing, so the collection
    the block put off runs at the caller's next allocation, once the block's
    temporaries are freed, not while they are all alive."""

    __slots__ = ("enabled",)

    def __enter__(self) -> None:
        self.enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            gc.enable()


def in_batches(header: Header, keys: Iterable[str], limit: int) -> Iterator[list[str]]:
    """``keys`` in order, cut into runs whose tensors hold at most ``limit`` bytes together
    (a larger tensor alone): N small tensors read in about N / batch loads, not N."""
    batch: list[str] = []
    size = 0
    for key in keys:
        n = header.tensors[key].nbytes
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch
