"""A store's directory as every process sees it: its steps, the damaged ones, the recorded
retention. Every decision goes through :func:`._agree.agree` or :func:`._orbax.on_primary`."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from etils import epath

from ..errors import DirectoryLockedError, OptionError, SourceChangedError
from ..io import _storage
from ..layouts._registry import owners
from . import _orbax
from ._agree import agree
from ._errors import CheckpointDamageWarning, CheckpointNotFoundError, CheckpointUsageError, UnsupportedCheckpointError
from ._format import METADATA_ITEM
from ._health import DirectoryView, read_json, scan
from ._metadata import check_step, is_number
from ._retention import STORE_RECORD, Retention, StepInfo, age_s, doomed, parse_record, record_json

__all__ = ["ASIDE_PREFIX", "RETIRED_PREFIX", "Disk", "unchanged_step"]

R = TypeVar("R")

# A step being overwritten is renamed to this (plus the step) until its replacement
# is complete, so a crash mid-overwrite never loses the step.
ASIDE_PREFIX = ".nnx_save-overwriting-"
# A step that retention lets go is renamed to this (plus the step) first, then deleted:
# a crash mid-delete leaves a hidden leftover (removed on the next open for writing),
# never a half-deleted step that lists as damaged.
RETIRED_PREFIX = ".nnx_save-deleting-"

# The entries the store (or Orbax for it) renames or deletes: steps, set-aside and
# retired steps, Orbax's temporary step directories.
_MANAGED = re.compile(
    rf"[0-9]+|{re.escape(ASIDE_PREFIX)}.*|{re.escape(RETIRED_PREFIX)}.*|.*\.orbax-checkpoint-tmp.*", re.DOTALL
)


@dataclasses.dataclass
class Disk:
    """The directory of one store, its view and its retention policies."""

    path: epath.Path
    given: Retention | None
    change_retention: bool = False
    view: DirectoryView | None = None
    recorded: Retention | None = None
    warned: bool = False
    writer: _storage.Lock | None = None  # process 0's, from the store's first write until it closes

    def __post_init__(self) -> None:
        local = self.location.directory  # None for a bucket: nothing is touched before the first use
        if local is not None and local.exists() and not local.is_dir():
            raise OptionError(f"checkpoint directory {self.path} exists and is not a directory")

    @property
    def location(self) -> _storage.Location:
        """Where the store's own records and lock live (:mod:`nnx_save.io._storage`)."""
        return _storage.locate(str(self.path))

    def load(self) -> DirectoryView:
        """The view, looked at (by process 0) the first time it is needed."""
        if self.view is None:
            self._adopt(agree("open", self._look))
        assert self.view is not None
        return self.view

    def forget(self) -> None:
        """Look at the directory again at the next :meth:`load`."""
        self.view = None

    def _look(self) -> dict[str, Any]:
        record = self.path / STORE_RECORD
        try:
            text = record.read_text() if record.exists() else None
        except (OSError, UnicodeDecodeError) as error:  # a directory, or another tool's bytes, under its name
            text = f"<{type(error).__name__}: {error}>"
        return {"view": scan(self.path).to_json(), "record": text}

    def refuse_foreign_step(self, step: int) -> None:
        """Refuse to write step ``step`` over what is not a step this store wrote under its name
        (a file, or a directory without the step's record), decided on process 0.

        Raises:
            CheckpointUsageError: ``reason="directory"``, naming the entry; nothing was written.
        """

        def look() -> str | None:
            step_dir = self.path / str(step)
            if not step_dir.exists() or (step_dir / METADATA_ITEM).is_dir():
                return None
            return "a directory without a step record" if step_dir.is_dir() else "not a directory"

        foreign = agree("foreign step", look)
        if foreign is not None:
            where = self.path / str(step)
            raise CheckpointUsageError(
                f"{where}: is {foreign}, not a step this store wrote; saving step {step} would replace it, "
                "so nothing was written: move it away, or save at another step",
                "directory",
                step=step,
                directory=str(self.path),
                entry=str(where),
            )

    def identity(self, step: int) -> tuple[int, int] | None:
        """Which directory holds step ``step`` now (device, inode); None: none (or a URL)."""
        if self.location.directory is None:
            return None
        try:
            st = os.stat(os.fspath(self.path / str(step)))
        except OSError:
            return None
        return st.st_dev, st.st_ino

    @contextlib.contextmanager
    def unchanged(self, step: int) -> Iterator[None]:
        """Run a read of step ``step``; if the step was deleted or replaced meanwhile (by
        another process: a writer's retention, an overwrite), raise that, typed, instead of
        the read's own error or result.

        One process only: in a job of several, each could see the directory differently.

        Raises:
            CheckpointNotFoundError: The step was deleted while it was read.
            SourceChangedError: The step was replaced while it was read (nothing of the mix
                is returned).
        """
        if _orbax.process_count() > 1:  # the processes could see it differently: Orbax's own errors
            yield
            return
        before = self.identity(step)
        try:
            yield
        except Exception as error:  # any failure of a read whose step changed is that change (Orbax's KeyError too)
            self._refuse_changed(step, before, error)
            raise
        self._refuse_changed(step, before, None)

    def _refuse_changed(self, step: int, before: tuple[int, int] | None, error: BaseException | None) -> None:
        after = self.identity(step)
        if self.location.directory is None or (after == before and before is not None):
            return  # the same step directory from start to end: the read's own result or error stands
        self.forget()
        where = self.path / str(step)
        if after is None:
            held = scan(self.path).steps
            raise CheckpointNotFoundError(step, self.path, held) from error
        raise SourceChangedError(
            f"{where}: step {step} was replaced while it was read (saved again with overwrite=True); "
            "nothing of the mix is returned: restore it again",
            str(where),
        ) from error

    def _adopt(self, data: Mapping[str, Any]) -> None:
        # Checked before the view is kept, so a refused store stays refused on every call.
        try:
            recorded = None if data["record"] is None else parse_record(data["record"])
        except UnsupportedCheckpointError as error:
            raise UnsupportedCheckpointError(error.found, directory=self.path) from None
        given = self.given
        if recorded is not None and given is not None and given != recorded and not self.change_retention:
            raise CheckpointUsageError.for_retention(recorded.describe(), given.describe(), self.path)
        self.view, self.recorded = DirectoryView.from_json(data["view"]), recorded

    @property
    def retention(self) -> Retention:
        """The policies in force: the ones given, else the recorded ones, else the default."""
        self.load()
        return self.given or self.recorded or Retention()

    def intact(self) -> list[int]:
        """Undamaged steps, ascending; warns once per store when some are damaged."""
        view = self.load()
        if view.damaged and not self.warned:
            self.warned = True
            lines = "; ".join(f"step {s}: {p}: {why}" for s, (p, why) in sorted(view.damaged.items()))
            warnings.warn(
                f"{self.path}: {len(view.damaged)} damaged steps are left out of list_steps(): {lines}",
                CheckpointDamageWarning,
                stacklevel=4,
            )
        return view.intact

    # -- changes, made on process 0 ------------------------------------------------

    def lock(self, what: str) -> None:
        """Become the directory's one writer (process 0 holds the lock for the job), or raise
        :class:`DirectoryLockedError` on every process; a directory that holds another layout's
        checkpoint raises :class:`CheckpointUsageError` on every process (decided on process 0). The
        lock is the location's (:meth:`~nnx_save.io._storage.Location.hold`: none on an object store)."""
        foreign = agree("layout", self._foreign)
        if foreign is not None:
            raise CheckpointUsageError.for_layout(str(self.path), foreign)
        holder = agree("lock", lambda: self._try_lock(what))
        if holder is not None:
            raise DirectoryLockedError(str(self.path), holder)

    def _names(self) -> set[str]:
        """The names in the store's directory (listed as Orbax lists it, on a filesystem or a bucket)."""
        return {p.name for p in self.path.iterdir()} if self.path.is_dir() else set()

    def _foreign(self) -> str | None:
        """What makes the directory another layout's checkpoint (an HF index, a pod manifest,
        ``.safetensors`` files: :func:`~nnx_save.layouts._registry.owners`), or ``None``: the
        store refuses to write its steps beside it."""
        found = owners(self.location, self._names())
        return next((owner.what for owner in found if owner.kind in ("pod", "index", "files")), None)

    def _try_lock(self, what: str) -> str | None:
        try:
            self.writer = self.location.hold(what)
        except DirectoryLockedError as error:
            return error.holder
        return None

    def release(self) -> None:
        """Give the writer's lock up (idempotent)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.release()

    def open_for_writing(self) -> None:
        """Finish an interrupted overwrite, record the retention policies, look again."""
        self.load()
        _orbax.on_primary("recover_overwrites", self._recover)
        retention = self.retention
        if retention != self.recorded:
            _orbax.on_primary("record_retention", lambda: self._record(retention))
        self.view = None
        self.load()

    def _recover(self) -> None:
        if not self.path.is_dir():
            return
        for retired in self.path.glob(f"{RETIRED_PREFIX}*"):
            retired.rmtree()  # its step was already gone from the directory
        for aside in self.path.glob(f"{ASIDE_PREFIX}*"):
            step_dir = self.path / aside.name.removeprefix(ASIDE_PREFIX)
            if step_dir.exists():
                aside.rmtree()  # the replacement was committed
            else:
                aside.rename(step_dir)  # the replacement never was: keep the original

    def _record(self, retention: Retention) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.location.replace(STORE_RECORD, record_json(retention).encode())

    def refuse_links(self) -> None:
        """Raise :class:`CheckpointUsageError` when an entry the store may rename or
        delete is a symbolic link (decided on process 0), before anything changes."""
        links = agree("links", self._links)
        if links:
            name, target = links[0]
            raise CheckpointUsageError.for_link(str(self.path / name), target, str(self.path))

    def _links(self) -> list[list[str]]:
        location = self.location
        names = sorted(n for n in self._names() if _MANAGED.fullmatch(n))
        return [[n, target] for n in names if (target := location.link_target(n)) is not None]

    def doomed(self) -> list[int]:
        """The intact steps the retention policies let go, decided on process 0."""
        retention = self.retention
        if retention == Retention.keep_all():
            return []
        return agree("retention", lambda: doomed(retention, self._infos(self.load().intact, retention)))

    def _infos(self, steps: list[int], retention: Retention) -> list[StepInfo]:
        if retention.best is None and retention.newer_than is None:  # they rank by step alone: no record read
            return [StepInfo(step, {}, 0.0) for step in steps]
        now = datetime.datetime.now(datetime.UTC)
        infos = []
        for step in steps:
            record, _ = read_json(self.path / str(step) / METADATA_ITEM / "metadata")
            record = record if isinstance(record, dict) else {}
            metrics = {k: float(v) for k, v in (record.get("metrics") or {}).items() if is_number(v)}
            infos.append(StepInfo(step, metrics, age_s(record.get("created_at", ""), now)))
        return infos

    def changed(self, step: int, *, saved: bool) -> None:
        """``step`` was saved (or replaced) or else deleted by this store, on every process."""
        view = self.load()
        steps = {*view.steps, step} if saved else set(view.steps) - {step}
        damaged = {s: d for s, d in view.damaged.items() if s != step}
        self.view = DirectoryView(view.exists or saved, tuple(sorted(steps)), damaged)

    def retire(self, step: int) -> None:
        """Delete step ``step``'s directory: renamed away first (one atomic step), then
        removed, so a crash in between leaves no half-deleted step behind."""
        retired, step_dir = self.path / f"{RETIRED_PREFIX}{step}", self.path / str(step)
        if step_dir.exists():
            if retired.exists():  # left by a crash while this step number was deleted before
                retired.rmtree()
            step_dir.rename(retired)
        if retired.exists():
            retired.rmtree()


def unchanged_step(restore: Callable[..., R]) -> Callable[..., R]:
    """A store's ``restore(step, **options)``, raising typed when its step is deleted or
    replaced while it is read (:meth:`Disk.unchanged`): never a mix, never Orbax's error."""

    @functools.wraps(restore)
    def run(store: Any, step: int | None = None, **options: Any) -> R:
        step = store._latest_or(None if step is None else check_step(step))
        with store._disk.unchanged(step):
            return restore(store, step, **options)

    return run
