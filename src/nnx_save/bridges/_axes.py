"""A model's partitioning against a mesh with other axis names: which variables name
which axes the mesh lacks.

jax says only ``Resource axis: model of P(None, 'model') is not found in mesh``, from
inside the variable's construction. To name every variable, the builder is traced again
under the same devices with each missing axis added (size 1, so the devices are the
same), and each variable's partitioning is read from its metadata.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax

from ..errors import ShardingError

__all__ = ["is_missing_axis", "missing_axes_error"]

_MISSING = re.compile(r"Resource axis: (\S+) of .* is not found in mesh")
_MAX_TRIES = 16  # axes a model may name that the mesh lacks, found one per trace


def is_missing_axis(error: BaseException) -> bool:
    """True for jax's refusal of a partitioning that names an axis the mesh lacks."""
    return isinstance(error, ValueError) and _MISSING.search(str(error)) is not None


Partitionings = Callable[[jax.sharding.Mesh], Sequence[tuple[str, tuple]]]


def missing_axes_error(partitionings: Partitionings, mesh: jax.sharding.Mesh, error: ValueError) -> ShardingError:
    """The :class:`ShardingError` naming each variable whose partitioning names axes
    ``mesh`` lacks, its axes and the mesh's. ``partitionings(mesh)`` traces the model
    under ``mesh`` and returns ``(variable path, its axes)`` pairs (raising jax's error
    for an axis still missing)."""
    names = tuple(mesh.axis_names)
    extra: list[str] = []
    found_axes: Sequence[tuple[str, tuple]] | None = None
    for _ in range(_MAX_TRIES):
        found = _MISSING.search(str(error))
        if found is None or found.group(1) in extra:
            break
        extra.append(found.group(1))
        wider = jax.sharding.Mesh(
            mesh.devices.reshape(mesh.devices.shape + (1,) * len(extra)),
            names + tuple(extra),
            axis_types=tuple(mesh.axis_types) + (jax.sharding.AxisType.Explicit,) * len(extra),
        )
        try:
            found_axes = partitionings(wider)
            break
        except ValueError as e:
            error = e
    lines = _variables(found_axes, set(names)) if found_axes is not None else []
    where = "\n  ".join(lines) if lines else f"({error})"
    return ShardingError(
        f"the model's partitioning names mesh axes {extra} that the mesh lacks; the mesh has axes "
        f"{dict(mesh.shape)}:\n  {where}\nbuild the mesh with the model's axis names "
        f"(jax.make_mesh(shape, {names + tuple(extra)!r}), sizes 1 where an axis is not split) "
        "or partition the model over the mesh's axes"
    )


def _variables(partitionings: Sequence[tuple[str, tuple]], known: set[str]) -> list[str]:
    """``path: partitioned over (...)`` for each variable naming an axis not in ``known``."""
    lines = []
    for path, axes in partitionings:
        used = {a for entry in axes for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None}
        if used - known:
            lines.append(f"{path}: partitioned over {tuple(axes)!r}")
    return sorted(lines)
