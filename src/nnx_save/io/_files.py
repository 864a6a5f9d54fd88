"""Local files: opening only regular files, exact positioned reads, and the one
process-wide pool of pinned descriptors.

A header read from local files pins each descriptor, so a load reads the very file it
validated even when a writer renames a new version over it. The pool holds a quarter of
the soft ``RLIMIT_NOFILE``; beyond it the least recently used descriptor is closed, and
reopened by name when next read (a typed error if it is no longer the same file).
"""

from __future__ import annotations

import collections
import contextlib
import os
import stat
import types
from _thread import allocate_lock  # threading.Lock itself: a small read need not import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from ..errors import SourceChangedError, SourceError, TruncatedFileError
from ..format._header import MAX_HEADER_SIZE

if TYPE_CHECKING:
    import numpy as np

_native: types.ModuleType | None
try:  # the optional extension (src/nnx_save/io/_gather.c): read_at, a pread and its fstat in one call
    from . import _gather as _native
except ImportError:  # pragma: no cover - an install built without a C compiler
    _native = None

__all__ = [
    "Pinned",
    "max_pinned",
    "open_head",
    "open_heads",
    "open_regular",
    "open_stat",
    "pread_exact",
    "read_capped",
    "read_head",
    "require_regular",
]

_Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


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


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def open_stat(name: str) -> tuple[int, os.stat_result]:
    """Open ``name`` for reading without blocking (a FIFO would otherwise wait for a
    writer forever) and ``fstat`` the descriptor itself: ``(fd, stat)``, whatever
    the file is (a directory too: the caller decides).

    Raises:
        SourceError: an unreadable path.
        FileNotFoundError: no such file.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SourceError(f"{name}: cannot open the file ({e.strerror})", name) from None
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def require_regular(fd: int, st: os.stat_result, name: str) -> None:
    """Set ``fd`` (from :func:`open_stat`) back to blocking if it is a regular file;
    else close it and raise :class:`SourceError` naming what it is."""
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), f"not a regular file (mode {st.st_mode:o})")
        raise SourceError(f"{name}: is {kind}, not a regular file; checkpoint files must be regular files", name)
    os.set_blocking(fd, True)


def open_head(name: str) -> tuple[int, os.stat_result, bytes, bytes | None]:
    """Open the regular file ``name`` (as :func:`open_regular`) and read its safetensors
    header, exactly: the 8-byte size prefix (none under 8 bytes: the size is checked
    first, ``/proc`` files report 0 and some fail to read), then the header it declares
    when that fits the file and the cap (else ``None``: the caller's checks say why).
    Returns ``(fd, stat, prefix, header)``; the caller owns ``fd``.

    Raises:
        SourceError: not a regular file, an unreadable path, or a read failed.
        FileNotFoundError: no such file.
    """
    fd, st = open_stat(name)
    require_regular(fd, st, name)
    return fd, st, *read_head(fd, st, name)


def read_head(fd: int, st: os.stat_result, name: str) -> tuple[bytes, bytes | None]:
    """The size prefix and header of the regular file open as ``fd``, as :func:`open_head`
    reads them; on a failure ``fd`` is closed.

    Raises:
        SourceError: a read failed.
    """
    try:
        prefix = os.pread(fd, 8, 0) if st.st_size >= 8 else b""
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else MAX_HEADER_SIZE + 1
        return prefix, os.pread(fd, n, 8) if n <= MAX_HEADER_SIZE and 8 + n <= st.st_size else None
    except OSError as e:
        os.close(fd)
        raise SourceError(f"{name}: reading the header failed ({e.strerror or e})", name) from None
    except BaseException:
        os.close(fd)
        raise


def open_heads(names: Sequence[str]) -> list[tuple[int, os.stat_result, bytes, bytes | None]]:
    """:func:`open_head` of each of ``names`` (a checkpoint's files, opened together);
    on a failure, the ones opened are closed."""
    opened: list[tuple[int, os.stat_result, bytes, bytes | None]] = []
    try:
        for name in names:
            opened.append(open_head(name))
    except BaseException:
        for fd, *_ in opened:
            os.close(fd)
        raise
    return opened


def open_regular(name: str) -> int:
    """Open ``name`` for reading, refusing anything but a regular file
    (:func:`open_stat`, then :func:`require_regular`).

    Raises:
        SourceError: a directory, FIFO, device or socket, or an unreadable path.
        FileNotFoundError: no such file.
    """
    fd, st = open_stat(name)
    require_regular(fd, st, name)
    return fd


def read_capped(name: str, what: str, cap: int, error: Callable[[str], Exception]) -> bytes:
    """The bytes of a small record (an index, a manifest): a regular file (never a
    FIFO or device) of at most ``cap`` bytes, sized before it is read."""
    fd = open_regular(name)
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise error(f"{name}: {what} of {size} bytes exceeds the cap of {cap} bytes")
        return pread_exact(fd, size, 0, name)
    finally:
        os.close(fd)


def max_pinned() -> int:
    """Descriptors the whole process keeps pinned: a quarter of the soft descriptor
    limit, at most 4096 (64 where the limit cannot be read).

    The limit is read through ``sysconf``, which gives the soft ``RLIMIT_NOFILE`` (-1 or
    a huge number where it is unlimited) without importing :mod:`resource`, a C extension
    a small read would otherwise load."""
    try:
        soft = os.sysconf("SC_OPEN_MAX")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return 64
    return 4096 if soft < 0 else max(0, min(4096, soft // 4))


def _identity(fd: int, st: os.stat_result | None = None) -> _Identity:
    st = os.fstat(fd) if st is None else st
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _Pool:
    """The process's pinned descriptors, least recently used first.

    A ``Pinned`` collected while its own thread holds the lock (the garbage collector
    runs ``__del__`` at any allocation, inside a locked section too) must not wait for
    that lock: it leaves its owner id in ``pending`` instead (a deque append takes no
    lock), and whoever takes the lock next drops those owners first, before an id
    can be reused by a new ``Pinned``.

    A small read (:meth:`read_at`) reads on the pool's own descriptor without the lock,
    which a read from a cold page cache would hold for the disk's time: the descriptor
    is marked ``busy`` while it reads, and one dropped meanwhile (evicted, or its owner
    closed) is closed by the last read on it, never under it (its number could be
    reused by another file)."""

    def __init__(self) -> None:
        self.fds: collections.OrderedDict[tuple[int, str], int] = collections.OrderedDict()
        self.lock = allocate_lock()
        self.pending: collections.deque[int] = collections.deque()
        self.busy: dict[int, int] = {}  # descriptor -> reads on it in flight
        self.doomed: set[int] = set()  # busy descriptors dropped from the pool: closed by their last read

    def _let_go(self, fd: int) -> None:
        """Close a descriptor the pool let go of, or leave it to its last read (the lock held)."""
        if fd in self.busy:
            self.doomed.add(fd)
        else:
            _close(fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self.lock:
            self._drain()
            yield

    def _drain(self) -> None:
        """Drop the owners collected while the lock was busy (the lock held)."""
        while self.pending:
            self._drop(self.pending.popleft())

    def add(self, key: tuple[int, str], fd: int, dup: bool = False) -> int | None:
        """Keep ``fd`` under ``key`` (the least recently used one goes when full); with
        ``dup``, a duplicate of it for the caller (None where the pool keeps nothing:
        then ``fd`` is the caller's still)."""
        with self.locked():
            limit = max_pinned()
            while self.fds and len(self.fds) >= limit:
                self._let_go(self.fds.popitem(last=False)[1])
            if limit:
                self.fds[key] = fd
                return os.dup(fd) if dup else None
        if not dup:
            _close(fd)
        return None

    def dup(self, key: tuple[int, str]) -> int | None:
        with self.lock:  # never dup a number another thread has just closed (and the OS reused)
            self._drain()  # as locked() does, without a generator on every small read's path
            fd = self.fds.get(key)
            if fd is None:
                return None
            self.fds.move_to_end(key)
            return os.dup(fd)

    def read_at(self, key: tuple[int, str], out: np.ndarray, offset: int, identity: _Identity) -> bool:
        """Whether ``out`` was filled from byte ``offset`` of ``key``'s descriptor, the file
        still of ``identity``'s size and modification time after the read: one native call
        on the pool's descriptor, marked busy (not closed meanwhile, so no duplicate is
        needed) and read outside the lock. False where there is no native call, no such
        descriptor, a short read, a changed file or an error."""
        if _native is None:
            return False
        with self.lock:
            if self.pending:
                self._drain()
            fd = self.fds.get(key)
            if fd is None:
                return False
            self.fds.move_to_end(key)  # used: the least recently used goes first, as after dup()
            busy = self.busy
            busy[fd] = busy.get(fd, 0) + 1
        try:
            return _native.read_at(fd, out, offset, identity[2], identity[3]) == out.nbytes
        except OSError:
            return False
        finally:
            with self.lock:
                if busy[fd] > 1:
                    busy[fd] -= 1
                else:
                    del busy[fd]
                    if fd in self.doomed:
                        self.doomed.discard(fd)
                        _close(fd)

    def drop(self, owner: int, wait: bool = True) -> None:
        """Close ``owner``'s descriptors; with ``wait=False`` (a finalizer) never wait
        for the lock: a busy pool drops them when it is next taken."""
        if not self.lock.acquire(blocking=wait):
            self.pending.append(owner)
            return
        try:
            self._drain()
            self._drop(owner)
        finally:
            self.lock.release()

    def _drop(self, owner: int) -> None:
        for key in [k for k in self.fds if k[0] == owner]:
            self._let_go(self.fds.pop(key))


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


_POOL = _Pool()


def _after_fork() -> None:
    """In a forked child: a new lock (another thread may have held the parent's), and no
    read in flight (the threads reading are the parent's): the descriptors they kept open
    for themselves are closed."""
    _POOL.lock = allocate_lock()
    _POOL.busy.clear()
    for fd in _POOL.doomed:
        _close(fd)
    _POOL.doomed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _changed(name: str, what: str) -> SourceChangedError:
    return SourceChangedError(
        f"{name}: {what} since its header was read (its descriptor was released: more files are open than "
        "the descriptor limit allows pinned); read the header again and reload",
        name,
    )


class Pinned:
    """The files whose headers one header holds: their descriptors, kept in the
    process-wide pool while it has room, and each file's identity, so a file whose
    descriptor was let go is reopened only if it is still the same file. Released by
    :meth:`close` or when garbage collected."""

    def __init__(self) -> None:
        self.seen: dict[str, _Identity] = {}
        self._open = True

    def __del__(self) -> None:  # not weakref.finalize: this is on every open's path, and costs nothing until then
        try:  # noqa: SIM105 - not contextlib.suppress: at interpreter exit module globals (contextlib, the pool) may be gone first
            self.close(wait=False)  # a finalizer never waits: it may run inside the pool's own lock
        except Exception:
            pass

    def keep(self, name: str, fd: int, st: os.stat_result | None = None) -> None:
        """Take ``fd``, open on ``name`` (closed here if ``name`` is already held);
        ``st``: its ``fstat``, when the caller has it."""
        if name in self.seen:
            os.close(fd)
            return
        self.seen[name] = _identity(fd, st)
        _POOL.add((id(self), name), fd)

    def keep_all(self, opened: Sequence[tuple[str, int, os.stat_result]]) -> None:
        """:meth:`keep` each ``(name, fd, stat)``."""
        for name, fd, st in opened:
            self.keep(name, fd, st)

    def read_checked(self, name: str, out: np.ndarray, offset: int) -> bool:
        """Whether ``out`` was filled with the bytes of ``name`` from ``offset``, the file
        unchanged since its header was read, by one native call on the pool's own
        descriptor (:meth:`_Pool.read_at`). False when that cannot be told here: the
        caller reads the general way, which reopens, retries or names what happened."""
        seen = self.seen.get(name)
        return seen is not None and _POOL.read_at((id(self), name), out, offset, seen)

    def open(self, name: str) -> int:
        """A new descriptor on the file ``name`` was when its header was read.

        Raises:
            SourceChangedError: the file was replaced, changed or removed since; read the header again.
            SourceError: the process's descriptor limit is reached.
        """
        try:
            fd = _POOL.dup((id(self), name))
            if fd is not None or name not in self.seen:
                return os.open(name, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd
        except OSError as error:  # EMFILE: the process's limit, reached by someone else's descriptors
            raise SourceError(f"{name}: cannot open the file ({error.strerror})", name) from None
        try:
            fd = open_regular(name)
        except FileNotFoundError:
            raise _changed(name, "gone") from None
        if _identity(fd) != self.seen[name]:
            os.close(fd)
            raise _changed(name, "replaced or changed")
        return self._pin_again(name, fd)

    def _pin_again(self, name: str, fd: int) -> int:
        """Keep a reopened ``fd`` in the pool again (the next read needs no reopening); a
        duplicate for the caller."""
        try:
            mine = _POOL.add((id(self), name), fd, dup=True) if self._open else None
        except OSError as error:
            raise SourceError(f"{name}: cannot open the file ({error.strerror})", name) from None
        return fd if mine is None else mine

    def replaced(self) -> list[str]:
        """The names whose path holds another file now than the one pinned (replaced,
        changed or gone since its header was read)."""
        gone = []
        for name, seen in self.seen.items():
            try:
                now = _identity(-1, os.stat(name))
            except OSError:
                now = None
            if now != seen:
                gone.append(name)
        return gone

    def close(self, wait: bool = True) -> None:
        """Release every pinned descriptor now (and no later than when garbage collected)."""
        if self._open:
            self._open = False
            _POOL.drop(id(self), wait)
