"""Everything that speaks Orbax: the manager, save arguments, metadata, restore arguments.

Orbax's metadata becomes the neutral ``{path: Spec | None}`` form the guard compares.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..errors import UnsupportedValueError
from ._format import DTYPES_ITEM, ITEM_NAMES, METADATA_ITEM, ROOT
from ._tree import Path, Spec, flatten, is_key_dtype, segment, show

T = TypeVar("T")
_RELISTS = 20  # a step deleted under a listing each time, 20 times in a row: not a race we wait out

if TYPE_CHECKING:
    from ._partial import Selection

__all__ = [
    "StepAlreadyExistsError",
    "item_plan",
    "make_manager",
    "on_primary",
    "restore_items",
    "save_args",
    "stored_kinds",
    "stored_restore_args",
    "stored_specs",
    "stored_trees",
    "subset_plan",
    "template_restore_args",
]

StepAlreadyExistsError = ocp.checkpoint_manager.StepAlreadyExistsError


def _registry() -> ocp.handlers.CheckpointHandlerRegistry:
    # Registering every item up front lets a fresh manager read metadata of steps it
    # did not write (Orbax only interprets items whose handler it knows).
    handlers = {name: ocp.PyTreeCheckpointHandler() for name in ITEM_NAMES}
    handlers[METADATA_ITEM] = ocp.JsonCheckpointHandler()
    handlers[DTYPES_ITEM] = ocp.JsonCheckpointHandler()
    return ocp.handlers.create_default_handler_registry(**handlers)


def make_manager(directory: pathlib.Path, *, create: bool) -> ocp.CheckpointManager:
    """An asynchronous manager that keeps every step (the store applies its own retention,
    decided on process 0). ``create`` (only for writing) makes the directory and removes
    the temporary step directories of a save killed midway."""
    options = ocp.CheckpointManagerOptions(
        create=create,
        cleanup_tmp_directories=create,
        enable_async_checkpointing=True,
        preservation_policy=ocp.checkpoint_managers.LatestN(n=None),
    )
    return ocp.CheckpointManager(directory, options=options, handler_registry=_registry())


def listed(list_steps: Callable[[], T]) -> T:
    """``list_steps()`` (a manager made or reloaded), again while another process deletes a
    step it lists: Orbax stats each step it found, and one deleted or replaced in between
    is a ``FileNotFoundError`` (or ``NotADirectoryError`` for a path under it), not a listing."""
    for _ in range(_RELISTS - 1):
        try:
            return list_steps()
        except (FileNotFoundError, NotADirectoryError):
            time.sleep(0.01)
    return list_steps()


def process_count() -> int:
    return jax.process_count()


def on_primary(name: str, action: Callable[[], object]) -> None:
    """Run a directory-level change on process 0 only; every process waits for it."""
    if ocp.multihost.is_primary_host(0):
        action()
    ocp.multihost.sync_global_processes(f"nnx_save:{name}")


def save_args(items: Mapping[str, Any], metadata: dict[str, Any], dtypes: dict[str, Any]) -> ocp.args.Composite:
    """One Orbax composite: a pytree per item (under :data:`ROOT`) and two JSON records."""
    args: dict[str, Any] = {name: ocp.args.PyTreeSave({ROOT: tree}) for name, tree in items.items()}
    args[METADATA_ITEM] = ocp.args.JsonSave(metadata)
    args[DTYPES_ITEM] = ocp.args.JsonSave(dtypes)
    return ocp.args.Composite(**args)


def stored_trees(manager: ocp.CheckpointManager, step: int, names: Iterable[str]) -> dict[str, Any]:
    """Orbax's metadata tree of each named item (the tree under :data:`ROOT`)."""
    metadata = manager.metadata(step).item_metadata
    return {name: metadata[name].tree[ROOT] for name in names}


def stored_specs(tree: Any) -> dict[Path, Spec | None]:
    """``{path: Spec}`` for stored arrays, ``{path: None}`` for stored Python values."""
    return {path: _spec(leaf) for path, leaf in flatten(tree)}


