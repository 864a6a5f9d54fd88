"""The step-addressed checkpoint store: the :class:`CheckpointStore` protocol and its
Orbax implementation.

Writes are strict (a step is written once, steps only move forward, a refused save
changes nothing) and reads are guarded (metadata validated first; dtypes, paths and
shapes compared against the templates before a single array is read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import pathlib
import shutil
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal, Protocol, Self, runtime_checkable

from .._errors import NnxSaveError
from . import _orbax
from ._directory import absolute_dir
from ._errors import (
    CheckpointDtypeMismatchError,
    CheckpointItemError,
    CheckpointNotFoundError,
    CheckpointNotWrittenError,
    CheckpointTemplateError,
    CheckpointWriteError,
    UnsupportedCheckpointError,
)
from ._format import DTYPES_ITEM, ITEM_NAMES, METADATA_ITEM
from ._guard import dtype_mismatches, explained_by_x64, template_problems
from ._metadata import CheckpointMetadata, Producer, check_extra, check_metrics, library_versions, utc_now
from ._tree import Path, check_item, dtype_record, flatten, parse_dtype_record

__all__ = ["Checkpoint", "CheckpointStore", "OrbaxCheckpointStore"]

# A step being overwritten is renamed to this (plus the step) until its replacement
# is complete, so a crash mid-overwrite never loses the step.
_ASIDE_PREFIX = ".nnx_save-overwriting-"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One restored step.

    Attributes:
        step: The step.
        items: The restored items by name, in the order they were recorded.
        metadata: The step's metadata record.
        path: The step's directory.
    """

    step: int
    items: Mapping[str, Any]
    metadata: CheckpointMetadata
    path: pathlib.Path


