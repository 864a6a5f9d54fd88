"""One standard safetensors file written by many JAX processes at once, on a filesystem
they share; the steps (agree, open, write, hash, commit) are told in docs/multihost.md.

Offsets are a pure function of names, dtypes and shapes, so every process computes the
same header and writes only the bytes it owns; the file is byte-identical to a
single-process save. The steps run over :class:`~nnx_save.io._kv.Sync`, not device
collectives (which block without a timeout), so every wait is bounded and a dead peer
leaves the previous file at the path intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SaveError
from ..format import _checksum, _dtypes
from ..format._boxes import box_runs, of_index, whole
from ..format._header import encode_header
from ..io._atomic import fsync_dir, temp_path, write_all
from ..io._files import pread_exact
from ..io._kv import StepResult, Sync
from . import _stage
from ._entry import Entry, check_storable, host_bytes, order_entries, spans_processes
from ._stage import BoxedValue
from ._write import final_header, host_data

__all__ = ["agree", "write_collective"]

_HASH_CHUNK = 64 << 20


def agree(sync: Sync, head: bytes, count: int, nbytes: int) -> None:
    """Every process computed the same header (same keys, dtypes, shapes, metadata), or
    every process raises naming what differs; nothing is written before."""
    mine = {"digest": hashlib.sha256(head).hexdigest(), "tensors": count, "bytes": nbytes, "header": len(head)}
    values = sync.step("agree", StepResult(True, mine))
    sync.forget_previous()
    differ = {p: v for p, v in values.items() if v != values[0]}
    if differ:

        def what(v: dict[str, Any]) -> str:
            return f"{v['tensors']} tensors, {v['bytes']} data bytes, a {v['header']}-byte header"

        lines = "; ".join(f"process {p}: {what(v)}" for p, v in differ.items())
        raise SaveError(
            f"{sync.path}: the processes computed different headers (process 0: {what(values[0])}; {lines}); "
            "every process must save the same keys, dtypes, global shapes and metadata. Nothing was written",
            str(sync.path),
        )


def _create(path: Path, size: int) -> StepResult:
    """Primary: create and size the temporary file; its name, or why not."""
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        return StepResult(False, error=f"cannot create a temporary file in {path.parent}: {e.strerror}")
    return StepResult(True, tmp.name)


def _write_shards(fd: int, e: Entry, parts: list[tuple[Any, np.ndarray]], base: int) -> None:
    """Write this process's part of a tensor, ``(box, host array)`` pairs, at their byte runs."""
    row = _dtypes.DTYPES[e.code]
    for box, host in parts:
        if not row.byte_aligned and box != whole(e.shape):
            raise SaveError(
                f"{e.key}: a {e.code} tensor packs several elements per byte; it cannot be written "
                "shard by shard. Replicate it before saving",
                key_path=e.key,
            )
        if e.code == "BOOL":
            check_storable(e.key, host)
        data = host_bytes(host, e.code)
        offsets, length = (
            box_runs(e.shape, row.itemsize, box, base) if row.byte_aligned else (np.array([base]), len(data))
        )
        if len(offsets) * length != len(data):
            raise SaveError(
                f"{e.key}: shard {box} gave {len(data)} bytes, expected {len(offsets) * length}", key_path=e.key
            )
        for i, off in enumerate(offsets.tolist()):
            write_all(fd, data[i * length : (i + 1) * length], off)


def _boxed(pairs: list[tuple[Any, np.ndarray]], shape: tuple[int, ...]) -> list[tuple[Any, np.ndarray]]:
    """``(shard, host array)`` pairs as ``(box, host array)`` pairs."""
    return [(of_index(shard.index, shape), h) for shard, h in pairs]


def _cross(e: Entry) -> Any:
    """The array (or boxed value) whose parts several processes write, or ``None`` (a host value)."""
    if isinstance(e.value, BoxedValue):
        return e.value if e.value.spanning else None
    return e.array if spans_processes(e.array) else None


def _parts(window: _stage.Window, i: int, e: Entry, cross: Any) -> list[tuple[Any, np.ndarray]]:
    """This process's ``(box, host array)`` parts of cross-process entry ``i``."""
    if isinstance(cross, BoxedValue):
        return cross.boxes()
    return window.take(
        i, lambda c: _boxed(c.host_shards(), e.shape), lambda: _boxed(_stage.host_shards(cross), e.shape)
    )


