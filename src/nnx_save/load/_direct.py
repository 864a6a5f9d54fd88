"""Small reads of one local tensor without the engine (whose planning and threads cost a
hundred times a few-KiB copy): what a ``safe_open`` handle does for a small slice.

The bytes of the slice's box are read with ``pread`` straight into the result, one call
per contiguous run; nothing is memory-mapped, so a file truncated (or truncated and
re-extended) by another process can never raise SIGBUS in the reader: a short read is a
:class:`~nnx_save.errors.TruncatedFileError`, and a file whose size or modification time
differs, after the read, from what its header was read from is a
:class:`~nnx_save.errors.SourceError` naming it (the bytes read may mix two versions).
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np

from ..errors import TruncatedFileError
from ..format._boxes import box_runs, extents
from ..format._header import TensorInfo
from ..io._files import Pinned
from ..io._reader import LocalReader
from ._slices import slice_box

__all__ = ["DIRECT_MAX_BYTES", "DIRECT_MAX_RUNS", "DirectFiles"]

# Above this, the engine's threads beat one thread's copy (a whole large tensor); under
# it, the engine's start-up dominates (benchmarks/lazy.py).
DIRECT_MAX_BYTES = 16 << 20
DIRECT_MAX_RUNS = 4096  # one pread each (~10 us on a VM): a column slice of a big matrix, without the engine's imports


class DirectFiles:
    """The local files of one handle, read with ``pread`` into the result.

    Readers (each a duplicate of the descriptor pinned with the header, so the very file
    that was validated is read) are made on first use and closed with this object.
    """

    def __init__(self, pinned: Pinned) -> None:
        self._pinned = pinned
        self._readers: dict[str, LocalReader] = {}
        self._lock = threading.Lock()

    def _reader(self, file: str) -> LocalReader:
        found = self._readers.get(file)
        if found is None:
            with self._lock:
                found = self._readers.get(file)
                if found is None:
                    fd = self._pinned.open(file)
                    try:
                        found = self._readers[file] = LocalReader(file, fd, self._pinned.seen.get(file))
                    finally:
                        os.close(fd)
        return found

    def plan(self, info: TensorInfo, items: tuple[int | slice, ...]) -> tuple[Any, Any, np.ndarray, int] | None:
        """``(box, post, run offsets, run length)`` of ``tensor[items]``, or None when the
        box is empty, over :data:`DIRECT_MAX_BYTES` or over :data:`DIRECT_MAX_RUNS` runs."""
        box, post = slice_box(items, info.shape, info.name)
        shape = extents(box)
        if not math.prod(shape) or math.prod(shape) * info.dtype.itemsize > DIRECT_MAX_BYTES:
            return None
        offsets, length = box_runs(info.shape, info.dtype.itemsize, box, info.begin)
        if len(offsets) > DIRECT_MAX_RUNS:
            return None
        return box, post, offsets, length

    def read(self, info: TensorInfo, planned: tuple[Any, Any, np.ndarray, int]) -> np.ndarray:
        """The slice :meth:`plan` planned, as a fresh C-contiguous array.

        Raises:
            TruncatedFileError: the file now ends before the slice's bytes.
            SourceError: the file changed since its header was read.
        """
        box, post, offsets, length = planned
        out = np.empty(extents(box), info.dtype.numpy)
        reader = self._reader(info.file)
        base = out.ctypes.data
        addr = [base + i * length for i in range(len(offsets))]
        try:
            if reader.can_read_runs():
                reader.read_runs(addr, [length] * len(offsets), offsets.tolist())
            else:  # no pread in the C library: memoryviews
                flat = out.reshape(-1).view(np.uint8).data
                for i, off in enumerate(offsets.tolist()):
                    reader.readv([flat[i * length : (i + 1) * length]], off)
        except TruncatedFileError as e:
            raise TruncatedFileError(
                f"{info.file}: the file ends at byte {e.offset}, tensor {info.name!r} needs bytes up to "
                f"{info.end} (was it truncated while open?)",
                info.file,
                e.offset,
            ) from None
        if all(p == slice(None) for p in post):
            return out
        return np.array(out[post])

    def close(self) -> None:
        """Close the readers (later reads reopen them)."""
        with self._lock:
            readers, self._readers = self._readers, {}
        for reader in readers.values():
            reader.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 - not contextlib.suppress: at interpreter exit its module may be gone first
            self.close()
        except Exception:
            pass
