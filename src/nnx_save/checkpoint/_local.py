"""Host-local arrays made global for a multi-process save.

A model built without a mesh holds its arrays on one device of each process (so does a
bare ``jax.random.key(0)`` and an ``nnx.Dropout``'s rng stream): every process has its own
copy of a value the job treats as replicated. Orbax refuses such arrays on many processes
(it cannot tell which copy to write). ``save_model`` writes them once, from process 0's
copy; the store does the same by viewing each one as a global array replicated over one
device per process, so Orbax writes replica 0 (process 0's copy) once and every process
reads it back.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from ._tree import is_key_dtype

__all__ = ["globalised"]


def globalised(items: dict[str, Any]) -> dict[str, Any]:
    """``items`` with every host-local jax array replaced by its global replicated view;
    the same objects on one process (nothing to do), the caller's never modified."""
    if jax.process_count() == 1:
        return items
    return {name: jax.tree_util.tree_map(_global, tree) for name, tree in items.items()}


@functools.lru_cache(maxsize=1)
def _replicated() -> jax.sharding.NamedSharding:
    """Replicated over one device per process: each process's first local device."""
    devices = [min(jax.local_devices(process_index=p), key=lambda d: d.id) for p in range(jax.process_count())]
    mesh = jax.sharding.Mesh(np.array(devices), ("nnx_save_processes",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _global(leaf: Any) -> Any:
    if not isinstance(leaf, jax.Array) or not leaf.is_fully_addressable or leaf.is_deleted():
        return leaf  # numpy, Python values, arrays already global; a deleted one is refused by the checks
    if is_key_dtype(leaf.dtype):  # a typed key: its key data made global, then wrapped again
        data = _global(jax.random.key_data(leaf))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
    sharding = _replicated()
    (device,) = sharding.addressable_devices
    local = jax.device_put(leaf, jax.sharding.SingleDeviceSharding(device))  # no copy when it is there already
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, [local])
