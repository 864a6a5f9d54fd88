"""One writer at a time per directory: a lock file that names its holder.

The lock is ``flock`` on ``<directory>/_nnx_save.lock``, held for as long as the writer
lives (a writer that finds no lock file makes it from its record, written whole and
locked first, then linked to the name: a full disk fails before the name exists): the kernel releases it when the holding process ends, however it ends, so a dead
holder never blocks the next writer. The file records the holder (host with its PID
namespace, process id, process start time) for the message that refuses a second writer.
A process forked from the holder closes its copy at once (``os.register_at_fork``), so a
child that outlives its parent does not keep the lock.

Where the filesystem has no ``flock`` (some network and FUSE mounts answer ``ENOLCK`` or
``EOPNOTSUPP``) the lock is the record itself, created exclusively: the writer writes its
record into a temporary file and hard-links it to the lock's name (``link`` fails when the
name exists, so of two writers exactly one creates it, and the record is whole from the
first instant). A record whose holder is live, or on another host, refuses the writer. One
whose holder is provably dead (on this host, its process gone or its process id now another
process's), or an empty one, is taken over under a second exclusive record,
``_nnx_save.lock.takeover``: only the writer holding it may remove a record not its own, and
it reads the record again before it does, so a record that came alive meanwhile is never
removed. A takeover record whose own holder died (killed inside that short step) is not
broken by anyone: the writer is refused, naming the file to remove. The holder removes its
record when it lets go. A record that is not one of ours (text that does not parse) is
refused, named, whatever the filesystem.

A writer may ask for the file to go when it releases (``remove=True``: a HuggingFace model
directory is uploaded whole, so no file of ours may stay in it): it unlinks the file while
it still holds the lock, then closes it. A writer that opened the file just before, and
gets the lock once it is closed, holds an unlinked inode; so :meth:`WriterLock.acquire`
checks, once it holds the lock, that its descriptor is still the file at the path
(``fstat(fd)`` against ``stat(path)``), and otherwise opens the path again. A file left by a
killed writer names a dead holder whose ``flock`` the kernel released: the next writer
takes it over (and, removing, removes it).

:func:`one_writer` holds the lock for the writer of a multi-process JAX job: process 0
takes it before the save's first step and gives it up after the commit; its peers never
take it, and every process of a second job is refused alike.

Readers never take, break or clean up after the lock, and no reader treats the file
as a checkpoint file: every layout lists its files by name, and ``_nnx_save.lock`` is
none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import itertools
import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import DirectoryLockedError, SaveError
from ._atomic import host_name, make_directory, pid_alive, temp_path
from ._kv import Channel, StepResult, Sync

__all__ = [
    "LOCK_NAME",
    "STORE_RECORD",
    "TAKEOVER_NAME",
    "Holder",
    "WriterLock",
    "holder_of",
    "one_writer",
    "process_start",
]

LOCK_NAME = "_nnx_save.lock"
TAKEOVER_NAME = "_nnx_save.lock.takeover"  # held while a dead holder's record is replaced (no flock)
STORE_RECORD = "_nnx_save_store.json"  # the step store's record, beside its lock: the store owns the directory
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL)
_RECORD_CAP = 4096  # a holder record is ~200 bytes; more is not one of ours
_REOPENS = 100  # a lock file replaced under us this many times in a row: a churn we do not wait out
_JOBS = itertools.count()  # every process of a job takes its writer locks in the same order (SPMD)

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
        return cls(host_name(), os.getpid(), process_start(os.getpid()), what)

    def gone(self) -> bool:
        """Provably dead: on this host, and its process is gone or is another process now."""
        if self.host != host_name():
            return False  # another host's processes cannot be checked from here
        if not pid_alive(self.pid):
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
        started = _wall_time(self.started) if self.host == host_name() else None
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

    def __init__(self, path: Path, fd: int, remove: bool = False) -> None:
        self.path, self._fd, self._remove = path, fd, remove

    @classmethod
    def acquire(cls, directory: Path, what: str, *, remove: bool = False) -> WriterLock:
        """Take the lock of ``directory`` (made if missing) for ``what``.

        Args:
            directory: The directory one writer at a time may write.
            what: What writes, for the message that refuses the next one.
            remove: Unlink the lock file at :meth:`release` (else it stays, emptied).

        Raises:
            DirectoryLockedError: A live writer holds it (named in the error).
            SaveError: The lock file cannot be created.
        """
        path = directory / LOCK_NAME
        for _ in range(_REOPENS):
            fd = _open(directory, path)
            if fd is None:  # none yet: made whole, from a record written first
                made = _create(directory, path, what)
                if made is None:  # another writer made it first: look at theirs
                    continue
                fd, flocked = made
                return cls._held(path, fd, remove or not flocked)
            try:
                if not cls._claim(fd, directory):  # no flock here: the record, created exclusively
                    os.close(fd)
                    fd = _claim_by_record(directory, path, what)
                    return cls._held(path, fd, remove=True)
                _check_flocked(fd, path)
                if not _is_file_at(fd, path):  # its holder removed it as it let go: lock the new one
                    os.close(fd)
                    continue
                _write_record(fd, path, what)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            return cls._held(path, fd, remove)
        raise DirectoryLockedError(str(directory), f"other writers (its {LOCK_NAME} was replaced {_REOPENS} times)")

    @classmethod
    def _held(cls, path: Path, fd: int, remove: bool) -> WriterLock:
        with _held_lock:
            _held.add(fd)
        return cls(path, fd, remove)

    @staticmethod
    def _claim(fd: int, directory: Path) -> bool:
        """Take the ``flock`` (True), or False where the filesystem has none."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = _read(fd)
        except OSError as error:
            if error.errno not in _NO_FLOCK:
                raise
            return False
        raise DirectoryLockedError(str(directory), str(holder) if holder else "another process (not yet named)")

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Give the lock up (idempotent): the file is removed (``remove``), else its
        record emptied, while the lock is held; then the file is closed."""
        fd, self._fd = self._fd, -1
        with _held_lock:
            mine = fd in _held  # not after a fork: the child closed it, and the number may be reused
            _held.discard(fd)
        if not mine:
            return
        with contextlib.suppress(OSError):
            if self._remove and _is_file_at(fd, self.path):
                os.unlink(self.path)
            else:
                os.ftruncate(fd, 0)
        os.close(fd)

    def __del__(self) -> None:  # a writer dropped without release: its lock goes with it
        try:  # noqa: SIM105 - contextlib itself may be gone at interpreter exit
            self.release()
        except Exception:  # at interpreter exit the module globals may be gone; the kernel frees the lock
            pass

    def __repr__(self) -> str:
        return f"WriterLock({str(self.path)!r}, {'held' if self.held else 'released'})"


def _open(directory: Path, path: Path) -> int | None:
    """The lock file at ``path``, opened (never created: see :func:`_create`); None when
    there is none."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise SaveError(f"{path}: cannot create the writer's lock file ({error.strerror})", str(path)) from error
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode):  # its links are counted once it is locked (a record being created has two)
        return fd
    os.close(fd)  # the holder's record would be written into it: a device, or a FIFO
    raise _not_ours(path, "not a regular file")


