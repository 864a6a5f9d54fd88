"""Streaming, atomic writes of one safetensors file from one process.

The header is a pure function of names, dtypes and shapes, so it is written first
and each tensor is then written at its known offset, one at a time: the host holds
at most one tensor beyond the caller's arrays. The file replaces its target
atomically (:func:`~nnx_save.io._atomic.atomic_file`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import _progress
from ..errors import SaveError
from ..format import _checksum, _dtypes
from ..format._header import encode_header
from ..io._atomic import atomic_file
from . import _stage
from ._entry import Entry, HostValue, check_storable, host_bytes, order_entries
from ._sink import Sink, chunk_memory, pwrite_all

__all__ = ["SHARD_WRITERS", "final_header", "host_data", "write_file", "write_files"]

# Below this a tensor is hashed on the writing thread: waking a helper thread costs
# more than hashing a small tensor (most tensors of a model: norms, biases).
HASH_THREAD_MIN_BYTES = 1 << 20
SHARD_WRITERS = 2  # files one process writes at once (write_files)
log = logging.getLogger("nnx_save")


def write_file(
    path: str | os.PathLike,
    entries: Sequence[Entry],
    metadata: Mapping[str, str] | None = None,
    *,
    staged: list[tuple[Path, Path]] | None = None,
    max_inflight_bytes: int | None = None,
    progress: bool | None = None,
    ordered: bool = False,
) -> None:
    """Write ``entries`` as one safetensors file at ``path``, atomically
    (or staged, see :func:`atomic_file`).

    Each tensor is hashed as it is written; the header, encoded first with
    fixed-width placeholder digests, is rewritten in place (same length) with the
    real ones before the fsync and rename (see :mod:`nnx_save.format._checksum`). The
    device -> host copies of the next tensors run while one is written; they and the
    writer's chunks (:mod:`nnx_save.save._sink`) hold at most ``max_inflight_bytes``
    at once (see :mod:`nnx_save.save._stage`); ``progress`` as in
    :func:`nnx_save._progress.bar`; ``ordered``: ``entries`` are in file order already
    (:func:`order_entries`: a layout planned them so).
    """
    entries = entries if ordered else order_entries(entries)
    names = [(e.key, e.code, e.shape) for e in entries]
    digests = _checksum.Digests([e.key for e in entries])
    head, offsets = encode_header(names, digests.metadata(metadata))
    total = offsets[-1][1] if offsets else 0
    bar = _progress.bar(f"saving {Path(path).name}", total, len(entries), progress)
    limit = _stage.budget(max_inflight_bytes)
    held = chunk_memory(len(head) + total, limit)  # the sink's chunks come out of the same budget
    window = _stage.Window(
        [e.array for e in entries],
        [e.key for e in entries],
        limit - held,
        str(path),
        split=[cuttable(e) for e in entries],
    )
    t0 = time.perf_counter()
    try:
        # xxhash and the writes both release the GIL: each block is hashed on a helper
        # thread while it is being written, so the checksum costs no extra wall time
        # where a core is free. The sink keeps the disk busy as the file grows (direct
        # I/O, or write-back started per chunk), so the fsync has little left to do.
        with (
            atomic_file(path, staged=staged) as fd,
            ThreadPoolExecutor(1, "nnx_save-hash") as hasher,
            Sink(fd, held) as sink,
        ):
            sink.write(memoryview(head))
            for i, (e, (begin, end)) in enumerate(zip(entries, offsets, strict=False)):
                feed = digests.start(e.key)
                size = end - begin
                blocks = (
                    host_blocks(window, i, e, path, size) if window.copies else (host_data(window, i, e, path, size),)
                )
                for data in blocks:
                    if len(data) >= HASH_THREAD_MIN_BYTES:
                        hashed = hasher.submit(feed, data)
                        sink.write(data)
                        hashed.result()
                    else:  # waking the helper costs more than hashing a small tensor here
                        feed(data)
                        sink.write(data)
                    del data  # before the next block is asked for: the window counts it freed
                del blocks  # (a tuple of one holds its tensor's bytes too)
                if bar.active:  # a bar not drawn needs no call per tensor
                    bar.update(end - begin, 1)
            sink.finish()
            pwrite_all(fd, memoryview(final_header(path, names, digests, metadata, head)), 0)
    finally:
        if window.copies:  # copies to drop only where some were started
            window.close()
        if bar.active:  # a bar not drawn has nothing to close
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


def write_files(
    files: Sequence[tuple[Path, Sequence[Entry]]],
    metadata: Mapping[str, str] | None,
    *,
    staged: list[tuple[Path, Path]],
    progress: bool | None,
    written: list[Path],
) -> None:
    """Write each ``(path, entries)`` of ``files`` as one file, staged (see
    :func:`write_file`), :data:`SHARD_WRITERS` at a time: the disk is kept busier by
    several streams, and each writer holds its share of the save's in-flight budget.
    Each file's entries are in file order (:func:`order_entries`), as the layout
    planned them. Each file written is added to ``written``; the first failure cancels the files
    not begun and is raised once the others have ended.
    """
    workers = min(SHARD_WRITERS, len(files))
    if workers < 2:
        for path, entries in files:
            write_file(path, entries, metadata, staged=staged, progress=progress, ordered=True)
            written.append(path)
        return
    limit = max(1, _stage.budget() // workers)
    with ThreadPoolExecutor(workers, "nnx_save-shard") as pool:
        jobs = {
            pool.submit(
                write_file,
                path,
                entries,
                metadata,
                staged=staged,
                max_inflight_bytes=limit,
                progress=progress,
                ordered=True,
            ): path
            for path, entries in files
        }
        try:
            futures.wait(jobs, return_when=futures.FIRST_EXCEPTION)
        finally:  # a failure, or an interrupt of this thread: no file not begun is begun
            for job in jobs:
                job.cancel()
    written.extend(jobs[job] for job in jobs if not job.cancelled() and job.exception() is None)
    failed = [job.exception() for job in jobs if not job.cancelled() and job.exception() is not None]
    if failed:
        raise failed[0]  # type: ignore[misc]


def final_header(
    path: str | os.PathLike, names: list, digests: _checksum.Digests, metadata: Mapping[str, str] | None, head: bytes
) -> bytes:
    """The header with the real digests, as long as ``head`` (its placeholder twin)."""
    final, _ = encode_header(names, digests.metadata(metadata))
    if len(final) != len(head):  # cannot happen: hex digits replace hex digits
        raise SaveError(f"{path}: the checksummed header changed length; nothing was saved", str(path))
    return final


def cuttable(e: Entry) -> bool:
    """Whether entry ``e``'s bytes may be written in blocks as they come off its devices:
    its value is its array's, in whole bytes, and needs no check of the whole."""
    return isinstance(e.value, HostValue) and e.code != "BOOL" and _dtypes.DTYPES[e.code].byte_aligned


