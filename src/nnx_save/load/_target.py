"""What a load asks for: one :class:`Target` per value the caller wants.

At the bottom of the import graph (numpy only), so every bridge (pytrees, NNX
models, porting rules) can build targets without importing the engine.
"""

from __future__ import annotations

import functools
import itertools
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .._frozen import frozen_many
from ..errors import DtypeMismatchError, ShardingError, SingleDeviceWarning
from ..format._boxes import Box, of_index, whole

__all__ = [
    "OwnPaths",
    "SourceTransform",
    "Target",
    "WholeReads",
    "check_device_dtype",
    "check_device_dtypes",
    "device_indices",
    "one_source_each",
    "per_sharding",
    "shard_boxes",
    "warn_single_device",
]

_SHARDING, _DTYPE = operator.attrgetter("sharding"), operator.attrgetter("dtype")
_PATH, _TRANSFORM, _SOURCES = map(operator.attrgetter, ("path", "transform", "sources"))


class SourceTransform(Protocol):
    """How a porting rule makes a target from file tensors, whole or box by box."""

    def __call__(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The whole target from the whole source arrays."""
        ...

    def source_boxes(self, box: Box, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, Box]] | None:
        """``(source index, source box)`` reads that make ``box`` of the target, given
        the sources' ``shapes``; ``None`` when ``box`` has no per-box preimage."""
        ...

    def from_boxes(self, box: Box, regions: Sequence[np.ndarray]) -> np.ndarray:
        """Box ``box`` of the target from the regions read for :meth:`source_boxes`."""
        ...


@dataclass(frozen=True, slots=True)  # slots: made per tensor, twice as fast
class Target:
    """One value the caller wants.

    Attributes:
        path: the caller's key for it (tree path joined with ``/``).
        shape, dtype: what the caller expects.
        sharding: a ``jax.sharding.Sharding``, or ``None`` for a host numpy array.
        sources: the file key(s) it is made from (one, unless ``transform``).
        transform: for porting rules: how the sources make the value, box by box
            where it can (each shard reads only the source boxes that feed it),
            else from the whole sources; ``None`` reads the single source directly.
        source_shape: the shape ``transform`` produces (checked before reading).
        box: for a host target (``sharding=None``), the region ``((start, stop), ...)``
            to read, ``None`` for all of it; the value then has the box's shape
            (``nnx_save.safe_open``'s slices).

    Examples:
        >>> import numpy as np
        >>> Target("w", (2, 3), np.dtype(np.float32), sources=("w",)).sources
        ('w',)
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any = None
    sources: tuple[str, ...] = ()
    transform: SourceTransform | None = None
    source_shape: tuple[int, ...] | None = None
    box: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def many(
        cls, paths: list[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype], shardings: Sequence[Any]
    ) -> OwnPaths:
        """``[Target(p, shape, dtype, sharding, (p,)) ...]``, one per path, made in bulk
        (:func:`~nnx_save._frozen.frozen_many`): each reads its own path whole."""
        columns = {"path": paths, "shape": shapes, "dtype": dtypes, "sharding": shardings, "sources": list(zip(paths))}
        return OwnPaths(frozen_many(cls, len(paths), columns, dict.fromkeys(("transform", "source_shape", "box"))))


class OwnPaths(list[Target]):
    """Targets made by :meth:`Target.many`: each reads its own path, whole, as its one
    source, with no transform (a later step need not ask each target that again)."""


class WholeReads(list[Target]):
    """Targets that each read one file tensor as it is stored, in its shape and held
    dtype, with no transform (what :func:`~nnx_save.load._match.check_targets` found
    of every target of a load), with each one's file key and tensor record, in order,
    and the set of those keys: later steps of the load take them from here rather than
    ask each target again (a target's held dtype is its tensor's ``dtype.numpy``)."""

    def __init__(self, targets: Sequence[Target], keys: list[str], infos: list[Any]) -> None:
        super().__init__(targets)
        self.keys, self.infos, self.used = keys, infos, set(keys)


def one_source_each(targets: Sequence[Target]) -> list[str] | None:
    """The file key each of ``targets`` reads, when none has a transform and each reads
    one tensor (asked of them all at once, at C speed); else ``None``."""
    if isinstance(targets, OwnPaths):  # each reads its own path
        return list(map(_PATH, targets))
    if any(map(operator.is_not, map(_TRANSFORM, targets), itertools.repeat(None))):
        return None
    sources = list(map(_SOURCES, targets))
    if set(map(len, sources)) != {1}:
        return None
    return list(map(operator.itemgetter(0), sources))


def device_indices(sharding: Any, shape: tuple[int, ...]) -> dict[Any, tuple[slice, ...]]:
    """``sharding.addressable_devices_indices_map(shape)``, computed once per sharding and
    shape (a load of many tensors of a few shapes asks for it twice per tensor; an
    unhashable sharding is asked each time). The caller must not modify the answer."""
    try:
        return _device_indices(sharding, tuple(shape))
    except TypeError:  # unhashable
        return sharding.addressable_devices_indices_map(shape)


@functools.lru_cache(maxsize=1024)
def _device_indices(sharding: Any, shape: tuple[int, ...]) -> dict[Any, tuple[slice, ...]]:
    return sharding.addressable_devices_indices_map(shape)


def shard_boxes(target: Target) -> list[tuple[Box, list[Any]]]:
    """Unique index boxes this process needs, each with the local devices that hold it.
    Computed once per sharding and shape: the caller must not modify the answer."""
    shape = target.shape
    if target.sharding is None:
        return [(target.box if target.box is not None else whole(shape), [None])]
    try:
        groups = per_sharding(_shard_groups, target.sharding, tuple(shape))
    except ValueError as e:  # jax refuses it (a split that does not divide the dimension, ...)
        raise ShardingError(f"{target.path}: sharding {target.sharding} cannot hold shape {shape}: {e}") from None
    if not groups:  # an array with no shard here: this process could never use or save it
        import jax

        raise ShardingError(
            f"{target.path}: its sharding {target.sharding} places no shard on a device of process "
            f"{jax.process_index()} (local devices {[d.id for d in jax.local_devices()]}); every process must "
            "load with a sharding over devices it can address (a mesh over jax.devices(), or jax.local_devices())"
        )
    return groups


def _groups(sharding: Any, shape: tuple[int, ...]) -> list[tuple[Box, list[Any]]]:
    groups: dict[Box, list[Any]] = {}
    for device, index in device_indices(sharding, shape).items():
        groups.setdefault(of_index(index, shape), []).append(device)
    return list(groups.items())


def _shard_groups(sharding: Any, shape: tuple[int, ...]) -> list[tuple[Box, list[Any]]]:
    try:
        return _hashed_groups(sharding, shape)
    except TypeError:  # unhashable
        return _groups(sharding, shape)


_hashed_groups = functools.lru_cache(maxsize=1024)(_groups)
_SEEN: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def per_sharding(fn: Callable[..., Any], sharding: Any, *args: Any) -> Any:
    """``fn(sharding, *args)``, remembered per sharding OBJECT: many tensors of one load
    share a sharding object, and hashing one (jax's ``__hash__`` in Python) costs more
    than the rest of a small tensor's placement. The entry holds the sharding, so its
    ``id`` cannot be reused while it is remembered. ``fn`` must be pure."""
    key = (fn, id(sharding), *args)
    hit = _SEEN.get(key)
    if hit is not None and hit[0] is sharding:
        return hit[1]
    value = fn(sharding, *args)
    if len(_SEEN) >= 4096:  # bounded: a load with more distinct shardings starts over
        _SEEN.clear()
    _SEEN[key] = (sharding, value)
    return value


def check_device_dtype(target: Target, file: str) -> None:
    """Refuse a device target whose dtype the device's jax backend cannot hold, so
    the load fails before reading rather than at the transfer after it.

    Raises:
        DtypeMismatchError: Names the file, the tensor, the dtype and the platform.
    """
    if target.sharding is None:
        return  # a host target
    device = per_sharding(_first_device, target.sharding)
    if device is None:
        return  # no shard here (refused by shard_boxes)
    if not _holds(device, target.dtype):
        raise DtypeMismatchError(
            f"{file}: tensor {target.path!r}: jax on {device.platform} cannot hold dtype {target.dtype} "
            "(nothing was read); load it onto the host instead (a numpy array or no template for it)"
        )


def check_device_dtypes(targets: Sequence[Target], files: Callable[[Target], str]) -> None:
    """:func:`check_device_dtype` of each target (``files``: the file it reads, for the
    message), asked once per sharding object and dtype: the answer is the same for all
    the targets that share them (a hundred thousand leaves, one sharding)."""
    ids, dtypes = list(map(id, map(_SHARDING, targets))), list(map(_DTYPE, targets))
    try:
        if len(set(ids)) == 1 and len(set(dtypes)) == 1:  # one sharding object, one dtype: one question
            first: dict[Any, int] = {None: 0} if targets else {}
        else:
            keys = list(zip(ids, dtypes, strict=True))
            first = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))  # each key's first target
    except TypeError:  # an unhashable dtype
        first = {i: i for i in range(len(targets))}
    for i in sorted(first.values()):
        check_device_dtype(targets[i], files(targets[i]))


def _first_device(sharding: Any) -> Any:
    """The local device of ``sharding`` with the lowest id, or None (asked per tensor: cached)."""
    return min(sharding.addressable_devices, key=lambda d: d.id, default=None)


@functools.cache
def _holds(device: Any, dtype: np.dtype) -> bool:
    """Whether ``device`` takes an array of ``dtype`` (tried once with an empty one)."""
    import jax

    try:
        jax.device_put(np.zeros(0, dtype), device).block_until_ready()
    except Exception:  # jax's JaxRuntimeError "Unknown NumPy dtype", or a TypeError
        return False
    return True


def warn_single_device(paths: Sequence[str], devices: Sequence[object], fix: str, stacklevel: int) -> None:
    """Warn (:class:`SingleDeviceWarning`) that ``paths`` have no sharding although this
    process has several ``devices``: how many, which, where they land, and ``fix``."""
    if not paths or len(devices) < 2:
        return
    shown = ", ".join(sorted(paths)[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    message = (
        f"{len(paths)} arrays have no sharding ({shown}): all of them are loaded onto {devices[0]}, although this "
        f"process has {len(devices)} devices. {fix}"
    )
    warnings.warn(message, SingleDeviceWarning, stacklevel=stacklevel + 1)