def _not_ours(path: Path, what: str) -> SaveError:
    return SaveError(
        f"{path}: the writer's lock file is {what}; nothing was written (remove it, and save again)", str(path)
    )


def _check_flocked(fd: int, path: Path) -> None:
    """The locked file is ours to write: one link (else another file's content would be
    replaced), and empty or a holder record (else it is another tool's file)."""
    st = os.fstat(fd)
    if st.st_nlink > 1:
        raise _not_ours(path, f"a hard link to another file ({st.st_nlink} links)")
    if st.st_size and _read(fd) is None:
        raise _not_ours(path, "not a lock record of nnx_save (another tool's file?)")


def _write_record(fd: int, path: Path, what: str) -> None:
    """Write this process's record into the locked file; on failure (a full disk) remove the
    file, still locked, so that no lock file is left, and raise :class:`SaveError`."""
    try:
        os.ftruncate(fd, 0)
        _write_whole(fd, Holder.this_process(what).to_json().encode())
    except OSError as error:
        with contextlib.suppress(OSError):
            if _is_file_at(fd, path):
                os.unlink(path)
        raise _record_failed(path, error) from error


def _write_whole(fd: int, record: bytes) -> None:
    """Write ``record`` at the start of ``fd``: a short write loops (a record is ~200 bytes)."""
    done = 0
    while done < len(record):
        done += os.pwrite(fd, record[done:], done)


def _record_failed(path: Path, error: OSError) -> SaveError:
    return SaveError(
        f"{path}: cannot write the writer's lock record ({error.strerror}); nothing was written", str(path)
    )


def _create(directory: Path, path: Path, what: str) -> tuple[int, bool] | None:
    """Make the lock file, which is not there, from this process's record written whole
    first (a full disk fails before the name exists): ``flock`` it and link it to the name
    (``(fd, True)``), or where there is no ``flock`` claim it as a record (``(fd, False)``);
    None when another writer made it first."""
    fd, staged = _staged_record(path, what)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file no one else has opened yet
    except OSError as error:
        if error.errno in _NO_FLOCK:
            return _claim_by_record(directory, path, what, (fd, staged)), False
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    with _staged_gone(fd, staged):
        linked = _link(staged, path)
    if not linked:
        os.close(fd)
        return None
    return fd, True


def _claim_by_record(directory: Path, path: Path, what: str, made: tuple[int, Path] | None = None) -> int:
    """Create the lock's record exclusively (no ``flock`` here); return its descriptor.
    ``made``: the record, already written (descriptor and temporary name).

    Raises:
        DirectoryLockedError: A live writer's record, or a takeover record, is there.
        SaveError: The record cannot be written, or the file there is not ours.
    """
    fd, staged = made or _staged_record(path, what)
    with _staged_gone(fd, staged):
        for _ in range(_REOPENS):
            if _link(staged, path) or _taken_over(directory, path, staged):
                return fd
        raise DirectoryLockedError(str(directory), f"other writers (its {LOCK_NAME} was replaced {_REOPENS} times)")


