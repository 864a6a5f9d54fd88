"""The loading engine: match targets to file tensors, plan, read, assemble.

One engine for every load. A :class:`Target` says what the caller wants at one path
(shape, dtype, and a jax sharding, or ``None`` for a host numpy array) and which file
tensor(s) it comes from. :func:`load_targets` checks every target against the
headers first (so a strict refusal reads nothing, and a sharding jax cannot apply
is refused before any read), then goes file by file: plans the byte runs each
addressable device needs (a shard several local devices hold is read once),
reads them straight into 64-byte aligned host buffers, makes each tensor's
``jax.Array`` in one batched put (jax on CPU adopts aligned buffers without a
copy) and lets go of the host buffers before the next file.

Buffers the arrays adopt are carved out of a few large allocations
(:func:`~nnx_save._read.pack_buffers`: huge pages fault in five times cheaper);
buffers that are only a step (a dtype cast, sub-byte unpacking, a porting
transform's sources) are allocated on their own and freed once used.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _checksum, _dtypes, _progress
from ._errors import ShardingError
from ._header import TensorInfo
from ._plan import Request, over_read_by_range, plan_file
from ._read import Budget, LocalReader, aligned_empty, execute, pack_buffers
from ._report import DtypeCast, LoadReport, LoadWarning, ShapeMismatch, split_allowed, split_allowed_shapes
from ._sources import Header

__all__ = ["OverReadWarning", "Target", "load_targets"]

log = logging.getLogger("nnx_save")
OVER_READ_WARN = 1.5  # a file read beyond this many times what it gave is worth a warning
Box = tuple[tuple[int, int], ...]


class OverReadWarning(LoadWarning):
    """The automatic over-read ratio made this process read much more than it needed."""


@dataclass(frozen=True)
class Target:
    """One value the caller wants.

    Attributes:
        path: the caller's key for it (tree path joined with ``/``).
        shape, dtype: what the caller expects.
        sharding: a ``jax.sharding.Sharding``, or ``None`` for a host numpy array.
        sources: the file key(s) it is made from (one, unless ``transform``).
        transform: for porting rules: full source arrays -> the value; ``None``
            reads the single source directly, sharded.
        source_shape: the shape ``transform`` produces (checked before reading).
        box: for a host target (``sharding=None``), the region ``[(start, stop), ...]``
            to read, ``None`` for all of it; the value then has the box's shape
            (``nnx_save.safe_open``'s slices).
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any = None
    sources: tuple[str, ...] = ()
    transform: Callable[[list[np.ndarray]], np.ndarray] | None = None
    source_shape: tuple[int, ...] | None = None
    box: Box | None = None


@dataclass
class _Shard:
    box: Box
    devices: list[Any]
    dest: int


@dataclass
class _Work:
    """What one file read must produce: its direct targets' shards and whole sources."""

    requests: list[Request] = field(default_factory=list)
    dests: list[np.ndarray] = field(default_factory=list)
    shards: dict[str, list[_Shard]] = field(default_factory=dict)
    wholes: dict[str, int] = field(default_factory=dict)


def _boxes(target: Target) -> list[tuple[Box, list[Any]]]:
    """Unique index boxes this process needs, each with the local devices that hold it."""
    shape = target.shape
    if target.sharding is None:
        return [(target.box if target.box is not None else tuple((0, d) for d in shape), [None])]
    groups: dict[Box, list[Any]] = {}
    try:
        indices = target.sharding.addressable_devices_indices_map(shape)
    except ValueError as e:  # jax refuses it (a split that does not divide the dimension, ...)
        raise ShardingError(f"{target.path}: sharding {target.sharding} cannot hold shape {shape}: {e}") from None
    for device, index in indices.items():
        box = tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=False)) if shape else ()
        groups.setdefault(box, []).append(device)
    if not groups:  # an array with no shard here: this process could never use or save it
        import jax

        raise ShardingError(
            f"{target.path}: its sharding {target.sharding} places no shard on a device of process "
            f"{jax.process_index()} (local devices {[d.id for d in jax.local_devices()]}); every process must "
            "load with a sharding over devices it can address (a mesh over jax.devices(), or jax.local_devices())"
        )
    return list(groups.items())


def _request(info: TensorInfo, box: Box, dest: int) -> Request:
    if info.dtype.byte_aligned:
        return Request(dest, info.begin, info.shape, info.dtype.itemsize, box)
    return Request(dest, info.begin, (info.nbytes,), 1, ((0, info.nbytes),))


