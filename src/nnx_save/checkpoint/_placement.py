"""Where restored arrays go, and what reading them cost.

Templates built by ``nnx.eval_shape`` under ``jax.set_mesh(mesh)`` carry shardings on an
*abstract* mesh (axis names and sizes, no devices); Orbax needs devices, so each such
sharding is resolved against a concrete mesh of the same axes: the one passed as
``mesh=``, else the one ``jax.set_mesh`` put in scope.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from ..errors import ShardingError
from ..load._report import IOStats
from ._tree import is_key_dtype, segment, show

__all__ = ["StoreIO", "concrete_sharding", "concrete_templates", "io_counters", "read_stats"]


def concrete_sharding(sharding: Any, mesh: Any, where: str) -> Any:
    """``sharding`` on devices: one on an abstract mesh is rebuilt on ``mesh`` (else the
    mesh in scope); any other sharding, or None, is returned as it is.

    Raises:
        ShardingError: No concrete mesh is given or in scope, or its axes differ from the
            abstract mesh's (names and sizes).
    """
    if not _on_abstract_mesh(sharding):
        return sharding
    abstract = sharding.mesh
    if mesh is None:
        mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        raise ShardingError(
            f"{where}: the sharding {sharding.spec} is on an abstract mesh {dict(abstract.shape)} (nnx.eval_shape "
            "under jax.set_mesh); pass mesh= (a jax.sharding.Mesh with those axes) or call it under jax.set_mesh(mesh)"
        )
    if dict(mesh.shape) != dict(abstract.shape):
        raise ShardingError(
            f"{where}: the sharding {sharding.spec} is on an abstract mesh {dict(abstract.shape)}, and the mesh to "
            f"place it on has axes {dict(mesh.shape)}; give a mesh with the template's axes"
        )
    return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def concrete_templates(item: str, template: Any, mesh: Any) -> Any:
    """``template`` with every abstract-mesh sharding of a ``jax.ShapeDtypeStruct`` resolved."""

    def resolve(keypath: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct) or not _on_abstract_mesh(leaf.sharding):
            _check_divides(item, keypath, leaf, getattr(leaf, "sharding", None))
            return leaf  # the common case, decided before the leaf's path is formatted
        where = f"templates[{item!r}]: {show(tuple(map(segment, keypath)))}"
        sharding = concrete_sharding(leaf.sharding, mesh, where)
        _check_divides(item, keypath, leaf, sharding)
        if sharding is leaf.sharding:
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type)

    return jax.tree_util.tree_map_with_path(resolve, template)


def _check_divides(item: str, keypath: Any, leaf: Any, sharding: Any) -> None:
    """Refuse, as ``load_file`` does, a template leaf whose sharding cannot hold its shape
    (a split that does not divide a dimension: jax's ``IndivisibleError``), before any read."""
    if not isinstance(sharding, jax.sharding.Sharding) or not hasattr(leaf, "shape"):
        return
    shape = tuple(leaf.shape)
    try:
        problem = _indivisible(sharding, shape)
    except TypeError:  # an unhashable sharding: asked each time
        problem = _indivisible.__wrapped__(sharding, shape)
    if problem is not None:
        where = f"templates[{item!r}]: {show(tuple(map(segment, keypath)))}"
        raise ShardingError(f"{where}: sharding {sharding} cannot hold shape {shape}: {problem}")


@functools.lru_cache(maxsize=1024)
def _indivisible(sharding: Any, shape: tuple[int, ...]) -> str | None:
    try:
        sharding.shard_shape(shape)
    except ValueError as error:
        return str(error)
    return None


def _on_abstract_mesh(sharding: Any) -> bool:
    return isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh)


def io_counters() -> tuple[int, int] | None:
    """Bytes read and read calls of this process so far (Linux ``/proc/self/io``), else None."""
    try:
        with open("/proc/self/io", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return int(fields[b"rchar"]), int(fields[b"syscr"])
    except (OSError, KeyError, ValueError):
        return None


@dataclasses.dataclass
class StoreIO(IOStats):
    """The I/O of a store's restore: ``bytes_needed`` the bytes restored onto this
    process's devices, ``bytes_read`` the bytes the process read from disk meanwhile
    (Orbax's chunks, compressed: fewer than restored for data that compresses), or
    ``counted=False`` where the system does not say (no ``/proc/self/io``)."""

    counted: bool = True

    def __str__(self) -> str:
        restored = f"restored {self.bytes_needed / 1e6:.1f} MB onto this process's devices from {self.files} file(s)"
        if not self.counted:
            return f"{restored}; the bytes read from disk cannot be counted here (no /proc/self/io); in {self.read_seconds:.3f}s"
        return (
            f"{restored}; read {self.bytes_read / 1e6:.1f} MB from disk (Orbax's compressed chunks) in "
            f"{self.requests} read calls, in {self.read_seconds:.3f}s"
        )


def read_stats(
    read: Mapping[str, Any], before: tuple[int, int] | None, seconds: float, item_dirs: Iterable[pathlib.Path]
) -> StoreIO:
    """The I/O of one restore: the bytes restored onto this process's devices (each
    distinct shard of each array once), the bytes and read calls the process made
    meanwhile (``/proc/self/io``; where it is missing, ``counted=False``), and the files
    of the items read."""
    needed = sum(_needed(leaf) for leaf in jax.tree_util.tree_leaves(dict(read)))
    after = io_counters()
    counted = before is not None and after is not None
    got, calls = (after[0] - before[0], after[1] - before[1]) if before and after else (0, 0)
    files = sum(len(names) for d in item_dirs if os.path.isdir(d) for _, _, names in os.walk(d))
    return StoreIO(
        bytes_read=got, bytes_needed=needed, requests=calls, files=files, read_seconds=seconds, counted=counted
    )


def _needed(leaf: Any) -> int:
    if isinstance(leaf, jax.Array):
        if is_key_dtype(leaf.dtype):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding):
            return int(leaf.nbytes)  # its one shard: no shard objects made for it
        boxes = {str(shard.index): shard.data.nbytes for shard in leaf.addressable_shards}
        return sum(boxes.values())
    return int(leaf.nbytes) if isinstance(leaf, np.ndarray) else 0
