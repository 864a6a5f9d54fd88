"""The loading engine, one for every layout: match targets to file tensors, plan, read,
assemble.

:func:`load_targets` checks every target against the headers first
(:mod:`nnx_save.load._match`) and plans every destination (:mod:`nnx_save.load._dests`),
so a strict refusal, or a sharding jax cannot apply, reads nothing. Each box a process
needs is one destination, and each piece overlapping it one request writing its part in
place. On the CPU backend reads land in the aligned buffers the arrays adopt without a
copy (a buffer that is only a step, a sub-byte tensor's packed bytes or a porting rule's
whole source, is freed once used; a dtype cast is read in slabs, each cast into the
result as it lands: :mod:`nnx_save.load._boxed`); elsewhere :mod:`nnx_save.load._stream`
streams them. What the engine did
(:class:`~nnx_save.load._result.EngineResult`) completes the report.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

import numpy as np

from .. import _progress
from ..errors import HostMemoryError, RemoteError, ShapeMismatchError
from ..format import _checksum
from ..format._header import FileHeader, TensorInfo
from ..format._units import human_bytes
from ..io._reader import LocalReader, Reader
from . import _share, _stream
from ._assemble import assemble, host_view, place_adopted, place_whole
from ._dests import Dest, Destinations
from ._execute import SLAB_BYTES, Budget, aligned_empty, execute, pack_buffers
from ._match import check_targets, describe_source, refuse_nothing_loaded
from ._options import LoadOptions
from ._pieces import Box, Piece, Request, extents, request, whole
from ._plan import FilePlan, over_read_by_range, plan_file
from ._report import LoadReport, complete
from ._result import OVER_READ_MIN_BYTES, OVER_READ_WARN, EngineResult
from ._source import Header, gc_paused
from ._target import Target, WholeReads, check_device_dtypes, device_indices

__all__ = ["load_targets"]

log = logging.getLogger("nnx_save")
_SOURCES, _NBYTES = operator.attrgetter("sources"), operator.attrgetter("nbytes")


def _no_memory(file: str, dests: list[Dest]) -> HostMemoryError:
    """The allocation of ``dests``' host buffers failed: name the largest tensor."""
    biggest = max(dests, key=lambda d: d.nbytes)
    total = sum(d.nbytes for d in dests)
    return HostMemoryError(
        f"{file}: cannot allocate host memory for tensor {biggest.key!r} ({human_bytes(biggest.nbytes)}; "
        f"{human_bytes(total)} for the {len(dests)} buffer(s) read from this file); nothing was read from this file. Free memory, "
        "raise the process's memory limit, or read the tensor in slices (safe_open(...).get_slice)",
        file,
        biggest.key,
        biggest.nbytes,
    )


