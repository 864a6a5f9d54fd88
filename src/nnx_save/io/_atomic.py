"""Write-side primitives every writer shares: the write-everything loop, temporary
names and the atomic replace.

A file is written under a temporary name beside its target, fsynced, renamed over
it and the directory fsynced: a crash leaves the previous file or the new one. The
new inode gets mode 0o666 under the umask, as a plain ``open()`` would (the old
file's mode, owner and hard links are not carried over).

Temporary names (``.<name>.nnx_save-tmp-<host>-<pid>-<random>``) carry the host (with
its PID namespace) and process id, so the next save of a target removes those of
dead processes of this host; other hosts' and live processes' are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import SaveError
from ._files import _KINDS

if TYPE_CHECKING:  # imported where used: a read of a local file needs neither
    import logging
    from pathlib import Path

__all__ = [
    "NAME_MAX",
    "TMP_MARKER",
    "atomic_file",
    "commit_staged",
    "discard_staged",
    "fsync_dir",
    "make_directory",
    "remove_stale_temps",
    "replace_file",
    "temp_path",
]

TMP_MARKER = ".nnx_save-tmp-"
NAME_MAX = 255  # bytes in one file name (Linux, macOS, most filesystems)


def _log() -> logging.Logger:
    """The package's logger; logging is imported by the first message (a read logs none)."""
    import logging

    return logging.getLogger("nnx_save")


def write_all(fd: int, data: memoryview, offset: int | None = None) -> None:
    """Write all of ``data`` (at ``offset``, else at the file position): a short write loops."""
    done = 0
    while done < len(data):
        if offset is None:
            done += os.write(fd, data[done : done + (1 << 30)])
        else:
            done += os.pwrite(fd, data[done : done + (1 << 30)], offset + done)


def host_name() -> str:
    """This host's name, made safe for a file name (cut to 64 characters), and on
    Linux the PID namespace: containers sharing a host name and a filesystem but not
    their process ids must not judge each other's processes dead."""
    import socket  # here, not with nnx_save: only saves name temporary files

    name = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())[:64] or "localhost"
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return name
    return f"{name}.ns{re.sub(r'[^0-9]', '', namespace)}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, under another user; else: cannot tell
        return True
    return True


def remove_stale_temps(path: Path) -> list[str]:
    """Remove temporary files of ``path`` left by dead processes of this host; return their names.

    Only names this module makes for this very target are considered; a file whose
    host is another, whose process is alive (or is this one), or whose name does
    not parse is kept. Best effort: a failure to list or remove is ignored (the
    save itself reports real I/O problems).
    """
    prefix, host, removed = _temp_prefix(path), host_name(), list[str]()
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        pid = _stale_pid(name, prefix, host)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.unlink(path.parent / name)
            removed.append(name)
            _log().info("removed %s, left by process %d (dead) during an interrupted save", path.parent / name, pid)
    return removed


def _stale_pid(name: str, prefix: str, host: str) -> int | None:
    """The process id in a temporary name of this target and host, else None."""
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix) :].rsplit("-", 2)
    # ASCII digits only ("²".isdigit() is true) and at most 9 of them: a pid os.kill can take.
    if len(parts) != 3 or parts[0] != host or not re.fullmatch(r"[0-9]{1,9}", parts[1]):
        return None
    return int(parts[1])


def _temp_prefix(path: Path) -> str:
    """``.<name>.nnx_save-tmp-``, the name cut (on a character boundary) so that the
    whole temporary name fits the 255-byte limit of a file name: a legal name near the
    limit must still be savable."""
    room = NAME_MAX - len(f".{TMP_MARKER}{host_name()}-{2**32}-{'0' * 8}".encode())
    raw = os.fsencode(path.name)  # the name's bytes: a name that is not UTF-8 decodes to surrogates
    cut = room
    while room - 3 < cut < len(raw) and raw[cut] & 0xC0 == 0x80:  # not inside a UTF-8 character (4 bytes at most)
        cut -= 1
    return f".{os.fsdecode(raw[:cut])}{TMP_MARKER}"


