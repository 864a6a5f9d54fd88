"""The failures of the checkpoint store, each with the fields a caller branches on.

Every class is an :class:`~nnx_save.NnxSaveError` (through :class:`CheckpointError`)
and also the builtin a caller would naturally catch: a refused write is a
``ValueError``, a missing step a ``FileNotFoundError``, a dtype mismatch a
``TypeError`` (through :class:`~nnx_save.errors.DtypeMismatchError`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

from ..errors import DtypeMismatchError, KeyMismatchError, NnxSaveError
from ._format import FORMAT_NAME, FORMAT_VERSION

__all__ = [
    "CheckpointArgumentError",
    "CheckpointCorruptError",
    "CheckpointDamageWarning",
    "CheckpointDirectoryError",
    "CheckpointDtypeMismatchError",
    "CheckpointError",
    "CheckpointItemError",
    "CheckpointLinkError",
    "CheckpointNotFoundError",
    "CheckpointNotWrittenError",
    "CheckpointRetentionError",
    "CheckpointSyncError",
    "CheckpointTemplateError",
    "CheckpointWriteError",
    "DtypeMismatch",
    "UnsupportedCheckpointError",
    "WriteRefusal",
]

WriteRefusal = Literal["exists", "below_latest", "rejected"]

_X64_HINT = (
    "jax's x64 mode is off, so 64-bit arrays come back as 32-bit: enable it with "
    "jax.config.update('jax_enable_x64', True) before restoring"
)


class CheckpointError(NnxSaveError):
    """Base class of every error raised by :mod:`nnx_save.checkpoint`."""


class CheckpointArgumentError(CheckpointError, ValueError):
    """An argument of a store call that is refused (a bad step, item name, epoch,
    metric, ``extra`` value, retention argument); raised before anything is written."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A stored step is damaged: a file is missing, truncated or unreadable. Nothing
    was restored; the other steps are unaffected.

    Attributes:
        step: The damaged step.
        path: The damaged file or directory (inside the step's directory).
        problem: What is wrong with it, in words.
    """

    def __init__(self, step: int, path: str | os.PathLike[str], problem: str) -> None:
        self.step, self.path, self.problem = step, str(path), problem
        super().__init__(f"step {step} is damaged: {self.path}: {problem}")


class CheckpointDamageWarning(UserWarning):
    """Steps of a store are damaged and are left out of ``list_steps`` and ``latest_step``
    (see ``damaged_steps()``)."""


class CheckpointDirectoryError(CheckpointError, ValueError):
    """A checkpoint directory the store cannot use, found before anything runs.

    Attributes:
        directory: The directory or URL as given.
    """

    def __init__(self, directory: str, found: str) -> None:
        self.directory = directory
        super().__init__(
            f"checkpoint directory {directory!r}: {found} is not supported; give a local path, a file:// URL, "
            "or a gs:// or s3:// URL (which Orbax writes through etils epath and tensorstore)"
        )


class CheckpointLinkError(CheckpointError, OSError):
    """An entry of the store's directory that the store may rename or delete (a step,
    a set-aside step, an Orbax temporary) is a symbolic link. The store never follows
    one: it refuses to write or delete before changing anything.

    Attributes:
        entry: The link's path.
        target: Where it points.
        directory: The store's directory.
    """

    def __init__(self, entry: str, target: str, directory: str) -> None:
        self.entry, self.target, self.directory = entry, target, directory
        super().__init__(
            f"{entry}: this entry of the checkpoint store {directory} is a symbolic link (to {target!r}); "
            "the store renames and deletes its entries and never follows a link, so nothing was written "
            "or deleted: move the link out of the directory (or put the real directory in its place)"
        )

    def __str__(self) -> str:  # OSError's own would show the arguments tuple
        return str(self.args[0])


class CheckpointSyncError(CheckpointError, RuntimeError):
    """The processes of a multi-process run could not agree on a decision about the
    store's directory (process 0 failed, did not answer in time, or the processes
    called the store in different orders)."""


class CheckpointRetentionError(CheckpointError, ValueError):
    """The store was opened with other retention policies than the ones recorded in
    its directory; pass ``change_retention=True`` to replace them.

    Attributes:
        recorded: The recorded policies, in words.
        given: The policies asked for, in words.
        directory: The store's directory.
    """

    def __init__(self, recorded: str, given: str, directory: str | os.PathLike[str]) -> None:
        self.recorded, self.given, self.directory = recorded, given, str(directory)
        super().__init__(
            f"{directory} keeps steps by {recorded}, not {given}: changing retention can delete steps at the next "
            "save, so it must be asked for: pass change_retention=True, or open the store without retention "
            "arguments to keep the recorded policies"
        )


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a step failed (a full disk, an I/O error in Orbax's writer); the steps
    stored before are intact and the failed step is not listed.

    Attributes:
        step: The step whose write failed.
        directory: The store's directory.
    """

    def __init__(self, step: int, directory: str | os.PathLike[str], cause: BaseException) -> None:
        text = " ".join(str(cause).split()) or type(cause).__name__
        if "No space left on device" in text:
            text = "no space left on the device; " + text
        detail = text if len(text) <= 400 else f"{text[:160]} ... {text[-200:]}"
        super().__init__(
            f"{directory}: step {step} was not written ({type(cause).__name__}: {detail}); "
            "the steps saved before are intact"
        )
        self.step, self.directory = step, directory


