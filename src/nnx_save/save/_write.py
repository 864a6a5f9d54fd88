"""Streaming, atomic writes of safetensors files.

The header is a pure function of names, dtypes and shapes, so it is written first
and each tensor is then written at its known offset, one at a time: the host holds
at most one tensor beyond the caller's arrays. The file is written under a temporary
name in the target's directory, fsynced, renamed over the target and the directory
fsynced: a crash at any moment leaves either the previous file or the new one. The
temporary file is created with mode 0o666 under the caller's umask, so the final
file has the mode a plain ``open()`` would give it. Saving makes a new inode: when
an existing file is replaced, its mode, owner and hard links are not carried over
(the umask decides, as for a new file), unlike ``open(path, "w")`` on it.

Temporary names carry the host name (with the PID namespace on Linux) and the
process id (``.<name>.nnx_save-tmp-<host>-<pid>-<random>``). A process killed mid-save
(SIGKILL, OOM killer, power loss) cannot remove its temporary file, so the next
save of the same target removes the ones whose process is dead on this host;
those of other hosts (a shared filesystem) and of live processes are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import _progress
from ..errors import SaveError
from ..format import _checksum, _dtypes
from ..format._header import encode_header
from . import _stage

__all__ = [
    "TMP_MARKER",
    "Entry",
    "atomic_file",
    "commit_staged",
    "discard_staged",
    "host_bytes",
    "remove_stale_temps",
    "temp_path",
    "write_file",
]

TMP_MARKER = ".nnx_save-tmp-"
NAME_MAX = 255  # bytes in one file name (Linux, macOS, most filesystems)
# Below this a tensor is hashed on the writing thread: a thread handoff costs ~0.1-1 ms
# (more on a busy machine), xxh3 hashes 1 MiB in ~0.1 ms, and most tensors of a model
# (norms, biases) are a few KiB: handing each off made saving ~20% slower.
HASH_THREAD_MIN_BYTES = 1 << 20
log = logging.getLogger("nnx_save")


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its key, dtype code, shape, and a callable giving its
    host value (called once, when its turn comes)."""

    key: str
    code: str
    shape: tuple[int, ...]
    value: Callable[[], np.ndarray]


def host_bytes(array: np.ndarray, code: str) -> memoryview:
    """The little-endian, C-ordered bytes of ``array`` as the format stores them."""
    row = _dtypes.DTYPES[code]
    if not row.byte_aligned:
        return memoryview(_dtypes.pack_subbyte(array, row))
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.reshape(-1).view(np.uint8).data  # a memoryview of the bytes, no copy


def _write_all(fd: int, data: memoryview, offset: int | None = None) -> None:
    done = 0
    while done < len(data):
        if offset is None:
            done += os.write(fd, data[done : done + (1 << 30)])
        else:
            done += os.pwrite(fd, data[done : done + (1 << 30)], offset + done)


def _host() -> str:
    """This host's name, made safe for a file name (cut to 64 characters), and on
    Linux the PID namespace: containers sharing a host name and a filesystem but not
    their process ids must not judge each other's processes dead."""
    name = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())[:64] or "localhost"
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return name
    return f"{name}.ns{re.sub(r'[^0-9]', '', namespace)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, under another user; else: cannot tell
        return True
    return True


def remove_stale_temps(path: Path) -> list[str]:
    """Remove temporary files of ``path`` left by dead processes of this host.

    Only names this module makes for this very target are considered; a file whose
    host is another, whose process is alive (or is this one), or whose name does
    not parse is kept. Best effort: a failure to list or remove is ignored (the
    save itself reports real I/O problems). Returns the names removed.
    """
    prefix, host, removed = _temp_prefix(path), _host(), list[str]()
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        pid = _stale_pid(name, prefix, host)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.unlink(path.parent / name)
            removed.append(name)
            log.info("removed %s, left by process %d (dead) during an interrupted save", path.parent / name, pid)
    return removed


def _stale_pid(name: str, prefix: str, host: str) -> int | None:
    """The process id in a temporary name of this target and host, or None when the
    name is not one (another host, a pid field that is not a plausible pid)."""
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
    room = NAME_MAX - len(f".{TMP_MARKER}{_host()}-{2**32}-{'0' * 8}".encode())
    name = path.name.encode()[:room].decode("utf-8", "ignore")
    return f".{name}{TMP_MARKER}"