@runtime_checkable
class CheckpointStore(Protocol):
    """A step-addressed store of training state; see :class:`OrbaxCheckpointStore`."""

    def save(
        self,
        step: int,
        items: Mapping[str, Any],
        *,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        producer: Producer | None = None,
        extra: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        blocking: bool = True,
    ) -> pathlib.Path: ...

    def restore(
        self, step: int, *, templates: Mapping[str, Any] | None = None, cast_dtypes: bool = False
    ) -> Checkpoint: ...

    def read_metadata(self, step: int) -> CheckpointMetadata: ...

    def list_steps(self) -> list[int]: ...

    def latest_step(self) -> int | None: ...

    def best_step(self, metric: str, *, mode: Literal["min", "max"] = "min") -> int | None: ...

    def delete(self, step: int) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class OrbaxCheckpointStore:
    """Training checkpoints in ``directory``, one Orbax composite checkpoint per step.

    Each step holds up to five named items (``model``, ``optimizer``, ``rng``,
    ``data_iterator``, ``extensions``), each a pytree of arrays, typed PRNG keys and
    plain Python values, plus a JSON metadata record and a JSON record of every
    array's dtype. Saves use Orbax's asynchronous checkpointing: with
    ``save(..., blocking=False)`` the call returns once the state is copied to the
    host (training may go on, donating the saved buffers) and the step is written
    in the background; reading a step, the next save, :meth:`wait_until_finished`,
    :meth:`close` and leaving the ``with`` block wait for pending saves and raise
    their errors. Refused saves raise at the ``save`` call either way. Only the latest ``max_to_keep`` steps are
    kept (``None`` keeps all). Nothing is created on disk before the first save.
    Restoring never executes code: Orbax reads arrays, numbers, strings and JSON.

    Args:
        directory: The checkpoint directory (relative paths against the working
            directory); see :func:`resolve_checkpoint_dir`.
        max_to_keep: How many of the latest steps to keep, at least 1, or None.

    Raises:
        ValueError: ``directory`` is empty, names a file, or ``max_to_keep`` < 1.

    Examples:
        >>> import jax, jax.numpy as jnp, tempfile
        >>> with OrbaxCheckpointStore(tempfile.mkdtemp(), max_to_keep=2) as store:
        ...     _ = store.save(10, {"model": {"w": jnp.ones(3)}, "rng": jax.random.key(0)},
        ...                    metrics={"loss": 0.5})
        ...     ckpt = store.restore(10)
        ...     print(store.list_steps(), ckpt.items["model"]["w"].dtype, ckpt.metadata.metrics)
        [10] float32 {'loss': 0.5}
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = 5) -> None:
        self._directory = absolute_dir("directory", directory)
        if self._directory.exists() and not self._directory.is_dir():
            raise ValueError(f"checkpoint directory {self._directory} exists and is not a directory")
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(f"max_to_keep must be an int >= 1 or None (keep every step), got {max_to_keep!r}")
        self._max_to_keep = max_to_keep
        self._manager: Any = None
        self._writable = False
        self._closed = False
        self._metadata: dict[int, CheckpointMetadata] = {}

    @property
    def directory(self) -> pathlib.Path:
        """The absolute checkpoint directory (it may not exist before the first save)."""
        return self._directory

    @property
    def max_to_keep(self) -> int | None:
        """How many of the latest steps are kept; None keeps every step."""
        return self._max_to_keep

    def __repr__(self) -> str:
        return f"OrbaxCheckpointStore({str(self._directory)!r}, max_to_keep={self._max_to_keep})"

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending saves, then release Orbax's resources (even when a save
        failed: its error is raised after). Idempotent; any later call raises
        ``ValueError``."""
        manager, self._manager, self._closed = self._manager, None, True
        if manager is not None:
            try:
                manager.wait_until_finished()
            finally:
                manager.close()

    def wait_until_finished(self) -> None:
        """Wait until every pending save is committed; raise the error of one that failed."""
        if self._manager is not None:
            with self._write_failures(self._manager.latest_step()):
                self._manager.wait_until_finished()

    def _reader(self) -> Any:
        if self._closed:
            raise ValueError(f"{self!r} is closed")
        if self._manager is None and self._directory.is_dir():
            self._manager = _orbax.make_manager(self._directory, self._max_to_keep, create=False)
        return self._manager

    def _writer(self) -> Any:
        if self._closed:
            raise ValueError(f"{self!r} is closed")
        if not self._writable:
            if self._manager is not None:
                self._manager.close()
            self._recover_overwrites()
            self._manager = _orbax.make_manager(self._directory, self._max_to_keep, create=True)
            self._writable = True
        return self._manager

    def _recover_overwrites(self) -> None:
        """Finish what a crash during ``save(..., overwrite=True)`` left behind."""
        if self._directory.is_dir():
            _orbax.on_primary("recover_overwrites", self._recover_on_primary)

    def _recover_on_primary(self) -> None:
        for aside in self._directory.glob(f"{_ASIDE_PREFIX}*"):
            step_dir = self._directory / aside.name.removeprefix(_ASIDE_PREFIX)
            if step_dir.exists():
                shutil.rmtree(aside)  # the replacement was committed
            else:
                aside.rename(step_dir)  # the replacement never was: keep the original

    # -- listing -----------------------------------------------------------------

    def list_steps(self) -> list[int]:
        """Every stored step, ascending (an empty list before the first save)."""
        manager = self._reader()
        return [] if manager is None else sorted(manager.all_steps())

    def latest_step(self) -> int | None:
        """The highest stored step, or None when the store is empty."""
        steps = self.list_steps()
        return steps[-1] if steps else None

    def best_step(self, metric: str, *, mode: Literal["min", "max"] = "min") -> int | None:
        """The kept step with the lowest (``"min"``) or highest (``"max"``) ``metric``.

        Steps without the metric, or where it is NaN, are skipped; ties go to the
        latest step. Only kept steps count: retention is by recency.

        Returns:
            The step, or None when the store is empty.

        Raises:
            ValueError: ``mode`` is not "min" or "max", or no stored step records
                ``metric``.
        """
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        steps = self.list_steps()
        if not steps:
            return None
        scored = [(m.metrics[metric], s) for s in steps if metric in (m := self.read_metadata(s)).metrics]
        scored = [(value, s) for value, s in scored if not math.isnan(value)]
        if not scored:
            recorded = sorted({name for s in steps for name in self.read_metadata(s).metrics})
            raise ValueError(
                f"no checkpoint in {self._directory} records a value for metric {metric!r}; "
                f"recorded metrics: {', '.join(recorded) or 'none'}"
            )
        sign = 1 if mode == "min" else -1
        return min(scored, key=lambda vs: (sign * vs[0], -vs[1]))[1]

    def _require(self, step: int) -> Any:
        step = _check_step(step)
        manager = self._reader()
        if manager is not None:
            manager.wait_until_finished()  # a pending step is read once it is committed
        if manager is None or step not in manager.all_steps():
            raise CheckpointNotFoundError(step, self._directory, self.list_steps())
        return manager

    def _step_path(self, step: int) -> pathlib.Path:
        return self._directory / str(step)

    # -- saving ------------------------------------------------------------------

    def save(
        self,
        step: int,
        items: Mapping[str, Any],
        *,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        producer: Producer | None = None,
        extra: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        blocking: bool = True,
    ) -> pathlib.Path:
        """Write ``items`` as ``step``; return the step's directory once it is committed
        (with ``blocking=False``: once the state is on the host; the directory
        appears when the background write commits it).

        Everything is validated before anything is written; a refused save leaves
        the store exactly as it was. An overwrite keeps the old step (set aside)
        until the new one is committed. The caller's objects are never modified.

        Args:
            step: A non-negative int, above the latest stored step (or equal to an
                existing step with ``overwrite=True``).
            items: Named pytrees: ``model``, ``optimizer``, ``rng``,
                ``data_iterator``, ``extensions`` (any non-empty subset). Pass NNX
                objects as ``nnx.state(obj)``.
            epoch: The epoch, recorded in the metadata.
            metrics: Scalar metrics by name (``best_step`` ranks by these).
            producer: The program writing the checkpoint.
            extra: JSON data (str keys) such as the run's config; may not reuse a
                metadata field name.
            overwrite: Replace ``step`` if it is already stored (always waits
                for the replacement to be committed).
            blocking: ``False`` returns before the step is written; see
                :meth:`wait_until_finished`.

        Returns:
            The step directory.

        Raises:
            ValueError: Bad step, empty ``items``, unknown item name, reserved or
                non-JSON ``extra``, bad metrics or epoch.
            UnsupportedValueError: A leaf Orbax cannot store exactly.
            KeyPathError: Two leaves would share one Orbax name.
            CheckpointNotWrittenError: ``reason`` ``"exists"``, ``"below_latest"``
                or ``"rejected"``.
        """
        step = _check_step(step)
        names = _check_items(items)
        ordered = {name: items[name] for name in names}
        record = _new_metadata(step, names, epoch, metrics, producer, extra)
        args = _orbax.save_args(ordered, record.to_dict(), dtype_record(ordered))
        if self._directory.is_dir():
            self._writer()  # recover an interrupted overwrite before judging the step
        exists = self._refuse_write(step, overwrite)
        manager = self._writer()
        with self._write_failures(step):
            if exists:
                self._replace(manager, step, args)
            else:
                self._write(manager, step, args)
            self._metadata = {s: m for s, m in self._metadata.items() if s != step and s in manager.all_steps()}
            if blocking:
                manager.wait_until_finished()
        return self._step_path(step)

    @contextlib.contextmanager
    def _write_failures(self, step: int | None) -> Iterator[None]:
        """Orbax's own write failures (tensorstore's ``ValueError`` for a full disk,
        ``OSError`` ...) become :class:`CheckpointWriteError` naming the store."""
        try:
            yield
        except NnxSaveError:
            raise
        except Exception as e:
            raise CheckpointWriteError(step if step is not None else -1, self._directory, e) from e

    def _refuse_write(self, step: int, overwrite: bool) -> bool:
        """Raise if ``step`` may not be written; return whether it already exists."""
        steps = self.list_steps()
        latest = steps[-1] if steps else None
        if step in steps and not overwrite:
            raise CheckpointNotWrittenError(step, latest, "exists", self._directory)
        if step not in steps and latest is not None and step < latest:
            raise CheckpointNotWrittenError(step, latest, "below_latest", self._directory)
        return step in steps

    def _write(self, manager: Any, step: int, args: Any) -> None:
        latest = self.latest_step()
        try:
            written = manager.save(step, args=args)
        except _orbax.StepAlreadyExistsError:
            raise CheckpointNotWrittenError(step, latest, "exists", self._directory) from None
        if not written:
            raise CheckpointNotWrittenError(step, latest, "rejected", self._directory)

    def _replace(self, manager: Any, step: int, args: Any) -> None:
        step_dir, aside = self._step_path(step), self._directory / f"{_ASIDE_PREFIX}{step}"
        manager.wait_until_finished()  # the step being replaced may still be in flight
        _orbax.on_primary("set_aside", lambda: step_dir.rename(aside))
        manager.reload()
        try:
            manager.save(step, args=args, force=True)
            manager.wait_until_finished()  # the old step goes only once its replacement is committed
        except BaseException:
            if _orbax.is_primary() and not step_dir.exists():
                aside.rename(step_dir)
            manager.reload()
            raise
        _orbax.on_primary("drop_aside", lambda: shutil.rmtree(aside))
        manager.reload()  # Orbax appends the step last; re-read the sorted list

    # -- reading -----------------------------------------------------------------

    def read_metadata(self, step: int) -> CheckpointMetadata:
        """The metadata record of ``step``, validated.

        Raises:
            CheckpointNotFoundError: ``step`` is not stored.
            UnsupportedCheckpointError: The step is not an nnx_save checkpoint this
                version can read (no record, another format, a newer version, a
                malformed record).
        """
        manager = self._require(step)
        if step not in self._metadata:
            self._metadata[step] = self._load_metadata(manager, step)
        return self._metadata[step]

    def _load_metadata(self, manager: Any, step: int) -> CheckpointMetadata:
        held = _orbax.held_items(manager, step)
        if METADATA_ITEM not in held:
            raise UnsupportedCheckpointError(
                f"no nnx_save metadata record (Orbax items: {', '.join(sorted(held)) or 'none'})",
                step=step,
                directory=self._directory,
            )
        try:
            record = CheckpointMetadata.from_dict(_orbax.read_json(manager, step, METADATA_ITEM))
        except UnsupportedCheckpointError as error:
            raise UnsupportedCheckpointError(error.found, step=step, directory=self._directory) from None
        if record.step != step or not set(record.items) <= held:
            raise UnsupportedCheckpointError(
                f"a record for step {record.step} naming items {list(record.items)} "
                f"(Orbax items: {', '.join(sorted(held))})",
                step=step,
                directory=self._directory,
            )
        return record

    def restore(
        self,
        step: int,
        *,
        templates: Mapping[str, Any] | None = None,
        cast_dtypes: bool = False,
        items: Iterable[str] | None = None,
    ) -> Checkpoint:
        """Read ``step``. Items with a template come back in its structure, on its
        shardings; items without one come back as stored (nested dicts and lists,
        string keys, the stored shardings).

        Args:
            step: The step to read.
            templates: Per item, a pytree of arrays or ``jax.ShapeDtypeStruct``
                (plus Python leaves) matching the stored paths and shapes, e.g.
                ``nnx.state(model)`` or ``nnx.state(nnx.eval_shape(...))``. Every
                array is placed on its template leaf's sharding, whatever topology
                wrote it (a struct without a sharding goes to the default device).
            cast_dtypes: Accept arrays whose dtype differs from the saved one.
            items: Restore only these items (default: all the step holds).

        Returns:
            The :class:`Checkpoint`.

        Raises:
            CheckpointNotFoundError: ``step`` is not stored.
            UnsupportedCheckpointError: See :meth:`read_metadata`.
            ValueError: ``templates`` or ``items`` name an unknown item.
            CheckpointItemError: They name an item the step does not hold.
            CheckpointTemplateError: A template's paths or shapes disagree with the
                checkpoint (raised before reading any array).
            CheckpointDtypeMismatchError: A dtype differs and ``cast_dtypes`` is off
                (before reading for templates; after reading otherwise).
        """
        metadata = self.read_metadata(step)
        templates = dict(templates or {})
        names = _restore_names(metadata, templates, items)
        manager = self._reader()
        stored = _orbax.stored_trees(manager, step, names)
        saved = self._saved_dtypes(manager, step, stored)
        plan = {
            name: (templates[name], _orbax.template_restore_args(name, templates[name]))
            if name in templates
            else (None, _orbax.stored_restore_args(stored[name]))
            for name in names
        }
        _check_templates(step, {n: templates[n] for n in names if n in templates}, stored, saved, cast_dtypes)
        restored = _orbax.restore_items(manager, step, plan)
        if not cast_dtypes:
            _check_restored(step, {n: restored[n] for n in names if n not in templates}, saved)
        return Checkpoint(step, restored, metadata, self._step_path(step))

    def _saved_dtypes(self, manager: Any, step: int, stored: Mapping[str, Any]) -> dict[str, dict[Path, str]]:
        """The dtype record, or (for checkpoints without one) Orbax's array metadata."""
        if DTYPES_ITEM in _orbax.held_items(manager, step):
            try:
                record = parse_dtype_record(_orbax.read_json(manager, step, DTYPES_ITEM))
            except UnsupportedCheckpointError as error:
                raise UnsupportedCheckpointError(error.found, step=step, directory=self._directory) from None
            absent = sorted(set(stored) - set(record))
            if absent:
                raise UnsupportedCheckpointError(
                    f"a dtype record without items {absent}", step=step, directory=self._directory
                )
            return {name: record[name] for name in stored}
        return {
            name: {path: spec.dtype for path, spec in _orbax.stored_specs(tree).items() if spec is not None}
            for name, tree in stored.items()
        }

    # -- deleting ----------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Delete ``step`` from disk.

        Raises:
            CheckpointNotFoundError: ``step`` is not stored.
        """
        self._require(step)
        self._writer().delete(step)
        self._metadata.pop(step, None)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def _check_items(items: Mapping[str, Any]) -> tuple[str, ...]:
    """The item names in canonical order, after validating every leaf."""
    if not isinstance(items, Mapping) or not items:
        raise ValueError(f"items must be a non-empty mapping of {', '.join(ITEM_NAMES)}, got {items!r}")
    for name, tree in items.items():
        check_item(name, tree)
    return tuple(name for name in ITEM_NAMES if name in items)


def _new_metadata(
    step: int,
    names: tuple[str, ...],
    epoch: int | None,
    metrics: Mapping[str, Any] | None,
    producer: Producer | None,
    extra: Mapping[str, Any] | None,
) -> CheckpointMetadata:
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        raise ValueError(f"epoch must be a non-negative int or None, got {epoch!r}")
    if producer is not None and not isinstance(producer, Producer):
        raise ValueError(f"producer must be a Producer(name, version) or None, got {producer!r}")
    return CheckpointMetadata(
        step=step,
        items=names,
        epoch=epoch,
        metrics=check_metrics(metrics),
        extra=check_extra(extra),
        producer=producer,
        library_versions=library_versions(),
        created_at=utc_now(),
    )


def _restore_names(
    metadata: CheckpointMetadata, templates: Mapping[str, Any], items: Iterable[str] | None
) -> list[str]:
    wanted = list(metadata.items if items is None else items)
    for name in [*wanted, *templates]:
        if name not in ITEM_NAMES:
            raise ValueError(f"unknown item name {name!r}; expected one of {', '.join(ITEM_NAMES)}")
    unused = sorted(set(templates) - set(wanted))
    if unused:
        raise ValueError(f"templates given for {unused}, which items={wanted} does not restore")
    absent = [name for name in wanted if name not in metadata.items]
    if absent:
        raise CheckpointItemError(metadata.step, absent, metadata.items)
    return [name for name in metadata.items if name in wanted]


def _check_templates(
    step: int,
    templates: Mapping[str, Any],
    stored: Mapping[str, Any],
    saved: Mapping[str, Mapping[Path, str]],
    cast_dtypes: bool,
) -> None:
    """Compare templates with the checkpoint; raise before any array is read."""
    flat = {name: flatten(tree) for name, tree in templates.items()}
    problems = [p for name in flat for p in template_problems(name, flat[name], _orbax.stored_specs(stored[name]))]
    if problems:
        raise CheckpointTemplateError(step, problems)
    mismatches = [m for name in flat for m in dtype_mismatches(name, flat[name], saved[name])]
    if mismatches and not cast_dtypes:
        raise CheckpointDtypeMismatchError(step, mismatches, before_read=True)


def _check_restored(step: int, restored: Mapping[str, Any], saved: Mapping[str, Mapping[Path, str]]) -> None:
    """Compare items restored without a template with the saved dtypes."""
    mismatches = [m for name, tree in restored.items() for m in dtype_mismatches(name, flatten(tree), saved[name])]
    if mismatches:
        raise CheckpointDtypeMismatchError(step, mismatches, x64_off=explained_by_x64(mismatches))
