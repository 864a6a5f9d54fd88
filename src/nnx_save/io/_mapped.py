"""Many small, scattered runs of a local file gathered out of a memory map, with no
load from the map that can kill the process.

A column slice of a matrix is thousands of runs of a few hundred bytes, a row apart:
one ``pread`` per run pays a system call each, and one ``preadv`` over the span reads
every byte between them. A memory map copies only the runs, but a load from a page
of a file truncated since it was mapped raises SIGBUS and kills the process.

:class:`MappedFile` maps the file read-only and private and copies the runs out of it
one of two ways, whichever this install has:

- **native** (the optional extension ``nnx_save.io._gather``, built with the package
  where a C compiler was found): ``memcpy`` with the GIL released, the SIGBUS of a
  truncated file caught in the copying thread (``sigsetjmp``) and turned into a
  refusal; a SIGBUS anywhere else goes to the handler installed before. A run costs
  what a copy out of a map costs (~20 ns for 256 bytes).
- **process_vm_readv** on the process's own id (up to :data:`IOV_MAX` runs per call):
  the kernel resolves each page as a ptrace reader would and answers a page past the
  end of a truncated file with ``EFAULT`` and a short count, not a signal. A run
  costs the kernel pinning its page (~0.3 µs).

Either way a refusal is a short gather: the caller reads the same runs again with
``pread``, which names the byte where the file now ends.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import types
from _thread import allocate_lock  # threading.Lock itself: a small read need not import threading

import numpy as np

from ._reader import IOV_MAX, _libc

_native: types.ModuleType | None
try:  # the optional extension (src/nnx_save/io/_gather.c), where a compiler built it
    from . import _gather as _native
except ImportError:  # pragma: no cover - an install built without a C compiler
    _native = None

__all__ = ["MappedFile", "can_map", "run_cost_bytes"]

_VM_READV = _libc(
    "process_vm_readv", ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong
)
_MMAP = _libc("mmap", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_longlong)
_MUNMAP = _libc("munmap", ctypes.c_void_p, ctypes.c_size_t)
_MADVISE = _libc("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
BLOCK_BYTES = 4 << 20  # span of the file gathered, then its pages dropped, at a time by a releasing gather
# process_vm_readv pins a run's page: about what copying this many bytes costs
# (benchmarks/lazy.py --gather, docs/performance.md).
PIN_COST_BYTES = 2 << 10
if _MMAP is not None:
    _MMAP.restype = ctypes.c_void_p  # an address, not a count
_FAILED = ctypes.c_void_p(-1).value  # MAP_FAILED
_usable = [_VM_READV is not None and _MMAP is not None and _MUNMAP is not None]  # cleared if the kernel refuses


def can_map() -> bool:
    """Whether this process can gather through a map: the native copy, or ``process_vm_readv``
    (Linux, and no sandbox refusing it; a refusal seen once turns it off for the process)."""
    return _MMAP is not None and _MUNMAP is not None and (_native is not None or _usable[0])


def run_cost_bytes() -> int:
    """What a gathered run costs, in bytes a ``preadv`` through the gap would copy for the
    same time: 0 for the native copy (a run costs its own bytes), :data:`PIN_COST_BYTES`
    for ``process_vm_readv`` (pinning the run's page). Runs closer together than that
    are cheaper read through (``nnx_save.load._direct``)."""
    return 0 if _native is not None else PIN_COST_BYTES


class MappedFile:
    """A private read-only map of ``size`` bytes of the file open as ``fd`` (the
    descriptor is not kept: the map holds the very file on its own), read only
    through :meth:`gather`. Unmapped by :meth:`close` once no gather is running.

    Raises:
        OSError: the map could not be made (address space exhausted, a file system
            that cannot map); the caller reads with ``pread`` instead.
    """

    def __init__(self, fd: int, size: int) -> None:
        base = _MMAP(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0) if size and _MMAP else _FAILED
        if base in (None, _FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {size} bytes: {os.strerror(err)}")
        self.base, self.size = int(base), size
        self._users, self._closed = 0, False
        self._lock = allocate_lock()

    def gather(self, dest: int, offsets: np.ndarray, length: int, release: bool = False) -> bool:
        """Copy run ``k`` (``length`` bytes at file byte ``offsets[k]``, ascending, each
        within the mapped size) to ``dest + k * length``; the caller guarantees that
        memory. With ``release``, a :data:`BLOCK_BYTES` span at a time, each span's pages
        dropped from the map once copied (a column slice of a matrix then holds one
        block of pages resident, not the matrix).

        Returns:
            True when every run was copied; False when the kernel refused or stopped
            short (a truncated file, a closed map): nothing is trusted, the caller reads
            the runs again another way.
        """
        with self._lock:
            if self._closed:
                return False
            self._users += 1
        try:
            if not release or _native is not None:  # the native copy drops each block's pages itself
                return self._copy(dest, offsets, length, BLOCK_BYTES if release else 0)
            ends = np.searchsorted(offsets, offsets + BLOCK_BYTES)  # the first run past each run's block
            lo = 0
            while lo < len(offsets):
                hi = max(int(ends[lo]), lo + 1)
                done = self._copy(dest + lo * length, offsets[lo:hi], length)
                self.release(int(offsets[lo]), int(offsets[hi - 1]) + length)
                if not done:
                    return False
                lo = hi
            return True
        finally:
            with self._lock:
                self._users -= 1
                if self._closed and not self._users:
                    self._unmap()

    def _copy(self, dest: int, offsets: np.ndarray, length: int, release: int = 0) -> bool:
        if _native is not None:
            try:
                runs = np.ascontiguousarray(offsets, np.int64)
                return _native.gather(dest, self.base, self.size, runs, length, release)
            except OSError:  # the signal handler could not be installed: the caller reads another way
                return False
        remote = np.empty((len(offsets), 2), np.uint64)
        remote[:, 0] = offsets
        remote[:, 0] += self.base
        remote[:, 1] = length
        local = np.empty(2, np.uint64)
        pid, call, stride = os.getpid(), _VM_READV, remote.strides[0]
        for lo in range(0, len(offsets), IOV_MAX):
            n = min(IOV_MAX, len(offsets) - lo)
            local[0], local[1] = dest + lo * length, n * length
            got = call(pid, local.ctypes.data, 1, remote.ctypes.data + lo * stride, n, 0)
            if got != n * length:
                if got < 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
                    _usable[0] = False  # a sandbox without the call: pread from now on
                return False
        return True

    def release(self, begin: int, end: int) -> None:
        """Drop the map's pages of file bytes ``[begin, end)`` (the page cache keeps them)."""
        page = mmap.PAGESIZE
        lo, hi = begin - begin % page, min(-(-end // page) * page, self.size)
        if hi > lo and _MADVISE is not None and hasattr(mmap, "MADV_DONTNEED"):
            _MADVISE(self.base + lo, hi - lo, mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Unmap now, or when the last running gather ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._users:
                self._unmap()

    def _unmap(self) -> None:
        if _MUNMAP is not None:
            _MUNMAP(self.base, self.size)