class Engine(Destinations):
    """Reads a load's destinations and places their values as each is filled.
    :meth:`run` reads on the host path; ``_stream.run`` streams."""

    def __init__(
        self,
        header: Header,
        targets: Sequence[Target],
        opt: LoadOptions,
        open_reader: Callable[[str], Reader],
        bar: Any,
        slab_bytes: int = SLAB_BYTES,
    ) -> None:
        self.open_reader, self.bar = open_reader, bar
        self.file_headers: dict[str, FileHeader] = {fh.file: fh for fh in header.files}
        self.wholes: dict[str, np.ndarray] = {}
        self.budget = Budget(opt.max_inflight_bytes)
        self.scratch: set[int] = set()  # ids of the destinations whose buffers the budget holds
        self.chunk_bytes = opt.chunk_bytes  # asked per file
        self.done: collections.Counter[str] = collections.Counter()  # owner -> destinations filled so far
        super().__init__(header, targets, opt, slab_bytes)
        # what it did, the report made of it outside (_report.complete); the lists given: no factory call
        self.result = EngineResult(
            read_whole=[t.path for t in self.pending], seconds=[0.0, 0.0, 0.0], over_read_bytes=[0, 0]
        )
        self.values = self.result.values
        self.over_reads = self.result.over_reads
        self.over_read_bytes = self.result.over_read_bytes  # bytes read, bytes max_over_read_ratio=1.0 would read
        self.checked = self.result.checked  # file key -> verified (True) or not verifiable (False)
        self._digests: dict[str, Mapping[str, str]] = {}  # file -> recorded checksums (verify only)
        self._lock = threading.Lock()
        self.staging: Any = None  # the streaming path's staging pool, once it ran
        self.readers: dict[str, tuple[Reader, tuple[bool, bool]]] = {}  # open on the files being read
        self.reads: ThreadPoolExecutor | None = None  # reading threads shared by the files read at once

    # ----------------------------------------------------------------- host path

    def run(self, skip: frozenset[int] = frozenset()) -> None:
        """Read every file into host shard buffers, several files at once (all
        destinations but ``skip``, which are streamed)."""
        if skip:
            kept = {f: [i for i in idx if i not in skip] for f, idx in self.by_file.items()}
            self.by_file = {f: idx for f, idx in kept.items() if idx}
        for index, dest in enumerate(self.dests):  # empty tensors: nothing to read
            if not dest.files and index not in skip:
                dest.buffer = aligned_empty(dest.nbytes)
                self._filled(index)
        boxed = self.boxed.by_file.keys() | self.boxed.eager.keys()
        files = [
            fh.file
            for fh in self.header.files
            if fh.file in self.by_file or fh.file in boxed or fh.file in self.batch.by_file
        ]
        if not files:
            return
        at_once = min(len(files), self.opt.threads)
        threads = max(1, self.opt.threads // at_once)  # a file's transformed units
        cancel = threading.Event()
        running: dict[Future, str] = {}
        readers = self.readers
        todo = iter(files)
        # several files at once share one pool of reading threads: a file's chunks queue
        # there, so when one file is done its threads read the others' (files differ in size)
        shared = ThreadPoolExecutor(self.opt.threads, "nnx_save-read") if at_once > 1 else contextlib.nullcontext()
        with shared as self.reads, ThreadPoolExecutor(at_once, thread_name_prefix="nnx_save-file") as pool:

            def submit(count: int, finished: str | None = None) -> None:
                """The next ``count`` files, each reader opened and its buffers allocated
                here; ``finished``'s reader closed with the next one's open (the last
                ones by :meth:`close`, once the load is over)."""
                for file in itertools.islice(todo, count):
                    readers[file] = self._open(file)
                    if finished is not None:
                        readers.pop(finished)[0].close()
                        finished = None
                    work = self._requests(file)
                    running[pool.submit(self._read_file, file, readers[file], work, threads, cancel)] = file

            try:
                submit(at_once)
                while running:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for f in done:
                        file = running.pop(f)
                        self._file_read(file, *f.result())
                        submit(1, file)
            except BaseException:
                cancel.set()
                wait(running)
                self.close()
                raise

    def close(self) -> None:
        """Close the readers still open (the last files read, at the end of the load)."""
        while self.readers:
            self.readers.popitem()[1][0].close()

    def _open(self, file: str) -> tuple[Reader, tuple[bool, bool]]:
        """A reader of ``file``, and its capabilities (``can_read_tables``, ``can_read_runs``), asked as it opens."""
        reader = self.open_reader(file)
        return reader, (reader.can_read_tables(), reader.can_read_runs())

    def _requests(self, file: str) -> tuple[list[Request], list[np.ndarray], list]:
        """This file's requests (destinations numbered locally) and buffers, allocating
        destinations first touched here (adopted ones packed together); the small
        transformed units read with them, with their temporaries, last."""
        indices = self.by_file.get(file, [])
        fresh = [self.dests[i] for i in indices if self.dests[i].buffer is None]
        try:
            packed = iter(pack_buffers([d.nbytes for d in fresh if d.adopted], slab_bytes=self.slab_bytes))
            for d in fresh:
                d.buffer = next(packed) if d.adopted else aligned_empty(d.nbytes)
                if not d.adopted:  # scratch beside the result (packed sub-byte, a whole source): in flight, reported
                    self.budget.hold(d.nbytes)
                    self.scratch.add(id(d))
        except MemoryError:
            raise _no_memory(file, fresh) from None
        requests = [
            request(piece, part, self.dests[i].box, local)
            for local, i in enumerate(indices)
            for piece, part in self.dests[i].parts
            if piece.info.file == file
        ]
        buffers = [self.dests[i].buffer for i in indices]
        if file in self.batch.by_file:  # one request and one buffer per run of small tensors
            more, extra = self.batch.work(file, len(buffers))
            requests, buffers = requests + more, buffers + extra
        if not self.boxed.boxes:  # no transformed target: nothing read with this file's plan
            return requests, buffers, []
        self.boxed.allocate(file)
        more, temps, eager = self.boxed.eager_work(file, len(buffers))
        return requests + more, buffers + temps, eager

    def _read_file(
        self,
        file: str,
        opened: tuple[Reader, tuple[bool, bool]],
        work: tuple[list[Request], list[np.ndarray], list],
        threads: int,
        cancel: threading.Event,
    ) -> tuple[FilePlan, int, float, float, tuple[int, int], int]:
        """Read this file's destinations through ``opened`` (a reader and its
        capabilities; the caller closes it), then run the transformed targets' units
        that start in it (each transformed in the copy, on these threads)."""
        t0 = time.perf_counter()
        requests, buffers, eager = work
        plan = plan_file(requests, max_over_read_ratio=self.opt.max_over_read_ratio, chunk_bytes=self.chunk_bytes)
        floor = self.floor_bytes(requests, plan) if self.over_read_warns(plan.read_bytes, plan.needed_bytes) else 0
        t1 = time.perf_counter()
        reader, capabilities = opened
        on_chunk = self.bar.update if self.bar.active else None
        execute(
            reader,
            plan,
            buffers,
            budget=self.budget,
            num_threads=threads,
            on_chunk=on_chunk,
            cancel=cancel,
            capabilities=capabilities,
            pool=self.reads,
        )
        del buffers
        *boxed, more = self._run_boxed(file, reader, eager, threads, cancel) if self.boxed.boxes else (0, 0, 0)
        return plan, reader.requests + more, t1 - t0, time.perf_counter() - t1, (boxed[0], boxed[1]), floor

    def _run_boxed(
        self, file: str, reader: Reader, eager: list, threads: int, cancel: threading.Event
    ) -> tuple[int, int, int]:
        """The transformed targets' units read with ``file`` (``eager``), then those starting in it."""
        self.boxed.apply_eager(self, eager)
        return self.boxed.run_file(self, file, reader, threads, cancel)

    def _file_read(
        self,
        file: str,
        plan: FilePlan,
        requests: int,
        plan_s: float,
        read_s: float,
        boxed: tuple[int, int],
        floor: int,
    ) -> None:
        t0 = time.perf_counter()
        self.result.files.append((file, plan.read_bytes + boxed[0], plan.needed_bytes + boxed[1], requests))
        if self.over_read_warns(plan.read_bytes, plan.needed_bytes):
            extra = self.read_through(file, plan)
            self.note_over_read(file, plan.read_bytes, plan.needed_bytes, plan.ratio, extra, floor)
        if self.opt.verify:
            self._verify(file)
        self.batch.place(self, file)
        for i in self.by_file.get(file, []):
            self.dests[i].files.discard(file)
            if not self.dests[i].files:
                self._filled(i)
        if self.boxed.boxes:
            self.boxed.place_finished(self)
        seconds = self.result.seconds
        seconds[0] += plan_s
        seconds[1] += read_s
        seconds[2] += time.perf_counter() - t0
        log.debug("%s: %r, %d requests; plan %.3fs, read %.3fs", file, plan, requests, plan_s, read_s)

    def over_read_warns(self, read: int, needed: int) -> bool:
        """Whether reading ``read`` bytes of a file for ``needed`` is worth the warning:
        only under the automatic ratio (an explicit one is the caller's choice), and only
        when the unneeded bytes are many (a skipped 1 KiB tensor costs nothing)."""
        auto = self.opt.max_over_read_ratio is None
        return auto and read - needed >= OVER_READ_MIN_BYTES and read > OVER_READ_WARN * needed

    def floor_bytes(self, requests: Sequence[Request], plan: FilePlan) -> int:
        """The bytes ``requests`` would read under ``max_over_read_ratio=1.0`` (``plan``'s
        own when that is its ratio): what the warning's advice promises, computed."""
        if plan.ratio <= 1.0:
            return plan.read_bytes
        return plan_file(requests, max_over_read_ratio=1.0, chunk_bytes=self.opt.chunk_bytes).read_bytes

    def read_through(self, file: str, plan: FilePlan) -> np.ndarray:
        """Per tensor of ``file`` (header order): bytes ``plan`` read but did not need."""
        infos = self.file_headers[file].tensors.values()
        return over_read_by_range(plan, np.array([i.begin for i in infos]), np.array([i.end for i in infos]))

    def note_over_read(self, file: str, read: int, needed: int, ratio: float, extra: np.ndarray, floor: int) -> None:
        """Remember an over-read file with the tensors whose unneeded bytes were read
        through (``extra``: per tensor, as :meth:`read_through`) and what ratio 1 would
        read (``floor``); one warning per load."""
        infos = list(self.file_headers[file].tensors.values())
        worst = [(int(x), i.name) for x, i in sorted(zip(extra, infos, strict=True), key=lambda p: -p[0]) if x > 0]
        named = ", ".join(f"{name} ({human_bytes(x)})" for x, name in worst[:5])
        self.over_reads.append(
            f"{file}: read {human_bytes(read)} for {human_bytes(needed)} needed "
            f"(over-read {read / needed:.2f}x; the automatic merge cap for this file was {ratio:.2f}x, "
            "gaps under 4 KiB are read through whatever the cap); "
            f"bytes read through in {named}{f' and {len(worst) - 5} more' if len(worst) > 5 else ''}; "
            f"max_over_read_ratio=1.0 would read {human_bytes(floor)}"
        )
        self.over_read_bytes[0] += read
        self.over_read_bytes[1] += floor

    def _verify(self, file: str) -> None:
        """Check the recorded checksum of every piece this file read gave in full."""
        digests = self._expected(file)
        got: dict[str, tuple[str, TensorInfo, dict[Box, np.ndarray]]] = {}
        for i in self.by_file.get(file, []):
            d = self.dests[i]
            for piece, part in d.parts:
                if piece.info.file == file:
                    entry = got.setdefault(piece.info.name, (d.key, piece.info, {}))
                    entry[2].update([self.piece_bytes(d.box, d.buffer, piece, part)])
        jobs: list[tuple[str, str, str, list[memoryview]]] = []
        for name, (key, info, regions) in got.items():
            expected = digests.get(name)
            buffers = _checksum.full_buffers(info.shape, list(regions.items())) if expected else None
            self.mark(key, buffers is not None)
            if expected is not None and buffers is not None:
                jobs.append((name, file, expected, [np.ascontiguousarray(b).data.cast("B") for b in buffers]))
        _checksum.check_all(jobs, self.opt.threads)  # xxhash releases the GIL: hash in parallel

    def _expected(self, file: str) -> Mapping[str, str]:
        """``file``'s recorded checksums, read once."""
        with self._lock:
            if file not in self._digests:
                self._digests[file] = _checksum.read_digests(self.file_headers[file].metadata, file)
            return self._digests[file]

    def mark(self, key: str, ok: bool) -> None:
        """Record whether every piece of ``key`` checked so far was verified."""
        with self._lock:
            self.checked[key] = self.checked.get(key, True) and ok

    @staticmethod
    def piece_bytes(box: Box, buffer: np.ndarray, piece: Piece, part: Box) -> tuple[Box, np.ndarray]:
        """``part``'s bytes in ``buffer`` (holding ``box``), with its box in the piece's coordinates."""
        info = piece.info
        if not info.dtype.byte_aligned:
            return whole(info.shape), buffer
        grid = buffer.reshape(*extents(box), info.dtype.itemsize)
        region = grid[tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(part, box, strict=True))]
        return tuple((lo - p, hi - p) for (lo, hi), (p, _) in zip(part, piece.box, strict=True)), region

    def checked_piece(self, key: str, piece: Piece, buffers: Iterable[memoryview] | None) -> None:
        """Check ``piece`` (of tensor ``key``) against its recorded checksum when
        ``buffers`` (its bytes in file order) are given; ``None``: not verifiable here."""
        info = piece.info
        expected = self._expected(info.file).get(info.name)
        if expected is not None and buffers is not None:
            _checksum.check(info.name, info.file, expected, buffers)
        self.mark(key, expected is not None and buffers is not None)

    def host(self, index: int) -> np.ndarray:
        """Destination ``index``'s bytes as an array of the file's dtype and its box's shape."""
        d = self.dests[index]
        return host_view(d.buffer, self.header.tensors[d.key], d.box)

    def streamable(self, index: int) -> bool:
        """Destinations a device array is made of, whose bytes need no host step."""
        d = self.dests[index]
        t = self.by_path.get(d.owner)
        return t is not None and t.sharding is not None and self.header.tensors[d.key].dtype.byte_aligned

    def stream(self, kind: str, device: Any) -> None:
        """Stream what can be streamed through ``kind`` staging buffers; the rest
        (numpy targets, sub-byte tensors, transforms' sources) on the host path."""
        import jax

        streamed = [i for i in range(len(self.dests)) if self.streamable(i)]
        self.run(skip=frozenset(streamed))
        arrays = _stream.run(self, streamed, kind, device)
        for owner in dict.fromkeys(self.dests[i].owner for i in streamed):
            t = self.by_path[owner]
            per_device = {dev: a for i in self.shards[owner] for dev, a in arrays[i].items()}
            devices = list(device_indices(t.sharding, t.shape))
            self.values[owner] = jax.make_array_from_single_device_arrays(
                t.shape, t.sharding, [per_device[d] for d in devices]
            )
            self.bar.update(items=1)

    def _filled(self, index: int) -> None:
        """Destination ``index`` is complete: place its owner once all its shards are."""
        d = self.dests[index]
        owner = d.owner
        shards = self.shards[owner]
        if len(shards) > 1:  # one shard (most tensors): nothing to count
            self.done[owner] += 1
            if self.done[owner] < len(shards):
                return
        elif d.adopted and (value := self.placed(d)) is not None:
            d.buffer = None  # released as soon as the array exists
            self.values[owner] = value
            if self.bar.active:
                self.bar.update(items=1)
            return
        if owner not in self.by_path:  # a transform's whole source (owner "source:<key>"): one destination
            self.wholes[self.dests[index].key] = self.host(index)
            self.release(self.dests[index])
            self.run_transforms()
            return
        parts = []
        for i in shards:
            d = self.dests[i]
            parts.append((d.buffer, self.header.tensors[d.key], d.box, d.devices))
            d.buffer = None  # released as soon as the array exists
        self.values[owner] = assemble(self.by_path[owner], self.held(owner), parts)
        for i in shards:
            self.release(self.dests[i])
        if self.bar.active:
            self.bar.update(items=1)

    def release(self, d: Dest) -> None:
        """``d``'s buffer is gone (or is the result): a scratch one no longer counts in flight."""
        d.buffer = None
        if id(d) in self.scratch:
            self.scratch.discard(id(d))
            self.budget.drop(d.nbytes)

    def placed(self, d: Dest) -> Any:
        """:func:`place_adopted` of ``d``, the one adopted destination of its owner."""
        return place_adopted(self.by_path.get(d.owner), d.buffer, self.header.tensors[d.key], d.box, d.devices)

    def run_transforms(self) -> None:
        ready = [t for t in self.pending if all(k in self.wholes for k in t.sources)]
        for t in ready:
            assert t.transform is not None
            value = np.asarray(t.transform([self.wholes[k] for k in t.sources]))
            if value.shape != tuple(t.shape):
                raise ShapeMismatchError(
                    f"{t.path}: rule produced shape {value.shape} from {list(t.sources)}, the target has {t.shape}"
                )
            self.values[t.path] = place_whole(t, value.astype(self.held(t.path), copy=False))
            self.pending.remove(t)
            self.bar.update(items=1)
            for k in t.sources:
                self.refs[k] -= 1
                if not self.refs[k]:
                    del self.wholes[k], self.refs[k]


