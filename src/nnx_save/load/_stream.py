"""Streaming onto accelerators (docs/accelerators.md): host memory is the in-flight
budget, not the checkpoint.

Each destination shard is cut into *slabs* (at most one staging buffer, cut on its
leading dimensions), grouped into *batches* in file order; a few workers each read a
batch into a pooled staging buffer, send every slab to its device(s), wait for those
transfers and return the buffer. A shard larger than one slab is assembled on its
device by ``jax.lax.dynamic_update_slice`` into a donated buffer. Sub-byte tensors,
porting transforms' whole sources and numpy targets take the host path.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..format._boxes import check_bools
from ..io._reader import Reader
from ._execute import Budget, Cancelled, aligned_empty, execute
from ._pieces import Box, extents, intersect, request
from ._plan import FilePlan, plan_file

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from ._dests import Dest
    from ._options import LoadOptions
    from ._pieces import Piece, Request
    from ._result import EngineResult
    from ._source import Header

__all__ = ["StagingPool", "StreamEngine", "allocator", "run", "slabs"]

ALIGN = 64
MAX_STAGING = 64 << 20  # per buffer: small enough that transfers overlap the next reads


class StreamEngine(Protocol):
    """What streaming needs of the engine (:class:`~nnx_save.load._engine.Engine`):
    its destinations, options, budget and readers, and the host path's over-read,
    checksum and dtype rules, so that both paths read, check and report alike."""

    header: Header
    result: EngineResult  # what the load did: its files' bytes and requests, per tensor its values
    opt: LoadOptions
    bar: Any
    budget: Budget
    dests: list[Dest]
    staging: Any  # set to the staging pool (tests look at it after a load)

    def open_reader(self, file: str) -> Reader: ...
    def held(self, owner: str) -> np.dtype: ...
    def read_through(self, file: str, plan: FilePlan) -> np.ndarray: ...
    def over_read_warns(self, read: int, needed: int) -> bool: ...
    def note_over_read(
        self, file: str, read: int, needed: int, ratio: float, extra: np.ndarray, floor: int
    ) -> None: ...
    def floor_bytes(self, requests: Sequence[Request], plan: FilePlan) -> int: ...
    def piece_bytes(self, box: Box, buffer: np.ndarray, piece: Piece, part: Box) -> tuple[Box, np.ndarray]: ...
    def checked_piece(self, key: str, piece: Piece, buffers: Iterable[memoryview] | None) -> None: ...


def slabs(box: Box, itemsize: int, size: int) -> list[Box]:
    """``box`` cut into C-ordered boxes of at most ``size`` bytes, on its leading
    dimensions (a slab is a run of whole trailing sub-arrays).

    Examples:
        >>> slabs(((0, 4), (0, 3)), 4, 24)
        [((0, 2), (0, 3)), ((2, 4), (0, 3))]
        >>> slabs(((0, 2), (0, 8)), 1, 3)
        [((0, 1), (0, 3)), ((0, 1), (3, 6)), ((0, 1), (6, 8)), ((1, 2), (0, 3)), ((1, 2), (3, 6)), ((1, 2), (6, 8))]
    """
    ext = extents(box)
    if math.prod(ext) * itemsize <= size or not ext:
        return [box]
    k, inner = len(ext) - 1, itemsize
    while inner * ext[k] <= size:  # trailing dimensions a slab holds whole
        inner *= ext[k]
        k -= 1
    step = max(1, size // inner)
    lo_k, hi_k = box[k]
    out = []
    for head in itertools.product(*(range(lo, hi) for lo, hi in box[:k])):
        for s in range(lo_k, hi_k, step):
            out.append((*((i, i + 1) for i in head), (s, min(s + step, hi_k)), *box[k + 1 :]))
    return out


# --------------------------------------------------------------------------- staging memory


def _pinned(device: Any) -> Callable[[int], tuple[np.ndarray, Any]]:
    """Staging buffers in jax's ``pinned_host`` memory of ``device``'s backend: a jax
    array kept alive as the owner, written through its host address."""
    import jax
    import jax.numpy as jnp

    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")

    def allocate(nbytes: int) -> tuple[np.ndarray, Any]:
        owner = jax.jit(lambda: jnp.zeros(nbytes + ALIGN, jnp.uint8), out_shardings=sharding)()
        address = owner.addressable_data(0).unsafe_buffer_pointer()
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * (nbytes + ALIGN)).from_address(address))
        shift = -raw.ctypes.data % ALIGN
        return raw[shift : shift + nbytes], owner

    return allocate


def allocator(kind: str, device: Any) -> Callable[[int], tuple[np.ndarray, Any]]:
    """``allocate(nbytes) -> (writable uint8 buffer, owner to keep alive)`` for staging
    ``kind`` (``"pinned"`` or ``"pageable"``: aligned numpy memory, no owner)."""
    return _pinned(device) if kind == "pinned" else lambda nbytes: (aligned_empty(nbytes, ALIGN), None)


class StagingPool:
    """At most ``count`` staging buffers of ``size`` bytes, allocated on first need
    and reused: :meth:`acquire` waits while all are out. ``allocations`` counts the
    buffers ever made."""

    def __init__(self, count: int, size: int, allocate: Callable[[int], tuple[np.ndarray, Any]]) -> None:
        self.count, self.size, self._allocate = count, size, allocate
        self.allocations = self.out = 0
        self._free: list[tuple[np.ndarray, Any]] = []
        self._cond = threading.Condition()

    def acquire(self) -> tuple[np.ndarray, Any]:
        with self._cond:
            self._cond.wait_for(lambda: self._free or self.allocations < self.count)
            self.out += 1
            if self._free:
                return self._free.pop()
            self.allocations += 1
        return self._allocate(self.size)

    def release(self, buffer: tuple[np.ndarray, Any]) -> None:
        with self._cond:
            self.out -= 1
            self._free.append(buffer)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._free.clear()


# --------------------------------------------------------------------------- the work


@dataclass
class _Slab:
    dest: int
    box: Box
    at: tuple[int, ...]  # where the slab starts in its destination's box
    nbytes: int
    offset: int = 0  # in its batch's staging buffer


@dataclass
class _Batch:
    slabs: list[_Slab] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Shard:
    """A streamed destination's state: per device, its array (or buffer being filled)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    arrays: dict[Any, Any] = field(default_factory=dict)


