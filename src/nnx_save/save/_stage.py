"""Device -> host copies for saving, overlapped with writing, under a byte budget.

On the CPU backend ``np.asarray`` aliases a jax array's buffer: nothing is staged. On
accelerators a :class:`Window` starts the copies of the next tensors that fit the budget
while one is written; the budget counts the copy being written too, and a tensor that
would not fit is copied in blocks of whole rows. A copy lands in the host memory that
``NNX_SAVE_SAVE_STAGING`` names (``_config.SAVE_STAGING_KINDS``): ``numpy`` (ordinary host memory, freed
to the system as each copy is written), or jax's ``pinned_host`` / ``unpinned_host``
memory of the device (a new array from an asynchronous ``jax.device_put``; jax's pinned
allocator keeps what it grows). No copy is ever cached on the caller's array.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _config
from ..errors import NnxSaveError, OptionError, SaveError

__all__ = ["BoxedValue", "Piece", "Staged", "Window", "budget", "kind", "row_blocks", "stage", "staging_kind"]

# A tensor is cut into blocks of at least this size (one row may be more): below it the
# copies' dispatch would cost more than their bytes; under a budget below twice this
# size, a block may take more than half of it.
MIN_BLOCK_BYTES = 1 << 20


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


def kind() -> str:
    """The host memory a save stages into (``NNX_SAVE_SAVE_STAGING``, one of ``_config.SAVE_STAGING_KINDS``)."""
    return _config.SAVE_STAGING.get()


def staging_kind(device: Any, wanted: str) -> str:
    """``wanted`` where ``device`` offers that memory kind, else ``numpy`` (offered everywhere)."""
    if wanted == "numpy":
        return wanted
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # a backend without memory spaces (jax raises its own error types)
        return "numpy"
    return wanted if wanted in kinds else "numpy"


def _copy_shard(data: Any, wanted: str) -> Any:
    """Start the device -> host copy of one single-device array into ``wanted`` memory;
    returns a new array, held by nobody else, to wait on."""
    import jax

    memory = staging_kind(data.device, wanted)
    if memory == "numpy":
        # A new handle on the same buffer (no device copy): the host copy is kept on it and
        # dies with it, never cached on the caller's array, as the array's own
        # copy_to_host_async or addressable_data(0) (a handle jax keeps) would.
        handle = jax.make_array_from_single_device_arrays(data.shape, data.sharding, [data])
        handle.copy_to_host_async()
        return handle
    return jax.device_put(data, jax.sharding.SingleDeviceSharding(data.device, memory_kind=memory), may_alias=False)


@functools.cache
def _row_block() -> Callable[..., Any]:
    """``block(data, start, rows)``: rows ``[start, start + rows)`` of ``data`` on its device
    (one compile per shape, dtype and ``rows``: the start is an argument)."""
    import jax

    return jax.jit(lambda x, start, rows: jax.lax.dynamic_slice_in_dim(x, start, rows, 0), static_argnums=2)


@dataclass(frozen=True)
class Piece:
    """One device -> host copy: ``shard``'s data whole (``rows`` None), or its rows
    ``[start, start + rows)`` of which the host keeps those from ``skip`` on (a last block
    is as long as the others, moved back to end at the shard's end)."""

    shard: Any
    rows: int | None = None
    start: int = 0
    skip: int = 0

    @property
    def nbytes(self) -> int:
        data = self.shard.data
        return int(data.nbytes) if self.rows is None else self.rows * int(data.nbytes) // int(data.shape[0])

    def copy(self, wanted: str) -> Any:
        data = self.shard.data
        if self.rows is not None:
            data = _row_block()(data, self.start, self.rows)
        return _copy_shard(data, wanted)

    def host(self, copy: Any) -> np.ndarray:
        host = np.asarray(copy)
        return host if self.rows is None else host[self.skip :]


def row_blocks(shard: Any, cap: int) -> list[Piece]:
    """``shard`` as one piece, or, when its data is over ``cap`` bytes and has rows to cut
    (axis 0 below 2**31, the device index's width), as blocks of whole rows, each at most
    ``cap`` bytes (one row at least) and all of one length."""
    data = shard.data
    total, nbytes = (int(data.shape[0]), int(data.nbytes)) if data.ndim else (1, int(data.nbytes))
    if nbytes <= cap or data.ndim == 0 or total < 2 or total >= 1 << 31:
        return [Piece(shard)]
    row = nbytes // total
    count = -(-total // max(1, cap // row))
    rows = -(-total // count)
    return [Piece(shard, rows, min(a, total - rows), a - min(a, total - rows)) for a in range(0, total, rows)]


def _row_slabs(array: Any, shards: list[Any]) -> bool:
    """Whether ``shards`` are slabs of whole rows (every axis after the first whole): their
    bytes then lie in the file one after another, in row order."""
    shape = tuple(array.shape)
    if not shape:
        return len(shards) == 1
    return all(
        (sl.start or 0) == 0 and (dim if sl.stop is None else sl.stop) == dim
        for s in shards
        for sl, dim in zip(s.index[1:], shape[1:], strict=True)
    )


class Staged:
    """The device -> host copies of ``pieces`` (of an array of ``shape`` and ``dtype``), in flight."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, pieces: Sequence[Piece], wanted: str) -> None:
        self.shape, self.dtype, self.pieces = shape, dtype, list(pieces)
        self.copies = [p.copy(wanted) for p in self.pieces]
        self.nbytes = sum(p.nbytes for p in self.pieces)

    def host_shards(self) -> list[tuple[Any, np.ndarray]]:
        """``(shard, host array)`` pairs of whole-shard pieces, waiting for the copies."""
        return [(p.shard, p.host(c)) for p, c in zip(self.pieces, self.copies, strict=True)]

    def assemble(self) -> np.ndarray:
        """The whole array on the host, waiting for the copies."""
        return assemble(self.shape, self.dtype, self.host_shards())

    def block(self) -> np.ndarray:
        """The host value of a one-piece copy, waiting for it."""
        (piece,), (copy,) = self.pieces, self.copies
        return piece.host(copy)


def stage(array: Any, spanning: bool = False, wanted: str | None = None) -> Staged | None:
    """Start copying ``array``'s replica-0 shards to the host (``wanted`` memory, else
    :func:`kind`); ``None`` when nothing needs copying."""
    if not staging_bytes(array, spanning):
        return None
    pieces = [Piece(s) for s in own_shards(array)]
    return Staged(tuple(array.shape), np.dtype(array.dtype), pieces, wanted or kind())


@dataclass(frozen=True)
class _Unit:
    tensor: int
    pieces: tuple[Piece, ...]  # empty: nothing to copy (the entry's own value is written)
    nbytes: int


class Window:
    """Copies of a sequence of tensors started ahead, under a byte budget ``limit`` that
    counts the copy being written too. Each tensor is one copy, or, where ``split[i]``
    allows (its bytes may be written in pieces), one copy per row-slab shard cut in
    :func:`row_blocks` of at most half the budget (:data:`MIN_BLOCK_BYTES` at least), so every copy fits and one is
    always in flight while another is written; a tensor that cannot be cut and is
    larger than the budget is copied alone. ``held``: bytes of copies started and not
    yet released, ``peak`` its maximum; ``copies``: whether any tensor needs one;
    ``kind``: the host memory (:func:`kind`). A failed copy raises a
    :class:`SaveError` naming ``where`` and the tensor's key."""

    def __init__(
        self,
        arrays: Sequence[Any],
        keys: Sequence[str],
        limit: int,
        where: str,
        spanning: bool = False,
        split: Sequence[bool] | None = None,
    ) -> None:
        self.keys, self.limit, self.where, self.spanning = list(keys), limit, where, spanning
        self.kind = kind()
        force = _config.FORCE_HOST_STAGING.get()
        split = split if split is not None else [False] * len(arrays)
        self.units: list[_Unit] = []
        self.first: list[int] = []
        for i, (array, cut) in enumerate(zip(arrays, split, strict=True)):
            self.first.append(len(self.units))
            self.units += self._plan(i, array, force, cut)
        self.first.append(len(self.units))
        self.shapes = [
            (tuple(a.shape), np.dtype(a.dtype)) if a is not None else ((), np.dtype(np.uint8)) for a in arrays
        ]
        self.copies = any(u.nbytes for u in self.units)  # False (the CPU backend, numpy): each entry's value()
        self.pending: dict[int, Staged] = {}
        self.next = 0
        self.held = self.peak = 0
        self.taken: int | None = None

    def _plan(self, i: int, array: Any, force: bool, cut: bool) -> list[_Unit]:
        if not staging_bytes(array, self.spanning, force):
            return [_Unit(i, (), 0)]
        shards = own_shards(array)
        if not (cut and _row_slabs(array, shards)):
            return [_Unit(i, tuple(Piece(s) for s in shards), sum(int(s.data.nbytes) for s in shards))]
        ordered = sorted(shards, key=lambda s: (s.index[0].start or 0) if s.index else 0)
        cap = max(MIN_BLOCK_BYTES, self.limit // 2)
        return [_Unit(i, (p,), p.nbytes) for s in ordered for p in row_blocks(s, cap)]

    def take(self, i: int, complete: Callable[[Staged], Any], fallback: Callable[[], Any]) -> Any:
        """Tensor ``i``'s host value (``i`` increasing, one copy): ``complete(staged copy)``,
        or ``fallback()`` when it needed no copy; releases the copy taken before and
        starts the next ones that fit."""
        copy = self._advance(self.first[i])
        return fallback() if copy is None else self._guard(i, lambda: complete(copy))

    def blocks(self, i: int, fallback: Callable[[], Any]) -> Iterator[Any]:
        """Tensor ``i``'s host bytes in file order, one copy at a time (``fallback()``
        whole when it needed none). A copy is released when the next one is asked for:
        drop each block before that, or it outlives the budget."""
        for u in range(self.first[i], self.first[i + 1]):
            yield self._host(u, fallback)

    def _host(self, u: int, fallback: Callable[[], Any]) -> Any:
        copy = self._advance(u)
        i = self.units[u].tensor
        if copy is None:
            return fallback()
        return self._guard(i, copy.block if len(copy.pieces) == 1 else copy.assemble)

    def _advance(self, u: int) -> Staged | None:
        """Release the unit taken before; start unit ``u`` and the next ones that fit; unit ``u``'s copy."""
        self._release()
        while self.next < len(self.units) and (self.next <= u or self._fits(self.units[self.next].nbytes)):
            unit = self.units[self.next]
            if unit.nbytes:
                shape, dtype = self.shapes[unit.tensor]
                start = functools.partial(Staged, shape, dtype, unit.pieces, self.kind)
                self.pending[self.next] = self._guard(unit.tensor, start)
            self.held += unit.nbytes
            self.next += 1
        self.peak = max(self.peak, self.held)
        self.taken = u
        return self.pending.pop(u, None)

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
            self.held -= self.units[self.taken].nbytes
            self.taken = None

    def close(self) -> None:
        """Drop every copy still held (a failed save): nothing outlives the writer."""
        self.pending.clear()
        self._release()
        self.held = 0