def _spec(leaf: Any) -> Spec | None:
    if isinstance(leaf, ocp.metadata.ArrayMetadata) and not isinstance(leaf, ocp.metadata.ScalarMetadata):
        return Spec(tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return None


def stored_kinds(tree: Any) -> dict[Path, str]:
    """The Python type of each stored Python leaf: ``"bool"``, ``"int"``, ``"float"`` or ``"str"``."""
    return {path: kind for path, leaf in flatten(tree) if (kind := _kind(leaf)) is not None}


def _kind(leaf: Any) -> str | None:
    if isinstance(leaf, ocp.metadata.StringMetadata):
        return "str"
    if isinstance(leaf, ocp.metadata.ScalarMetadata):
        return {"b": "bool", "i": "int", "u": "int", "f": "float"}.get(np.dtype(leaf.dtype).kind)
    return None


def template_restore_args(item: str, template: Any) -> Any:
    """Restore arguments placing every array on its template leaf's sharding and dtype
    (no sharding: the default device); numpy and Python leaves restore as their type."""
    return jax.tree_util.tree_map_with_path(lambda keypath, leaf: _template_arg(item, keypath, leaf), template)


def _template_arg(item: str, keypath: Any, leaf: Any) -> ocp.RestoreArgs:
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = leaf.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        if is_key_dtype(leaf.dtype):
            return ocp.ArrayRestoreArgs(sharding=sharding)  # Orbax rebuilds the key from its key data
        return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(leaf.shape), dtype=leaf.dtype)
    if isinstance(leaf, np.ndarray):
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
    if isinstance(leaf, (int, float, str)):
        return ocp.RestoreArgs(restore_type=type(leaf))
    raise UnsupportedValueError(
        f"templates[{item!r}]: leaf {show(tuple(map(segment, keypath)))} is a {type(leaf).__name__}; template "
        "leaves must be arrays, jax.ShapeDtypeStruct, or ints, floats, bools and strings"
    )


def stored_restore_args(tree: Any) -> Any:
    """Restore arguments that bring every leaf back as stored, sharding included."""
    return jax.tree_util.tree_map(_stored_arg, tree)


def _stored_arg(leaf: Any) -> ocp.RestoreArgs:
    if isinstance(leaf, ocp.metadata.StringMetadata):
        return ocp.RestoreArgs(restore_type=str)
    if isinstance(leaf, ocp.metadata.ScalarMetadata):
        return ocp.RestoreArgs(restore_type=type(np.dtype(leaf.dtype).type(0).item()))
    if isinstance(leaf, ocp.metadata.ArrayMetadata) and leaf.sharding is not None:
        return ocp.ArrayRestoreArgs(sharding=leaf.sharding)
    if isinstance(leaf, ocp.metadata.ArrayMetadata):
        return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.RestoreArgs()


def subset_plan(item: str, pairs: Iterable[tuple[Path, Any]]) -> tuple[dict[str, Any], Any]:
    """``(template, restore_args)`` reading only the leaves ``pairs`` name: nested
    dicts keyed as Orbax stored them (read with ``partial_restore``)."""
    template: dict[str, Any] = {}
    args: dict[str, Any] = {}
    for path, leaf in pairs:
        node, arg_node = template, args
        for key in path[:-1]:
            node, arg_node = node.setdefault(key, {}), arg_node.setdefault(key, {})
        node[path[-1]] = leaf
        arg_node[path[-1]] = _template_arg(item, (jax.tree_util.DictKey(k) for k in path), leaf)
    return template, args


def restore_items(
    manager: ocp.CheckpointManager, step: int, plan: Mapping[str, tuple[Any | None, Any]], partial: Iterable[str] = ()
) -> dict[str, Any]:
    """Read items in one Orbax call; ``plan`` maps a name to ``(template or None,
    restore_args)``; items named in ``partial`` read only their template's leaves."""
    partial = set(partial)
    args = {
        name: ocp.args.PyTreeRestore(
            item=None if template is None else {ROOT: template},
            restore_args={ROOT: restore_args},
            partial_restore=name in partial,
        )
        for name, (template, restore_args) in plan.items()
    }
    restored = manager.restore(step, args=ocp.args.Composite(**args))
    return {name: restored[name][ROOT] for name in plan}


def item_plan(name: str, whole: tuple[Any, Any] | None, selection: Selection | None, stored: Any) -> tuple[Any, Any]:
    """``(template, restore_args)`` for one item: as stored, whole, or the leaves read."""
    if whole is None or selection is None:
        return None, stored_restore_args(stored)
    return whole if selection.whole else subset_plan(name, selection.read_pairs())