def host_blocks(window: _stage.Window, i: int, e: Entry, path: str | os.PathLike, size: int) -> Iterator[memoryview]:
    """Entry ``i``'s bytes as ``window`` copies them (:attr:`~_stage.Window.copies`) in file
    order, block by block, as long in all as the header's ``size`` (a longer block is
    refused before it is written)."""
    done = 0
    for value in window.blocks(i, e.value):
        if e.code == "BOOL":  # bytes a load refuses: asked of bool arrays only
            check_storable(e.key, value)
        data = host_bytes(value, e.code)  # (inline, as in host_data: one call fewer per block)
        del value
        if done + len(data) > size:  # the header is already written: never let it lie
            raise _size_error(path, e, done + len(data), size)
        done += len(data)
        yield data
        del data  # the caller dropped its own: the window may count this block freed
    if done != size:
        raise _size_error(path, e, done, size)


def host_data(window: _stage.Window, i: int, e: Entry, path: str | os.PathLike, size: int) -> memoryview:
    """Entry ``i``'s bytes (staged by ``window``, one copy), once their length is the header's ``size``."""
    value = window.take(i, _stage.Staged.assemble, e.value) if window.copies else e.value()
    if e.code == "BOOL":  # bytes a load refuses: asked of bool arrays only
        check_storable(e.key, value)
    data = host_bytes(value, e.code)
    if len(data) != size:  # the header is already written: never let it lie
        raise _size_error(path, e, len(data), size)
    return data


def _size_error(path: str | os.PathLike, e: Entry, got: int, size: int) -> SaveError:
    return SaveError(
        f"{path}: tensor {e.key!r} gave {got} bytes, its header entry {e.code} {list(e.shape)} says {size}; "
        "nothing was saved",
        str(path),
        e.key,
    )
