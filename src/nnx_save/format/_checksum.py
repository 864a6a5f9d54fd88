"""Per-tensor integrity checksums, kept inside the file's ``__metadata__``.

``__metadata__["nnx_save.checksums"]`` is a JSON object ``{tensor key: 16 hex digits}``
of the xxh3_64 digest of each tensor's bytes as stored (``nnx_save.checksum_algorithm``
names the algorithm); other readers ignore metadata they do not know. The writer stays
one-pass: it encodes the header with placeholder digests and rewrites them in place at
the end (same length) before the fsync and rename. A tensor may have no entry (one whose
shards other processes wrote, files of other tools): readers report it unverified.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from ..errors import ChecksumError
from . import _header
from ._boxes import Box, whole

__all__ = [
    "ALGORITHM",
    "ALGORITHM_KEY",
    "KEY",
    "Digests",
    "check",
    "check_all",
    "digest",
    "full_buffers",
    "read_digests",
]

KEY = "nnx_save.checksums"
ALGORITHM_KEY = "nnx_save.checksum_algorithm"
ALGORITHM = "xxh3_64"
_WIDTH = 16
_PLACEHOLDER = "0" * _WIDTH


def digest(buffers: Iterable[memoryview | bytes]) -> str:
    """The xxh3_64 hex digest of the concatenation of ``buffers``."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.hexdigest()


class Digests:
    """The writer's side: placeholders first, real digests as tensors are written."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.values = dict.fromkeys(keys, _PLACEHOLDER)
        self._running: dict[str, Any] = {}

    def update(self, key: str, data: memoryview) -> None:
        self.values[key] = xxhash.xxh3_64_hexdigest(data)

    def start(self, key: str) -> Callable[[memoryview], None]:
        """``feed(data)`` for ``key``'s bytes given in order, in parts; its digest is
        ``key``'s once they are all fed (read by :meth:`metadata`)."""
        self._running[key] = xxhash.xxh3_64()
        return self._running[key].update

    def metadata(self, metadata: Mapping[str, str] | None) -> dict[str, str] | None:
        """``metadata`` plus the checksum entries (a stale checksum entry is replaced);
        the keys fed since :meth:`start` get their digests first."""
        self.values.update({k: h.hexdigest() for k, h in self._running.items()})
        self._running.clear()
        out = {k: v for k, v in (metadata or {}).items() if k not in (KEY, ALGORITHM_KEY)}
        if not self.values:
            return out or None
        out[ALGORITHM_KEY] = ALGORITHM
        out[KEY] = json.dumps(self.values, separators=(",", ":"), ensure_ascii=False)
        return out


def read_digests(metadata: Mapping[str, str], file: str) -> Mapping[str, str]:
    """The ``{key: hex}`` checksums a file records (empty when it records none): parsed
    once per record text (a tool reading a file's tensors one load at a time, ``nnx-save
    verify``, pays for the record once, not once per tensor). Read-only.

    Raises:
        ChecksumError: the entry is present but malformed, or names an unknown algorithm.
    """
    raw = metadata.get(KEY)
    if raw is None:
        return {}
    return _parsed(raw, metadata.get(ALGORITHM_KEY, ALGORITHM), file)


@functools.lru_cache(maxsize=16)
def _parsed(raw: str, algorithm: str, file: str) -> Mapping[str, str]:
    if algorithm != ALGORITHM:
        raise ChecksumError(
            f"{file}: checksums use algorithm {algorithm!r}; this version of nnx_save knows "
            f"only {ALGORITHM!r}. Load with verify=False",
            file=file,
        )
    try:
        value = _header.strict_json(raw)
    except ValueError as e:  # not JSON, too deep, a duplicate key
        raise ChecksumError(f"{file}: __metadata__[{KEY!r}] is not valid JSON: {e}", file=file) from None
    if not isinstance(value, dict) or not all(isinstance(v, str) and len(v) == _WIDTH for v in value.values()):
        raise ChecksumError(f"{file}: __metadata__[{KEY!r}] must map tensor names to {_WIDTH} hex digits", file=file)
    return types.MappingProxyType(value)


def check(key: str, file: str, expected: str, buffers: Iterable[memoryview | bytes]) -> None:
    """Raise :class:`ChecksumError` naming ``key`` unless ``buffers`` hash to ``expected``."""
    found = digest(buffers)
    if found != expected:
        raise ChecksumError(
            f"{file}: tensor {key!r}: checksum mismatch (xxh3_64 recorded {expected}, bytes read hash to {found}); "
            "the file was modified or corrupted after it was written",
            key,
            file,
            expected,
            found,
        )


def check_all(jobs: Sequence[tuple[str, str, str, Sequence[memoryview]]], num_threads: int) -> None:
    """:func:`check` every ``(key, file, expected, buffers)``, on up to ``num_threads``
    threads (xxhash releases the GIL); the first mismatch in ``jobs`` order is raised."""
    if num_threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            check(*job)
        return
    with ThreadPoolExecutor(min(num_threads, len(jobs)), thread_name_prefix="nnx_save-verify") as pool:
        futures = [pool.submit(check, *job) for job in jobs]
    for f in futures:
        f.result()


def full_buffers(shape: tuple[int, ...], pieces: Sequence[tuple[Box, object]]) -> list[object] | None:
    """The buffers that hold the whole tensor in file order, or ``None``.

    ``pieces`` are ``(box, buffer)`` pairs read for one tensor. One box covering the
    whole tensor does; so do boxes split on the leading dimension only that tile it
    (their bytes are consecutive ranges of the file). Anything else is a partial
    read this process cannot check.
    """
    full = whole(shape)
    for box, buf in pieces:
        if box == full:
            return [buf]
    if not shape or not pieces:
        return None
    ordered = sorted(pieces, key=lambda p: p[0][0])
    position = 0
    for box, _ in ordered:
        if box[1:] != full[1:] or box[0][0] != position:
            return None
        position = box[0][1]
    return [buf for _, buf in ordered] if position == shape[0] else None
