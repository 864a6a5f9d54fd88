"""Small reads of one local tensor without the engine (whose planning and threads cost a
hundred times a few-KiB copy): what a ``safe_open`` handle does for a small slice.

A file is memory-mapped once per handle; a first request copies in blocks of rows and
drops each block's pages (``MADV_DONTNEED``), so a column slice does not make the whole
matrix resident (docs/lazy.md). Each request first ``fstat``-s the file, so a file
truncated in place raises :class:`~nnx_save.errors.TruncatedFileError`, not SIGBUS.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import HostMemoryError, TruncatedFileError
from ..format._header import TensorInfo

__all__ = ["DIRECT_MAX_BYTES", "MappedFiles"]

# Above this, the engine's threads beat one thread's copy out of a map (a whole
# large tensor); under it, the engine's start-up dominates (benchmarks/lazy.py).
DIRECT_MAX_BYTES = 16 << 20
BLOCK_BYTES = 4 << 20  # mapped span copied, then dropped, at a time on a first request
RESIDENT_BYTES = 1 << 30  # tensors kept mapped per handle once asked for twice


class MappedFiles:
    """Read-only maps of the local files of one handle, made on first use.

    ``open_fd(file)`` gives a new descriptor on the very file whose header was
    validated (the header's pinned one, duplicated); it is closed once mapped. The maps
    are unmapped when this object and the arrays viewing them are garbage collected.
    """

    def __init__(self, open_fd: Callable[[str], int], resident_bytes: int = RESIDENT_BYTES) -> None:
        self._open_fd = open_fd
        self._maps: dict[str, mmap.mmap] = {}
        self._seen: set[str] = set()  # by tensor name (unique in one handle)
        self._resident: dict[str, TensorInfo] = {}  # in admission order
        self._resident_bytes, self._limit = 0, resident_bytes
        self._lock = threading.Lock()

    def _map(self, file: str) -> mmap.mmap:
        found = self._maps.get(file)
        if found is None:
            fd = self._open_fd(file)
            try:
                found = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # keeps its own duplicate of fd
            finally:
                os.close(fd)
            self._maps[file] = found
        return found

    def view(self, info: TensorInfo) -> np.ndarray:
        """Tensor ``info`` as an array over the mapped file (no bytes read yet)."""
        try:
            mapped = self._map(info.file)
        except OSError as e:  # ENOMEM: the address space (a memory limit) cannot hold the map
            if e.errno != errno.ENOMEM:
                raise
            raise HostMemoryError(
                f"{info.file}: cannot map the file to read tensor {info.name!r} ({e.strerror}); nothing was read",
                info.file,
                info.name,
                info.nbytes,
            ) from None
        # np.ndarray over the buffer in one call, not frombuffer + view + reshape: each is dear in a fresh process
        return np.ndarray(info.shape, info.dtype.numpy, mapped, info.begin)

    def copy(self, info: TensorInfo, view: np.ndarray, index: tuple[Any, ...]) -> np.ndarray:
        """A C-contiguous copy of ``view[index]`` (``view``: :meth:`view` of ``info``;
        ``index``: one int or slice per dimension)."""
        size = self._maps[info.file].size()  # fstat: the file may have been truncated in place
        if size < info.end:
            raise TruncatedFileError(
                f"{info.file}: the file ends at byte {size}, tensor {info.name!r} needs bytes up to {info.end} "
                "(was it truncated while open?)",
                info.file,
                size,
            )
        key = info.name
        if key in self._resident:
            return np.array(view[index])
        with self._lock:  # handles are shared between threads; admission is not the per-call path
            first = key not in self._seen
            self._seen.add(key)
            if not first:
                self._admit(key, info)
        return self._copy_released(info, view, index) if first else np.array(view[index])

    def _admit(self, key: str, info: TensorInfo) -> None:
        if key in self._resident:
            return
        self._resident[key] = info
        self._resident_bytes += info.nbytes
        while self._resident_bytes > self._limit and len(self._resident) > 1:
            old = self._resident.pop(next(iter(self._resident)))
            self._resident_bytes -= old.nbytes
            self._release(old, old.begin, old.end)

    def _release(self, info: TensorInfo, begin: int, end: int) -> None:
        """Drop the pages of file bytes ``[begin, end)`` from this process's map."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = begin - begin % mmap.PAGESIZE
        hi = min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, len(self._maps[info.file]))
        if hi > lo:
            self._maps[info.file].madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _copy_released(self, info: TensorInfo, view: np.ndarray, index: tuple[Any, ...]) -> np.ndarray:
        """``view[index]`` copied a block of rows at a time, each block's pages dropped
        once copied (a first request holds one block's pages, not the tensor's)."""
        first = index[0] if index else None
        if not isinstance(first, slice) or first.step != 1:
            out = np.array(view[index])
            self._release(info, info.begin, info.end)
            return out
        row = math.prod(info.shape[1:]) * info.dtype.itemsize
        rows = max(1, BLOCK_BYTES // max(row, 1))
        trailing = view[(slice(0, 0), *index[1:])].shape[1:]  # the dimensions ints do not drop
        out = np.empty((len(range(first.start, first.stop)), *trailing), view.dtype)
        for a in range(first.start, max(first.stop, first.start), rows):
            b = min(a + rows, first.stop)
            out[a - first.start : b - first.start] = view[(slice(a, b), *index[1:])]
            self._release(info, info.begin + a * row, info.begin + b * row)
        return out
