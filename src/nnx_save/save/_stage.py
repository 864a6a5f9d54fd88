"""Device -> host copies for saving, overlapped with writing, under a byte budget.

On the CPU backend ``np.asarray`` aliases a jax array's buffer: nothing is staged. On
accelerators a :class:`Window` starts the copies of the next tensors that fit the budget
while one is written (at most ``max(budget, largest tensor)`` bytes of copies). A copy
is a new host array from an asynchronous ``jax.device_put``, dying with the save
(``copy_to_host_async`` would cache it on the caller's array: only the fallback).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _config
from ..errors import NnxSaveError, OptionError, SaveError

__all__ = ["BoxedValue", "Staged", "Window", "budget", "stage"]

# Host memory kinds a device -> host copy may land in, the fastest first.
_HOST_KINDS = ("pinned_host", "unpinned_host")


Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class BoxedValue:
    """An entry's value made from other arrays (a ported export), for a tensor no
    process may hold whole: ``whole()`` the whole host value (the single-process
    writers call the entry); ``boxes()`` this process's ``(box, host array)`` parts,
    over every process each element exactly once (the collective writer's; every
    process calls it for the same entries in order: a fallback may gather);
    ``spanning``: its sources have shards on several processes."""

    whole: Callable[[], np.ndarray]
    boxes: Callable[[], list[tuple[Box, np.ndarray]]]
    spanning: bool

    def __call__(self) -> np.ndarray:
        return self.whole()


def budget(value: int | None = None) -> int:
    """The byte budget for host copies in flight: ``value``, else ``NNX_SAVE_SAVE_INFLIGHT_BYTES``, else 1 GiB."""
    if value is not None:
        if value < 1:
            raise OptionError(f"max_inflight_bytes={value}: expected a positive number of bytes", "max_inflight_bytes")
        return value
    return _config.SAVE_INFLIGHT_BYTES.get()


def own_shards(array: Any) -> list[Any]:
    """The addressable shards of replica 0: one copy of every element in the job."""
    return [s for s in array.addressable_shards if s.replica_id == 0]


def host_shards(array: Any) -> list[tuple[Any, np.ndarray]]:
    """``(shard, host array)`` for each of :func:`own_shards`, without staging."""
    return [(s, np.asarray(s.data)) for s in own_shards(array)]


def assemble(shape: tuple[int, ...], dtype: np.dtype, parts: Sequence[tuple[Any, np.ndarray]]) -> np.ndarray:
    """The whole array on the host from ``(shard, host array)`` pairs that cover it."""
    if len(parts) == 1 and parts[0][1].shape == shape:
        return parts[0][1]
    out = np.empty(shape, dtype)
    for shard, host in parts:
        out[shard.index] = host
    return out


def staging_bytes(array: Any, spanning: bool = False, force: bool | None = None) -> int:
    """Host bytes :func:`stage` would copy for ``array``: 0 for numpy, a CPU-backed
    jax array, or one spanning processes unless ``spanning`` (the collective writer)."""
    import jax

    if not isinstance(array, jax.Array) or array.is_deleted():
        return 0
    if not spanning and not array.is_fully_addressable:  # HostValue() refuses it with the reason
        return 0
    shards = own_shards(array)
    force = _config.FORCE_HOST_STAGING.get() if force is None else force  # given once per save by a Window
    if not force and all(s.device.platform == "cpu" for s in shards):
        return 0
    return sum(int(s.data.nbytes) for s in shards)


def host_kind(device: Any) -> str | None:
    """The first of ``pinned_host`` / ``unpinned_host`` that ``device`` offers, else ``None``."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # a backend without memory spaces (jax raises its own error types)
        return None
    return next((k for k in _HOST_KINDS if k in kinds), None)


def _copy_shard(data: Any) -> Any:
    """Start the device -> host copy of one single-device array; returns what to wait on."""
    import jax

    kind = host_kind(data.device)
    if kind is None:
        data.copy_to_host_async()
        return data
    return jax.device_put(data, jax.sharding.SingleDeviceSharding(data.device, memory_kind=kind), may_alias=False)


class Staged:
    """The device -> host copies of one array's replica-0 addressable shards, in flight."""

    def __init__(self, array: Any) -> None:
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.shards = own_shards(array)
        self.copies = [_copy_shard(s.data) for s in self.shards]
        self.nbytes = sum(int(s.data.nbytes) for s in self.shards)

    def host_shards(self) -> list[tuple[Any, np.ndarray]]:
        """``(shard, host array)`` pairs, waiting for the copies."""
        return [(s, np.asarray(c)) for s, c in zip(self.shards, self.copies, strict=True)]

    def assemble(self) -> np.ndarray:
        """The whole array on the host, waiting for the copies."""
        return assemble(self.shape, self.dtype, self.host_shards())


def stage(array: Any, spanning: bool = False) -> Staged | None:
    """Start copying ``array`` to the host; ``None`` when nothing needs copying."""
    return Staged(array) if staging_bytes(array, spanning) else None


class Window:
    """Copies of a sequence of tensors started ahead, under a byte budget ``limit``
    (a larger tensor is copied alone). ``held``: bytes of copies started and not yet
    released, ``peak`` its maximum; ``copies``: whether any tensor needs one. A failed copy raises a :class:`SaveError` naming
    ``where`` and the tensor's key."""

    def __init__(
        self, arrays: Sequence[Any], keys: Sequence[str], limit: int, where: str, spanning: bool = False
    ) -> None:
        self.arrays, self.keys, self.limit, self.where = list(arrays), list(keys), limit, where
        self.spanning = spanning
        force = _config.FORCE_HOST_STAGING.get()
        self.sizes = [staging_bytes(a, spanning, force) for a in self.arrays]
        self.copies = any(self.sizes)  # False (the CPU backend, numpy): take() is each entry's value()
        self.pending: dict[int, Staged] = {}
        self.next = 0
        self.held = self.peak = 0
        self.taken: int | None = None

    def take(self, i: int, complete: Callable[[Staged], Any], fallback: Callable[[], Any]) -> Any:
        """Tensor ``i``'s host value (``i`` increasing): ``complete(staged copy)``, or
        ``fallback()`` when it needed no copy; releases the copy taken before and
        starts the next ones that fit."""
        self._release()
        while self.next < len(self.arrays) and (self.next <= i or self._fits(self.sizes[self.next])):
            if self.sizes[self.next]:
                self.pending[self.next] = self._guard(
                    self.next, functools.partial(stage, self.arrays[self.next], self.spanning)
                )
            self.held += self.sizes[self.next]
            self.next += 1
        self.peak = max(self.peak, self.held)
        self.taken = i
        copy = self.pending.pop(i, None)
        return fallback() if copy is None else self._guard(i, lambda: complete(copy))

    def _guard(self, i: int, step: Callable[[], Any]) -> Any:
        try:
            return step()
        except NnxSaveError:
            raise
        except Exception as e:  # a device error (jax raises its own types): name the tensor
            raise SaveError(
                f"{self.where}: the device -> host copy of {self.keys[i]!r} failed ({type(e).__name__}: {e}); "
                "the previous file, if any, is intact",
                self.where,
                self.keys[i],
            ) from e

    def _fits(self, size: int) -> bool:
        return size == 0 or self.held == 0 or self.held + size <= self.limit

    def _release(self) -> None:
        if self.taken is not None:
            self.held -= self.sizes[self.taken]
            self.taken = None

    def close(self) -> None:
        """Drop every copy still held (a failed save): nothing outlives the writer."""
        self.pending.clear()
        self._release()
        self.held = 0