def load_targets(
    header: Header,
    targets: Sequence[Target],
    options: LoadOptions | None = None,
    *,
    open_reader: Callable[[str], Reader] = LocalReader,
    strict: bool = False,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
    allow_shape_mismatch: Sequence[str] = (),
    ignore_unexpected: frozenset[str] = frozenset(),
    renamed: Mapping[str, tuple[str, ...]] | None = None,
    allow_casts: str | Sequence[str] = (),
    warn: bool = True,
    progress: bool | None = False,
    slab_bytes: int = SLAB_BYTES,
) -> tuple[dict[str, Any], LoadReport]:
    """Load ``targets`` from ``header``'s files. Returns ``({path: value}, report)``.

    The report is complete before any byte of tensor data is read; under
    ``strict=True`` any mismatch raises :class:`~nnx_save.LoadError` then.
    ``options.verify`` checks the recorded checksum of every piece read in full
    (:class:`~nnx_save.ChecksumError` on a mismatch) and lists the rest in
    ``report.unverified``; ``progress`` as in :func:`nnx_save._progress.bar`.
    ``slab_bytes``: host buffers that arrays adopt are packed into allocations of up
    to this size (huge pages); a shared load's parts pass 0, each buffer its own, so
    each is freed as soon as its exchange is done (a slab lives as long as its last array).
    """
    # The call's own arguments, for a shared load that re-enters with a part of the
    # targets: every keyword travels, including any added later.
    given = {k: v for k, v in locals().items() if k not in ("header", "targets", "options")}
    remote = header.placement.remote
    # HTTP ranges are cheap: their size follows the whole checkpoint (what one process reads at
    # most); an object store's GET costs more (S3 advises 8-16 MB), so its requests stay at the default
    http = remote and bool(header.files) and header.files[0].file.startswith(("http://", "https://"))
    total = sum(info.nbytes for info in header.tensors.values()) if http else None
    opt = (options if options is not None else LoadOptions()).for_source(remote, total)
    in_memory = header.kind == "memory"  # every process holds its own state dict: nothing to share
    if not in_memory and _share.enabled(opt.share_reads, targets, header.placement.remote, describe_source(header)):
        run = functools.partial(
            load_targets, header, options=replace(opt, share_reads=False), **given | {"slab_bytes": 0}
        )
        shapes = {k: info.shape for k, info in header.tensors.items()}
        return _share.shared_load(list(targets), run, shapes, describe_source(header))
    loadable, report = check_targets(
        header, targets, allow_missing, allow_unexpected, allow_shape_mismatch, ignore_unexpected, renamed, allow_casts
    )
    if not loadable:  # the shapes only for the message: a lazy handle's reads come here per tensor
        shapes = {k: tuple(info.shape) for k, info in header.tensors.items()}
        refuse_nothing_loaded(report, {t.path: tuple(t.shape) for t in targets}, shapes, len(loadable))
    unpinned = header.placement.unpinned()
    if unpinned and not opt.verify:  # the recorded checksums pin what no validator does
        opt = replace(opt, verify=True)
    if strict:
        report.raise_or_warn(True)
    # each has sources, all in the header (check_targets)
    check_device_dtypes(loadable, lambda t: header.tensors[t.sources[0]].file)
    label = f"loading {os.path.basename(report.source)}"
    bar = _progress.bar(label, lambda: _total_bytes(header, loadable), len(loadable), progress)
    with gc_paused():
        try:
            engine = Engine(header, loadable, opt, open_reader, bar, slab_bytes)
        except BaseException:
            bar.close()
            raise
        try:
            _read(engine, loadable, opt)
        except BaseException:
            engine.close()
            raise
        finally:
            bar.close()
    try:
        engine.result.peak = engine.budget.peak
        complete(report, engine.result, header.placement.retries())
        _refuse_unpinned(header, unpinned, report.unverified)
        if warn:
            report.raise_or_warn(False, stacklevel=4)
    finally:
        engine.close()  # its last readers, once the load is over
    return engine.values, report


