"""Read once per pod: a tensor several processes need is loaded under a *derived*
sharding that splits it among them on one dimension, then resharded to the target by a
jitted identity (JAX's own collectives), one tensor at a time. docs/multihost.md
tells when ``share_reads=None`` turns it on (:func:`decide`, the same on every process).

Before any collective, every process posts whether its reads succeeded through the
key-value store and waits with a deadline: a failed process raises its own error, every
other one a :class:`~nnx_save.errors.SourceError` naming it, instead of blocking.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SaveError, SourceError
from ..format._boxes import Box, extents, intersect, of_index, whole
from ..io._kv import StepResult, Sync
from ._assemble import held_dtype, place
from ._report import LoadReport
from ._target import Target, shard_boxes

__all__ = ["decide", "enabled", "one_host_buffer", "shared_load"]


def decide(setting: bool | None, processes: int, shared: bool, remote: bool, hosts: Callable[[], int]) -> bool:
    """Whether a load shares its reads (the rule of the module docstring): ``shared``
    says there are bytes to share in a load every process takes part in; ``hosts()``
    is called only when it decides.

    Examples:
        >>> decide(None, 2, True, True, lambda: 1), decide(None, 2, True, False, lambda: 1)
        (True, False)
        >>> decide(None, 2, True, False, lambda: 2), decide(None, 2, False, True, lambda: 2)
        (True, False)
        >>> decide(True, 2, False, False, lambda: 1), decide(False, 2, True, True, lambda: 2)
        (True, False)
    """
    if processes < 2:
        return False
    if setting is not None:
        return setting
    return shared and (remote or hosts() > 1)


def enabled(setting: bool | None, targets: Sequence[Target], remote: bool, where: str) -> bool:
    """:func:`decide` for this JAX job loading ``targets`` from ``where``."""
    import jax

    processes = jax.process_count()
    shared = setting is None and processes > 1 and _every_process(targets, processes)
    shared = shared and any(_held_by_several(t) for t in targets)
    return decide(setting, processes, shared, remote, functools.partial(host_count, where))


def _every_process(targets: Sequence[Target], processes: int) -> bool:
    """Whether the targets' devices are on every process: the exchanges wait for all
    of them, so a load on a sub-mesh of some processes only does not share."""
    held = {d.process_index for t in targets if t.sharding is not None for d in t.sharding.device_set}
    return len(held) == processes


def _held_by_several(t: Target) -> bool:
    """Whether devices of several processes hold some element of ``t`` (the same
    answer on every process: it reads the global sharding)."""
    if t.sharding is None or t.sharding.is_fully_addressable or not t.shape:
        return False
    try:
        return _overlaps_across_processes(t)
    except ValueError:  # jax refuses the sharding: the engine says so
        return False


_HOSTS: list[int] = []  # this job's host count, once known


def host_count(where: str) -> int:
    """How many hosts this job's processes run on: their host names, exchanged once
    per job (every process asks at the same point of the program, its first
    automatic decision on a local source); ``where`` names the load in errors."""
    if not _HOSTS:
        import socket

        names = _step(_sync(where), "hosts", StepResult(True, socket.gethostname()), where)
        _HOSTS.append(len(set(names.values())))
    return _HOSTS[0]


def _sync(where: str) -> Sync:
    return Sync.open(Path(where), what="shared-read load", intact="nothing was loaded")


def _step(sync: Sync, name: str, mine: StepResult, where: str) -> dict[int, Any]:
    """Every process's result of step ``name`` (bounded wait); a failed or silent peer
    raises :class:`SourceError` on all."""
    try:
        return sync.step(name, mine)
    except SaveError as e:
        raise SourceError(str(e), where) from e


def _volume(box: Box) -> int:
    return math.prod(extents(box))


def _overlaps_across_processes(t: Target) -> bool:
    """Whether some element of ``t`` is held by devices of two processes."""
    held = {(d.process_index, of_index(index, t.shape)) for d, index in t.sharding.devices_indices_map(t.shape).items()}
    return sum(_volume(box) for _, box in held) > _volume(whole(t.shape))  # each process's distinct boxes


def _runs(box: Box, shape: tuple[int, ...]) -> int:
    """How many contiguous runs of a C-ordered tensor of ``shape`` make ``box``."""
    partial = [d for d, (b, n) in enumerate(zip(box, shape, strict=True)) if b != (0, n)]
    return math.prod(extents(box[: partial[-1]])) if partial else 1


def _cost(t: Target, dim: int, parts: int, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Contiguous source runs of one part of ``t`` split in ``parts`` on ``dim`` (fewer:
    cheaper reads; a transposed port prefers the target dimension that is the
    source's first)."""
    box = tuple((0, n // parts) if d == dim else (0, n) for d, n in enumerate(t.shape))
    if t.transform is None:
        return _runs(box, shapes[t.sources[0]])
    feeds = t.transform.source_boxes(box, [shapes[k] for k in t.sources])
    if feeds is None:
        return math.prod(t.shape)  # read whole anyway: any dimension will do
    return sum(_runs(b, shapes[t.sources[i]]) for i, b in feeds)


def derived_sharding(t: Target, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """A sharding over ``t``'s devices that splits it among their processes (each
    process's devices splitting its part further where the dimension allows) on the
    dimension cheapest to read from the sources of ``shapes``, or ``None`` when no
    process shares an element with another, or no dimension divides."""
    import jax

    if not _held_by_several(t):
        return None
    devices = sorted(t.sharding.device_set, key=lambda d: (d.process_index, d.id))
    per = collections.Counter(d.process_index for d in devices)  # process -> its devices
    if len(set(per.values())) != 1:
        return None  # uneven devices per process: no process x local grid
    grid = np.array(devices, dtype=object).reshape(len(per), -1)
    mesh = jax.sharding.Mesh(grid, ("p", "l"))
    for axes, parts in ((("p", "l"), grid.size), ("p", len(per))):
        dims = [d for d, size in enumerate(t.shape) if size % parts == 0]
        if dims:
            dim = min(dims, key=lambda d: (_cost(t, d, parts, shapes), d))
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * dim), axes))
    return None


