"""Positioned reads from local files: the :class:`Reader` protocol every transport
implements, and :class:`LocalReader`, whose ``preadv`` / ``pread`` calls go through
ctypes and release the GIL."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from _thread import allocate_lock  # threading.Lock itself: a small read need not import threading
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import SourceError, TruncatedFileError

__all__ = ["IOV_MAX", "LocalReader", "Reader", "ViewReader", "check_identity"]

IOV_MAX = 1024  # the POSIX minimum of the kernel's iovec limit (Linux: exactly 1024)


def _libc(name: str, *argtypes):
    """``name`` from the C library via ctypes (releases the GIL), or None."""
    try:
        # The symbols the process already has (libc among them): ctypes.util.find_library
        # would run ldconfig in a subprocess, at every import of nnx_save.
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):  # no such C function (Windows): the memoryview path
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_ssize_t
    return fn


_PREADV = _libc("preadv", ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong)
_PREAD = _libc("pread", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_longlong)


@runtime_checkable
class Reader(Protocol):
    """Positioned reads from one file or object (local, HTTP, fsspec).

    ``requests`` counts the requests made so far. :meth:`can_read_tables` says
    whether :meth:`readv_table` works, :meth:`can_read_runs` whether
    :meth:`read_runs` does: local files read iovec tables through ``preadv`` and
    batches of small runs through ``pread``, with raw addresses; other readers get
    one ``memoryview`` per run.
    """

    requests: int

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        """Fill ``buffers`` in order from byte ``offset``, or raise naming the offset."""
        ...

    def close(self) -> None: ...

    def can_read_tables(self) -> bool:
        """Whether :meth:`readv_table` may be called."""
        ...

    def readv_table(self, table: np.ndarray, offset: int) -> None:
        """Fill the ``(address, length)`` rows of ``table`` in order from ``offset``."""
        ...

    def can_read_runs(self) -> bool:
        """Whether :meth:`read_runs` may be called."""
        ...

    def read_runs(self, addr: list[int], length: list[int], offset: list[int]) -> None:
        """Fill ``length[k]`` bytes at raw address ``addr[k]`` from byte ``offset[k]``."""
        ...


def check_identity(path: str, fd: int, identity: tuple[int, int, int, int]) -> None:
    """Raise when the file open as ``fd`` no longer has the size and modification time
    of ``identity`` (device, inode, size, mtime_ns: what its header was read from).

    Raises:
        TruncatedFileError: it is shorter now (names the byte where it ends).
        SourceError: it was changed in place (what was read may mix two versions).
    """
    st = os.fstat(fd)
    if st.st_size < identity[2]:
        raise TruncatedFileError(
            f"{path}: truncated while open: it ends at byte {st.st_size}, its header was read from {identity[2]} bytes",
            path,
            st.st_size,
        )
    # an open file keeps its device and inode: its size and modification time tell
    if st.st_mtime_ns != identity[3] or st.st_size != identity[2]:
        raise SourceError(
            f"{path}: changed while open (size {identity[2]} -> {st.st_size} bytes, or modified "
            "in place since its header was read); what was read may mix two versions: read the header "
            "again and reload",
            path,
        )


class LocalReader:
    """Positioned reads from a local file; ``preadv`` releases the GIL."""

    def __init__(self, path: str, fd: int | None = None, identity: tuple[int, int, int, int] | None = None) -> None:
        self.path = path
        # ``fd``: a descriptor the caller holds on the very file whose header it read
        # (duplicated here), so a file replaced since then is still read whole.
        self.fd = os.open(path, os.O_RDONLY) if fd is None else os.dup(fd)
        self.requests = 0
        self._lock = allocate_lock()
        # ``identity``: (device, inode, size, mtime_ns) the header was read from; after each
        # read the file must still have it (a writer truncating and re-extending it in
        # place would otherwise hand back zeros or a mix of two versions)
        self._identity = identity

    def verify(self) -> None:
        """Raise :class:`SourceError` naming the file when it changed in place since
        ``identity`` was taken (size or modification time)."""
        if self._identity is not None:
            check_identity(self.path, self.fd, self._identity)

    def close(self) -> None:
        os.close(self.fd)

    def can_read_tables(self) -> bool:
        return _PREADV is not None

    def can_read_runs(self) -> bool:
        return _PREAD is not None

    def _count(self) -> None:
        with self._lock:
            self.requests += 1

    def _ended(self, at: int, missing: int) -> TruncatedFileError:
        """A read that got nothing at byte ``at``, ``missing`` bytes short: the file ends
        there, or before it (a file cut below where the read began), as ``fstat`` says."""
        end = at
        with contextlib.suppress(OSError):
            end = min(at, os.fstat(self.fd).st_size)
        return TruncatedFileError(
            f"{self.path}: file ended at byte {end}, expected {at + missing - end} more bytes "
            "(was it truncated while loading?)",
            self.path,
            end,
        )

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        """Fill ``buffers`` in order from ``offset``, or raise naming the offset."""
        total = sum(len(b) for b in buffers)
        buffers = list(buffers)  # the caller's list is not modified
        done, i = 0, 0
        while i < len(buffers):
            n = os.preadv(self.fd, buffers[i : i + IOV_MAX], offset + done)
            self._count()
            if n == 0:
                raise self._ended(offset + done, total - done)
            done += n
            while i < len(buffers) and n >= len(buffers[i]):  # an index, not list slicing: O(n)
                n -= len(buffers[i])
                i += 1
            if n:
                buffers[i] = buffers[i][n:]
        self.verify()

    def read_into(self, array: np.ndarray, offset: int) -> None:
        """Fill the C-contiguous ``array`` from byte ``offset`` (one ``preadv`` when the
        file has the bytes), or raise naming the byte where the file ends."""
        got = os.preadv(self.fd, [array], offset)  # type: ignore[list-item]
        with self._lock:
            self.requests += 1
        if got != array.nbytes:  # short: the general path retries or raises naming the byte
            self.readv([memoryview(array.reshape(-1).view(np.uint8))[got:]], offset + got)  # type: ignore[arg-type]
            return
        self.verify()

    def read_runs(self, addr: list[int], length: list[int], offset: list[int]) -> None:
        """Fill ``length[k]`` bytes at raw address ``addr[k]`` from file byte
        ``offset[k]``, one ``pread`` per run (many small, scattered runs).

        The caller guarantees every run is writable memory it keeps alive.
        """
        if _PREAD is None:
            raise NotImplementedError(f"{self.path}: no pread in this C library; use readv")
        pread, fd, calls = _PREAD, self.fd, 0
        try:
            for a, n, off in zip(addr, length, offset, strict=True):
                got = pread(fd, a, n, off)
                calls += 1
                if got != n:  # short, interrupted or failed: the table path retries or raises naming the byte
                    got = max(got, 0)
                    self.readv_table(np.array([[a + got, n - got]], np.uint64), off + got)
        finally:
            with self._lock:
                self.requests += calls
        self.verify()

    def readv_table(self, table: np.ndarray, offset: int) -> None:
        """Fill the ``(address, length)`` rows of ``table`` (uint64, C-contiguous,
        modified on short reads) in order from ``offset``.

        The caller guarantees every row is writable memory it keeps alive.
        """
        if _PREADV is None:
            raise NotImplementedError(f"{self.path}: no preadv in this C library; use readv")
        i, pos = 0, offset
        while i < len(table):
            batch = table[i : i + IOV_MAX]
            want = int(batch[:, 1].sum())
            got = _PREADV(self.fd, batch.ctypes.data, len(batch), pos)
            self._count()
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, f"{os.strerror(err)} reading {self.path} at byte {pos}")
            if got == 0:
                raise self._ended(pos, int(table[i:, 1].sum()))
            pos += got
            if got == want:
                i += len(batch)
                continue
            ends = np.cumsum(batch[:, 1])
            k = int(np.searchsorted(ends, got, "right"))  # rows [0, k) are full
            into = got - (int(ends[k - 1]) if k else 0)
            i += k
            table[i, 0] += into
            table[i, 1] -= into
        self.verify()


class ViewReader:
    """A reader with no raw addresses to give (remote readers: none over the network; a
    state dict in memory): no iovec tables or batched runs, one ``memoryview`` per run
    (``readv``), named by ``url`` in errors."""

    url: str

    def readv(self, buffers: list[memoryview], offset: int) -> None:
        raise NotImplementedError

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.readv([memoryview(out)], offset)
        return bytes(out)

    def can_read_tables(self) -> bool:
        return False

    def can_read_runs(self) -> bool:
        return False

    def readv_table(self, table: object, offset: int) -> None:
        raise NotImplementedError(f"{self.url}: this reader fills memoryviews (readv), not iovec tables")

    def read_runs(self, addr: list[int], length: list[int], offset: list[int]) -> None:
        raise NotImplementedError(f"{self.url}: this reader fills memoryviews (readv), not raw runs")
