"""Small reads of one local tensor without the engine (whose planning and threads cost a
hundred times a few-KiB copy): what a ``safe_open`` handle does for a small slice.

One contiguous run (an element, rows) is one ``preadv`` straight into the result; a
large one (:data:`MAP_COPY_BYTES`) of a tensor read before is copied out of the file's
map instead, where the native copy exists and its pages are mapped already. Many runs
(a column slice of a matrix, a block) are gathered out of a private read-only map of the
file (:mod:`nnx_save.io._mapped`: a native copy whose SIGBUS is caught, or
``process_vm_readv``), so a file truncated under it is a refusal, not a signal; where a
gathered run costs more than reading through the gap before it
(:func:`~nnx_save.io._mapped.run_cost_bytes`: with ``process_vm_readv`` only), runs
close together are one ``preadv`` over their span, the bytes between them into a
scratch buffer. Either way a file truncated (or truncated and re-extended) by another
process is a typed error: a short read is a :class:`~nnx_save.errors.TruncatedFileError`,
and a file whose size or modification time differs, after the read, from what its header
was read from is a :class:`~nnx_save.errors.SourceError` naming it (the bytes read may
mix two versions).
"""

from __future__ import annotations

import contextlib
import math
import os
from _thread import allocate_lock  # threading.Lock itself: a small read need not import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import SourceError, TruncatedFileError
from ..format._boxes import box_runs, check_bools, extents
from ..format._header import TensorInfo
from ..io._files import Pinned
from ..io._mapped import MappedFile, can_map, run_cost_bytes
from ..io._reader import LocalReader, check_identity
from ._slices import slice_box

__all__ = ["DIRECT_MAX_BYTES", "DIRECT_MAX_RUNS", "GATHER_GAP", "DirectFiles", "one_run", "quick_run"]

# Above this, the engine's threads beat one thread's copy (a whole large tensor); under
# it, the engine's start-up dominates (benchmarks/lazy.py).
DIRECT_MAX_BYTES = 16 << 20
DIRECT_MAX_RUNS = 4096  # a column slice of a big matrix, without the engine's imports
# A contiguous run at least this large, of a tensor read before, is copied natively out of
# the file's map: about twice preadv's rate once the pages are mapped, where preadv's one
# call wins under it (benchmarks/lazy.py, docs/performance.md).
MAP_COPY_BYTES = 256 << 10
# A run at most this large is read by one native call holding the pool's lock (no
# duplicate descriptor, the fstat in C): a page cache read of a few pages.
READ_AT_BYTES = 64 << 10
GATHER_GAP = 64 << 10  # bytes read through (into scratch) rather than cut into another request (~10 us on a VM)
RESIDENT_BYTES = 1 << 30  # tensors whose gathered pages stay mapped per handle, once asked for twice


