"""HuggingFace multi-file checkpoints (``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json``), in a local directory or at an fsspec URL.

Written under the one commit rule: the data files first, under names no committed file
has; then the index, replaced atomically; only then the previous version's files (and
a pod's, in a directory saved over a pod) are removed. The save id in the index and
every file lets a reader tell a mix of two saves (:mod:`~nnx_save.layouts._versions`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import IndexFileError
from ..format import _dtypes
from ..format._units import parse_size
from ..io import _remote
from ..io._kv import Sync
from ..io._write import (
    TMP_MARKER,
    _write_all,
    atomic_file,
    commit_staged,
    discard_staged,
    make_directory,
    remove_stale_temps,
)
from ..save import _remote as _remote_write
from ..save import _stage
from ..save._collective import write_collective
from ..save._entry import Entry, order_entries
from ..save._write import write_file
from . import _pod
from ._index import INDEX_NAME, file_names, index_record, parse_index
from ._versions import SAVE_ID_KEY, new_save_id

__all__ = ["shard_groups", "write_sharded"]

log = logging.getLogger("nnx_save")
SHARD_WRITERS = 2  # files one process writes at once


def _nbytes(e: Entry) -> int:
    return _dtypes.nbytes_for(_dtypes.DTYPES[e.code], math.prod(e.shape))


def shard_groups(entries: Sequence[Entry], max_shard_size: int | str) -> list[list[Entry]]:
    """Pack entries in order into groups of at most ``max_shard_size`` bytes (a
    tensor larger than the limit gets a file of its own, as transformers does)."""
    limit = parse_size(max_shard_size)
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + _nbytes(e) > limit:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += _nbytes(e)
    return groups


class _Local:
    """A local directory as the target of a multi-file save."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.root = make_directory(directory)
        self.index = self.root / INDEX_NAME
        self.staged: list[tuple[Path, Path]] = []  # complete data files, renamed together

    def listing(self) -> set[str]:
        return set(os.listdir(self.root))

    def read_index(self) -> bytes:
        return self.index.read_bytes()

    def write_shard(self, name: str, entries: Sequence[Entry], meta: Mapping[str, str], budget: int | None) -> None:
        write_file(self.root / name, entries, meta, staged=self.staged, max_inflight_bytes=budget)

    def commit_index(self, data: bytes) -> None:
        commit_staged(self.staged)  # fresh names: one directory fsync for them all, before the index
        with atomic_file(self.index) as fd:
            _write_all(fd, memoryview(data))

    def discard(self) -> None:
        discard_staged(self.staged)

    def remove(self, name: str) -> None:
        try:
            os.unlink(self.root / name)
        except FileNotFoundError:
            pass
        except OSError as e:  # after the commit a leftover file only costs disk space
            log.warning("%s: could not remove %s (%s)", self.root, name, e.strerror)