def temp_path(path: Path) -> Path:
    """A fresh temporary name next to ``path``; first removes those of dead processes."""
    remove_stale_temps(path)
    return path.parent / f"{_temp_prefix(path)}{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


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
    path = Path(path)
    if "\x00" in os.fspath(path):
        raise SaveError(f"{str(path)!r}: a path cannot contain a NUL character", str(path))
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
            raise _save_error(path, e) from e
        raise
    if staged is None:
        fsync_dir(path.parent)
    else:
        staged.append((tmp, path))


def _save_error(path: Path, e: OSError) -> SaveError:
    what = "no space left on the device" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else e.strerror
    return SaveError(f"{path}: save failed ({what}); the previous file, if any, is intact", str(path))


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


def order_entries(entries: Sequence[Entry]) -> list[Entry]:
    """Descending dtype rank, then name: aligned data, and the reference layout."""
    return sorted(entries, key=lambda e: (-_dtypes.RANK[e.code], e.key))


def write_file(
    path: str | os.PathLike,
    entries: Sequence[Entry],
    metadata: Mapping[str, str] | None = None,
    *,
    staged: list[tuple[Path, Path]] | None = None,
    max_inflight_bytes: int | None = None,
) -> None:
    """Write ``entries`` as one safetensors file at ``path``, atomically
    (or staged, see :func:`atomic_file`).

    Each tensor is hashed as it is written; the header, encoded first with
    fixed-width placeholder digests, is rewritten in place (same length) with the
    real ones before the fsync and rename (see :mod:`nnx_save.format._checksum`). The
    device -> host copies of the next tensors run while one is written, at most
    ``max_inflight_bytes`` of them at once (see :mod:`nnx_save.save._stage`).
    """
    entries = order_entries(entries)
    names = [(e.key, e.code, e.shape) for e in entries]
    digests = _checksum.Digests([e.key for e in entries])
    head, offsets = encode_header(names, digests.metadata(metadata))
    total = offsets[-1][1] if offsets else 0
    bar = _progress.bar(f"saving {Path(path).name}", total, len(entries), _progress.save_setting())
    window = _stage.Window(
        [_source(e) for e in entries], [e.key for e in entries], _stage.budget(max_inflight_bytes), str(path)
    )
    t0 = time.perf_counter()
    try:
        # xxhash and os.write both release the GIL: each tensor is hashed on a helper
        # thread while it is being written, so the checksum costs no extra wall time
        # where a core is free.
        with atomic_file(path, staged=staged) as fd, ThreadPoolExecutor(1, "nnx_save-hash") as hasher:
            _write_all(fd, memoryview(head))
            for i, (e, (begin, end)) in enumerate(zip(entries, offsets, strict=False)):
                data = _checked(
                    path, e, host_bytes(window.take(i, _stage.Staged.assemble, e.value), e.code), end - begin
                )
                if len(data) >= HASH_THREAD_MIN_BYTES:
                    hashed = hasher.submit(digests.update, e.key, data)
                    _write_all(fd, data)
                    hashed.result()
                else:  # waking the helper costs more than hashing a small tensor here
                    digests.update(e.key, data)
                    _write_all(fd, data)
                bar.update(len(data), 1)
                del data
            final, _ = encode_header(names, digests.metadata(metadata))
            if len(final) != len(head):  # cannot happen: hex digits replace hex digits
                raise SaveError(f"{path}: the checksummed header changed length; nothing was saved", str(path))
            _write_all(fd, memoryview(final), 0)
    finally:
        window.close()
        bar.close()
    seconds = time.perf_counter() - t0
    log.debug(
        "saved %s: %d tensors, %d bytes in %.3f s (%.0f MB/s), xxh3_64 checksums recorded; "
        "at most %d bytes of host copies in flight",
        path,
        len(entries),
        total,
        seconds,
        total / seconds / 1e6 if seconds else 0.0,
        window.peak,
    )


def _source(e: Entry) -> object:
    """The array an entry's value comes from, for staging (``None``: a computed value)."""
    return e.value.array if isinstance(e.value, _stage.HostValue) else None


def _checked(path: str | os.PathLike, e: Entry, data: memoryview, size: int) -> memoryview:
    """``data``, once its length is the header's for ``e``."""
    if len(data) != size:  # the header is already written: never let it lie
        raise SaveError(
            f"{path}: tensor {e.key!r} gave {len(data)} bytes, its header entry "
            f"{e.code} {list(e.shape)} says {size}; nothing was saved",
            str(path),
            e.key,
        )
    return data
