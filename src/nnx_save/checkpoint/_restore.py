"""Reading one step back: plan each item against its template (or as stored), read
what the plan needs through Orbax, graft partial reads into their templates, and check
every dtype against the step's record."""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from ..load._report import DtypeCast
from ..load._source import gc_paused
from . import _orbax, _partial, _placement, _tree
from ._health import corrupt_from, looks_damaged, orbax_dtypes, step_record, typed_failures
from ._metadata import CheckpointMetadata, restore_names
from ._store_location import Location
from ._tree import flatten
from ._types import Checkpoint

__all__ = ["restore_step"]


def restore_step(
    reader: Callable[[], Any],
    directory: Location,
    step: int,
    metadata: CheckpointMetadata,
    templates: Mapping[str, Any] | None,
    mesh: jax.sharding.Mesh | None,
    items: Iterable[str] | None,
    cast_options: tuple[bool, str | Sequence[str]],
    options: _partial.PartialOptions,
) -> Checkpoint:
    """Read ``step`` of the store in ``directory`` (``metadata``: its record) through
    Orbax's manager (``reader()``), as :meth:`~nnx_save.checkpoint.OrbaxCheckpointStore.restore`
    says; ``cast_options``: its ``(cast_dtypes, allow_casts)``."""
    step_dir = directory / str(step)
    with gc_paused():  # the records, the templates' plans: many small objects, no cycles
        templates = {n: _placement.concrete_templates(n, t, mesh) for n, t in dict(templates or {}).items()}
        names = restore_names(metadata, templates, items)
        manager = reader()
        saved, recorded, stored = _stored_view(reader, directory, step, names, [n for n in names if n in templates])
        accept = _partial.CastPolicy.of(*cast_options)
        given = {n: templates[n] for n in names if n in templates}
        given, retyped = _partial.prepare(step, given, {n: recorded[n].kinds for n in given})
        whole = {n: (t, _orbax.template_restore_args(n, t)) for n, t in given.items()}  # refuses odd leaves first
        specs = {n: recorded[n].specs for n in given}
        chosen, report = _partial.select(step, given, specs, options, str(step_dir))
        casts = _partial.check_template_dtypes(
            step, {n: s.read_pairs() for n, s in chosen.items()}, saved, accept, retyped
        )
        report.dtype_casts.extend(
            DtypeCast(f"{m.item}/{m.leaf}", m.saved, m.restored) for m in casts if m not in retyped
        )
        to_read = [n for n in names if n not in chosen or chosen[n].read]  # an item may have nothing to read
        plan = {n: _orbax.item_plan(n, whole.get(n), chosen.get(n), stored.get(n)) for n in to_read}
        partial = [n for n, s in chosen.items() if not s.whole]
    read: dict[str, Any] = {}
    if plan:
        before, started = _placement.io_counters(), time.perf_counter()
        with _corrupt_on_failure(step_dir, step, any_error=False):
            read = _orbax.restore_items(manager, step, plan, partial)
        item_dirs = [pathlib.Path(step_dir) / n for n in plan]
        report.io = _placement.read_stats(read, before, time.perf_counter() - started, item_dirs)
    with gc_paused():
        restored = {
            n: _partial.graft(chosen[n], dict(flatten(read.get(n, {})))) if n in partial else read[n] for n in names
        }
        restored = {n: _partial.cast_back(step, n, restored[n], retyped, report.dtype_casts) for n in names}
        as_stored = {n: restored[n] for n in names if n not in templates}  # x64 off narrows 64-bit arrays
        _partial.check_restored(step, as_stored, saved, accept)
        report.loaded.extend(f"{n}/{_tree.show(p)}" for n, tree in as_stored.items() for p, _ in flatten(tree))
    return Checkpoint(step, restored, metadata, step_dir, report)


def _stored_view(
    reader: Callable[[], Any], directory: Location, step: int, names: list[str], templated: list[str]
) -> tuple[dict[str, dict[_tree.Path, str]], dict[str, _tree.Recorded], dict[str, Any]]:
    """What the step holds: the saved dtypes, the leaves of each templated item (from
    the step's record: no Orbax metadata read for them), and Orbax's metadata trees of
    the items that need them (those restored as stored; all, for a step whose record
    has no leaves)."""
    dtypes, leaves = step_record(directory, step, names)
    asked = [n for n in names if leaves is None or n not in templated]
    stored: dict[str, Any] = {}
    if asked:
        with _corrupt_on_failure(
            directory / str(step), step, any_error=True
        ):  # Orbax's metadata of an item is unreadable
            stored = _orbax.stored_trees(reader(), step, asked)
    saved = dtypes if dtypes is not None else orbax_dtypes(stored)
    recorded = {
        n: leaves[n]
        if leaves is not None
        else _tree.Recorded(_orbax.stored_specs(stored[n]), _orbax.stored_kinds(stored[n]))
        for n in templated
    }
    return saved, recorded, stored


def _corrupt_on_failure(step_dir: Location, step: int, *, any_error: bool) -> contextlib.AbstractContextManager[None]:
    """Orbax's read failures (all, or only those that look like damage: tensorstore's
    DATA_LOSS for a truncated file) as :class:`CheckpointCorruptError` naming the file."""
    where = str(step_dir)
    return typed_failures(lambda e: corrupt_from(step, where, e) if any_error or looks_damaged(e) else None)