class _Remote:
    """An fsspec URL (a "directory" of objects) as the target of a multi-file save."""

    def __init__(self, url: str) -> None:
        self.root = url.rstrip("/")
        self.fs = _remote_write.filesystem(self.root)
        self.index = f"{self.root}/{INDEX_NAME}"

    def listing(self) -> set[str]:
        try:
            return {str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)}
        except FileNotFoundError:
            return set()

    def read_index(self) -> bytes:
        return self.fs.cat(self.index)

    def write_shard(self, name: str, entries: Sequence[Entry], meta: Mapping[str, str], budget: int | None) -> None:
        _remote_write.write_remote(f"{self.root}/{name}", entries, meta)

    def commit_index(self, data: bytes) -> None:
        _remote_write.put(self.fs, self.index, lambda f: f.write(data))

    def discard(self) -> None:  # nothing staged: each object is moved into place once complete
        pass

    def remove(self, name: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.rm(f"{self.root}/{name}")


def _committed_files(target: _Local | _Remote) -> set[str]:
    """The plain file names the committed index names (none: no readable index)."""
    try:
        weight_map, _ = parse_index(target.read_index(), str(target.index))
    except (OSError, IndexFileError):
        return set()
    return {n for n in weight_map.values() if "/" not in n and "\\" not in n and not n.startswith(".")}


def write_sharded(
    directory: str | os.PathLike,
    entries: Sequence[Entry],
    metadata: Mapping[str, str] | None,
    max_shard_size: int | str,
    *,
    prefix: str = "model",
) -> Any:
    """Write ``entries`` as a HuggingFace multi-file checkpoint in ``directory`` (a
    path or an fsspec URL); returns the index's path (a URL stays a ``str``).

    Raises:
        SaveError: a file or the index could not be written; the previous
            checkpoint there is intact and this save's files are removed.
        OptionError: ``max_shard_size`` is not a size.
    """
    groups = shard_groups(order_entries(entries), max_shard_size)
    target = _Remote(str(directory)) if _remote.is_url(directory) else _Local(directory)
    sync = Sync.open(Path(str(directory)), "multi-file save", "the previous checkpoint there, if any, is intact")

    def plan() -> dict[str, Any]:
        save_id, previous = new_save_id(), _committed_files(target)
        names = file_names(len(groups), prefix, previous | target.listing(), save_id)
        return {"id": save_id, "previous": sorted(previous), "names": names}

    agreed = sync.on_primary("plan", plan)
    names, previous, meta = agreed["names"], set(agreed["previous"]), {**(metadata or {}), SAVE_ID_KEY: agreed["id"]}
    weight_map = {e.key: name for name, group in zip(names, groups, strict=True) for e in group}
    index = index_record(weight_map, sum(_nbytes(e) for e in entries), agreed["id"])
    written: list[str] = []
    try:
        if sync.n == 1 and isinstance(target, _Local) and min(SHARD_WRITERS, len(groups)) > 1:
            _write_parallel(target, names, groups, meta, written)
        for name, group in zip(names, groups, strict=True) if not written else ():
            if sync.n == 1:
                target.write_shard(name, group, meta, None)
            else:  # every process writes its shards of the file's tensors
                write_collective(Path(target.root) / name, group, meta)
            written.append(name)
        sync.on_primary("index", lambda: target.commit_index(index))
    except BaseException:
        target.discard()
        for name in written if sync.pid == 0 else ():
            target.remove(name)
        raise
    if sync.pid == 0:
        _remove_superseded(target, previous, set(names), prefix)
    return target.index


def _write_parallel(
    target: _Local, names: list[str], groups: list[list[Entry]], meta: Mapping[str, str], written: list[str]
) -> None:
    """Write the files ``SHARD_WRITERS`` at a time (the disk is kept busier by several
    streams; each writer holds its share of the save's in-flight budget), adding each
    written name to ``written``. The first failure cancels the files not begun and is
    raised once the others have ended."""
    workers = min(SHARD_WRITERS, len(groups))
    budget = max(1, _stage.budget() // workers)
    with ThreadPoolExecutor(workers, "nnx_save-shard") as pool:
        jobs = {
            pool.submit(contextvars.copy_context().run, target.write_shard, name, group, meta, budget): name
            for name, group in zip(names, groups, strict=True)
        }
        try:
            futures.wait(jobs, return_when=futures.FIRST_EXCEPTION)
        finally:  # a failure, or an interrupt of this thread: no file not begun is begun
            for job in jobs:
                job.cancel()
    for job in jobs:  # every job has ended: cancelled, done or failed
        if not job.cancelled() and job.exception() is None:
            written.append(jobs[job])
    for job in jobs:
        if not job.cancelled() and job.exception() is not None:
            raise job.exception()  # type: ignore[misc]


def _remove_superseded(target: _Local | _Remote, previous: set[str], keep: set[str], prefix: str) -> None:
    """After the commit: the previous version's files, files of interrupted saves
    (this layout's names, the index does not name them; their temporary files when
    their process is dead), and a pod layout's manifest (first) and shard files."""
    ours = re.compile(rf"{re.escape(prefix)}(-\d{{5}}-of-\d{{5}})?(\.[0-9a-f]{{8}})?\.safetensors")
    listing = target.listing()
    stale = (previous | {n for n in listing if ours.fullmatch(n)}) - keep
    if isinstance(target, _Local):
        for name in listing:  # ".<file>.nnx_save-tmp-<host>-<pid>-<random>"
            if TMP_MARKER in name and ours.fullmatch(name[1 : name.index(TMP_MARKER)]):
                remove_stale_temps(target.root / name[1 : name.index(TMP_MARKER)])
        if _pod.MANIFEST in listing:
            stale |= {n for n in listing if _pod.SHARD_FILE.match(n)}
            target.remove(_pod.MANIFEST)
    for name in sorted(stale):
        target.remove(name)