def _staging_sources(entries: Sequence[Entry], primary: bool) -> list[Any]:
    """What this process copies from its devices: the shards it writes of every
    cross-process tensor, and on the primary the host values' arrays."""
    return [e.array if primary or _cross(e) is not None else None for e in entries]


def _write_mine(
    sync: Sync, tmp: Path, entries: Sequence[Entry], offsets: list[tuple[int, int]], head: bytes
) -> dict[str, str]:
    """Write this process's part (device -> host copies overlapped, under the save
    budget); the digests of the host values it wrote."""
    digests = {}
    keys = [e.key for e in entries]
    window = _stage.Window(_staging_sources(entries, sync.pid == 0), keys, _stage.budget(), str(sync.path), True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if sync.pid == 0:
            write_all(fd, memoryview(head), 0)
        for i, (e, (begin, end)) in enumerate(zip(entries, offsets, strict=False)):
            array = _cross(e)
            if array is not None:
                parts = _parts(window, i, e, array)
                _write_shards(fd, e, parts, len(head) + begin)
                del parts
            elif sync.pid == 0:
                data = host_data(window, i, e, sync.path, end - begin)
                write_all(fd, data, len(head) + begin)
                digests[e.key] = _checksum.digest([data])
                del data
        os.fsync(fd)
    finally:
        window.close()
        os.close(fd)
    return digests


def _assign(entries: Sequence[Entry], offsets: list[tuple[int, int]], n: int) -> list[list[int]]:
    """Share the cross-process tensors out for hashing: biggest first, to the least loaded."""
    load, share = [0] * n, [list[int]() for _ in range(n)]
    cross = [i for i, e in enumerate(entries) if _cross(e) is not None]
    for i in sorted(cross, key=lambda i: (offsets[i][0] - offsets[i][1], i)):
        p = min(range(n), key=lambda p: (load[p], p))
        share[p].append(i)
        load[p] += offsets[i][1] - offsets[i][0]
    return share


def _hash_back(
    sync: Sync, tmp: Path, entries: Sequence[Entry], offsets: list[tuple[int, int]], data_start: int
) -> dict[str, str]:
    """Digest this process's share of the cross-process tensors, read back from the file."""
    digests = {}
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for i in _assign(entries, offsets, sync.n)[sync.pid]:
            begin, end = data_start + offsets[i][0], data_start + offsets[i][1]
            chunks = (
                pread_exact(fd, min(_HASH_CHUNK, end - pos), pos, str(tmp)) for pos in range(begin, end, _HASH_CHUNK)
            )
            digests[entries[i].key] = _checksum.digest(chunks)
    finally:
        os.close(fd)
    return digests


def _commit(sync: Sync, tmp: Path, head: bytes) -> StepResult:
    """Primary: the final header in place, fsync, rename; the result to post."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
        try:
            write_all(fd, memoryview(head), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, sync.path)
        fsync_dir(sync.path.parent)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        return StepResult(False, error=f"the primary could not commit the file: {e.strerror}")
    return StepResult(True)


def write_collective(path: str | os.PathLike, entries: Sequence[Entry], metadata: Mapping[str, str] | None) -> None:
    """Write ``entries`` as one safetensors file at ``path`` from every process.

    Every process must call it with the same entries (global shapes) and metadata.
    The result is byte-identical to a single-process :func:`~nnx_save.save._write.write_file`
    of the same values, checksums included. Raises the same :class:`SaveError` on
    every process when any of them fails; the previous file at ``path`` is then intact.
    """
    path = Path(path)
    sync = Sync.open(path)
    entries = order_entries(entries)
    names = [(e.key, e.code, e.shape) for e in entries]
    digests = _checksum.Digests([e.key for e in entries])
    head, offsets = encode_header(names, digests.metadata(metadata))  # placeholder digests
    size = len(head) + (offsets[-1][1] if offsets else 0)
    agree(sync, head, len(entries), size - len(head))
    tmp = path.parent / sync.step("open", _create(path, size) if sync.pid == 0 else None, only=0)[0]
    try:
        written = sync.step("write", StepResult.of(lambda: _write_mine(sync, tmp, entries, offsets, head)))
        hashed = sync.step("hash", StepResult.of(lambda: _hash_back(sync, tmp, entries, offsets, len(head))))
        digests.values.update({k: v for part in (*written.values(), *hashed.values()) for k, v in part.items()})
        final = final_header(path, names, digests, metadata, head)
        sync.step("commit", _commit(sync, tmp, final) if sync.pid == 0 else None, only=0)
    except BaseException:
        if sync.pid == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
