"""One writer at a time per directory: a lock file that names its holder.

The lock is ``flock`` on ``<directory>/_nnx_save.lock``, held for as long as the writer
lives: the kernel releases it when the holding process ends, however it ends, so a dead
holder never blocks the next writer. The file records the holder (host with its PID
namespace, process id, process start time) for the message that refuses a second writer.
A process forked from the holder closes its copy at once (``os.register_at_fork``), so a
child that outlives its parent does not keep the lock.

Where the filesystem has no ``flock`` (some network and FUSE mounts answer ``ENOLCK`` or
``EOPNOTSUPP``) the record decides alone: a holder on this host whose process is gone, or
whose process id now belongs to a process started at another time, is provably dead and
taken over; a live one, or one on another host, refuses the writer.

Readers never take, break or clean up after the lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import os
import threading
from pathlib import Path

from ..errors import DirectoryLockedError, SaveError
from ._write import _host, _pid_alive

__all__ = ["LOCK_NAME", "Holder", "WriterLock", "holder_of", "process_start"]

LOCK_NAME = "_nnx_save.lock"  # beside the store record _nnx_save_store.json
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL)
_RECORD_CAP = 4096  # a holder record is ~200 bytes; more is not one of ours

_held: set[int] = set()  # descriptors of the locks this process holds
_held_lock = threading.Lock()


def process_start(pid: int) -> int | None:
    """When process ``pid`` of this host started, in clock ticks since boot (Linux), else None.

    Examples:
        >>> process_start(os.getpid()) == process_start(os.getpid())
        True
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()  # after the command name, which may hold spaces and parens
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _wall_time(ticks: int | None) -> str | None:
    """A start time in ticks since boot as ISO 8601 UTC (None when unknown)."""
    try:
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        seconds = boot + (ticks or 0) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    if ticks is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")


@dataclasses.dataclass(frozen=True)
class Holder:
    """The writer a lock file names.

    Attributes:
        host: The host name with its PID namespace (as temporary file names carry it).
        pid: The process id on that host.
        started: The process's start time in clock ticks since boot (None: unknown).
        what: What writes (``"OrbaxCheckpointStore"``).

    Examples:
        >>> me = Holder.this_process("a store")
        >>> me.gone(), Holder.from_json(me.to_json()) == me
        (False, True)
    """

    host: str
    pid: int
    started: int | None
    what: str

    @classmethod
    def this_process(cls, what: str) -> Holder:
        return cls(_host(), os.getpid(), process_start(os.getpid()), what)

    def gone(self) -> bool:
        """Provably dead: on this host, and its process is gone or is another process now."""
        if self.host != _host():
            return False  # another host's processes cannot be checked from here
        if not _pid_alive(self.pid):
            return True
        return self.started is not None and process_start(self.pid) not in (None, self.started)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Holder | None:
        """The holder a record names, or None for an empty or foreign record."""
        try:
            data = json.loads(text)
            holder = cls(str(data["host"]), int(data["pid"]), data["started"], str(data["what"]))
        except (ValueError, TypeError, KeyError):
            return None
        return holder if holder.started is None or isinstance(holder.started, int) else None

    def __str__(self) -> str:
        started = _wall_time(self.started) if self.host == _host() else None
        since = f", started {started}" if started else ""
        return f"{self.what} in process {self.pid} on host {self.host}{since}"


class WriterLock:
    """The exclusive right to write into one directory, held until :meth:`release`.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> where = Path(tempfile.mkdtemp())
        >>> lock = WriterLock.acquire(where, "a store")
        >>> try:
        ...     WriterLock.acquire(where, "another store")
        ... except DirectoryLockedError as error:
        ...     print(error.holder.startswith("a store in process"))
        True
        >>> lock.release()
        >>> WriterLock.acquire(where, "another store").release()
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, directory: Path, what: str) -> WriterLock:
        """Take the lock of ``directory`` (made if missing) for ``what``.

        Raises:
            DirectoryLockedError: A live writer holds it (named in the error).
            SaveError: The lock file cannot be created.
        """
        path = directory / LOCK_NAME
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        except OSError as error:
            raise SaveError(f"{path}: cannot create the writer's lock file ({error.strerror})", str(path)) from error
        try:
            cls._claim(fd, directory)
            record = Holder.this_process(what).to_json().encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except BaseException:
            os.close(fd)
            raise
        with _held_lock:
            _held.add(fd)
        return cls(path, fd)

    @staticmethod
    def _claim(fd: int, directory: Path) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _read(fd)
        except OSError as error:
            if error.errno not in _NO_FLOCK:
                raise
            holder = _read(fd)  # no flock on this filesystem: the record decides
            if holder is None or holder.gone():
                return
        raise DirectoryLockedError(str(directory), str(holder) if holder else "another process (not yet named)")

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Give the lock up (idempotent): the record is emptied, then the file closed."""
        fd, self._fd = self._fd, -1
        with _held_lock:
            mine = fd in _held  # not after a fork: the child closed it, and the number may be reused
            _held.discard(fd)
        if not mine:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)

    def __del__(self) -> None:  # a writer dropped without release: its lock goes with it
        try:  # noqa: SIM105 - contextlib itself may be gone at interpreter exit
            self.release()
        except Exception:  # at interpreter exit the module globals may be gone; the kernel frees the lock
            pass

    def __repr__(self) -> str:
        return f"WriterLock({str(self.path)!r}, {'held' if self.held else 'released'})"


def holder_of(directory: Path) -> Holder | None:
    """The writer the lock file of ``directory`` names (a record, not a proof it is alive)."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return _read(fd)
    finally:
        os.close(fd)


def _read(fd: int) -> Holder | None:
    try:
        return Holder.from_json(os.pread(fd, _RECORD_CAP, 0).decode("utf-8", "replace"))
    except OSError:
        return None


def _close_in_child() -> None:
    """A forked child must not keep its parent's locks alive after the parent ends."""
    global _held_lock
    _held_lock = threading.Lock()
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
