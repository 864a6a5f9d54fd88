"""Small reads of one local tensor without the engine (whose planning and threads cost a
hundred times a few-KiB copy): what a ``safe_open`` handle does for a small slice.

The bytes of the slice's box are read with ``preadv`` straight into the result (runs
closer than :data:`GATHER_GAP` share one request, the bytes between them read into a
scratch buffer); nothing is memory-mapped, so a file truncated (or truncated and
re-extended) by another process can never raise SIGBUS in the reader: a short read is a
:class:`~nnx_save.errors.TruncatedFileError`, and a file whose size or modification time
differs, after the read, from what its header was read from is a
:class:`~nnx_save.errors.SourceError` naming it (the bytes read may mix two versions).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import SourceError, TruncatedFileError
from ..format._boxes import box_runs, extents
from ..format._header import TensorInfo
from ..io._files import Pinned
from ..io._reader import LocalReader
from ._assemble import check_bools
from ._slices import slice_box

__all__ = ["DIRECT_MAX_BYTES", "DIRECT_MAX_RUNS", "GATHER_GAP", "DirectFiles"]

# Above this, the engine's threads beat one thread's copy (a whole large tensor); under
# it, the engine's start-up dominates (benchmarks/lazy.py).
DIRECT_MAX_BYTES = 16 << 20
DIRECT_MAX_RUNS = 4096  # a column slice of a big matrix, without the engine's imports
GATHER_GAP = 64 << 10  # bytes read through (into scratch) rather than cut into another request (~10 us on a VM)


class DirectFiles:
    """The local files of one handle, read with ``pread`` into the result.

    A read takes a reader for its one call (a duplicate of the descriptor pinned with the
    header, so the very file that was validated is read) and closes it after: a handle
    holds no descriptor of its own between reads, so any number of open handles share the
    process-wide pool (:class:`~nnx_save.io._files.Pinned`), which reopens a file it let go
    on demand, and the descriptor limit is never reached by handles left open.
    """

    def __init__(self, pinned: Pinned) -> None:
        self._pinned = pinned

    @contextlib.contextmanager
    def _reader(self, file: str) -> Iterator[LocalReader]:
        fd = self._pinned.open(file)
        try:
            reader = LocalReader(file, fd, self._pinned.seen.get(file))
        except OSError as error:  # the duplicate (EMFILE): typed, naming the file
            raise SourceError(f"{file}: cannot open the file ({error.strerror})", file) from None
        finally:
            os.close(fd)
        try:
            yield reader
        finally:
            reader.close()

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
        with self._reader(info.file) as reader:
            self._fill(reader, info, out, offsets, length)
        check_bools(out, info, box)
        if all(p == slice(None) for p in post):
            return out
        return np.array(out[post])

    @staticmethod
    def _fill(reader: LocalReader, info: TensorInfo, out: np.ndarray, offsets: np.ndarray, length: int) -> None:
        base = out.ctypes.data
        try:
            if len(offsets) > 1 and reader.can_read_tables():
                _gather(reader, base, offsets, length)
            elif reader.can_read_runs():
                reader.read_runs(
                    [base + i * length for i in range(len(offsets))], [length] * len(offsets), offsets.tolist()
                )
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

    def close(self) -> None:
        """Nothing to close: a read closes its reader (kept for the handle's ``close()``)."""


def _gather(reader: LocalReader, base: int, offsets: np.ndarray, length: int) -> None:
    """Runs ``offsets`` (ascending, ``length`` bytes each) into consecutive slots from
    address ``base``, with few requests: runs closer than :data:`GATHER_GAP` share one
    ``preadv`` whose gaps land in a scratch buffer (reading a few KiB through costs far
    less than a request), so a column slice of a matrix is a handful of calls, not one
    per row."""
    gaps = offsets[1:] - (offsets[:-1] + length)
    cuts = np.flatnonzero(gaps > GATHER_GAP) + 1  # a new block after each wide gap
    scratch = np.empty(max(int(gaps[gaps <= GATHER_GAP].max(initial=0)), 1), np.uint8)
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(offsets)], strict=True):
        n = hi - lo
        table = np.empty((2 * n - 1, 2), np.uint64)
        table[0::2, 0] = base + np.arange(lo, hi, dtype=np.uint64) * length
        table[0::2, 1] = length
        table[1::2, 0] = scratch.ctypes.data
        table[1::2, 1] = gaps[lo : hi - 1]
        keep = table[:, 1] > 0  # runs that touch: no empty iovec
        reader.readv_table(np.ascontiguousarray(table[keep]), int(offsets[lo]))