@contextlib.contextmanager
def _staged_gone(fd: int, staged: Path) -> Iterator[None]:
    """Remove the staged record ``staged`` once the body is done with it, whatever
    happens; close its descriptor ``fd`` only when the body raises (else it is the lock's)."""
    try:
        yield
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staged)


def _staged_record(path: Path, what: str) -> tuple[int, Path]:
    """This process's record, whole, in a temporary file beside ``path``."""
    staged = temp_path(path)
    try:
        fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as error:
        raise SaveError(f"{path}: cannot create the writer's lock file ({error.strerror})", str(path)) from error
    try:
        _write_whole(fd, Holder.this_process(what).to_json().encode())
    except OSError as error:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise _record_failed(path, error) from error
    return fd, staged


def _link(staged: Path, path: Path) -> bool:
    """Give ``staged`` the name ``path`` unless that name exists (atomic: one wins)."""
    try:
        os.link(staged, path, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError as error:
        raise _record_failed(path, error) from error
    return True


def _taken_over(directory: Path, path: Path, staged: Path) -> bool:
    """Replace a dead holder's (or an empty) record at ``path`` by ours, holding the
    takeover record; False when the name was taken again meanwhile (the caller retries)."""
    _refuse_live(directory, path)  # most refusals need no takeover record
    guard = directory / TAKEOVER_NAME
    if not _link(staged, guard):
        holder = holder_of(directory, TAKEOVER_NAME)
        if holder is None and _foreign(guard):
            raise _not_ours(guard, "not a lock record of nnx_save (another tool's file?)")
        if holder is None or not holder.gone():
            time.sleep(0.001)
            return False  # another writer is taking it over (or just let it go): look again
        raise DirectoryLockedError(
            str(directory), f"{holder}, which died taking the lock over (if no writer runs, remove {guard})"
        )
    try:
        if _refuse_live(directory, path):
            os.unlink(path)  # dead or empty, and only the takeover record's holder removes one
        return _link(staged, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(guard)


def _foreign(path: Path) -> bool:
    """Whether ``path`` is there and is not a record (a record is linked whole: never empty)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISREG(st.st_mode) or st.st_size > 0


def _refuse_live(directory: Path, path: Path) -> bool:
    """Raise for a live holder's record (or a file not ours) at ``path``; True when a dead
    holder's or an empty record is there, False when nothing is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError as error:
        raise _not_ours(path, f"unreadable ({error.strerror})") from error
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_ours(path, "not a regular file")
        holder = _read(fd)
    finally:
        os.close(fd)
    if holder is None and st.st_size:
        raise _not_ours(path, "not a lock record of nnx_save (another tool's file?)")
    if holder is not None and not holder.gone():
        raise DirectoryLockedError(str(directory), str(holder))
    return True


def _is_file_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the one at ``path`` now (not unlinked or replaced)."""
    try:
        mine, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


@contextlib.contextmanager
def one_writer(directory: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold the lock of ``directory`` (created, as a save's) for the writer of this job while
    the block runs, and remove the lock file after it: taken by process 0 alone, before
    any other step; refused on every process of the job when another writer holds it.

    Args:
        directory: The directory the save writes (a local path).
        what: What writes (``"a multi-file save"``), for the message that refuses the next one.

    Raises:
        DirectoryLockedError: Another live writer holds ``directory`` (named); nothing was written.
        SaveError: ``directory`` or the lock file cannot be created, or process 0's answer did
            not come in time.

    Examples:
        >>> import tempfile
        >>> where = tempfile.mkdtemp()
        >>> with one_writer(where, "a save"):
        ...     print(holder_of(Path(where)).what)
        a save
        >>> os.listdir(where)
        []
    """
    root = make_directory(directory)
    kv = Channel.open(str(root), SaveError)
    holder, lock = None, None
    if kv.n == 1:
        lock = WriterLock.acquire(root, what, remove=True)
    else:
        holder, lock = _take_for_job(root, what, kv)
    if holder is not None:
        raise DirectoryLockedError(str(root), holder)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _take_for_job(root: Path, what: str, kv: Channel) -> tuple[str | None, WriterLock | None]:
    """Process 0 takes the lock; every process learns who holds it instead (``None``: us)."""
    sync = Sync(root, kv, f"nnx_save/lock/{next(_JOBS)}", what=what, intact="nothing was written")
    taken: list[WriterLock] = []

    def take() -> str | None:
        try:
            taken.append(WriterLock.acquire(root, what, remove=True))
        except DirectoryLockedError as error:
            return error.holder
        return None

    try:
        holder = sync.step("lock", StepResult.of(take) if kv.pid == 0 else None, only=0)[0]
    except BaseException:
        for lock in taken:
            lock.release()
        raise
    if kv.pid != 0:
        kv.read_once(f"{sync.prefix}/lock", kv.n - 1)  # the last peer to read it deletes the key
    return holder, (taken[0] if taken else None)


def holder_of(directory: Path, name: str = LOCK_NAME) -> Holder | None:
    """The writer the lock file of ``directory`` names (a record, not a proof it is alive)."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
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
