"""Device -> host copies for saving, overlapped with writing, under a byte budget.

On the CPU backend ``np.asarray`` of a single-device ``jax.Array`` aliases its buffer:
nothing is copied and nothing needs staging. On accelerators every tensor must cross
to the host before it is written. The writers therefore walk their tensors with a
:class:`Window`: before writing tensor ``i`` they start the device -> host copies of
the tensors after it, as many as fit in the byte budget, so the copies run while
tensor ``i`` goes to the disk. A tensor's host copy is dropped as soon as it is
written, so the host holds at most ``max(budget, largest tensor)`` bytes of copies
beyond the caller's arrays, never the whole checkpoint.

A copy lands in a new array of the device's ``pinned_host`` memory (page-locked: the
copy engine writes it directly), or ``unpinned_host`` where that is all the device
offers, made with ``jax.device_put`` (asynchronous: it returns before the copy is
done). Host-memory copies are new arrays that die with the save; ``copy_to_host_async``
would instead cache the host copy on the caller's array for as long as the caller
keeps it (the whole checkpoint after a save), so it is only the fallback for devices
without host memory spaces.

Testing aid: ``NNX_SAVE_FORCE_HOST_STAGING=1`` stages on the CPU backend too (its
``pinned_host`` memory is ordinary memory and the copy is real), so the overlapped,
bounded path runs, and can be measured, without an accelerator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _config
from ..errors import NnxSaveError, OptionError, SaveError

__all__ = [
    "BUDGET_ENV",
    "FORCE_ENV",
    "BoxedValue",
    "Staged",
    "Window",
    "budget",
    "stage",
]

BUDGET_ENV = _config.SAVE_INFLIGHT_BYTES.name
FORCE_ENV = _config.FORCE_HOST_STAGING.name
# Host memory kinds a device -> host copy may land in, the fastest first.
_HOST_KINDS = ("pinned_host", "unpinned_host")


Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class BoxedValue:
    """An entry's value made from other arrays (a ported export), for a tensor that
    no process may hold whole.

    ``whole()`` makes the whole host value (the single-process writers call the entry);
    ``boxes()`` this process's ``(box, host array)`` parts, which over every process
    hold each element exactly once (the collective writer writes them where they
    land). ``spanning``: its sources have shards on several processes. Every process
    calls ``boxes()`` for the same entries in the same order: a fallback may gather.
    """

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


def _forced() -> bool:
    return _config.FORCE_HOST_STAGING.get()


def own_shards(array: Any) -> list[Any]:
    """The addressable shards of ``array`` this process writes: those of replica 0
    (exactly one copy of every element in the whole job)."""
    return [s for s in array.addressable_shards if s.replica_id == 0]


def host_shards(array: Any) -> list[tuple[Any, np.ndarray]]:
    """``(shard, host array)`` for each of :func:`own_shards`, without staging (the
    CPU backend: ``np.asarray`` aliases the device buffer)."""
    return [(s, np.asarray(s.data)) for s in own_shards(array)]


def assemble(shape: tuple[int, ...], dtype: np.dtype, parts: Sequence[tuple[Any, np.ndarray]]) -> np.ndarray:
    """The whole array of ``shape`` on the host from ``(shard, host array)`` pairs
    that cover it (a shard named by its ``index``)."""
    if len(parts) == 1 and parts[0][1].shape == shape:
        return parts[0][1]
    out = np.empty(shape, dtype)
    for shard, host in parts:
        out[shard.index] = host
    return out


def staging_bytes(array: Any, spanning: bool = False) -> int:
    """Host bytes :func:`stage` would copy for ``array``; 0 when it copies nothing
    (numpy, a CPU-backed jax array, an array spanning processes unless ``spanning``:
    the collective writer, which writes this process's shards only)."""
    import jax

    if not isinstance(array, jax.Array) or array.is_deleted():
        return 0
    if not spanning and not array.is_fully_addressable:  # HostValue() refuses it with the reason
        return 0
    shards = own_shards(array)
    if not _forced() and all(s.device.platform == "cpu" for s in shards):
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
    """Copies of the tensors of a sequence started ahead, under a byte budget.

    ``take(i)`` (``i`` increasing) releases the copy taken before, starts the copies
    of the next tensors while the bytes held stay within ``limit`` (a tensor larger
    than ``limit`` is copied alone), then returns tensor ``i``'s host value:
    ``fallback()`` when nothing needed copying (``spanning``: see
    :func:`staging_bytes`). ``held`` is the bytes of copies
    started and not yet released, ``peak`` its maximum. A failed copy raises a
    :class:`SaveError` naming ``where`` and the tensor's key.
    """

    def __init__(
        self, arrays: Sequence[Any], keys: Sequence[str], limit: int, where: str, spanning: bool = False
    ) -> None:
        self.arrays, self.keys, self.limit, self.where = list(arrays), list(keys), limit, where
        self.spanning = spanning
        self.sizes = [staging_bytes(a, spanning) for a in self.arrays]
        self.pending: dict[int, Staged] = {}
        self.next = 0
        self.held = self.peak = 0
        self.taken: int | None = None

    def take(self, i: int, complete: Callable[[Staged], Any], fallback: Callable[[], Any]) -> Any:
        """Tensor ``i``'s host value: ``complete(staged copy)``, or ``fallback()`` when it needed no copy."""
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
