"""The batch path: runs of small whole tensors read into one buffer each, their values
made from views of it in bulk.

A load of many small tensors pays per tensor for records (a destination, its pieces, a
request, a planned run) and for placing each value, not for bytes. Here a tensor that
is small, stored as one whole piece of a local or remote file, and wanted whole as a
host array or on one device whose arrays adopt host memory (the CPU backend, not
streamed) costs none of those records: :func:`plan_runs` (pure, on arrays) cuts such
tensors, in file order, into runs of consecutive tensors; each run is ONE request into
ONE buffer, planned and read with the file's other requests (so bytes read and the
over-read accounting are those of the general path); once the file is read, each
tensor's value is a view of its run's buffer (checked, cast, checksummed as the
general path does) and the device arrays are made in one loop per shape.

A run's buffer is 64-byte aligned, so each tensor whose offset from the run's first
byte is a multiple of 64 (every tensor of a file whose tensors are multiples of 64
bytes) is a 64-byte aligned view, which jax on CPU adopts without a copy; the buffer
lives as long as the last array made from it, as the general path's slabs do.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import HostMemoryError
from ..format import _checksum
from ..format._boxes import check_bools
from ..format._header import TensorInfo
from ..format._units import human_bytes
from ._assemble import batched_put, held_of
from ._execute import aligned_empty
from ._pieces import Request
from ._target import Target, WholeReads, one_source_each

__all__ = ["SMALL_BYTES", "Batch", "plan_runs"]

_SHARDING, _DTYPE = operator.attrgetter("sharding"), operator.attrgetter("dtype")
_FILE, _BEGIN, _END, _NBYTES = map(operator.attrgetter, ("file", "begin", "end", "nbytes"))
_PATH, _SHAPE = operator.attrgetter("path"), operator.attrgetter("shape")
_HELD = operator.attrgetter("dtype.numpy")
SMALL_BYTES = 64 << 10  # a tensor of at most this many bytes is read in a run with its neighbours
RUN_BYTES = 64 << 20  # a run starts at most this many bytes after its first tensor
ALIGN = 64  # jax on CPU adopts host memory aligned to this without a copy


def plan_runs(begin: np.ndarray, end: np.ndarray, max_bytes: int = RUN_BYTES) -> np.ndarray:
    """Where runs start among tensors sorted by ``begin`` (file byte ranges
    ``[begin, end)``): a run is consecutive tensors each starting where the previous
    ended, all starting in one window of ``max_bytes`` counted from the first byte of
    their stretch of touching tensors (so a run spans less than ``max_bytes`` and one
    tensor). Returns the index of each run's first tensor, ascending, and
    ``len(begin)`` last.

    Examples:
        >>> b = np.array([0, 4, 8, 20, 24]); e = np.array([4, 8, 12, 24, 28])
        >>> plan_runs(b, e).tolist()  # a gap between 12 and 20
        [0, 3, 5]
        >>> plan_runs(b, e, max_bytes=8).tolist()
        [0, 2, 3, 5]
    """
    n = len(begin)
    if n == 0:
        return np.zeros(1, np.int64)
    cut = np.ones(n, bool)
    cut[1:] = begin[1:] != end[:-1]
    first = np.flatnonzero(cut)  # segments of touching tensors
    seg = np.repeat(first, np.diff(np.append(first, n)))  # each tensor's segment start
    bucket = (begin - begin[seg]) // max_bytes
    cut[1:] |= bucket[1:] != bucket[:-1]
    return np.append(np.flatnonzero(cut), n).astype(np.int64)


@dataclass
class _FileRuns:
    """One file's batched tensors, in file order, with their targets and runs."""

    infos: list[TensorInfo] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    held: list[np.dtype] = field(default_factory=list)
    starts: np.ndarray | None = None  # plan_runs' answer
    buffers: list[np.ndarray] = field(default_factory=list)