class DirectFiles:
    """The local files of one handle, read with ``pread`` into the result.

    A read takes a reader for its one call (a duplicate of the descriptor pinned with the
    header, so the very file that was validated is read) and closes it after: a handle
    holds no descriptor of its own between reads, so any number of open handles share the
    process-wide pool (:class:`~nnx_save.io._files.Pinned`), which reopens a file it let go
    on demand, and the descriptor limit is never reached by handles left open. A file's
    map (for gathers) holds no descriptor either: it is closed once mapped.
    """

    def __init__(self, pinned: Pinned) -> None:
        self._pinned = pinned
        self._maps: dict[str, MappedFile | None] = {}  # None: this file cannot be mapped
        self._seen: set[str] = set()  # tensors gathered from a map once (their pages dropped after)
        self._resident: dict[str, TensorInfo] = {}  # tensors asked for again: pages kept, oldest first
        self._resident_bytes = 0
        self._lock = allocate_lock()

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

    def _map(self, file: str) -> MappedFile | None:
        if file in self._maps:
            return self._maps[file]
        with self._lock:
            if file not in self._maps:
                fd = self._pinned.open(file)
                try:
                    seen = self._pinned.seen.get(file)
                    self._maps[file] = MappedFile(fd, seen[2] if seen else os.fstat(fd).st_size)
                except OSError:
                    self._maps[file] = None
                finally:
                    os.close(fd)
            return self._maps[file]

    def _mapped(self, info: TensorInfo, base: int, offsets: np.ndarray, length: int) -> bool:
        """Whether the runs were gathered from the file's map: runs far enough apart (each
        gap over :func:`~nnx_save.io._mapped.run_cost_bytes` on average), and a map that
        worked. A tensor's
        first gather drops its pages block by block; from its second, they stay (up to
        :data:`RESIDENT_BYTES` of tensors per handle, the oldest dropped first)."""
        n = len(offsets)
        gaps = int(offsets[-1]) - int(offsets[0]) - (n - 1) * length
        if n < 2 or gaps <= (n - 1) * run_cost_bytes() or not can_map():
            return False
        mapped = self._map(info.file)
        if mapped is None:
            return False
        return mapped.gather(base, offsets, length, release=not self._kept(info))

    def _kept(self, info: TensorInfo) -> bool:
        """Whether ``info``'s pages stay mapped after a gather (asked for before)."""
        key = info.name
        if key in self._resident:
            return True
        with self._lock:
            if key not in self._seen:
                self._seen.add(key)
                return False
            self._resident[key] = info
            self._resident_bytes += info.nbytes
            while self._resident_bytes > RESIDENT_BYTES and len(self._resident) > 1:
                old = self._resident.pop(next(iter(self._resident)))
                self._resident_bytes -= old.nbytes
                dropped = self._maps.get(old.file)
                if dropped is not None:
                    dropped.release(old.begin, old.end)
        return True

    def read_run(self, info: TensorInfo, first: int, shape: list[int]) -> np.ndarray:
        """The elements of ``info`` from flat index ``first`` that fill ``shape`` (one
        contiguous run, :func:`one_run`), as a fresh array: one ``preadv``. Not for
        BOOL tensors (:meth:`read` checks their bytes against the slice's box).

        Raises:
            TruncatedFileError: the file now ends before the run's bytes.
            SourceError: the file changed since its header was read.
        """
        out = np.empty(shape, info.dtype.numpy)
        offset = info.begin + first * info.dtype.itemsize
        if out.nbytes >= MAP_COPY_BYTES and self._copied(info, out, offset):
            return out
        if out.nbytes <= READ_AT_BYTES and self._pinned.read_checked(info.file, out, offset):
            return out
        try:
            fd = self._pinned.open(info.file)  # no reader object: an element costs a few microseconds
            try:
                got = os.preadv(fd, [out], offset)  # type: ignore[list-item]
                if got == out.nbytes:
                    identity = self._pinned.seen.get(info.file)
                    if identity is not None:
                        check_identity(info.file, fd, identity)
                    return out
            finally:
                os.close(fd)
            with self._reader(info.file) as reader:  # short: the reader retries, or names where the file ends
                reader.read_into(out, offset)
        except TruncatedFileError as e:
            raise _truncated(info, e) from None
        return out

    def _copied(self, info: TensorInfo, out: np.ndarray, offset: int) -> bool:
        """Whether ``out`` was filled with the run at ``offset`` natively out of the file's
        map, the file checked unchanged after: where the native copy exists, for a tensor
        read before (its pages then stay mapped, as a gather's do). A tensor's first read
        is left to ``preadv`` (a fresh map's page faults cost more than it) and marks it;
        a refusal (the file truncated) too, which then names where the file ends."""
        if run_cost_bytes() or not can_map() or not self._kept(info):
            return False
        mapped = self._map(info.file)
        if mapped is None or not mapped.gather(out.ctypes.data, np.array([offset], np.int64), out.nbytes):
            return False
        with self._reader(info.file) as reader:
            reader.verify()
        return True

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
        base = out.ctypes.data
        try:
            with self._reader(info.file) as reader:
                if self._mapped(info, base, offsets, length):
                    reader.verify()
                elif len(offsets) > 1 and reader.can_read_tables():
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
            raise _truncated(info, e) from None
        check_bools(out, info, box)
        if all(p == slice(None) for p in post):
            return out
        return np.array(out[post])

    def close(self) -> None:
        """Drop the maps (later gathers map again; a read holds no descriptor between calls)."""
        with self._lock:
            maps, self._maps = self._maps, {}
            self._seen.clear()
            self._resident.clear()
            self._resident_bytes = 0
        for mapped in maps.values():
            if mapped is not None:
                mapped.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 - not contextlib.suppress: at interpreter exit its module may be gone first
            self.close()
        except Exception:
            pass


def _truncated(info: TensorInfo, e: TruncatedFileError) -> TruncatedFileError:
    return TruncatedFileError(
        f"{info.file}: the file ends at byte {e.offset}, tensor {info.name!r} needs bytes up to "
        f"{info.end} (was it truncated while open?)",
        info.file,
        e.offset,
    )


def one_run(items: tuple[int | slice, ...], shape: tuple[int, ...]) -> tuple[int, list[int]] | None:
    """``(first flat index, result shape)`` when ``items`` (normalized) select one
    contiguous, non-empty run of a C-ordered tensor of ``shape``: single indices
    first, then one range, then whole dimensions. Else None.

    Examples:
        >>> one_run((5, 7), (10, 10))
        (57, [])
        >>> one_run((slice(2, 4, 1), slice(0, 10, 1)), (10, 10))
        (20, [2, 10])
        >>> one_run((slice(0, 10, 1), slice(0, 3, 1)), (10, 10)) is None
        True
    """
    first, wide, out = 0, False, []
    for item, size in zip(items, shape, strict=True):
        if type(item) is int:
            lo, n = item, 1
        else:
            lo, n = item.start, item.stop - item.start  # type: ignore[union-attr]
            if item.step != 1 or n <= 0:  # type: ignore[union-attr]
                return None
            out.append(n)
        if wide and n != size:
            return None
        wide = wide or n > 1
        first = first * size + lo
    return first, out


def quick_run(index: Any, shape: tuple[int, ...]) -> tuple[int, list[int]] | None:
    """:func:`one_run` of the commonest raw indices (``[i, j]``, ``[a:b]``,
    ``[a:b, :]``: in-range ints and step-less slices with in-range int bounds, one per
    dimension) without normalizing them first; None for any other index (the general
    path checks it).

    Examples:
        >>> quick_run((5, 7), (10, 10))
        (57, [])
        >>> quick_run(slice(2, 4), (10, 10))
        (20, [2, 10])
        >>> quick_run((-1, 0), (10, 10)) is None
        True
    """
    if type(index) is not tuple:
        index = (index,)
    if len(index) > len(shape):
        return None
    first, wide, out = 0, False, []
    for k, size in enumerate(shape):
        item = index[k] if k < len(index) else slice(None)
        if type(item) is int:
            if not 0 <= item < size:
                return None
            lo, n = item, 1
        elif type(item) is slice and item.step is None:
            lo = 0 if item.start is None else item.start
            hi = size if item.stop is None else item.stop
            if type(lo) is not int or type(hi) is not int or not 0 <= lo < hi <= size:
                return None
            n = hi - lo
            out.append(n)
        else:
            return None
        if wide and n != size:
            return None
        wide = wide or n > 1
        first = first * size + lo
    return first, out


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
