"""Saves that do not stall training (``blocking=False``); docs/async.md is the contract.

The call returns a :class:`SaveHandle` once a host snapshot of every tensor exists
(:func:`snapshot`); writing, hashing, fsync and the rename run on one background thread
in submission order. On the CPU backend the snapshot aliases device buffers, which
PJRT then refuses to donate, so no copy is needed (``tests/save/test_async.py``).
A blocking save first waits for the asynchronous ones, so every process's save ids
stay in step; at most :func:`max_in_flight` saves are in flight.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _config
from .._options import path_arg, seconds_arg
from ..errors import NnxSaveError, SaveError
from ..io import _storage
from . import _stage
from ._entry import Entry

__all__ = ["SaveHandle", "max_in_flight", "snapshot", "start", "wait_earlier", "wait_for_saves"]

log = logging.getLogger("nnx_save")

_lock = threading.Lock()
_pending: collections.deque[SaveHandle] = collections.deque()  # submitted, maybe finished, in order
_uncollected: list[SaveHandle] = []  # failed, and nobody has seen the error yet
_jobs: queue.Queue[tuple[SaveHandle, Callable[[Path | str, list[Entry]], object], list[Entry]]] = queue.Queue()
_worker: threading.Thread | None = None


class SaveHandle:
    """An asynchronous save in flight (``save_file`` / ``save_model`` with ``blocking=False``).

    Attributes:
        path: the file (or directory) being written.

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> handle = nnx_save.save_file({"w": np.ones(3, np.float32)}, path, blocking=False)
        >>> str(handle.result()) == path
        True
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = path_arg(path, "path", "SaveHandle")
        self.path: Path | str = _storage.absolute(path)  # a URL (s3://...) stays a str
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the save has finished, successfully or not."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for the save to finish; never raises
        its error. Returns :meth:`done`."""
        return self._finished.wait(timeout)

    def result(self, timeout: float | None = None) -> Path | str:
        """Wait for the save; return its path, or raise its error.

        Raises:
            SaveError: the background write failed (names the path); the previous
                file at the path is intact.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.path}: the asynchronous save is still running after {timeout:g} s")
        _collect(self)
        if self._error is not None:
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "done"
        return f"SaveHandle({str(self.path)!r}, {state})"


def max_in_flight() -> int:
    """How many asynchronous saves may be in flight (``NNX_SAVE_MAX_ASYNC_SAVES``, default 2)."""
    return _config.MAX_ASYNC_SAVES.get()


def start(
    path: str | os.PathLike, entries: Sequence[Entry], write: Callable[[str | os.PathLike, Sequence[Entry]], object]
) -> SaveHandle:
    """Run ``write(path, entries)`` on a host snapshot of ``entries``, in the background,
    given the absolute path (the caller may change directory meanwhile); returns at once
    with the save's handle (at most :func:`max_in_flight` saves in flight: the oldest
    waited for first)."""
    _make_room(max_in_flight())
    snap = snapshot(entries, where=str(path))
    handle = SaveHandle(path)
    with _lock:
        _pending.append(handle)
        _start_worker()
    _jobs.put((handle, write, snap))  # no closure over the snapshot: see _work
    return handle


def wait_earlier() -> None:
    """Wait for every asynchronous save in flight, before a blocking save writes (saves
    happen in the order they were asked for); their failures stay with their handles."""
    _wait_all(None)


def wait_for_saves(timeout: float | None = None) -> None:
    """Wait for every asynchronous save in flight, then raise any failure nobody collected.

    Args:
        timeout: seconds to wait at most (``None``: as long as it takes).

    Raises:
        SaveError: an asynchronous save failed and its ``result()`` was never
            called (the first such; the message lists the others). Each failure
            is raised once.
        TimeoutError: saves still running after ``timeout`` seconds.

    Examples:
        >>> import numpy as np, nnx_save, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> for i in range(3):
        ...     _ = nnx_save.save_file({"w": np.full(3, i, np.float32)}, os.path.join(d, f"{i}.safetensors"),
        ...                            blocking=False)
        >>> nnx_save.wait_for_saves()
        >>> sorted(os.listdir(d))
        ['0.safetensors', '1.safetensors', '2.safetensors']
    """
    timeout = seconds_arg(timeout, "timeout", "wait_for_saves")
    if not _wait_all(timeout):
        raise TimeoutError(
            f"asynchronous saves still running after {timeout:g} s: {[str(h.path) for h in _unfinished()]}"
        )
    failed = _take_uncollected()
    if failed:
        error = failed[0]._error
        if len(failed) > 1:
            others = "; ".join(f"{h.path}: {h._error}" for h in failed[1:])
            raise SaveError(
                f"{error} (and {len(failed) - 1} more failed asynchronous saves: {others})", str(failed[0].path)
            ) from error
        raise error  # type: ignore[misc]


# --------------------------------------------------------------------------- snapshot


class HostSnapshot:
    """Host copies of a ``jax.Array``'s replica-0 addressable shards (``(shard, host
    array)`` pairs), with the attributes of ``jax.Array`` the writers read."""

    def __init__(self, array: Any, shards: list[tuple[Any, np.ndarray]]) -> None:
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.sharding = array.sharding
        self.is_fully_addressable = bool(array.is_fully_addressable)
        self.is_fully_replicated = bool(array.is_fully_replicated)
        self.addressable_shards = [_HostShard(s.index, s.replica_id, host) for s, host in shards]

    def assemble(self) -> np.ndarray:
        """The whole array on the host (a fully addressable array only)."""
        return _stage.assemble(self.shape, self.dtype, [(s, s.data) for s in self.addressable_shards])


