"""Assembling loaded bytes into values: host views of what was read, the held
dtype, and the ``jax.Array`` made from host shards.

On the CPU backend a ``jax.Array`` adopts each aligned host shard buffer without a
copy (:func:`place`); numpy targets get the host array itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..format import _dtypes
from ..format._boxes import check_bools
from ..format._header import TensorInfo
from ._pieces import Box
from ._target import Target, device_indices

__all__ = [
    "assemble",
    "batched_put",
    "held_dtype",
    "held_of",
    "host_view",
    "place",
    "place_adopted",
    "place_whole",
]


def held_dtype(t: Target) -> np.dtype:
    """The dtype the loaded value will have: the target's, narrowed the way jax
    narrows it when ``jax_enable_x64`` is off (int64 -> int32, float64 -> float32)."""
    if t.sharding is None:
        return _native(np.dtype(t.dtype))
    return _canonical(t.dtype)


def _native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order: a model holding a big-endian array loads
    its values exactly, not as a cast (the byte order is how they sit, not what they are)."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _canonical(dtype: Any) -> np.dtype:
    """jax's dtype for ``dtype`` under the current ``jax_enable_x64`` (asked per tensor:
    a dict beats jax's own cache)."""
    import jax

    key = (dtype, jax.config.jax_enable_x64)  # type: ignore[attr-defined]  # the attribute: read() costs 10x
    held = _HELD.get(key)
    if held is None:
        held = _HELD[key] = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    return held


_HELD: dict[tuple[Any, bool], np.dtype] = {}


@functools.lru_cache(maxsize=256)
def held_of(dtype: np.dtype, on_device: bool, x64: bool) -> np.dtype:
    """:func:`held_dtype` of a target of ``dtype``, on a device or not, under
    ``jax_enable_x64`` = ``x64`` (the caller's current value: part of the key only):
    asked per tensor, computed once per key."""
    return _canonical(dtype) if on_device else _native(dtype)


def host_view(buf: np.ndarray, info: TensorInfo, box: Box) -> np.ndarray:
    """The bytes read for ``box``, as an array of the file's dtype and the box's shape."""
    if info.dtype.byte_aligned:
        view = buf.view(info.dtype.numpy).reshape([hi - lo for lo, hi in box])  # extents(box), per tensor inline
        return view if info.dtype.code != "BOOL" else check_bools(view, info, box)
    full = _dtypes.unpack_subbyte(buf, info.dtype, info.numel).reshape(info.shape)
    return full[tuple(slice(lo, hi) for lo, hi in box)]


def assemble(t: Target, held: np.dtype, shards: list[tuple[np.ndarray, TensorInfo, Box, list[Any]]]):
    """The target's value from its filled destinations, each ``(buffer, file tensor,
    box, local devices)``: viewed as the file's dtype (:func:`host_view`), cast to
    ``held`` where it differs, placed (:func:`place`)."""
    pieces = []
    for buffer, info, box, devices in shards:
        host = host_view(buffer, info, box)
        pieces.append((host if host.dtype == held else host.astype(held), devices))
    return place(t, pieces)


def place(t: Target, pieces: list[tuple[np.ndarray, list[Any]]]):
    """The target's ``jax.Array`` from its host shards (each shard's buffer adopted,
    not copied, by every local device that holds it when jax runs on CPU)."""
    if t.sharding is None:
        return pieces[0][0]
    import jax

    if len(pieces) == 1 and len(pieces[0][1]) == 1:  # one device: no order to follow
        hosts, devices = [pieces[0][0]], list(pieces[0][1])
    else:
        by_device = {d: host for host, devices in pieces for d in devices}
        devices = list(device_indices(t.sharding, t.shape))
        hosts = [by_device[d] for d in devices]
    put = batched_put()
    if put is not None and hosts[0].dtype == _canonical(hosts[0].dtype):
        return put(t.shape, t.sharding, hosts, devices)
    arrays = [jax.device_put(h, d) for h, d in zip(hosts, devices, strict=True)]
    return jax.make_array_from_single_device_arrays(t.shape, t.sharding, arrays)


def place_adopted(t: Target | None, buffer: np.ndarray, info: TensorInfo, box: Box, devices: list[Any]) -> Any:
    """The device array of ``t`` from its one adopted destination ``buffer`` (the
    bytes of ``box`` of file tensor ``info``, whose dtype is the held one), viewed
    (:func:`host_view`: BOOL bytes checked) and placed on its one device with none of
    :func:`assemble`'s general steps (what many small tensors cost); ``None`` where
    ``t`` is not such a target or jax lacks :func:`batched_put`."""
    put = batched_put()
    if t is None or t.sharding is None or len(devices) != 1 or put is None:
        return None
    return put(t.shape, t.sharding, [host_view(buffer, info, box)], devices)


@functools.cache
def batched_put() -> Callable | None:
    """jax's one-call path from per-device host arrays to a sharded array: what
    ``jax.make_array_from_callback`` ends in, without its per-shard checks, several
    times cheaper per tensor (docs/performance.md). Internal API: ``None`` when
    absent, and the public path (``jax.device_put`` per device) is used instead.

    The C++ call itself (``xla_client.batched_device_put``) when jax has it, with the
    abstract value made once per shape, dtype and sharding: many small tensors of a
    few shapes then cost a few microseconds each, not the tens that ``pxla``'s wrapper
    and a fresh abstract value per tensor cost."""
    try:
        from jax._src import core
        from jax._src.interpreters import pxla

        core.update_aval_with_sharding, pxla.batched_device_put  # noqa: B018 - probe both
    except (ImportError, AttributeError):
        return None
    try:
        from jax._src.lib import xla_client

        direct = xla_client.batched_device_put
    except (ImportError, AttributeError):
        direct = None

    avals: dict[tuple[Any, ...], tuple[Any, Any]] = {}  # per sharding OBJECT, as per_sharding

    def put(shape, sharding, hosts, devices):
        key = (id(sharding), tuple(shape), hosts[0].dtype)
        hit = avals.get(key)
        if hit is None or hit[0] is not sharding:  # the entry holds its sharding: no id reuse
            if len(avals) >= 4096:  # bounded, as per_sharding
                avals.clear()
            aval = core.update_aval_with_sharding(core.ShapedArray(shape, hosts[0].dtype), sharding)
            hit = avals[key] = (sharding, aval)
        made = hit[1]
        if direct is not None and all(type(h) is np.ndarray for h in hosts):
            return direct(made, sharding, hosts, devices, True)
        return pxla.batched_device_put(made, sharding, hosts, devices)

    return put


def place_whole(t: Target, value: np.ndarray):
    import jax

    if t.sharding is None:
        return value
    return jax.make_array_from_callback(t.shape, t.sharding, lambda index: np.ascontiguousarray(value[index]))