def temp_path(path: Path) -> Path:
    """A fresh temporary name next to ``path``; first removes those of dead processes."""
    remove_stale_temps(path)
    return path.parent / f"{_temp_prefix(path)}{host_name()}-{os.getpid()}-{os.urandom(4).hex()}"


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, *, staged: list[tuple[Path, Path]] | None = None) -> Iterator[int]:
    """Yield a file descriptor whose content replaces ``path`` atomically on success.

    On any failure the temporary file is removed, the previous file at ``path`` is
    untouched, and an ``OSError`` becomes a :class:`SaveError` naming ``path``.
    With ``staged`` (a list), the complete, fsynced temporary file is not renamed:
    ``(temporary, path)`` is appended for :func:`commit_staged` (several files that
    must appear together) or :func:`discard_staged`.
    """
    from pathlib import Path

    path = Path(path)
    if "\x00" in os.fspath(path):
        raise SaveError(f"{str(path)!r}: a path cannot contain a NUL character", str(path))
    _refuse_special(path)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise SaveError(f"{path}: cannot create a temporary file in {path.parent}: {e.strerror}", str(path)) from e
    try:
        try:
            yield fd
            os.fsync(fd)
        finally:
            os.close(fd)
        if staged is None:
            os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, SaveError):
            what = "no space left on the device" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else e.strerror
            raise SaveError(f"{path}: save failed ({what}); the previous file, if any, is intact", str(path)) from e
        raise
    if staged is None:
        fsync_dir(path.parent)
    else:
        staged.append((tmp, path))


def replace_file(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (:func:`atomic_file`): a record's commit."""
    with atomic_file(path) as fd:  # a short write loops: a full disk raises, never truncates
        write_all(fd, memoryview(data))


def _refuse_special(path: Path) -> None:
    """Refuse to replace what is not a regular file (or a link): the rename would put a
    checkpoint where a device, a FIFO, a socket or a directory was (as root, ``/dev/null``)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return  # absent (or unreadable: the save reports what goes wrong)
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        kind = _KINDS.get(stat.S_IFMT(mode), f"not a regular file (mode {mode:o})")
        raise SaveError(
            f"{path}: is {kind}; a save replaces a regular file only, so nothing was written (give a file path)",
            str(path),
        )


def discard_staged(staged: list[tuple[Path, Path]]) -> None:
    """Remove staged temporary files (a save of several files failed)."""
    for tmp, _ in staged:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def commit_staged(staged: list[tuple[Path, Path]]) -> None:
    """Rename staged files over their targets, in order, then fsync their directories.

    Only renames remain by then, so a crash can interleave old and new files only
    within this loop (no data is written during it); the caller puts the file that
    commits the whole (an index) last.
    """
    for i, (tmp, path) in enumerate(staged):
        try:
            os.replace(tmp, path)
        except OSError as e:
            discard_staged(staged[i:])
            raise SaveError(
                f"{path}: could not rename the complete file into place ({e.strerror}); "
                f"{i} of the {len(staged)} files of this save were already replaced",
                str(path),
            ) from e
    for directory in dict.fromkeys(path.parent for _, path in staged):
        fsync_dir(directory)


def make_directory(directory: str | os.PathLike) -> Path:
    """Create ``directory`` and its parents for a multi-file or pod save.

    Raises:
        SaveError: naming the path, when it exists and is not a directory (a file, a
            dangling link) or cannot be created; nothing is changed then.
    """
    from pathlib import Path

    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise SaveError(
            f"{root}: exists and is not a directory; a multi-file or pod save writes a directory there "
            "(remove it, or save to another path)",
            str(root),
        ) from None
    except OSError as e:
        raise SaveError(f"{root}: cannot create the checkpoint directory ({e.strerror})", str(root)) from None
    return root