class CheckpointNotWrittenError(CheckpointError, ValueError):
    """A save was refused; the store is exactly as it was before the call.

    Attributes:
        step: The step that was not written.
        latest_step: The store's latest step at the time (``None`` when empty).
        reason: ``"exists"`` (the step is already saved and ``overwrite`` is off),
            ``"below_latest"`` (steps only move forward) or ``"rejected"`` (Orbax's
            save policy declined the step).
        directory: The store's directory.
    """

    def __init__(
        self,
        step: int,
        latest_step: int | None,
        reason: WriteRefusal,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        self.step = step
        self.latest_step = latest_step
        self.reason = reason
        self.directory = None if directory is None else str(directory)
        super().__init__(_not_written_message(step, latest_step, reason, self.directory))


def _not_written_message(step: int, latest: int | None, reason: str, directory: str | None) -> str:
    where = f" in {directory}" if directory else ""
    if reason == "exists":
        return f"step {step} already exists{where}; pass overwrite=True to replace it"
    if reason == "below_latest":
        return (
            f"step {step} is below the latest step {latest}{where}; steps only move forward: "
            f"save at a step above {latest}, or delete the later steps first"
        )
    return f"Orbax declined to save step {step}{where} (latest step {latest}); nothing was written"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint is stored at the requested step.

    Attributes:
        step: The step asked for.
        directory: The store's directory.
        available: The steps the store does hold, ascending.
    """

    def __init__(self, step: int, directory: str | os.PathLike[str], available: Sequence[int] = ()) -> None:
        self.step = step
        self.directory = str(directory)
        self.available = tuple(available)
        held = ", ".join(map(str, self.available)) if self.available else "none"
        super().__init__(f"no checkpoint at step {step} in {self.directory} (steps held: {held})")

    def __str__(self) -> str:  # OSError would format (errno, strerror) pairs
        return str(self.args[0])


class UnsupportedCheckpointError(CheckpointError, ValueError):
    """A checkpoint this version of nnx_save cannot read: another format, a malformed
    record or a newer format version. Nothing was restored.

    Attributes:
        found: What the checkpoint holds, in words (e.g. ``"format version 7"``).
        step: The step, when known.
        directory: The store's directory, when known.
    """

    def __init__(self, found: str, *, step: int | None = None, directory: str | os.PathLike[str] | None = None) -> None:
        self.found = found
        self.step = step
        self.directory = None if directory is None else str(directory)
        where = _where(step, self.directory)
        super().__init__(
            f"{where}holds {found}; this nnx_save reads format {FORMAT_NAME!r} up to version {FORMAT_VERSION}"
        )


def _where(step: int | None, directory: str | None) -> str:
    if step is None:
        return f"{directory} " if directory else "the checkpoint record "
    return f"step {step}{f' in {directory}' if directory else ''} "


class CheckpointTemplateError(CheckpointError, ValueError):
    """Restore templates disagree with what the checkpoint stores (paths, shapes or
    leaf kinds). Found before any array was read.

    Attributes:
        step: The step being restored.
        problems: One line per disagreement, ``item/leaf: ...``, sorted.
    """

    def __init__(self, step: int, problems: Iterable[str]) -> None:
        self.step = step
        self.problems = tuple(sorted(problems))
        lines = "\n  ".join(self.problems)
        super().__init__(f"step {step}: {len(self.problems)} template leaves disagree with the checkpoint:\n  {lines}")


class CheckpointItemError(CheckpointError, KeyMismatchError):
    """An item was asked for (by ``items`` or ``templates``) that the step does not hold.

    Attributes:
        step: The step being restored.
        missing: The item names asked for and absent.
        held: The item names the step holds.
    """

    def __init__(self, step: int, missing: Iterable[str], held: Iterable[str]) -> None:
        self.step = step
        self.missing = tuple(missing)
        self.held = tuple(held)
        super().__init__(
            f"step {step} holds no item {', '.join(map(repr, self.missing))}; it holds {', '.join(self.held)}"
        )


class DtypeMismatch(NamedTuple):
    """One array whose restored dtype would differ from (or differs from) the saved one.

    Attributes:
        item: The item name (``"model"``, ``"optimizer"``, ...).
        leaf: The leaf path inside the item, ``/``-joined (``"<root>"`` for a bare array).
        saved: The dtype recorded at save time.
        restored: The template's dtype, or the dtype the array came back with.
    """

    item: str
    leaf: str
    saved: str
    restored: str


class CheckpointDtypeMismatchError(CheckpointError, DtypeMismatchError):
    """Arrays would be (or were) restored with another dtype than they were saved with.

    Raised before any array is read when a template disagrees, and after reading for
    items restored without a template. Pass ``cast_dtypes=True`` to accept the casts.

    Attributes:
        step: The step being restored.
        mismatches: Every differing array, sorted by item and leaf.
        before_read: True when found from the templates, before reading.
        x64_off: True when jax's x64 mode was off and explains the mismatches.
    """

    def __init__(
        self, step: int, mismatches: Iterable[DtypeMismatch], *, before_read: bool = False, x64_off: bool = False
    ) -> None:
        self.step = step
        self.mismatches = tuple(sorted(mismatches))
        self.before_read = before_read
        self.x64_off = x64_off
        got = "in the template" if before_read else "restored"
        lines = "\n  ".join(f"{m.item}/{m.leaf}: {m.saved} saved, {m.restored} {got}" for m in self.mismatches)
        remedy = f"{_X64_HINT}, or pass" if x64_off else "Pass"
        what = (
            "arrays change dtype" if not any("(Python)" in m.saved for m in self.mismatches) else "leaves change type"
        )
        super().__init__(
            f"step {step}: {len(self.mismatches)} {what} on restore:\n  {lines}\n"
            f"{remedy} cast_dtypes=True to accept the casts"
        )