class Batch:
    """The targets a load reads on the batch path, per file.

    Made by :meth:`split`; the engine asks :meth:`work` for each file's requests and
    buffers and :meth:`place` once the file is read."""

    def __init__(self) -> None:
        self.by_file: dict[str, _FileRuns] = {}
        self.nbytes = 0

    @classmethod
    def split(
        cls, header: Any, targets: Sequence[Target], x64: bool, streams: Any, enabled: bool
    ) -> tuple[Batch, list[Target]]:
        """The batch of ``targets`` (under ``jax_enable_x64`` = ``x64``) and the
        targets left for the general path. Nothing is batched unless ``enabled``, or
        where tensors are not whole pieces of files (``placement.local_files()``);
        a device target only on a device whose platform does not stream
        (``streams(platform)``) and whose sharding keeps it whole on that device; a
        file tensor wanted by two targets is left to the general path, and so is a
        cast (the general path casts slab by slab: here the file's dtype would be held,
        for all the file's casts at once, until each is cast)."""
        batch = cls()
        if not enabled or header.placement.local_files() is None or many_put() is None:
            return batch, list(targets)
        tensors = header.tensors
        whole = _all_batched(tensors, targets, x64, not streams("cpu"))
        if whole is not None:
            batch._group(list(targets), *whole)
            return batch, []
        rest: list[Target] = []
        chosen: dict[str, int] = {}  # file key -> its index in picked
        picked: list[tuple[Target, TensorInfo, np.dtype] | None] = []
        used: set[str] = set()  # file keys some general-path target reads
        cpu = not streams("cpu")  # device targets batch only where arrays adopt host memory
        one_cpu: dict[int, bool] = {}  # id(sharding) -> whether it is one CPU device here (held by targets)
        held: tuple[dict[Any, np.dtype], dict[Any, np.dtype]] = ({}, {})  # target dtype -> held, host / device
        for t in targets:
            if t.transform is not None or len(t.sources) != 1:
                rest.append(t)
                used.update(t.sources)
                continue
            key = t.sources[0]
            info = tensors[key]
            if not (0 < info.nbytes <= SMALL_BYTES and info.dtype.byte_aligned) or key in chosen:
                rest.append(t)
                used.add(key)
                continue
            ok: bool | None
            if t.sharding is None:
                ok = t.box is None or t.box == tuple((0, d) for d in info.shape)
            else:
                ok = one_cpu.get(id(t.sharding))
                if ok is None:
                    ok = one_cpu[id(t.sharding)] = cpu and _one_cpu_device(t.sharding)
            if not ok:
                rest.append(t)
                used.add(key)
                continue
            cache = held[t.sharding is not None]
            dtype = cache.get(t.dtype)
            if dtype is None:
                dtype = cache[t.dtype] = held_of(np.dtype(t.dtype), t.sharding is not None, x64)
            if dtype != info.dtype.numpy:
                rest.append(t)
                used.add(key)
                continue
            chosen[key] = len(picked)
            picked.append((t, info, dtype))
        for key in used & chosen.keys():  # a tensor the general path reads too: not here
            j = chosen.pop(key)
            entry = picked[j]
            assert entry is not None
            rest.append(entry[0])
            picked[j] = None
        kept = [p for p in picked if p is not None]
        batch._group([p[0] for p in kept], [p[1] for p in kept], [p[2] for p in kept])
        return batch, rest

    def _group(self, targets: list[Target], infos: list[TensorInfo], held: list[np.dtype]) -> None:
        """The batched ``targets`` (reading ``infos``, held as ``held``) by file, each
        file's in file order, cut into runs (:func:`plan_runs`)."""
        if not targets:
            return
        files = set(map(_FILE, infos))
        by_file: dict[str, Sequence[int]]
        if len(files) == 1:
            by_file = {files.pop(): range(len(targets))}  # all of them, in their order
        else:
            lists: dict[str, list[int]] = {}
            for j, info in enumerate(infos):
                lists.setdefault(info.file, []).append(j)
            by_file = dict(lists)
        for file, indices in by_file.items():
            mine = infos if isinstance(indices, range) else [infos[j] for j in indices]
            begin = np.fromiter(map(_BEGIN, mine), np.int64, len(indices))
            if len(begin) > 1 and (begin[1:] < begin[:-1]).any():
                order = np.argsort(begin, kind="stable")
                indices, begin = [indices[k] for k in order.tolist()], begin[order]
            runs = self.by_file[file] = _FileRuns()
            if isinstance(indices, range):
                runs.targets, runs.infos, runs.held = list(targets), list(infos), list(held)
            else:
                runs.targets = [targets[j] for j in indices]
                runs.infos = [infos[j] for j in indices]
                runs.held = [held[j] for j in indices]
            end = np.fromiter(map(_END, runs.infos), np.int64, len(indices))
            runs.starts = plan_runs(begin, end)
            self.nbytes += int((end - begin).sum())

    def work(self, file: str, first: int) -> tuple[list[Request], list[np.ndarray]]:
        """``file``'s runs as requests into fresh buffers (destinations numbered from
        ``first``): one request and one buffer per run, not per tensor.

        Raises:
            HostMemoryError: a buffer cannot be allocated (nothing was read from the file).
        """
        runs = self.by_file.get(file)
        if runs is None:
            return [], []
        assert runs.starts is not None
        requests, buffers = [], []
        for n, (a, b) in enumerate(zip(runs.starts[:-1].tolist(), runs.starts[1:].tolist(), strict=True)):
            lo, hi = runs.infos[a].begin, runs.infos[b - 1].end
            try:
                buffers.append(aligned_empty(hi - lo, ALIGN))
            except MemoryError:
                raise HostMemoryError(
                    f"{file}: cannot allocate host memory for {b - a} small tensor(s) from {runs.infos[a].name!r} "
                    f"on ({human_bytes(hi - lo)} in one buffer); nothing was read from this file. Free memory, or "
                    "raise the process's memory limit",
                    file,
                    runs.infos[a].name,
                    hi - lo,
                ) from None
            requests.append(Request(first + n, lo, (hi - lo,), 1, ((0, hi - lo),)))
        runs.buffers = buffers
        return requests, buffers

    def place(self, engine: Any, file: str) -> None:
        """The values of ``file``'s batched targets, once it is read: checksums checked
        (``verify``), BOOL bytes checked, device arrays made in bulk (no cast is batched)."""
        runs = self.by_file.pop(file, None)
        if runs is None:
            return
        assert runs.starts is not None
        hosts = self._views(runs)
        runs.buffers = []  # the views hold them now
        if engine.opt.verify:
            _verify(engine, file, runs, hosts)
        kinds = list(map(_DTYPE, runs.infos))
        if any(d.code == "BOOL" for d in dict(zip(map(id, kinds), kinds, strict=True)).values()):
            for host, info in zip(hosts, runs.infos, strict=True):
                if info.dtype.code == "BOOL":
                    check_bools(host, info, tuple((0, d) for d in info.shape))
        results = engine.values
        shardings = list(map(_SHARDING, runs.targets))
        # runs of one sharding object, shape and dtype: each one call of many_put
        cuts = {0, len(shardings)}
        for column in (list(map(id, shardings)), list(map(_SHAPE, runs.targets)), runs.held):
            cuts.update(_differ(column[1:], column[:-1], 1))
        for a, b in itertools.pairwise(sorted(cuts)):
            targets = runs.targets[a:b]
            if shardings[a] is None:
                results.update(zip(map(_PATH, targets), hosts[a:b], strict=True))
            else:
                _put(results, targets, hosts[a:b])
        if engine.bar.active:
            engine.bar.update(items=len(runs.targets))

    @staticmethod
    def _views(runs: _FileRuns) -> list[np.ndarray]:
        """Each tensor's bytes in its run's buffer, as an array of its file dtype and shape
        (tensors of one shape and dtype next to each other: one reshape for them all)."""
        assert runs.starts is not None
        out: list[np.ndarray] = []
        infos = runs.infos
        for buf, a, b in zip(runs.buffers, runs.starts[:-1].tolist(), runs.starts[1:].tolist(), strict=True):
            base = infos[a].begin
            i = a
            while i < b:
                info = infos[i]
                j = i + 1
                while j < b and infos[j].shape == info.shape and infos[j].dtype is info.dtype:
                    j += 1
                block = buf[info.begin - base : infos[j - 1].end - base].view(info.dtype.numpy)
                if j - i == 1 or not info.shape:  # a 0-d row of a reshape would be a numpy scalar, not an array
                    step = info.nbytes // info.dtype.itemsize
                    out += [block[k : k + step].reshape(info.shape) for k in range(0, (j - i) * step, step)]
                else:
                    out += list(block.reshape(j - i, *info.shape))
                i = j
        return out


