"""Small reads of one local tensor without the engine: what a warm ``safe_open``
handle does for a slice of a few runs.

The engine plans, budgets and reads on a pool of threads; for a slice of a few
kilobytes that machinery costs a hundred times the copy. Here a local file is
memory-mapped once per handle (no bytes are read by the map itself) and a request
is one numpy copy out of the mapped tensor: the kernel faults in the pages that
hold the slice, and only those (the map is advised random access, so it does not
fault in neighbouring pages ahead). Large requests still go to the engine, whose
concurrent ``preadv`` into fresh buffers is faster than one thread copying out of
a map.

A map of a file that another process truncates in place would fault (SIGBUS) on
the missing pages; each request first checks, with one ``fstat`` on the pinned
descriptor, that the file still holds the tensor, and raises
:class:`~nnx_save.errors.TruncatedFileError` instead.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

from ..errors import TruncatedFileError
from ..format._header import TensorInfo

__all__ = ["DIRECT_MAX_BYTES", "MappedFiles"]

# Above this, the engine's threads beat one thread's copy out of a map (a whole
# large tensor); under it, the engine's start-up dominates (benchmarks/lazy.py).
DIRECT_MAX_BYTES = 16 << 20


class MappedFiles:
    """Read-only maps of the local files of one handle, made on first use.

    ``fds`` gives the descriptor a header pinned for a file (the very file whose
    header was validated); a file without one is opened by name. Maps and views
    are dropped with this object.
    """

    def __init__(self, fds: dict[str, int] | None = None) -> None:
        self._fds = fds if fds is not None else {}
        self._maps: dict[str, mmap.mmap] = {}

    def _map(self, file: str) -> mmap.mmap:
        found = self._maps.get(file)
        if found is None:
            pinned = self._fds.get(file)
            own = pinned is None
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC) if pinned is None else pinned
            try:
                found = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # keeps its own duplicate of fd
            finally:
                if own:
                    os.close(fd)
            if hasattr(found, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                found.madvise(mmap.MADV_RANDOM)  # fault in the slice's pages only, not 64 KiB around each
            self._maps[file] = found
        return found

    def view(self, info: TensorInfo) -> np.ndarray:
        """Tensor ``info`` as an array over the mapped file (no bytes read yet)."""
        raw = np.frombuffer(self._map(info.file), np.uint8, info.nbytes, info.begin)
        return raw.view(info.dtype.numpy).reshape(info.shape)

    def check_size(self, info: TensorInfo) -> None:
        """Raise if the file no longer holds ``info``'s bytes (truncated in place)."""
        size = self._maps[info.file].size()  # fstat of the mapped file now
        if size < info.end:
            raise TruncatedFileError(
                f"{info.file}: the file ends at byte {size}, tensor {info.name!r} needs bytes up to {info.end} "
                "(was it truncated while open?)",
                info.file,
                size,
            )

    def close(self) -> None:
        """Unmap the files (a map outlives this while an array still views it)."""
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # an array still views it: unmapped when that goes
                m.close()
        self._maps.clear()
