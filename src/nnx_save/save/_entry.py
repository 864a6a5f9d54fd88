"""Save's data model: the :class:`Entry` of one tensor, and its bytes as the format
stores them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SaveError
from ..format import _dtypes

__all__ = ["Entry", "HostValue", "host_bytes", "order_entries", "spans_processes"]


def spans_processes(value: Any) -> bool:
    """A jax.Array with shards on devices of other processes."""
    return not isinstance(value, np.ndarray) and not getattr(value, "is_fully_addressable", True)


@dataclass(frozen=True)
class HostValue:
    """The value callable of an array's entry (:meth:`Entry.of`): the whole array on
    the host, refusing one that spans processes (only the collective writer, which
    reads ``Entry.array`` shard by shard, can save that)."""

    array: Any

    def __call__(self) -> np.ndarray:
        if isinstance(self.array, np.ndarray):
            return self.array
        if spans_processes(self.array) and not self.array.is_fully_replicated:
            raise SaveError(
                f"an array of shape {tuple(self.array.shape)} with sharding {self.array.sharding} spans "
                f"{len({d.process_index for d in self.array.sharding.device_set})} processes; this process holds "
                "only its shards, and writing them alone would save a partial tensor. Save it with save_file / "
                "save_model called on every process (one file), or gather it first"
            )
        return np.asarray(self.array)


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its key, dtype code, shape, a callable giving its host
    value (called once, when its turn comes) and ``array``, the array that value
    comes from when the caller holds one (numpy or jax: what is staged to the host,
    snapshotted, or written shard by shard); ``None`` for a value computed lazily."""

    key: str
    code: str
    shape: tuple[int, ...]
    value: Callable[[], np.ndarray]
    array: Any = None

    @classmethod
    def of(cls, key: str, code: str, shape: tuple[int, ...], array: Any) -> Entry:
        """The entry of ``array``: its value is the array on the host (:class:`HostValue`)."""
        return cls(key, code, shape, HostValue(array), array)


def order_entries(entries: Sequence[Entry]) -> list[Entry]:
    """Descending dtype rank, then name: aligned data, and the reference layout."""
    return sorted(entries, key=lambda e: (-_dtypes.RANK[e.code], e.key))


def host_bytes(array: np.ndarray, code: str) -> memoryview:
    """The little-endian, C-ordered bytes of ``array`` as the format stores them."""
    row = _dtypes.DTYPES[code]
    if not row.byte_aligned:
        return memoryview(_dtypes.pack_subbyte(array, row))
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.reshape(-1).view(np.uint8).data  # a memoryview of the bytes, no copy