def _box_nbytes(info: TensorInfo, box: Box) -> int:
    if not info.dtype.byte_aligned:
        return info.nbytes
    return math.prod(hi - lo for lo, hi in box) * info.dtype.itemsize


def _check(header: Header, t: Target, report: LoadReport) -> bool:
    """Record what is wrong with ``t``; True if it can be loaded."""
    absent = [k for k in t.sources if k not in header.tensors]
    if absent or not t.sources:
        report.missing.append(t.path)
        return False
    if t.transform is None:
        info = header.tensors[t.sources[0]]
        shape, dtype = info.shape, info.dtype.numpy
    else:
        shape = t.source_shape if t.source_shape is not None else t.shape
        dtype = np.result_type(*(header.tensors[k].dtype.numpy for k in t.sources))
    if tuple(shape) != tuple(t.shape):
        report.shape_mismatches.append(ShapeMismatch(t.path, tuple(t.shape), tuple(shape), t.sources[0]))
        return False
    held = _held_dtype(t)
    if np.dtype(dtype) != held:
        model = (
            str(held)
            if held == np.dtype(t.dtype)
            else f"{held} (the model's {np.dtype(t.dtype)}: jax_enable_x64 is off)"
        )
        report.dtype_casts.append(DtypeCast(t.path, str(np.dtype(dtype)), model))
    return True


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _held_dtype(t: Target) -> np.dtype:
    """The dtype the loaded value will have: the target's, narrowed the way jax
    narrows it when ``jax_enable_x64`` is off (int64 -> int32, float64 -> float32)."""
    if t.sharding is None:
        return np.dtype(t.dtype)
    import jax

    return np.dtype(jax.dtypes.canonicalize_dtype(t.dtype))


def _host_view(buf: np.ndarray, info: TensorInfo, box: Box) -> np.ndarray:
    """The bytes read for ``box``, as an array of the file's dtype and the box's shape."""
    box_shape = tuple(hi - lo for lo, hi in box)
    if info.dtype.byte_aligned:
        return buf.view(info.dtype.numpy).reshape(box_shape)
    full = _dtypes.unpack_subbyte(buf, info.dtype, info.numel).reshape(info.shape)
    return full[tuple(slice(lo, hi) for lo, hi in box)]


def _place(t: Target, pieces: list[tuple[np.ndarray, list[Any]]]):
    """The target's ``jax.Array`` from its host shards (each shard's buffer adopted,
    not copied, by every local device that holds it when jax runs on CPU)."""
    if t.sharding is None:
        return pieces[0][0]
    by_device = {d: host for host, devices in pieces for d in devices}
    devices = list(t.sharding.addressable_devices_indices_map(t.shape))
    return _device_array(t.shape, t.sharding, [by_device[d] for d in devices], devices)


