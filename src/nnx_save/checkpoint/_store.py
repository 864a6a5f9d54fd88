"""The Orbax implementation of :class:`CheckpointStore`: strict writes, guarded reads."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Self

import jax
from etils import epath

from ..errors import OptionError
from ..load._source import gc_paused
from . import _exit, _local, _orbax, _partial, _restore
from ._disk import ASIDE_PREFIX, Disk, unchanged_step
from ._errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointNotWrittenError, CheckpointWriteError
from ._health import load_metadata, typed_failures
from ._metadata import CheckpointMetadata, Producer, check_items, check_step, new_metadata
from ._retention import UNSET, Retention, StepInfo, Unset, given_retention, ranked
from ._schedule import SaveSchedule
from ._store_location import store_location
from ._types import Checkpoint, CheckpointStore

__all__ = ["OrbaxCheckpointStore"]


class OrbaxCheckpointStore:
    """Training checkpoints in ``directory``, one Orbax composite checkpoint per step.

    Each step holds up to five named items (``model``, ``optimizer``, ``rng``,
    ``data_iterator``, ``extensions``), each a pytree of arrays, typed PRNG keys and
    Python values, plus JSON records of its metadata and every array's dtype. A
    background save (``blocking=False``) is waited for, and its error raised, by the next
    read or save, :meth:`wait_until_finished` and :meth:`close`. Nothing is created before
    the first save; restoring never runs code. The first save or delete makes the store
    the directory's one writer until :meth:`close` (reading takes no lock). With several
    processes, every process calls each method in the same order (docs/checkpoints.md
    tells retention, preemption and multi-process use).

    Args:
        directory: The checkpoint directory (relative paths against the working
            directory); see :func:`resolve_checkpoint_dir`.
        max_to_keep: Shorthand for ``retention=Retention(latest=max_to_keep)``;
            None keeps every step.
        retention: The retention policies, applied after each committed save
            (default: the ones recorded at the first save, else the latest 5 steps).
        change_retention: Replace the recorded policies; other policies without it
            raise :class:`CheckpointUsageError`.
        save_interval_steps: :meth:`should_save` is true at steps divisible by this;
            :meth:`save` skips the others (``force=True`` saves), as Orbax's manager.
        save_interval_seconds: :meth:`should_save` is true once this many seconds
            passed since the last save (measured on process 0); :meth:`save` likewise.

    Raises:
        ValueError: ``directory`` is empty, names a file, ``max_to_keep`` < 1, both
            ``max_to_keep`` and ``retention`` are given, or an interval is not positive.

    Examples:
        >>> import jax, jax.numpy as jnp, tempfile
        >>> with OrbaxCheckpointStore(tempfile.mkdtemp(), max_to_keep=2) as store:
        ...     _ = store.save(10, {"model": {"w": jnp.ones(3)}, "rng": jax.random.key(0)},
        ...                    metrics={"loss": 0.5})
        ...     ckpt = store.restore(10)
        ...     print(store.list_steps(), ckpt.items["model"]["w"].dtype, ckpt.metadata.metrics)
        [10] float32 {'loss': 0.5}
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | Unset | None = UNSET,
        retention: Retention | None = None,
        change_retention: bool = False,
        save_interval_steps: int | None = None,
        save_interval_seconds: float | None = None,
    ) -> None:
        self._directory = store_location("directory", directory)
        self._given = given_retention(max_to_keep, retention)
        self._disk = Disk(epath.Path(str(self._directory)), self._given, change_retention)  # refuses a file
        self._schedule = SaveSchedule(save_interval_steps, save_interval_seconds)
        self._manager: Any = None
        self._writable = False
        self._closed = False
        self._metadata: dict[int, CheckpointMetadata] = {}
        self._in_flight: int | None = None  # the step of a save still in flight, if any

    @property
    def directory(self) -> pathlib.Path:
        """The absolute checkpoint directory (it may not exist before the first save)."""
        return self._directory

    @property
    def retention(self) -> Retention:
        """The retention policies in force (given, else recorded, else the default)."""
        self._open()
        return self._disk.retention

    @property
    def max_to_keep(self) -> int | None:
        """How many of the latest steps are kept (``retention.latest``); None: no such limit."""
        return self.retention.latest

    def __repr__(self) -> str:
        given = self._given
        if given is None:
            return f"OrbaxCheckpointStore({str(self._directory)!r})"
        if given == Retention(latest=given.latest):
            return f"OrbaxCheckpointStore({str(self._directory)!r}, max_to_keep={given.latest})"
        return f"OrbaxCheckpointStore({str(self._directory)!r}, retention={given!r})"

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending saves and apply retention, then release Orbax's resources
        (even when a save failed: its error is raised after). Idempotent; any later call
        raises ``OptionError``."""
        manager, self._closed = self._manager, True
        self._schedule.close()
        try:
            if manager is not None:
                try:
                    self._settle(manager)
                finally:  # _settle has marked the pending save landed, even when it raised
                    self._manager = None
                    manager.close()
        finally:
            self._disk.release()  # last: the lock outlives every write of this store

    def _pending_description(self) -> str:
        return f"step {self._in_flight} in {self._directory}"

    def _landed(self) -> None:
        self._in_flight = None
        _exit.finished(self)

    def wait_until_finished(self) -> None:
        """Wait until every pending save is committed (raising the error of one that
        failed), then delete the steps retention lets go."""
        if self._manager is not None:
            self._settle(self._manager)

    def _settle(self, manager: Any) -> None:
        try:
            with self._write_failures(manager.latest_step()):
                manager.wait_until_finished()
        except CheckpointWriteError:
            for step in set(self._disk.load().steps) - set(manager.all_steps()):
                self._disk.changed(step, saved=False)  # Orbax dropped the step it failed to write, on every process
            raise
        finally:
            self._landed()
        if self._writable:
            doomed = self._disk.doomed()
            for step in doomed:
                self._retire(step)
            if doomed:
                manager.reload()  # Orbax forgets the steps retired behind its back

    def _open(self) -> None:
        if self._closed:
            raise OptionError(f"{self!r} is closed")
        self._disk.load()

    def reload(self) -> None:
        """Look at the directory again: the steps another process saved or deleted since (a
        store that has not written does at every listing and read in a one-process job; in
        a job of several, call it on every process). The writing store needs none."""
        self._disk.forget()  # before the look: one listing of the directory, not two
        self._open()
        self._metadata.clear()
        if self._manager is not None and not self._writable:
            _orbax.listed(self._manager.reload)

    def _relist(self) -> None:
        self.reload() if not self._writable and jax.process_count() == 1 else self._open()

    def _reader(self) -> Any:
        self._open()
        if self._manager is None and self._disk.load().exists:
            self._manager = _orbax.listed(lambda: _orbax.make_manager(self._directory, create=False))
        return self._manager

    def _writer(self) -> Any:
        self._open()
        if not self._writable:
            self._disk.lock(type(self).__name__)  # first: recovery and Orbax's clean-up act for the one writer
            if self._manager is not None:
                self._manager.close()
                self._manager = None
            self._disk.open_for_writing()
            self._manager = _orbax.make_manager(self._directory, create=True)
            self._writable = True
        return self._manager

    # -- when to save ------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether the loop should save ``step`` now: at a preemption (``SIGTERM``), else
        by the intervals (with none, every step); a stored step is never due. Call it at
        every step, on every process; check :attr:`preemption_requested` after saving.

        Examples:
            >>> import tempfile
            >>> store = OrbaxCheckpointStore(tempfile.mkdtemp(), save_interval_steps=50)
            >>> [s for s in range(1, 201) if store.should_save(s)]
            [50, 100, 150, 200]
            >>> store.close()
        """
        step = check_step(step)
        self._open()
        due = self._schedule.due(step)  # first, on every step: the preemption sync point counts calls
        steps = self._disk.load().steps
        return due and not (steps and step <= steps[-1])

    @property
    def preemption_requested(self) -> bool:
        """True once a preemption was seen: save the step :meth:`should_save` names, then stop."""
        return self._schedule.preemption_requested

    # -- listing -----------------------------------------------------------------

    def list_steps(self) -> list[int]:
        """Every stored, undamaged step, ascending; damaged steps are left out, with a
        :class:`CheckpointDamageWarning` (once per store)."""
        self._relist()
        return self._disk.intact()

    def latest_step(self) -> int | None:
        """The highest stored undamaged step, or None when there is none."""
        steps = self.list_steps()
        return steps[-1] if steps else None

    def damaged_steps(self) -> dict[int, CheckpointCorruptError]:
        """The damaged steps (an unreadable record, an item without its directory or
        ``_METADATA``), each with the error reading it raises; truncated array files are
        found only when the step is read."""
        self._relist()
        view = self._disk.load()
        return {step: view.corrupt_error(step) for step in sorted(view.damaged)}

    def all_steps(self) -> list[int]:
        """Orbax ``CheckpointManager``'s name for :meth:`list_steps`."""
        return self.list_steps()

    def best_step(self, metric: str | None = None, *, mode: Literal["min", "max"] | None = None) -> int | None:
        """The kept step with the lowest (``"min"``) or highest (``"max"``) ``metric``;
        steps without it (or NaN) are skipped, ties go to the latest step.

        Args:
            metric: The recorded metric to rank by; default: the one the retention
                policies rank by (``Retention(best=..., metric=...)``).
            mode: ``"min"`` or ``"max"``; default: the retention's mode when the
                metric is the retention's default, else ``"min"``.

        Returns:
            The step, or None when the store is empty.

        Raises:
            OptionError: ``mode`` is not "min" or "max", no metric is given and the
                retention ranks by none, or no stored step records ``metric``.
        """
        name, order = self._ranking(metric, mode)
        steps = self.list_steps()
        if not steps:
            return None
        infos = [StepInfo(s, self._record(s).metrics, 0.0) for s in steps]
        best = ranked(infos, name, order)
        if not best:
            recorded = sorted({name for info in infos for name in info.metrics})
            raise OptionError(
                f"no checkpoint in {self._directory} records a value for metric {name!r}; "
                f"recorded metrics: {', '.join(recorded) or 'none'}"
            )
        return best[0]

    def _ranking(self, metric: str | None, mode: str | None) -> tuple[str, str]:
        """The metric and mode :meth:`best_step` ranks by, defaults from the retention."""
        if mode not in (None, "min", "max"):
            raise OptionError(f"mode must be 'min' or 'max', got {mode!r}", "mode")
        retention = self.retention
        if metric is None:
            if retention.metric is None:
                raise OptionError(
                    f"best_step() needs a metric: the retention of {self._directory} ({retention.describe()}) "
                    "ranks by none; pass best_step('loss'), or keep the best steps with "
                    "Retention(best=K, metric='loss')",
                    "metric",
                )
            metric, mode = retention.metric, mode or retention.mode
        return metric, mode or "min"

    def _require(self, step: int, *, damaged_ok: bool = False) -> None:
        """Raise unless ``step`` is stored (and undamaged, unless ``damaged_ok``), once pending saves landed."""
        step = check_step(step)
        manager = self._reader()
        if manager is not None:
            manager.wait_until_finished()  # a pending step is read once it is committed
        view = self._disk.load()
        if step in view.damaged and not damaged_ok:
            raise view.corrupt_error(step)
        if manager is None or step not in view.steps:
            raise CheckpointNotFoundError(step, self._directory, self.list_steps())

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
        force: bool = False,
    ) -> pathlib.Path | None:
        """Write ``items`` as ``step``; return the step's directory once it is committed.

        With a save interval, a step that is not due (as :meth:`should_save` answers) is
        skipped and None returned, as Orbax's manager does; ``force`` or ``overwrite`` saves.

        Everything is validated first: a refused save leaves the store as it was, and an
        overwrite keeps the old step until the new one is committed. Then retention runs.
        The caller's objects are never modified.

        Args:
            step: A non-negative int, above the latest stored step (or equal to an
                existing step with ``overwrite=True``).
            items: Named pytrees: ``model``, ``optimizer``, ``rng``,
                ``data_iterator``, ``extensions`` (any non-empty subset). Pass NNX
                objects as ``nnx.state(obj)``.
            epoch: The epoch, recorded in the metadata.
            metrics: Scalar metrics by name (``best_step`` and retention rank by these).
            producer: The program writing the checkpoint.
            extra: JSON data (str keys), such as the run's config; not a metadata field name.
            overwrite: Replace ``step`` if it is already stored (always blocking).
            blocking: ``False`` returns once the state is on the host; Orbax writes
                the step in the background (see the class docstring).
            force: Save even when the intervals say the step is not due.

        Returns:
            The step directory, or None when the step was not due and was skipped.

        Raises:
            OptionError: Bad step, empty ``items``, unknown item name, reserved or
                non-JSON ``extra``, bad metrics or epoch (also a ``ValueError``).
            UnsupportedValueError: A leaf Orbax cannot store exactly.
            KeyPathError: Two leaves would share one Orbax name.
            CheckpointNotWrittenError: ``reason`` ``"exists"``, ``"below_latest"``
                or ``"rejected"``.
            DirectoryLockedError: Another live writer holds the directory (named).
        """
        step = check_step(step)
        if not (force or overwrite or self._schedule.lets_save(step)):
            return None
        with gc_paused():  # the guards, the records, the directory's view: many small objects, no cycles
            names, dtypes = check_items(items)  # one pass over the leaves: the guards and the dtype record
            ordered = _local.globalised({name: items[name] for name in names})  # host-local: written once
            record = new_metadata(step, names, epoch, metrics, producer, extra)
            args = _orbax.save_args(ordered, record.to_dict(), dtypes)
            self._open()
            self._disk.refuse_links()  # every call: the directory may have changed since the last one
            opening = not self._writable  # opening for writing looks at the directory last
            manager = self._writer()  # every process, every time: no branch on what one process sees
            if self._in_flight is None and not opening:
                self._disk.forget()  # the refusal reads the disk, not what this store saw (in flight: not there yet)
            exists = self._refuse_write(step, overwrite)
        self._settle(manager)
        with self._write_failures(step):
            if exists:
                self._replace(manager, step, args)
            else:
                self._write(manager, step, args)
            self._disk.changed(step, saved=True)
            self._metadata.pop(step, None)
            if blocking:
                self._settle(manager)
            else:
                self._in_flight = step
                _exit.pending(self)
        self._schedule.saved()
        return self._step_path(step)

    def _write_failures(self, step: int | None) -> contextlib.AbstractContextManager[None]:
        """Orbax's write failures (tensorstore's ``ValueError`` for a full disk, ``OSError``
        ...) as :class:`CheckpointWriteError`."""
        return typed_failures(lambda e: CheckpointWriteError(-1 if step is None else step, self._directory, e))

    def _refuse_write(self, step: int, overwrite: bool) -> bool:
        """Raise if ``step`` may not be written; return whether it already exists.
        Damaged steps count: they hold the step number until overwritten or deleted."""
        steps = list(self._disk.load().steps)
        latest = steps[-1] if steps else None
        self._disk.refuse_foreign_step(step)
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
        step_dir, aside = self._disk.path / str(step), self._disk.path / f"{ASIDE_PREFIX}{step}"
        manager.wait_until_finished()  # the step being replaced may still be in flight
        _orbax.on_primary("set_aside", lambda: step_dir.rename(aside))
        manager.reload()
        try:
            manager.save(step, args=args, force=True)
            manager.wait_until_finished()  # the old step goes only once its replacement is committed
        except BaseException:
            _orbax.on_primary("put_back", lambda: step_dir.exists() or aside.rename(step_dir))
            manager.reload()
            raise
        _orbax.on_primary("drop_aside", aside.rmtree)
        manager.reload()  # Orbax appends the step last; re-read the sorted list

    # -- reading -----------------------------------------------------------------

    def read_metadata(self, step: int) -> CheckpointMetadata:
        """The metadata record of ``step``, validated.

        Raises:
            CheckpointNotFoundError: ``step`` is not stored.
            CheckpointCorruptError: The step is damaged (the record is not JSON, an
                item's files are missing).
            UnsupportedCheckpointError: The step is not an nnx_save checkpoint this
                version can read (no record, another format, a newer version, a
                record that does not validate).
        """
        self._relist()
        return self._record(step)

    def _record(self, step: int) -> CheckpointMetadata:
        self._require(step)
        if step not in self._metadata:
            self._metadata[step] = load_metadata(self._directory, step)
        return self._metadata[step]

    @unchanged_step
    def restore(
        self,
        step: int | None = None,
        *,
        templates: Mapping[str, Any] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        cast_dtypes: bool = False,
        allow_casts: str | Sequence[str] = (),
        items: Iterable[str] | None = None,
        strict: bool = True,
        allow_missing: Sequence[str] = (),
        allow_unexpected: Sequence[str] = (),
        allow_shape_mismatch: Sequence[str] = (),
    ) -> Checkpoint:
        """Read ``step``. Items with a template come back in its structure, on its
        shardings; items without one as stored (nested dicts and lists, string keys).
        Leaves excused by ``strict=False`` or ``allow_*`` are not read and keep the
        template's value; ``checkpoint.report`` lists them as ``load_model``'s does.

        Args:
            step: The step to read (None, the default: the latest step).
            templates: Per item, a pytree of arrays or ``jax.ShapeDtypeStruct``
                (plus Python leaves), e.g. ``nnx.state(model)`` or
                ``nnx.state(nnx.eval_shape(...))``. Every array is placed on its
                template leaf's sharding, whatever topology wrote it (a struct
                without a sharding goes to the default device).
            mesh: The devices for template shardings on an abstract mesh (what
                ``nnx.eval_shape`` under ``jax.set_mesh`` gives); default: the mesh
                ``jax.set_mesh`` put in scope.
            cast_dtypes: Accept every dtype change (arrays and Python leaves).
            allow_casts: The casts accepted, as for ``load_model``: ``"lossless"``
                (array casts that cannot change a value, bfloat16 -> float32) or
                patterns over ``item/leaf`` paths; the others are refused.
            items: Restore only these items (default: all the step holds).
            strict: Refuse (before reading) any missing, unexpected or reshaped
                leaf not allowed below; ``False`` warns once (``LoadWarning``).
            allow_missing: Glob or regex patterns over ``item/leaf`` paths
                (``"model/head/*"``): template leaves the step may lack.
            allow_unexpected: Patterns: stored leaves the template may leave out.
            allow_shape_mismatch: Patterns: leaves whose stored shape may differ.

        Returns:
            The :class:`Checkpoint`, with its ``report``.

        Raises:
            CheckpointNotFoundError: ``step`` is not stored (or, for None, no step is).
            CheckpointCorruptError: The step is damaged (found before reading, or
                an array file is truncated or unreadable).
            ShardingError: A template sharding is on an abstract mesh and no mesh
                with its axes is given or in scope.
            UnsupportedCheckpointError: See :meth:`read_metadata`.
            OptionError: ``templates`` or ``items`` name an unknown item.
            CheckpointUsageError: They name an item the step does not hold.
            CheckpointUsageError: A template's paths or shapes disagree with the
                step under ``strict`` (a leaf's kind: always), before any read.
            CheckpointDtypeMismatchError: A dtype differs and neither ``allow_casts``
                nor ``cast_dtypes`` accepts it.
        """
        with gc_paused():  # the records: many small objects, no cycles
            step = self._latest_or(step)
            metadata = self.read_metadata(step)
        options = _partial.PartialOptions(
            strict, tuple(allow_missing), tuple(allow_unexpected), tuple(allow_shape_mismatch)
        )
        return _restore.restore_step(
            self._reader, self._directory, step, metadata, templates, mesh, items, (cast_dtypes, allow_casts), options
        )

    def _latest_or(self, step: int | None) -> int:
        """``step``, or for None the latest step (``CheckpointNotFoundError`` when there is none)."""
        if step is not None:
            return step
        latest = self.latest_step()
        if latest is None:
            raise CheckpointNotFoundError(None, self._directory, [])
        return latest

    # -- deleting ----------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Delete ``step`` from disk (a damaged step too).

        Raises:
            CheckpointNotFoundError: ``step`` is not stored.
            DirectoryLockedError: Another live writer holds the directory (named).
        """
        if not self._writable:
            self._disk.forget()  # what the disk holds now, not what this reader saw
        self._require(step, damaged_ok=True)  # before the lock: a missing step creates nothing
        self._disk.refuse_links()  # before anything changes, opening for writing included
        writer = self._writer()  # the one writer deletes
        self._retire(step)
        writer.reload()

    def _retire(self, step: int) -> None:
        """Delete ``step`` (process 0 renames it away, then removes it) and forget it."""
        _orbax.on_primary("retire", functools.partial(self._disk.retire, step))
        self._disk.changed(step, saved=False)
        self._metadata.pop(step, None)


_CONTRACT: type[CheckpointStore] = OrbaxCheckpointStore  # mypy checks here that the store keeps the contract