@dataclasses.dataclass(frozen=True)
class _HostShard:
    index: tuple
    replica_id: int
    data: np.ndarray


def snapshot(entries: Sequence[Entry], max_inflight_bytes: int | None = None, where: str = "") -> list[Entry]:
    """The entries with values that no later step of the caller can change (device
    -> host copies in flight bounded by :func:`nnx_save.save._stage.budget`)."""
    sources = [e.array for e in entries]
    window = _stage.Window(sources, [e.key for e in entries], _stage.budget(max_inflight_bytes), where)
    out = []
    try:
        for i, (e, source) in enumerate(zip(entries, sources, strict=False)):
            value = window.take(i, functools.partial(_from_copy, source), functools.partial(_own, e))
            host = value.assemble if isinstance(value, HostSnapshot) else functools.partial(np.asarray, value)
            out.append(dataclasses.replace(e, value=host, array=value))
    finally:
        window.close()
    return out


def _from_copy(source: Any, copy: _stage.Staged) -> HostSnapshot:
    return HostSnapshot(source, copy.host_shards())


def _own(e: Entry) -> Any:
    """A value no later step of the caller can change, for an entry that needed no device copy."""
    import jax

    source = e.array
    if isinstance(source, jax.Array):  # CPU backend: the alias pins the buffer (see above)
        return HostSnapshot(source, _stage.host_shards(source))
    if source is not None:
        return np.array(source)  # numpy: the caller may write to it after we return
    return np.array(e.value())  # computed lazily (porting export): compute and own it now


# --------------------------------------------------------------------------- the queue


def _start_worker() -> None:
    global _worker
    if _worker is None:
        # Run at exit before concurrent.futures refuses new work (the writer hashes on a
        # helper pool) and before jax's atexit handlers (jax.distributed, backends):
        # threading's exit hooks run first, the latest registered first.
        getattr(threading, "_register_atexit", atexit.register)(_at_exit)
        _worker = threading.Thread(target=_work, name="nnx_save-async", daemon=True)
        _worker.start()


def _work() -> None:
    while True:
        handle, write, snap = _jobs.get()
        t0 = time.perf_counter()
        try:
            write(handle.path, snap)  # its options draw no bar (layouts' save)
        except BaseException as e:  # kept for result(), wait_for_saves() and exit
            handle._error = _with_path(e, handle.path)
            _drop_locals(handle._error)
            with _lock:
                _uncollected.append(handle)
        del write, snap  # the snapshot: freed as soon as it is written
        log.debug(
            "asynchronous save of %s %s in %.3f s",
            handle.path,
            "failed" if handle._error else "finished",
            time.perf_counter() - t0,
        )
        handle._finished.set()


def _drop_locals(error: BaseException | None) -> None:
    """Clear the locals (the snapshot) of the frames an error's tracebacks keep, so
    an uncollected error does not pin the state in memory."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _with_path(e: BaseException, path: Path | str) -> BaseException:
    if isinstance(e, NnxSaveError) and str(path) in str(e):
        return e
    error = SaveError(
        f"{path}: the asynchronous save failed ({type(e).__name__}: {e}); the previous file, if any, is intact",
        str(path),
    )
    error.__cause__ = e
    return error


def _take_uncollected() -> list[SaveHandle]:
    """The failed saves nobody collected, each handed out once."""
    with _lock:
        failed = list(_uncollected)
        _uncollected.clear()
    return failed


def _collect(handle: SaveHandle) -> None:
    with _lock:
        if handle in _uncollected:
            _uncollected.remove(handle)


def _unfinished() -> list[SaveHandle]:
    with _lock:
        while _pending and _pending[0].done():
            _pending.popleft()
        return [h for h in _pending if not h.done()]


def _make_room(limit: int) -> None:
    """Wait until fewer than ``limit`` saves are in flight (the oldest first)."""
    while len(running := _unfinished()) >= limit:
        running[0].wait()


def _wait_all(timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    return all(h.wait(None if deadline is None else max(0.0, deadline - time.monotonic())) for h in _unfinished())


def _reset_in_child() -> None:
    """After ``fork`` the child has the parent's pending handles but not its writer
    thread: waiting on them would hang. The parent finishes those saves; in the
    child their handles fail at once (nothing to report at exit), the queue starts empty."""
    global _lock, _jobs, _worker, _pending, _uncollected
    forked = [h for h in _pending if not h.done()]
    _lock, _jobs, _worker = threading.Lock(), queue.Queue(), None
    _pending, _uncollected = collections.deque(), []
    for h in forked:
        h._error = SaveError(
            f"{h.path}: this process was forked while the asynchronous save was running; the parent process "
            "finishes it, this one cannot wait for it",
            str(h.path),
        )
        h._finished = threading.Event()  # a parent thread may have held the old one's lock at the fork
        h._finished.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def _at_exit() -> None:
    running = _unfinished()
    if running:
        log.info(
            "waiting for %d unfinished asynchronous save(s) before exit: %s",
            len(running),
            ", ".join(str(h.path) for h in running),
        )
        _wait_all(None)
    failed = _take_uncollected()
    for h in failed:
        log.error(
            "nnx_save: the asynchronous save to %s failed and nobody collected its error "
            "(call result() or nnx_save.wait_for_saves()): %s",
            h.path,
            h._error,
        )