def _device_array(shape: tuple[int, ...], sharding: Any, hosts: list[np.ndarray], devices: list[Any]):
    import jax

    put = _batched_put()
    if put is not None and hosts[0].dtype == jax.dtypes.canonicalize_dtype(hosts[0].dtype):
        return put(shape, sharding, hosts, devices)
    arrays = [jax.device_put(h, d) for h, d in zip(hosts, devices, strict=False)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


@functools.cache
def _batched_put() -> Callable | None:
    """jax's one-call path from per-device host arrays to a sharded array: what
    ``jax.make_array_from_callback`` ends in, without its per-shard checks (~0.5 ms
    per tensor, a third of a 700-tensor load). Internal API: ``None`` when absent,
    and the public per-device path is used instead."""
    try:
        from jax._src import core
        from jax._src.interpreters import pxla

        core.update_aval_with_sharding, pxla.batched_device_put  # noqa: B018 - probe both
    except (ImportError, AttributeError):
        return None

    def put(shape, sharding, hosts, devices):
        aval = core.update_aval_with_sharding(core.ShapedArray(shape, hosts[0].dtype), sharding)
        return pxla.batched_device_put(aval, sharding, hosts, devices)

    return put


def _place_whole(t: Target, value: np.ndarray):
    import jax

    if t.sharding is None:
        return value
    return jax.make_array_from_callback(t.shape, t.sharding, lambda index: np.ascontiguousarray(value[index]))


class _Engine:
    def __init__(self, header: Header, targets: Sequence[Target], report: LoadReport, options: dict) -> None:
        self.header, self.report, self.opt = header, report, options
        self.targets = list(targets)
        self.results: dict[str, Any] = {}
        self.wholes: dict[str, np.ndarray] = {}
        self.budget = Budget(options["max_inflight_bytes"])
        self.pending = [t for t in self.targets if t.transform is not None]
        self.refs: dict[str, int] = {}
        for t in self.pending:
            for k in t.sources:
                self.refs[k] = self.refs.get(k, 0) + 1
        self.by_path = {t.path: t for t in self.targets}
        self.by_file: dict[str, list[Target]] = {}
        for t in self.targets:
            if t.transform is None:
                self.by_file.setdefault(header.tensors[t.sources[0]].file, []).append(t)
        self.boxes = {t.path: _boxes(t) for t in self.targets if t.transform is None}  # refusals before any read
        self.over_reads: list[str] = []
        self.bar = options["bar"]
        self.digests: dict[str, str] = {}  # file key -> recorded checksum (verify=True only)
        self.checked: dict[str, bool] = {}  # file key -> verified (True) or not verifiable (False)
        if options["verify"]:
            for fh in header.files:
                recorded = _checksum.read_digests(fh.metadata, fh.file)
                self.digests.update({k: v for k, v in recorded.items() if k in fh.tensors})

    def work_for(self, file: str) -> _Work:
        work, kept, sizes = _Work(), [], []
        for t in self.by_file.get(file, ()):
            info = self.header.tensors[t.sources[0]]
            adopted = info.dtype.byte_aligned and info.dtype.numpy == _held_dtype(t)  # the buffer becomes the array
            work.shards[t.path] = [
                _Shard(box, devices, self._add(work, info, box, sizes, kept, adopted))
                for box, devices in self.boxes[t.path]
            ]
        for key in self.refs:
            info = self.header.tensors[key]
            if info.file == file:
                work.wholes[key] = self._add(work, info, tuple((0, d) for d in info.shape), sizes, kept, False)
        # buffers the arrays adopt share large (huge-page) allocations; transient ones
        # (cast, unpacked, transformed) are their own, freed as soon as they are used
        packed = iter(pack_buffers([n for n, k in zip(sizes, kept, strict=False) if k]))
        work.dests = [next(packed) if k else aligned_empty(n) for n, k in zip(sizes, kept, strict=False)]
        return work

    @staticmethod
    def _add(work: _Work, info: TensorInfo, box: Box, sizes: list[int], kept: list[bool], adopted: bool) -> int:
        dest = len(sizes)
        sizes.append(_box_nbytes(info, box))
        kept.append(adopted)
        work.requests.append(_request(info, box, dest))
        return dest

    def run_file(self, file: str) -> None:
        io, t0 = self.report.io, time.perf_counter()
        work = self.work_for(file)
        if not work.requests:
            return
        plan = plan_file(
            work.requests,
            max_over_read_ratio=self.opt["max_over_read_ratio"],
            chunk_bytes=min(self.opt["read_chunk_bytes"], self.opt["max_inflight_bytes"]),
        )
        t1 = time.perf_counter()
        reader = self.opt["open_reader"](file)
        try:
            execute(
                reader,
                plan,
                work.dests,
                budget=self.budget,
                num_threads=self.opt["num_threads"],
                on_chunk=self.bar.update if self.bar.active else None,
            )
        finally:
            reader.close()
        t2 = time.perf_counter()
        io.files += 1
        io.bytes_read += plan.read_bytes
        io.bytes_needed += plan.needed_bytes
        io.requests += reader.requests
        io.over_read_by_file[file] = plan.read_bytes / plan.needed_bytes if plan.needed_bytes else 1.0
        self._note_over_read(file, plan)
        self._assemble(work)
        t3 = time.perf_counter()
        io.plan_seconds += t1 - t0
        io.read_seconds += t2 - t1
        io.assemble_seconds += t3 - t2
        log.debug(
            "%s: %r, %d requests; plan %.3fs, read %.3fs, assemble %.3fs",
            file,
            plan,
            reader.requests,
            t1 - t0,
            t2 - t1,
            t3 - t2,
        )

    def _note_over_read(self, file: str, plan) -> None:
        """Remember a file the automatic ratio made this process over-read, with the
        tensors whose unneeded bytes were read through (one warning per load)."""
        if self.opt["max_over_read_ratio"] is not None or plan.read_bytes <= OVER_READ_WARN * plan.needed_bytes:
            return
        infos = [i for i in self.header.tensors.values() if i.file == file]
        extra = over_read_by_range(plan, np.array([i.begin for i in infos]), np.array([i.end for i in infos]))
        worst = [(int(x), i.name) for x, i in sorted(zip(extra, infos, strict=False), key=lambda p: -p[0]) if x > 0]
        named = ", ".join(f"{name} ({_size(x)})" for x, name in worst[:5])
        self.over_reads.append(
            f"{file}: read {_size(plan.read_bytes)} for {_size(plan.needed_bytes)} needed "
            f"(over-read {plan.read_bytes / plan.needed_bytes:.2f}x under the automatic ratio {plan.ratio:.2f}); "
            f"bytes read through in {named}{f' and {len(worst) - 5} more' if len(worst) > 5 else ''}"
        )

    def _verify(self, work: _Work) -> None:
        """Check the recorded checksum of every tensor this file read gave in full."""
        targets = {t.path: t for t in self.targets}
        pieces: dict[str, dict[Box, np.ndarray]] = {}
        for path, shards in work.shards.items():
            info = self.header.tensors[targets[path].sources[0]]
            for s in shards:  # a sub-byte tensor is always read whole
                box = s.box if info.dtype.byte_aligned else tuple((0, d) for d in info.shape)
                pieces.setdefault(info.name, {})[box] = work.dests[s.dest]
        for key, dest in work.wholes.items():
            pieces.setdefault(key, {})[tuple((0, d) for d in self.header.tensors[key].shape)] = work.dests[dest]
        jobs = []
        for key, got in pieces.items():
            info, expected = self.header.tensors[key], self.digests.get(key)
            buffers = _checksum.full_buffers(info.shape, list(got.items())) if expected else None
            if buffers is None:
                self.checked.setdefault(key, False)
            else:
                jobs.append((key, info.file, expected, [memoryview(b) for b in buffers]))
        _checksum.check_all(jobs, self.opt["num_threads"])  # xxhash releases the GIL: hash in parallel
        self.checked.update({key: True for key, *_ in jobs})

    def _assemble(self, work: _Work) -> None:
        if self.opt["verify"]:
            self._verify(work)
        for path, shards in work.shards.items():
            t = self.by_path[path]
            info, held = self.header.tensors[t.sources[0]], _held_dtype(t)
            pieces = []
            for s in shards:
                host = _host_view(work.dests[s.dest], info, s.box)
                if host.dtype != held:
                    host = host.astype(held)
                pieces.append((host, s.devices))
            self.results[path] = _place(t, pieces)
            for s in shards:
                work.dests[s.dest] = None  # release as soon as the array exists
            self.bar.update(items=1)
        for key, dest in work.wholes.items():
            self.wholes[key] = _host_view(
                work.dests[dest], self.header.tensors[key], tuple((0, d) for d in self.header.tensors[key].shape)
            )
        self._run_transforms()

    def _run_transforms(self) -> None:
        ready = [t for t in self.pending if all(k in self.wholes for k in t.sources)]
        for t in ready:
            value = np.asarray(t.transform([self.wholes[k] for k in t.sources]))
            if value.shape != tuple(t.shape):
                from ._errors import ShapeMismatchError

                raise ShapeMismatchError(
                    f"{t.path}: rule produced shape {value.shape} from {list(t.sources)}, the target has {t.shape}"
                )
            self.results[t.path] = _place_whole(t, value.astype(_held_dtype(t), copy=False))
            self.pending.remove(t)
            self.bar.update(items=1)
            for k in t.sources:
                self.refs[k] -= 1
                if not self.refs[k]:
                    del self.wholes[k], self.refs[k]


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection while the engine runs: it allocates tens of
    thousands of small objects (boxes, requests, shard lists), enough to trigger a
    full collection, and a full collection walks every live object of the process
    (with jax imported, 130K: 0.11-0.14 s measured, a sixth of a 2.2 GB load). What
    the engine allocates is freed by reference counting; the collector's previous
    state is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


def load_targets(
    header: Header,
    targets: Sequence[Target],
    *,
    strict: bool = False,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
    allow_shape_mismatch: Sequence[str] = (),
    ignore_unexpected: frozenset[str] = frozenset(),
    renamed: Mapping[str, tuple[str, ...]] | None = None,
    max_over_read_ratio: float | None = None,
    read_chunk_bytes: int = 128 << 20,
    max_inflight_bytes: int = 2 << 30,
    num_threads: int | None = None,
    open_reader: Callable[[str], Any] = LocalReader,
    warn: bool = True,
    verify: bool = False,
    progress: bool | None = False,
) -> tuple[dict[str, Any], LoadReport]:
    """Load ``targets`` from ``header``'s files. Returns ``({path: value}, report)``.

    The report is complete before any byte of tensor data is read; under
    ``strict=True`` any mismatch raises :class:`~nnx_save.LoadError` then.
    ``verify=True`` checks the recorded checksum of every tensor read in full
    (:class:`~nnx_save.ChecksumError` on a mismatch) and lists the rest in
    ``report.unverified``; ``progress`` as in :func:`nnx_save._progress.bar`.
    """
    if max_inflight_bytes <= 0 or read_chunk_bytes <= 0:
        raise ValueError(
            f"max_inflight_bytes and read_chunk_bytes must be positive, got {max_inflight_bytes}, {read_chunk_bytes}"
        )
    report = LoadReport(source=_describe(header))
    loadable = [t for t in targets if _check(header, t, report)]
    used = {k for t in targets for k in t.sources}
    report.missing, report.allowed_missing = split_allowed(report.missing, allow_missing)
    report.shape_mismatches, report.allowed_shape_mismatches = split_allowed_shapes(
        report.shape_mismatches, allow_shape_mismatch
    )
    unexpected = [k for k in header.tensors if k not in used and k not in ignore_unexpected]
    report.unexpected, report.allowed_unexpected = split_allowed(unexpected, allow_unexpected)
    report.renamed = dict(renamed or {})  # porting: file key -> model paths, shown with unexpected keys
    report.sources = {t.path: t.sources for t in loadable}
    landed: dict[str, list[str]] = {k: [] for k in header.tensors}
    for t in loadable:
        for k in t.sources:
            landed[k].append(t.path)
    report.landed = {k: tuple(v) for k, v in landed.items()}
    if strict:
        report.raise_or_warn(True)
    options = {
        "max_over_read_ratio": max_over_read_ratio,
        "read_chunk_bytes": read_chunk_bytes,
        "max_inflight_bytes": max_inflight_bytes,
        "num_threads": num_threads or _default_threads(),
        "open_reader": open_reader,
    }
    options["verify"] = verify
    options["bar"] = _progress_bar(header, loadable, report, progress)
    engine_class = _Engine
    if getattr(header, "pieces", None) is not None:  # a pod directory: pieces of tensors in shard files
        from ._pod import PodEngine as engine_class
    with _gc_paused():
        try:
            engine = engine_class(header, loadable, report, options)
            for fh in header.files:
                engine.run_file(fh.file)
        finally:
            options["bar"].close()
    report.verified = sorted(k for k, ok in engine.checked.items() if ok)
    report.unverified = sorted(k for k, ok in engine.checked.items() if not ok)
    report.io.max_inflight_bytes = engine.budget.peak
    if header.remote is not None:
        report.io.retries = header.remote.retries
    report.loaded = sorted(engine.results)
    log.debug("loaded %d tensors from %s: %s", len(engine.results), report.source, report.io)
    if engine.over_reads:
        warnings.warn(
            "the automatic over-read ratio read far more than this process needed, because the "
            "shardings want many small strided pieces of these files (fewer, larger requests "
            "were read instead):\n  "
            + "\n  ".join(engine.over_reads)
            + "\nShard the leading dimension, or pass max_over_read_ratio to choose the trade "
            "(1.0: exact reads, more requests).",
            OverReadWarning,
            stacklevel=3,
        )
    if warn:
        report.raise_or_warn(False, stacklevel=4)
    return engine.results, report


def _progress_bar(header: Header, targets: Sequence[Target], report: LoadReport, progress: bool | None):
    keys = {k for t in targets for k in t.sources}
    upper = sum(header.tensors[k].nbytes for k in keys)  # this process may need less: exact below
    label = f"loading {os.path.basename(report.source)}"
    bar = _progress.bar(label, upper, len(targets), progress)
    if bar.active:
        wholes = {k for t in targets if t.transform is not None for k in t.sources}
        bar.total = sum(header.tensors[k].nbytes for k in wholes) + sum(
            _box_nbytes(header.tensors[t.sources[0]], box)
            for t in targets
            if t.transform is None
            for box, _ in _boxes(t)
        )
    return bar


def _describe(header: Header) -> str:
    if len(header.files) == 1:
        return header.files[0].file
    return f"{len(header.files)} files ({header.kind})"