def _received(t: Target, derived: Target) -> int:
    """Bytes of the boxes this process needs of ``t`` that its own part does not hold."""
    own = [box for box, _ in shard_boxes(derived)]
    needed = [box for box, _ in shard_boxes(t)]
    held = sum(_volume(part) for box in needed for o in own if (part := intersect(box, o)) is not None)
    return (sum(map(_volume, needed)) - held) * held_dtype(t).itemsize


def shared_load(
    targets: Sequence[Target],
    run: Callable[[list[Target]], tuple[dict[str, Any], LoadReport]],
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
) -> tuple[dict[str, Any], LoadReport]:
    """Load ``targets`` through ``run`` with shared reads (see the module docstring);
    ``shapes``: the file tensors' shapes."""
    loadable = [t for t in targets if t.sources and all(k in shapes for k in t.sources)]
    derived = {t.path: s for t in loadable if (s := derived_sharding(t, shapes)) is not None}
    swapped = [dataclasses.replace(t, sharding=derived[t.path]) if t.path in derived else t for t in targets]
    sync = _sync(where)
    try:
        values, report = run(swapped)
    except Exception as e:  # posted, so no peer waits for this process in a collective; raised here as it is
        sync.gather("read", StepResult(False, error=f"{type(e).__name__}: {e}").encode(), only=sync.pid)
        raise
    _step(sync, "read", StepResult(True), where)
    sync.forget_previous()  # every process is past the previous exchange by now
    by_path = {t.path: t for t in targets}
    originals = {t.path: t for t in swapped}
    shared = sorted(p for p in derived if p in values)  # one order on every process
    for p in shared:  # the derived array is freed as each is replaced
        values[p] = one_host_buffer(_reshard(values[p], by_path[p].sharding), by_path[p])
    report.io.bytes_received += sum(_received(by_path[p], originals[p]) for p in shared)
    return values, report


@functools.cache
def _identity(sharding: Any) -> Any:
    """A jitted identity onto ``sharding``: one per target sharding, compiled once per
    shape and dtype, so a model's many same-shaped tensors share one executable."""
    import jax

    return jax.jit(lambda x: x, out_shardings=sharding)


def _reshard(array: Any, sharding: Any) -> Any:
    """``array`` under ``sharding`` (JAX's collectives move the bytes), waited for:
    the CPU client may run executables concurrently, and two processes interleaving
    two collectives in different orders would deadlock, so one runs at a time."""
    import jax

    return jax.block_until_ready(_identity(sharding)(array))


def one_host_buffer(array: Any, t: Target) -> Any:
    """``array`` (of target ``t``) with each box that several local devices hold in one
    host buffer, as the plain path's adopted arrays are, on the CPU backend.

    The reshard leaves one buffer per local device; on CPU a device's buffer is host
    memory, and a ``jax.Array`` adopts an aligned host array without a copy, however
    many devices take it. So the first holder's buffer is viewed (read-only, no copy)
    and adopted by every device that holds the same box; the other copies are freed
    with ``array``. Nothing is aliased that anything writes later: jax arrays are
    immutable, and a donated adopted buffer is copied, not reused (tests/load).
    Elsewhere (a device's own memory) ``array`` is returned as it is.
    """
    shards = array.addressable_shards
    if not shards or shards[0].device.platform != "cpu":
        return array
    held: dict[Box, list[Any]] = {}
    for shard in shards:
        held.setdefault(of_index(shard.index, t.shape), []).append(shard)
    if all(len(group) == 1 for group in held.values()):
        return array
    pieces = [(np.asarray(group[0].data), [s.device for s in group]) for group in held.values()]
    return place(t, pieces)