def _total_bytes(header: Header, loadable: Sequence[Target]) -> int:
    """Bytes of the tensors ``loadable`` reads (this process may need less: the
    progress total is made exact once the engine has planned)."""
    keys = loadable.keys if isinstance(loadable, WholeReads) else itertools.chain.from_iterable(map(_SOURCES, loadable))
    return sum(map(_NBYTES, map(header.tensors.__getitem__, set(keys))))


def _read(engine: Engine, loadable: Sequence[Target], opt: LoadOptions) -> None:
    """Run ``engine``: on the host path, or streamed where the devices' platform asks it."""
    if isinstance(engine.bar, _progress.Bar):
        engine.bar.total = (
            sum(d.nbytes for d in engine.dests) + engine.boxed.nbytes + engine.batch.nbytes
        )  # exact: what this process reads
    # a device this load puts arrays on: its platform decides how
    device = next((next(iter(t.sharding.addressable_devices)) for t in loadable if t.sharding is not None), None)
    if device is not None and opt.streaming(device.platform):
        kinds = tuple(m.kind for m in device.addressable_memories())
        engine.stream(opt.staging_kind(device.platform, kinds), device)
    else:
        engine.run()


def _refuse_unpinned(header: Header, unpinned: frozenset[str], unverified: Sequence[str]) -> None:
    """Refuse a load that read, from a file no validator pins, a tensor its recorded
    checksum could not confirm (read in part, or with no checksum): the bytes may mix
    two versions of the object and nothing could tell."""
    names = sorted(k for k in unverified if k in header.tensors and header.tensors[k].file in unpinned)
    if names:
        file = header.tensors[names[0]].file
        raise RemoteError(
            f"{file}: the server sends neither an ETag nor a Last-Modified header, so the object's version cannot "
            f"be pinned across requests, and tensor(s) {names[:5]} could not be checked against a recorded "
            "checksum (read in part, or the file records none): the load might mix two versions, so it is "
            "refused. Serve the file with an ETag or Last-Modified header, or read whole tensors of a file "
            "saved with checksums"
        )
