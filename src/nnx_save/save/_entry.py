"""Save's data model: the :class:`Entry` of one tensor, and its bytes as the format
stores them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SaveError, UnsupportedValueError
from ..format import _dtypes

__all__ = ["Entry", "HostValue", "check_storable", "host_bytes", "order_entries", "spans_processes"]


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


def check_storable(key: str, array: Any) -> None:
    """Refuse, before any byte of it is written, a value the format's readers refuse on
    load: a bool array holding a byte other than 0 or 1 (a ``uint8`` mask viewed as
    bool; numpy then holds a bool that is neither). Asked of a numpy or jax array (on
    its device: ``view`` and ``max`` are methods of both), and by each writer of every
    host copy it writes.

    Raises:
        UnsupportedValueError: naming the key, the first such element and its byte.

    Examples:
        >>> check_storable("mask", np.array([1, 0, 2], np.uint8).view(np.bool_))
        Traceback (most recent call last):
        ...
        nnx_save.errors.UnsupportedValueError: mask: a bool array holding byte 2 at element [2] ...
    """
    if np.dtype(array.dtype) != np.bool_ or not array.size:
        return
    if spans_processes(array):  # its shards are checked as each is written
        return
    raw = array.view(np.uint8)
    if int(raw.max()) <= 1:
        return
    at = [int(i) for i in np.unravel_index(int((raw > 1).reshape(-1).argmax()), raw.shape)]
    raise UnsupportedValueError(
        f"{key}: a bool array holding byte {int(raw[tuple(at)])} at element {at} (a uint8 viewed as bool?); "
        "a bool is stored as 0 or 1, and a load refuses any other byte. Save its truth values, "
        "x.view(np.uint8) != 0, or the uint8 array itself",
        key,
    )


def host_bytes(array: np.ndarray, code: str) -> memoryview:
    """The little-endian, C-ordered bytes of ``array`` as the format stores them."""
    row = _dtypes.DTYPES[code]
    if not row.byte_aligned:
        return memoryview(_dtypes.pack_subbyte(array, row))
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.reshape(-1).view(np.uint8).data  # a memoryview of the bytes, no copy
