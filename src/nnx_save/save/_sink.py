"""One file's bytes written front to back, with the disk kept busy while the caller
produces the next ones, so that the final ``fsync`` has little left to do.

Two ways, chosen per file:

- **direct** (``O_DIRECT``, where the filesystem takes it and ``NNX_SAVE_DIRECT_IO``
  allows): the bytes are gathered into a few page-aligned chunks and each full chunk
  is written by a helper thread straight to the disk while the next is filled; the
  page cache is bypassed, so nothing waits for the kernel to find and dirty pages
  (on VMs the slowest part of a buffered write) and the save leaves no dirty pages
  behind. The last, partial chunk is written through the page cache (``O_DIRECT``
  needs whole blocks), and so is anything after :meth:`Sink.finish`.
- **buffered** (elsewhere): plain writes, with the kernel's write-back of each
  completed chunk started at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)`` on
  Linux) instead of at the ``fsync``.

Host memory: ``DEPTH`` chunks of ``CHUNK_BYTES`` in the direct way, none in the other.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import _config

__all__ = ["CHUNK_BYTES", "DEPTH", "Sink", "chunk_memory", "pwrite_all"]

CHUNK_BYTES = 4 << 20  # a power of two: every direct write is whole blocks at a block-aligned offset
DEPTH = 2  # chunks in rotation: one filled by the caller while the other is written


def chunk_memory(size: int, budget: int) -> int:
    """Host bytes a :class:`Sink` of a ``size``-byte file may hold for direct I/O, out
    of a save's ``budget``: its chunks when the file fills one and they take at most
    half the budget (``NNX_SAVE_DIRECT_IO`` allowing), else 0 (buffered writes)."""
    held = DEPTH * CHUNK_BYTES
    return held if size >= CHUNK_BYTES and 2 * held <= budget and _config.DIRECT_IO.get() else 0


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``: a short write loops; an error raises ``OSError``."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + (1 << 30)], offset + done)


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the system or filesystem refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return False
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:  # EINVAL: this filesystem has no direct I/O
        return False
    return True


_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _range_starter() -> Callable[[int, int, int], Any] | None:
    """``start(fd, offset, length)``: begin write-back of a range without waiting
    (Linux's ``sync_file_range``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, length: fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class Sink:
    """Appends bytes to the file open on ``fd`` from offset 0 (see the module).

    ``memory``: the host bytes it may hold (:func:`chunk_memory`; 0: buffered
    writes). A context manager: on leaving, every write in
    flight has ended, so the descriptor may be closed; an error of a write raises
    from a later :meth:`write` or from :meth:`finish`.
    """

    def __init__(self, fd: int, memory: int) -> None:
        self.fd, self.pos, self.fill = fd, 0, 0  # direct: pos is where the chunk being filled goes
        self.direct = memory >= DEPTH * CHUNK_BYTES and _set_direct(fd, True)
        self.start = None if self.direct else _range_starter()
        self.started = 0  # buffered: write-back started up to here
        self.chunks = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(DEPTH)] if self.direct else []  # page-aligned
        self.pending: list[tuple[Future, int] | None] = [None] * DEPTH
        self.pool = ThreadPoolExecutor(DEPTH, "nnx_save-write") if self.direct else None

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, data: memoryview) -> None:
        """Append ``data`` (bytes as a ``memoryview``)."""
        done = 0
        while self.direct and done < len(data):
            n = min(CHUNK_BYTES - self.fill, len(data) - done)
            memoryview(self.chunks[self._slot()])[self.fill : self.fill + n] = data[done : done + n]
            self.fill, done = self.fill + n, done + n
            if self.fill == CHUNK_BYTES:
                self._submit()
        if done < len(data):
            pwrite_all(self.fd, data[done:], self.pos)
            self.pos += len(data) - done
            self._start_writeback(final=False)

    def finish(self) -> None:
        """Write what is left and wait for every write; ``fd`` is then buffered again:
        the caller may rewrite bytes in place and fsync."""
        for slot in range(DEPTH):
            self._wait(slot)
        if self.fill:
            tail = memoryview(self.chunks[self._slot()])[: self.fill]
            self._buffered()
            pwrite_all(self.fd, tail, self.pos)
            self.pos, self.fill = self.pos + len(tail), 0
        self._buffered()
        self._start_writeback(final=True)

    def close(self) -> None:
        """Wait for the writes in flight (their errors ignored: the caller is
        failing, or :meth:`finish` raised them) and free the chunks."""
        for job in self.pending:
            if job is not None:
                with contextlib.suppress(BaseException):
                    job[0].result()
        self.pending = [None] * DEPTH
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None
        self._buffered()
        self.chunks = []  # freed with the last view (a failed write's traceback may hold one)

    def _slot(self) -> int:
        return (self.pos // CHUNK_BYTES) % DEPTH

    def _submit(self) -> None:
        """Hand the full chunk to a writer thread and move on to the next slot,
        once that slot's previous write has ended."""
        assert self.pool is not None
        slot = self._slot()
        self.pending[slot] = (self.pool.submit(pwrite_all, self.fd, memoryview(self.chunks[slot]), self.pos), self.pos)
        self.pos, self.fill = self.pos + CHUNK_BYTES, 0
        self._wait(self._slot())

    def _wait(self, slot: int) -> None:
        """Wait for ``slot``'s write. One refused as direct I/O (``EINVAL``: the
        filesystem wants a larger alignment, or a short write left the offset
        unaligned) is written again through the page cache, and so is all that
        follows: the chunk is intact until its slot is refilled, after this wait."""
        job, self.pending[slot] = self.pending[slot], None
        if job is None:
            return
        try:
            job[0].result()
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._buffered()
            pwrite_all(self.fd, memoryview(self.chunks[slot]), job[1])

    def _buffered(self) -> None:
        if self.direct:
            _set_direct(self.fd, False)
            self.direct = False

    def _start_writeback(self, *, final: bool) -> None:
        if self.start is not None and self.pos > self.started and (final or self.pos - self.started >= CHUNK_BYTES):
            self.start(self.fd, self.started, self.pos - self.started)
            self.started = self.pos
