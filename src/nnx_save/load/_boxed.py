"""Targets made by a porting transform, read box by box, the transform applied in the copy.

Each box a process needs of such a target (a shard, or the whole value) has one final
buffer. The box is cut into slabs (:mod:`nnx_save.load._slabs`) whose source bytes stay
a few MiB, along the axis whose slabs are contiguous runs of the source where there is
one; each slab is one unit of work on the reader threads: read its source boxes into
small temporaries (under the load's byte budget), apply the transform to them
(:meth:`~nnx_save.load._target.SourceTransform.from_boxes`: a transpose is a view) and
copy the result into its part of the final buffer (:func:`copy_into`, in cache-sized
strips), then free the temporaries. No full-size source buffer exists and nothing runs
over a finished file; the main thread only places each finished target (an adoption on
the CPU backend). A transform with no per-box map reads its sources whole
(``report.io.read_whole``: the engine lists them in its result).

A dtype cast is the identity map here (:data:`~nnx_save.load._slabs.CAST`, planned by
:meth:`BoxedTargets.cast`): a target held in another dtype than its file's gets its
final buffer in the held dtype and each slab is cast into it as it lands, so the file's
dtype is never held whole; small ones are read together, in units of up to a slab's
bytes. Under ``verify`` a tensor cut into slabs is read again, a unit's bytes at a
time, and hashed in file order (its recorded checksum is of the whole tensor's bytes).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import HostMemoryError, ShapeMismatchError
from ..format._boxes import check_bools
from ..format._units import human_bytes
from ..io._reader import Reader
from ._assemble import held_dtype, place
from ._execute import SLAB_BYTES, Budget, Cancelled, aligned_empty, execute, pack_buffers
from ._pieces import Box, Request, extents, request
from ._plan import plan_file
from ._slabs import CAST, plan_units
from ._target import SourceTransform, Target, shard_boxes

__all__ = ["UNIT_BYTES", "BoxedTargets", "copy_into", "unit_bytes"]

UNIT_BYTES = 4 << 20  # source bytes per unit: cache-friendly temporaries, enough units to share out
UNIT_MIN_BYTES = 256 << 10  # the least a budget's share cuts units to (a unit costs a plan and a read)
# Units of at most this many bytes are read in their file's plan (temporaries allocated with
# its buffers): a plan of its own would cost more than the read, and the file's plan reads
# through gaps under a page, which may hold them.
EAGER_BYTES = 64 << 10
TILE_BYTES = 32  # a tile's width: measured best for float16 to float64 (a cache line was slower)
TILE_ROWS = 512
STRIP_MIN_ROWS = 16  # tiles pay only when each holds this many rows (else one numpy copy)
_UNBOUNDED = Budget(1 << 62)  # a unit holds its bytes in the load's budget before its reads start


def unit_bytes(max_inflight_bytes: int, threads: int) -> int:
    """Source bytes per unit: :data:`UNIT_BYTES`, or a thread's share of the in-flight
    budget where that is less (not under :data:`UNIT_MIN_BYTES`, nor over the budget), so
    that the units in flight and the threads' reused temporaries stay within about the
    budget.

    Examples:
        >>> unit_bytes(2 << 30, 8) >> 20, unit_bytes(16 << 20, 8) >> 20, unit_bytes(1 << 20, 8) >> 10
        (4, 2, 256)
        >>> unit_bytes(64 << 10, 8) >> 10
        64
    """
    return min(UNIT_BYTES, max(min(UNIT_MIN_BYTES, max_inflight_bytes), max_inflight_bytes // threads))


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (casting to ``dst``'s dtype), cache-blocked when ``src`` is
    strided along ``dst``'s last axis (a transpose).

    numpy copies such a view element by element in ``dst``'s order, each read a cache
    miss (about 0.5 GB/s for a float32 matrix). Tiles of :data:`TILE_ROWS` rows of
    ``dst`` and :data:`TILE_BYTES` across, each copied whole, read each source line
    once while it is in cache, and the row cap keeps rows a power of two apart from
    evicting each other (benchmarks/ported.py measures the load around it).

    Examples:
        >>> a = np.arange(4096, dtype=np.float32).reshape(64, 64)
        >>> out = np.empty((64, 64), np.float32)
        >>> copy_into(out, a.T)
        >>> bool((out == a.T).all())
        True
    """
    width = max(1, TILE_BYTES // dst.itemsize)
    if dst.ndim < 2 or src.strides[-1] == src.itemsize or dst.shape[-1] <= width or dst.shape[-2] < STRIP_MIN_ROWS:
        dst[...] = src
        return
    for i in range(0, dst.shape[-2], TILE_ROWS):
        d, s = dst[..., i : i + TILE_ROWS, :], src[..., i : i + TILE_ROWS, :]
        for j in range(0, dst.shape[-1], width):
            d[..., j : j + width] = s[..., j : j + width]


def _no_memory(file: str, boxes: list[_Box], sizes: list[int]) -> HostMemoryError:
    """The final buffers of ``boxes`` (``sizes`` bytes) cannot be allocated: name the largest."""
    i = max(range(len(sizes)), key=sizes.__getitem__)
    path = boxes[i].target.path
    return HostMemoryError(
        f"{file}: cannot allocate host memory for {path!r} ({human_bytes(sizes[i])}; {human_bytes(sum(sizes))} "
        f"for the {len(sizes)} transformed shard(s) filled from this file); nothing was read from this file. "
        "Free memory or raise the process's memory limit",
        file,
        path,
        sizes[i],
    )


@dataclass
class _Box:
    """One box of a target: its final buffer (allocated by its first unit)."""

    target: Target
    box: Box
    devices: list[Any]
    transform: SourceTransform  # the target's, or CAST
    left: int = 0  # units not yet copied in
    buffer: np.ndarray | None = None


@dataclass
class _Unit:
    """Slabs of some boxes of one target: the source boxes that make them, and their reads."""

    parts: list[tuple[int, Box, int, int]]  # (box, slab, its feeds [start, stop))
    feeds: list[tuple[str, Box]]  # (source key, source box): one temporary each
    reads: dict[str, list[Request]] = field(default_factory=dict)  # file -> requests into the temporaries
    pieces: list[Any] = field(default_factory=list)  # per feed: the one piece it is whole, or None
    nbytes: int = 0
    sizes: list[int] = field(default_factory=list)  # per feed: its temporary's bytes


def _part(final: np.ndarray, sub: Box, box: Box) -> np.ndarray:
    """The view of ``final`` (holding ``box``) that slab ``sub`` fills (the ellipsis: a
    0-d box's view too, not a scalar)."""
    at: list[Any] = [slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(sub, box, strict=True)]
    return final[(*at, ...)]


def _merge(into: _Unit, unit: _Unit) -> None:
    """Append ``unit``'s parts, feeds and reads to ``into`` (its temporaries after ``into``'s)."""
    shift = len(into.feeds)
    into.parts += [(i, sub, a + shift, b + shift) for i, sub, a, b in unit.parts]
    into.feeds += unit.feeds
    for file, reqs in unit.reads.items():
        into.reads.setdefault(file, []).extend(dataclasses.replace(r, dest=r.dest + shift) for r in reqs)
    into.pieces += unit.pieces
    into.sizes += unit.sizes
    into.nbytes += unit.nbytes


class BoxedTargets:
    """The box-mapped targets of one engine run. Each method takes the engine (whose
    planning, :mod:`nnx_save.load._dests`, imports this module) rather than holding it:
    no reference cycle keeps a finished load's arrays alive until the next garbage
    collection."""

    def __init__(self, slab_bytes: int = SLAB_BYTES, unit: int = UNIT_BYTES) -> None:
        self.slab_bytes = slab_bytes  # final buffers are packed into allocations of up to this size
        self.boxes: list[_Box] = []
        self.by_target: dict[str, list[int]] = {}  # target path -> its boxes
        self.by_file: dict[str, list[_Unit]] = {}  # the file a unit's first read is in -> units
        self.eager: dict[str, list[_Unit]] = {}  # file -> small units read with its plan (all in it)
        self.nbytes = 0  # source bytes all units read
        self._lock = threading.Lock()
        self._local = threading.local()  # per reader thread: its scratch buffer
        self._finished: list[int] = []  # boxes filled since the last :meth:`place_finished`
        self._open: dict[str, _Unit] = {}  # file -> the unit small casts from it are gathered in
        self.unit = unit  # source bytes per unit (unit_bytes of the load's options)
        self.apart: set[str] = set()  # file keys of casts verified apart from their units (verify)
        self.rehash: dict[str, list[tuple[str, Any]]] = {}  # file -> (key, piece) hashed after its units

    def add(self, engine: Any, t: Target, transform: SourceTransform | None = None) -> bool:
        """Plan ``t`` unit by unit with ``transform`` (``t``'s own by default, :data:`CAST`
        for a cast); False (nothing added) when the transform cannot."""
        transform = transform or t.transform
        assert transform is not None
        infos = [engine.header.tensors[k] for k in t.sources]
        if not all(info.dtype.byte_aligned for info in infos):
            return False  # packed sub-byte sources: read whole, unpacked after
        shapes, sizes = [info.shape for info in infos], [info.dtype.itemsize for info in infos]
        boxes = shard_boxes(t)
        # verify: a transform reads each piece whole, so that it can be checked; a cast is hashed apart
        limit = math.inf if engine.opt.verify and transform is not CAST else self.unit
        planned = plan_units(transform, [b for b, _ in boxes], shapes, sizes, limit)
        if planned is None:
            return False
        first = len(self.boxes)
        self.by_target[t.path] = list(range(first, first + len(boxes)))
        self.boxes += [_Box(t, box, devices, transform) for box, devices in boxes]
        files = []
        for parts in planned:
            unit = _Unit([], [])
            for i, sub, feeds in parts:
                unit.parts.append((first + i, sub, len(unit.feeds), len(unit.feeds) + len(feeds)))
                unit.feeds += [(t.sources[k], b) for k, b in feeds]
                self.boxes[first + i].left += 1
            files.append(self._add_unit(engine, unit, self.unit if transform is CAST else 0))
        if transform is CAST and engine.opt.verify:
            read_whole = {b for parts in planned for _, _, fed in parts for _, b in fed}
            self._verify_apart(engine, t.sources[0], [b for b, _ in boxes], read_whole, files[0])
        return True

    def _verify_apart(self, engine: Any, key: str, boxes: list[Box], feeds: set[Box], file: str) -> None:
        """Under ``verify``, the pieces of cast tensor ``key`` that no unit reads whole
        (``feeds``: the source boxes its units read): each one this process needs whole
        (``boxes`` cover it) is read again and hashed after ``file``'s units; the others
        cannot be checked here."""
        self.apart.add(key)
        pieces: dict[Box, tuple[Any, set[Box]]] = {}
        for box in boxes:
            for piece, part in engine.choose(key, box):
                pieces.setdefault(piece.box, (piece, set()))[1].add(part)
        for piece, parts in pieces.values():
            if piece.box in feeds:  # a unit reads it whole: checked there
                continue
            if sum(math.prod(extents(p)) for p in parts) == math.prod(extents(piece.box)):
                self.rehash.setdefault(file, []).append((key, piece))
            else:
                engine.mark(key, False)

    def cast(self, engine: Any, t: Target) -> None:
        """Plan ``t``, read from one byte-aligned file tensor and held in another dtype,
        as :data:`CAST` units. A small tensor wanted whole in one box, one piece of one
        file (what a model's many biases and norms are), joins its file's open unit
        straight away: :meth:`add`'s general planning costs more than its read."""
        key = t.sources[0]
        info = engine.header.tensors[key]
        boxes = shard_boxes(t)
        if len(boxes) > 1 or info.nbytes > min(EAGER_BYTES, self.unit):
            self.add(engine, t, CAST)
            return
        box, devices = boxes[0]
        parts = engine.choose(key, box)
        piece = parts[0][0]
        if len(parts) != 1 or piece.box != box:
            self.add(engine, t, CAST)
            return
        self.by_target[t.path] = [len(self.boxes)]
        self.boxes.append(_Box(t, box, devices, CAST, 1))
        into = self._open.get(info.file)
        if into is None or into.nbytes + info.nbytes > self.unit:
            into = self._open[info.file] = _Unit([], [])
            self.by_file.setdefault(info.file, []).append(into)
        j = len(into.feeds)
        into.parts.append((len(self.boxes) - 1, box, j, j + 1))
        into.feeds.append((key, box))
        into.reads.setdefault(info.file, []).append(request(piece, box, box, j))
        into.pieces.append(piece)
        into.sizes.append(info.nbytes)
        into.nbytes += info.nbytes
        self.nbytes += info.nbytes

    def _add_unit(self, engine: Any, unit: _Unit, gather: int = 0) -> str:
        """Add ``unit`` to the file of its first read (returned): a small one read with
        that file's plan, or, where ``gather`` is given, in one unit of up to ``gather``
        bytes with the small ones before it (casts: their temporaries are then the
        unit's, never the whole file's)."""
        for j, (key, box) in enumerate(unit.feeds):
            parts = engine.choose(key, box)  # a refusal (a missing pod file) before any read
            whole = len(parts) == 1 and parts[0][0].box == box
            unit.pieces.append(parts[0][0] if whole else None)
            for piece, part in parts:
                unit.reads.setdefault(piece.info.file, []).append(request(piece, part, box, j))
            unit.sizes.append(math.prod(extents(box)) * engine.header.tensors[key].dtype.itemsize)
            unit.nbytes += unit.sizes[-1]
        assert unit.reads, "a unit's source boxes are never empty (Transform.source_boxes maps only non-empty boxes)"
        file = next(iter(unit.reads))
        self.nbytes += unit.nbytes
        small = unit.nbytes <= EAGER_BYTES and len(unit.reads) == 1
        if not small or not gather:
            (self.eager if small else self.by_file).setdefault(file, []).append(unit)
            return file
        into = self._open.get(file)
        if into is None or into.nbytes + unit.nbytes > gather:
            into = self._open[file] = _Unit([], [])
            self.by_file.setdefault(file, []).append(into)
        _merge(into, unit)
        return file

    def allocate(self, file: str) -> None:
        """Allocate the final buffers of the boxes that ``file``'s units fill first,
        packed into a few large allocations (:func:`~nnx_save.load._execute.pack_buffers`):
        the shards of a sharded target are mostly far below the 4 MiB from which numpy
        asks for huge pages, and faulting them in 4 KiB at a time cost more than the
        transposed copy into them (benchmarks/ported.py, 8 devices). Runs on the
        caller's thread, before the file's reads; untouched memory costs nothing yet."""
        fresh: dict[int, _Box] = {}
        for unit in itertools.chain(self.eager.get(file, []), self.by_file.get(file, [])):
            for index, *_ in unit.parts:
                if self.boxes[index].buffer is None:
                    fresh.setdefault(index, self.boxes[index])
        helds = [held_dtype(b.target) for b in fresh.values()]
        sizes = [math.prod(extents(b.box)) * h.itemsize for b, h in zip(fresh.values(), helds, strict=True)]
        try:
            packed = pack_buffers(sizes, slab_bytes=self.slab_bytes)
        except MemoryError:
            raise _no_memory(file, list(fresh.values()), sizes) from None
        for owner, held, flat in zip(fresh.values(), helds, packed, strict=True):
            owner.buffer = flat.view(held).reshape(extents(owner.box))

    def eager_work(self, file: str, first: int) -> tuple[list[Request], list[np.ndarray], list[tuple[_Unit, list]]]:
        """The small units of ``file``, read with its other destinations (numbered from
        ``first``): their requests, temporaries, and each unit with its temporaries."""
        requests: list[Request] = []
        temps: list[np.ndarray] = []
        work: list[tuple[_Unit, list]] = []
        for unit in self.eager.get(file, []):
            mine = self._temps(unit)
            base = first + len(temps)
            for r in unit.reads[file]:
                requests.append(dataclasses.replace(r, dest=base + r.dest))
            temps += mine
            work.append((unit, mine))
        return requests, temps, work

    def apply_eager(self, engine: Any, work: list[tuple[_Unit, list]]) -> None:
        """Transform the small units read with their file's plan into their boxes."""
        for unit, temps in work:
            self._apply(engine, unit, temps)

    @staticmethod
    def _temps(unit: _Unit) -> list[np.ndarray]:
        return [aligned_empty(n) for n in unit.sizes]

    def _scratch(self, unit: _Unit) -> list[np.ndarray]:
        """``unit``'s temporaries, carved from this thread's reused scratch buffer (fresh
        memory for every unit would fault in as many pages as the checkpoint has)."""
        padded = [-(-n // 64) * 64 for n in unit.sizes]
        have = getattr(self._local, "scratch", None)
        if have is None or len(have) < sum(padded):
            have = self._local.scratch = aligned_empty(max(sum(padded), self.unit))
        starts = itertools.accumulate(padded, initial=0)
        return [have[at : at + n] for at, n in zip(starts, unit.sizes, strict=False)]

    def run_file(
        self, engine: Any, file: str, opened: Reader, threads: int, cancel: threading.Event
    ) -> tuple[int, int, int]:
        """Run the units whose first read is in ``file`` (read through ``opened``),
        ``threads`` at a time, opening readers of other files as units need them.
        Returns (bytes read, bytes needed, requests through the other readers)."""
        todo: list[Any] = [*self.by_file.get(file, []), *self.rehash.get(file, [])]
        readers: dict[str, Reader] = {}
        totals = [0, 0]

        def reader(name: str) -> Reader:
            if name == file:
                return opened
            with self._lock:
                if name not in readers:
                    readers[name] = engine.open_reader(name)
                return readers[name]

        def run(unit: _Unit | tuple[str, Any]) -> None:
            if cancel.is_set():
                raise Cancelled
            if not isinstance(unit, _Unit):  # a cast's piece, hashed apart
                with engine.budget(self.unit):
                    self._hash(engine, *unit, reader)
                return
            over = max(0, unit.nbytes - engine.budget.limit)  # a unit the budget cannot hold runs alone: counted
            with engine.budget(unit.nbytes):
                engine.budget.hold(over)
                try:
                    read, needed = self._run(engine, unit, reader)
                finally:
                    engine.budget.drop(over)
            with self._lock:
                totals[0] += read
                totals[1] += needed

        try:
            if threads <= 1 or len(todo) <= 1:
                for unit in todo:
                    run(unit)
            else:
                with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="nnx_save-unit") as pool:
                    for f in [pool.submit(run, u) for u in todo]:
                        f.result()
        except BaseException:
            cancel.set()
            raise
        finally:
            for r in readers.values():
                r.close()
        return totals[0], totals[1], sum(r.requests for r in readers.values())

    def _hash(self, engine: Any, key: str, piece: Any, reader: Callable[[str], Reader]) -> None:
        """Check ``piece`` of cast tensor ``key`` against its recorded checksum, its bytes
        read again into this thread's scratch a unit at a time, in file order (read only
        where the file records a checksum: ``checked_piece`` consumes them lazily)."""
        info, scratch = piece.info, self._scratch(_Unit([], [], sizes=[self.unit]))[0]

        def chunks() -> Iterator[memoryview]:
            for at in range(info.begin, info.end, len(scratch)):
                n = min(len(scratch), info.end - at)
                reader(info.file).readv([scratch.data[:n]], at)
                yield scratch.data[:n]

        engine.checked_piece(key, piece, chunks())

    def _run(self, engine: Any, unit: _Unit, reader: Callable[[str], Reader]) -> tuple[int, int]:
        """Read ``unit``'s source boxes, transform them into their part of the final buffer."""
        temps = self._scratch(unit)
        read = needed = 0
        for file, reqs in unit.reads.items():
            ratio, chunk = engine.opt.max_over_read_ratio, engine.opt.chunk_bytes
            plan = plan_file(reqs, max_over_read_ratio=ratio, chunk_bytes=chunk)
            on_chunk = engine.bar.update if engine.bar.active else None
            execute(reader(file), plan, temps, budget=_UNBOUNDED, num_threads=1, on_chunk=on_chunk)
            read, needed = read + plan.read_bytes, needed + plan.needed_bytes
        self._apply(engine, unit, temps)
        return read, needed

    def _apply(self, engine: Any, unit: _Unit, temps: list[np.ndarray]) -> None:
        """Check ``unit``'s pieces read whole (``verify``), transform its temporaries
        into its boxes, and count the boxes it finishes."""
        if engine.opt.verify:  # a piece read whole is checked; one read in parts cannot be
            for (key, _), whole, temp in zip(unit.feeds, unit.pieces, temps, strict=True):
                if whole is not None:
                    engine.checked_piece(key, whole, [temp.data])
                elif key not in self.apart:  # a cast's pieces cut into slabs are checked apart
                    engine.mark(key, False)
        regions = [
            check_bools(
                temp.view(engine.header.tensors[k].dtype.numpy).reshape(extents(b)), engine.header.tensors[k], b
            )
            for (k, b), temp in zip(unit.feeds, temps, strict=True)
        ]
        for index, sub, start, stop in unit.parts:
            self._copy(self.boxes[index], sub, regions[start:stop])
        with self._lock:  # once per unit: a unit of small casts fills thousands of boxes
            for index, *_ in unit.parts:
                owner = self.boxes[index]
                owner.left -= 1
                if not owner.left:
                    self._finished.append(index)

    def _copy(self, owner: _Box, sub: Box, regions: list[np.ndarray]) -> None:
        """Slab ``sub`` of ``owner`` from its source regions, into the final buffer."""
        t = owner.target
        if owner.transform is CAST:  # the region itself: its shape is the slab's
            _part(self._final(owner), sub, owner.box)[...] = regions[0]
            return
        value = np.asarray(owner.transform.from_boxes(sub, regions))
        if value.shape != extents(sub):
            raise ShapeMismatchError(
                f"{t.path}: rule produced shape {value.shape} for box {[list(b) for b in sub]} "
                f"from {list(t.sources)}, expected {extents(sub)}"
            )
        copy_into(_part(self._final(owner), sub, owner.box), value)

    @staticmethod
    def _final(owner: _Box) -> np.ndarray:
        """``owner``'s final buffer (held dtype, its box's shape): :meth:`allocate` made
        it before the reads of the first file that fills it."""
        assert owner.buffer is not None, f"{owner.target.path}: a box is filled before its buffer is allocated"
        return owner.buffer

    def place_finished(self, engine: Any) -> None:
        """Place every target whose boxes are all filled (on the caller's thread)."""
        with self._lock:
            done, self._finished = self._finished, []
        for index in done:
            t = self.boxes[index].target
            mine = self.by_target[t.path]
            if all(self.boxes[i].left == 0 for i in mine) and t.path not in engine.values:
                pieces = [(self._final(self.boxes[i]), self.boxes[i].devices) for i in mine]
                for i in mine:
                    self.boxes[i].buffer = None  # the array holds it now
                engine.values[t.path] = place(t, pieces)
                engine.bar.update(items=1)