def _all_batched(
    tensors: Any, targets: Sequence[Target], x64: bool, cpu: bool
) -> tuple[list[TensorInfo], list[np.dtype]] | None:
    """``(infos, held dtypes)`` of ``targets`` when :meth:`Batch.split` would batch
    every one of them (``cpu``: device targets may be), asked of them all at once at C
    speed; ``None`` when one would not, and the per target way decides."""
    if not targets:
        return None
    if isinstance(targets, WholeReads):
        keys, infos = targets.keys, targets.infos
        if len(targets.used) != len(keys):  # a tensor two targets want
            return None
    else:
        found = one_source_each(targets)
        if found is None or len(set(found)) != len(found):  # a transform, or a tensor two targets want
            return None
        keys, infos = found, list(map(tensors.__getitem__, found))
    nbytes = np.fromiter(map(_NBYTES, infos), np.int64, len(infos))
    if nbytes.min() <= 0 or nbytes.max() > SMALL_BYTES:
        return None
    kinds = list(map(_DTYPE, infos))
    if not all(d.byte_aligned for d in dict(zip(map(id, kinds), kinds, strict=True)).values()):
        return None
    shardings = list(map(_SHARDING, targets))
    for sharding in dict(zip(map(id, shardings), shardings, strict=True)).values():
        if sharding is not None and not (cpu and _one_cpu_device(sharding)):
            return None
    if any(map(operator.is_, shardings, itertools.repeat(None))):  # a host target: wanted whole
        boxes = [(t.box, info.shape) for t, info in zip(targets, infos, strict=True) if t.sharding is None]
        if not all(box is None or box == tuple((0, d) for d in shape) for box, shape in boxes):
            return None
    if isinstance(targets, WholeReads):  # each held as its tensor is stored
        return infos, list(map(_HELD, infos))
    on_device = list(map(operator.is_not, shardings, itertools.repeat(None)))
    try:
        held = {k: held_of(np.dtype(k[0]), k[1], x64) for k in set(zip(map(_DTYPE, targets), on_device, strict=True))}
    except TypeError:  # an unhashable dtype: the per target way
        return None
    dtypes = list(map(held.__getitem__, zip(map(_DTYPE, targets), on_device, strict=True)))
    if dtypes != list(map(_HELD, infos)):  # a cast: cast slab by slab on the general path, not here
        return None
    return infos, dtypes