def _plan_batches(engine: StreamEngine, streamed: list[int], size: int) -> list[_Batch]:
    """Slabs in file order, grouped into batches of at most ``size`` bytes; the
    batches of different files interleave (files read at once)."""
    per_file: dict[str, list[tuple[int, _Slab]]] = {}
    for i in streamed:
        d = engine.dests[i]
        info = engine.header.tensors[d.key]
        first = min(((p.info.file, p.info.begin) for p, _ in d.parts), default=("", 0))  # empty: no reads
        for box in slabs(d.box, info.dtype.itemsize, size):
            at = tuple(lo - b for (lo, _), (b, _) in zip(box, d.box, strict=True))
            slab = _Slab(i, box, at, math.prod(extents(box)) * info.dtype.itemsize)
            per_file.setdefault(first[0], []).append((first[1], slab))
    queues = []
    for items in per_file.values():
        batches, batch = [], _Batch()
        for _, slab in sorted(items, key=lambda item: item[0]):
            aligned = -(-slab.nbytes // ALIGN) * ALIGN
            if batch.slabs and batch.nbytes + aligned > size:
                batches.append(batch)
                batch = _Batch()
            slab.offset = batch.nbytes
            batch.slabs.append(slab)
            batch.nbytes += aligned
        batches.append(batch)
        queues.append(batches)
    return [b for group in itertools.zip_longest(*queues) for b in group if b is not None]


def _owned(array: Any, host: np.ndarray) -> Any:
    """``array``, or a device-side copy of it when it aliases ``host`` (jax's CPU backend
    adopts aligned host memory even under ``may_alias=False``; a staging buffer is
    reused, so nothing may keep pointing into it)."""
    cpu = host.nbytes and next(iter(array.devices())).platform == "cpu"
    return _copier()(array) if cpu and array.unsafe_buffer_pointer() == host.ctypes.data else array


@functools.cache
def _copier():
    import jax

    return jax.jit(lambda x: x.copy())


@functools.cache
def _updater():
    """``update(buffer, slab, *starts)``: the slab written into the (donated) device buffer."""
    import jax

    def update(buffer, slab, *starts):
        return jax.lax.dynamic_update_slice(buffer, slab.astype(buffer.dtype), starts)

    return jax.jit(update, donate_argnums=0)


class _Streamer:
    def __init__(self, engine: StreamEngine, streamed: list[int], pool: StagingPool) -> None:
        self.engine, self.pool = engine, pool
        self.batches = iter(_plan_batches(engine, streamed, pool.size))
        self.shards = {i: _Shard() for i in streamed}
        self.lock = threading.Lock()
        self.cancel = threading.Event()
        self.readers: dict[str, Reader] = {}
        self.errors: list[BaseException] = []
        self.hashed: set[tuple[str, str]] = set()  # pieces verified from a staging buffer
        self.stats: dict[str, list[int]] = {}  # file -> [read, needed, read at max_over_read_ratio=1.0]
        self.through: dict[str, tuple[float, np.ndarray]] = {}  # file -> (top ratio, bytes read through per tensor)

    def reader(self, file: str) -> Reader:
        with self.lock:
            if file not in self.readers:
                self.readers[file] = self.engine.open_reader(file)
            return self.readers[file]

    def guarded(self) -> None:
        try:
            self.work()
        except BaseException as e:  # the first real failure is raised by run(); the rest stop
            self.cancel.set()
            if not isinstance(e, Cancelled):
                with self.lock:
                    self.errors.append(e)

    def next_batch(self) -> _Batch | None:
        with self.lock:
            return None if self.cancel.is_set() else next(self.batches, None)

    def work(self) -> None:
        while (batch := self.next_batch()) is not None:
            staging = self.pool.acquire()
            try:
                views = [staging[0][s.offset : s.offset + s.nbytes] for s in batch.slabs]
                self.read(batch, views)
                self.send(batch, views)
            finally:
                self.pool.release(staging)

    def read(self, batch: _Batch, views: list[np.ndarray]) -> None:
        by_file: dict[str, list] = {}
        for n, slab in enumerate(batch.slabs):
            d = self.engine.dests[slab.dest]
            for piece, part in d.parts:
                sub = intersect(part, slab.box)
                if sub is not None:
                    by_file.setdefault(piece.info.file, []).append(request(piece, sub, slab.box, n))
        opt, bar, budget = self.engine.opt, self.engine.bar, self.engine.budget
        on_chunk = bar.update if bar.active else None
        for file, requests in by_file.items():
            plan = plan_file(requests, max_over_read_ratio=opt.max_over_read_ratio, chunk_bytes=opt.chunk_bytes)
            execute(self.reader(file), plan, views, budget=budget, num_threads=1, on_chunk=on_chunk, cancel=self.cancel)
            self.note(file, plan, requests)
        if opt.verify:
            self.verify(batch, views)

    def note(self, file: str, plan: FilePlan, requests: Sequence[Request]) -> None:
        """Add one batch's plan to its file's statistics, and where the automatic ratio
        read through (above 1) the bytes per tensor, for the over-read warning (at ratio
        1 only sub-page gaps are read: the staging size's cost, not the ratio's), with
        what ratio 1 would have read, for the warning's advice."""
        extra, floor = None, plan.read_bytes
        if self.engine.opt.max_over_read_ratio is None and plan.ratio > 1.0 and plan.read_bytes > plan.needed_bytes:
            extra = self.engine.read_through(file, plan)
            floor = self.engine.floor_bytes(requests, plan)
        with self.lock:
            got = self.stats.setdefault(file, [0, 0, 0])
            got[0] += plan.read_bytes
            got[1] += plan.needed_bytes
            got[2] += floor
            if extra is not None:
                ratio, before = self.through.get(file, (plan.ratio, 0))
                self.through[file] = (max(ratio, plan.ratio), before + extra)

    def send(self, batch: _Batch, views: list[np.ndarray]) -> None:
        """Each slab to its device(s); returns once every transfer from ``views`` is done."""
        import jax

        sent = []
        for slab, view in zip(batch.slabs, views, strict=True):
            d = self.engine.dests[slab.dest]
            info = self.engine.header.tensors[d.key]
            host = check_bools(view.view(info.dtype.numpy).reshape(extents(slab.box)), info, slab.box)
            puts = [(device, _owned(jax.device_put(host, device, may_alias=False), host)) for device in d.devices]
            sent.append((slab, puts))
        jax.block_until_ready([a for _, puts in sent for _, a in puts])  # then the staging buffer may be reused
        for slab, puts in sent:
            self.assemble(slab, puts)

    def assemble(self, slab: _Slab, puts: list[tuple[Any, Any]]) -> None:
        d, shard = self.engine.dests[slab.dest], self.shards[slab.dest]
        held = self.engine.held(d.owner)
        with shard.lock:
            for device, array in puts:
                if slab.box == d.box:
                    shard.arrays[device] = array if array.dtype == held else array.astype(held)
                    continue
                if device not in shard.arrays:
                    import jax.numpy as jnp

                    shard.arrays[device] = jnp.zeros(extents(d.box), held, device=device)
                shard.arrays[device] = _updater()(shard.arrays[device], array, *slab.at)

    def verify(self, batch: _Batch, views: list[np.ndarray]) -> None:
        """Hash every whole piece a slab holds, from the staging buffer."""
        for slab, view in zip(batch.slabs, views, strict=True):
            d = self.engine.dests[slab.dest]
            for piece, part in d.parts:
                name = (piece.info.file, piece.info.name)
                if part == piece.box and intersect(part, slab.box) == part:
                    _, region = self.engine.piece_bytes(slab.box, view, piece, part)
                    self.engine.checked_piece(d.key, piece, [np.ascontiguousarray(region).data.cast("B")])
                    with self.lock:
                        self.hashed.add(name)

    def verify_rest(self) -> None:
        """The pieces this process needed whole (over all its shards) but no slab held
        whole are read again and hashed in staging-sized chunks; the pieces it needed
        only part of are recorded as not verifiable."""
        needed: dict[tuple[str, str], tuple[str, Any, set[Box]]] = {}
        for i in self.shards:
            d = self.engine.dests[i]
            for piece, part in d.parts:
                needed.setdefault((piece.info.file, piece.info.name), (d.key, piece, set()))[2].add(part)
        staging = self.pool.acquire()
        try:
            for name, (key, piece, parts) in needed.items():
                if name in self.hashed:
                    continue
                if sum(math.prod(extents(p)) for p in parts) != math.prod(extents(piece.box)):
                    self.engine.checked_piece(key, piece, None)
                else:
                    chunks = _chunks(self.reader(piece.info.file), piece.info, staging[0])
                    self.engine.checked_piece(key, piece, chunks)
        finally:
            self.pool.release(staging)


def _chunks(reader: Reader, info: Any, scratch: np.ndarray) -> Iterator[memoryview]:
    """A tensor's bytes read again in ``len(scratch)`` chunks (each valid until the next)."""
    for at in range(info.begin, info.end, len(scratch)):
        n = min(len(scratch), info.end - at)
        reader.readv([scratch.data[:n]], at)
        yield scratch.data[:n]


def _shape(opt: Any, host_devices: bool) -> tuple[int, int]:
    """``(workers, staging bytes)``: one staging buffer per worker, all within the budget.

    Where device memory is host memory (the CPU backend, streaming forced), each staged
    batch is also copied once on its "device" before its buffer is reused
    (:func:`_owned`): the pool then gets half the budget and those copies the other half.
    """
    budget = opt.max_inflight_bytes // 2 if host_devices else opt.max_inflight_bytes
    size = opt.staging_bytes or max(ALIGN, min(MAX_STAGING, budget // opt.threads))
    size = min(size, max(ALIGN, budget))
    return max(1, min(opt.threads, budget // size)), size


def run(engine: StreamEngine, streamed: list[int], kind: str, device: Any) -> dict[int, dict[Any, Any]]:
    """Stream destinations ``streamed`` of ``engine`` through ``kind`` staging buffers
    (allocated for ``device``'s backend). Returns each one's array per device.

    On any failure the other workers stop before their next batch, every worker is
    waited for, every reader closed and the pool dropped before the error propagates.
    """
    workers, size = _shape(engine.opt, host_devices=device.platform == "cpu")
    pool = StagingPool(workers, size, allocator(kind, device))
    engine.staging = pool
    streamer = _Streamer(engine, streamed, pool)
    try:
        threads = [threading.Thread(target=streamer.guarded, name=f"nnx_save-stream-{n}") for n in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if streamer.errors:
            raise streamer.errors[0]
        if engine.opt.verify:
            streamer.verify_rest()
    finally:
        for r in streamer.readers.values():
            r.close()
        pool.close()
    for file, (read, needed, floor) in streamer.stats.items():
        engine.result.files.append((file, read, needed, 0))
        if file in streamer.through and engine.over_read_warns(read, needed):  # one warning per load, as hosted
            engine.note_over_read(file, read, needed, *streamer.through[file], floor)
    engine.result.requests += sum(r.requests for r in streamer.readers.values())
    return {i: shard.arrays for i, shard in streamer.shards.items()}
