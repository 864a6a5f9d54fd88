"""NNX glue: put a restored state back into a Module, an Optimizer or any graph node.

Orbax stores dict keys as strings (``"0"`` for an ``nnx.List``'s ``0``), so
:func:`restore_into` walks the target's structure and looks each leaf up by its Orbax name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from ..errors import DtypeMismatchError, KeyMismatchError, OptionError, ShapeMismatchError
from ._placement import concrete_sharding
from ._tree import Path, flatten, is_array, segment, show

__all__ = ["restore_into"]


def restore_into(
    target: Any,
    state: Any,
    *,
    filter: Any = ...,
    cast_dtypes: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> None:
    """Update ``target`` in place with a restored state (templated or not), exactly.

    Everything is checked before anything changes: every target leaf restored and
    nothing else, same shapes and dtypes. Arrays go on the target leaf's sharding.

    Args:
        target: An NNX graph node (``nnx.Module``, ``nnx.Optimizer``), possibly
            abstract (built under ``nnx.eval_shape``).
        state: The restored item, e.g. ``checkpoint.items["model"]``.
        filter: The NNX filter of the target's state to update, as for ``load_model``
            (``nnx.Param``: parameters only; the target's other state keeps its
            values, and the restored state's leaves of that other state are not
            unexpected).
        cast_dtypes: Cast arrays to the target's dtypes instead of refusing.
        mesh: The devices for target shardings on an abstract mesh (a target built by
            ``nnx.eval_shape`` under ``jax.set_mesh``); default: the mesh in scope.

    Raises:
        KeyMismatchError: Leaves missing from ``state`` or not in the target.
        ShapeMismatchError: A restored array's shape differs from the target's.
        DtypeMismatchError: A dtype differs and ``cast_dtypes`` is off.
        ShardingError: A target sharding is on an abstract mesh and no mesh with its
            axes is given or in scope.

    Examples:
        >>> import tempfile
        >>> from flax import nnx
        >>> from nnx_save.checkpoint import OrbaxCheckpointStore, restore_into
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.layers = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(2)])
        >>> store = OrbaxCheckpointStore(tempfile.mkdtemp())
        >>> _ = store.save(1, {"model": nnx.state(Net(nnx.Rngs(0)))})
        >>> net = Net(nnx.Rngs(1))
        >>> restore_into(net, store.restore(1).items["model"])
        >>> bool((net.layers[0].kernel[...] == Net(nnx.Rngs(0)).layers[0].kernel[...]).all())
        True
        >>> restore_into(net, store.restore(1).items["model"], filter=nnx.Param)  # parameters only
    """
    name = type(target).__name__
    if not isinstance(target, nnx.Pytree):
        raise OptionError(f"restore_into: target must be an NNX object (an nnx.Module, ...), got {name}")
    keypaths, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(target, filter))
    wanted = [(tuple(segment(e) for e in keypath), leaf) for keypath, leaf in keypaths]
    given = dict(flatten(state))
    if filter is not ...:  # the target's other state is filtered out, not unexpected
        outside = _paths_of(nnx.state(target)) - {path for path, _ in wanted}
        given = {path: leaf for path, leaf in given.items() if path not in outside}
    _check_paths(name, [path for path, _ in wanted], given)
    _check_arrays(name, wanted, given, cast_dtypes)
    leaves = [
        _adopt(leaf, given[path], cast_dtypes, mesh, f"restore_into({name}): {show(path)}") for path, leaf in wanted
    ]
    nnx.update(target, jax.tree_util.tree_unflatten(treedef, leaves))


def _paths_of(state: Any) -> frozenset[Path]:
    return frozenset(path for path, _ in flatten(state))


def _check_paths(name: str, wanted: Sequence[Path], given: dict[Path, Any]) -> None:
    missing = sorted(show(p) for p in wanted if p not in given)
    unexpected = sorted(show(p) for p in set(given) - set(wanted))
    if missing or unexpected:
        raise KeyMismatchError(
            f"restore_into({name}): the restored state does not match the target's structure: "
            f"{len(missing)} missing (in the target, not restored): {', '.join(missing) or '-'}; "
            f"{len(unexpected)} unexpected (restored, not in the target): {', '.join(unexpected) or '-'}"
        )


def _check_arrays(name: str, wanted: Sequence[tuple[Path, Any]], given: dict[Path, Any], cast: bool) -> None:
    shapes, dtypes = [], []
    for path, leaf in wanted:
        value = given[path]
        if not is_array(leaf):
            continue
        if not is_array(value):
            shapes.append(f"{show(path)}: an array in the target, a {type(value).__name__} restored")
        elif tuple(leaf.shape) != tuple(value.shape):
            shapes.append(f"{show(path)}: shape {tuple(leaf.shape)} in the target, {tuple(value.shape)} restored")
        elif leaf.dtype != value.dtype:
            dtypes.append(f"{show(path)}: {leaf.dtype} in the target, {value.dtype} restored")
    if shapes:
        raise ShapeMismatchError(f"restore_into({name}): {len(shapes)} leaves differ in shape: {'; '.join(shapes)}")
    if dtypes and not cast:
        raise DtypeMismatchError(
            f"restore_into({name}): {len(dtypes)} leaves differ in dtype: {'; '.join(dtypes)}; "
            "pass cast_dtypes=True to cast them to the target's dtypes"
        )


def _adopt(leaf: Any, value: Any, cast: bool, mesh: Any, where: str) -> Any:
    """``value`` with the target leaf's dtype (when casting) and sharding."""
    if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return value
    if cast and value.dtype != leaf.dtype:
        value = value.astype(leaf.dtype)
    sharding = concrete_sharding(leaf.sharding, mesh, where)
    if sharding is None:
        return jax.numpy.asarray(value)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    return jax.device_put(value, sharding)