def _differ(a: Sequence[Any], b: Sequence[Any], offset: int = 0) -> list[int]:
    """The indices (plus ``offset``) where ``a`` and ``b`` differ, compared at C speed."""
    return list(itertools.compress(itertools.count(offset), map(operator.ne, a, b)))


def _put(results: dict[str, Any], targets: list[Target], hosts: list[np.ndarray]) -> None:
    """Device arrays of ``targets`` (one sharding, shape and dtype) from ``hosts``, in one call."""
    t, put = targets[0], many_put()
    assert put is not None  # Batch.split batches no device target otherwise
    values = put(t.shape, t.sharding, hosts, list(t.sharding.device_set))
    results.update(zip(map(_PATH, targets), values, strict=True))


def _one_cpu_device(sharding: Any) -> bool:
    """Whether ``sharding`` holds the whole value on one CPU device of this process."""
    devices = sharding.device_set
    return len(devices) == 1 and sharding.is_fully_addressable and next(iter(devices)).platform == "cpu"


@functools.cache
def many_put() -> Callable | None:
    """``put(shape, sharding, hosts, devices)``: one single-device array per host array
    of ``hosts`` (all of ``shape`` and one dtype, each whole on the one device of
    ``devices``), jax's abstract value made once for them all and jax's C++
    ``batched_device_put`` called per array (an internal API: ``None`` where jax lacks
    :func:`~nnx_save.load._assemble.batched_put`'s, and this path is not taken)."""
    put = batched_put()
    if put is None:
        return None
    try:
        from jax._src import core
        from jax._src.lib import xla_client

        direct = xla_client.batched_device_put
    except (ImportError, AttributeError):
        return lambda shape, sharding, hosts, devices: [put(shape, sharding, [h], devices) for h in hosts]

    def put_all(shape: tuple[int, ...], sharding: Any, hosts: list[np.ndarray], devices: list[Any]) -> list[Any]:
        aval = core.update_aval_with_sharding(core.ShapedArray(shape, hosts[0].dtype), sharding)
        n, same = len(hosts), itertools.repeat
        return list(map(direct, same(aval, n), same(sharding, n), zip(hosts), same(devices, n), same(True, n)))

    return put_all


def _verify(engine: Any, file: str, runs: _FileRuns, hosts: list[np.ndarray]) -> None:
    """Check each tensor against ``file``'s recorded checksum (each was read whole), and
    record which were verified, as the general path does."""
    digests = engine._expected(file)
    jobs = []
    for info, host in zip(runs.infos, hosts, strict=True):
        expected = digests.get(info.name)
        if expected:
            jobs.append((info.name, file, expected, [host.reshape(-1).view(np.uint8).data]))
    with engine._lock:
        checked = engine.checked
        for info, t in zip(runs.infos, runs.targets, strict=True):
            key = t.sources[0]
            checked[key] = checked.get(key, True) and bool(digests.get(info.name))
    _checksum.check_all(jobs, engine.opt.threads)
