"""The training store's errors and warning (public as ``nnx_save.checkpoint.X``): one base,
:class:`CheckpointError`, a class per way a caller handles a refusal, a ``reason`` per case."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

from .._version import CHECKPOINT_FORMAT_NAME, CHECKPOINT_FORMAT_VERSION
from ..errors import DtypeMismatchError, NnxSaveError, NnxSaveWarning

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDamageWarning",
    "CheckpointDtypeMismatchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointNotWrittenError",
    "CheckpointUsageError",
    "CheckpointWriteError",
    "DtypeMismatch",
    "UnsupportedCheckpointError",
    "UsageReason",
    "WriteRefusal",
]


WriteRefusal = Literal["exists", "below_latest", "rejected"]

_X64_HINT = (
    "jax's x64 mode is off, so 64-bit arrays come back as 32-bit: enable it with "
    "jax.config.update('jax_enable_x64', True) before restoring"
)


class CheckpointError(NnxSaveError):
    """Base class of every error raised by :mod:`nnx_save.checkpoint`."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A stored step is damaged (a file missing, truncated or unreadable); nothing was
    restored. ``step``, ``path`` (the damaged file) and ``problem`` say which and what."""

    def __init__(self, step: int, path: str | os.PathLike[str], problem: str) -> None:
        self.step, self.path, self.problem = step, str(path), problem
        super().__init__(f"step {step} is damaged: {self.path}: {problem}")


class CheckpointDamageWarning(NnxSaveWarning):
    """Steps of a store are damaged and are left out of ``list_steps`` and ``latest_step``
    (see ``damaged_steps()``)."""


UsageReason = Literal["directory", "link", "retention", "template", "item", "sync"]


class CheckpointUsageError(CheckpointError, ValueError):
    """The store refused a call before anything changed, because of how it was called or
    what its directory holds; ``reason`` says which (one class, an attribute per case,
    since no caller recovers from one case and not another):

    - ``"directory"``: a checkpoint ``directory`` (as given) the store cannot use, or one that holds
      a checkpoint of another layout (``entry``: an HF index, a pod manifest, ``.safetensors`` files);
    - ``"link"``: an entry (``entry``, linking to ``target``) of ``directory`` that the store
      may rename or delete is a symbolic link;
    - ``"retention"``: the store was opened with retention policies (``given``) other than
      those recorded in ``directory`` (``recorded``); ``change_retention=True`` replaces them;
    - ``"template"``: restore templates disagree with what ``step`` stores (paths, shapes,
      leaf kinds); ``problems`` has one sorted line per disagreement;
    - ``"item"``: items were asked for that ``step`` does not hold: ``missing`` names them,
      ``held`` the ones it holds;
    - ``"sync"``: the processes could not agree on a decision about the directory (process 0
      failed or timed out, or the processes called the store in different orders).
    """

    reason: UsageReason
    step: int | None = None
    directory: str | None = None
    entry: str | None = None
    target: str | None = None
    recorded: str | None = None
    given: str | None = None
    problems: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    held: tuple[str, ...] = ()

    def __init__(self, message: str, reason: UsageReason, **details: object) -> None:
        super().__init__(message)
        self.reason = reason
        for name, value in details.items():
            setattr(self, name, value)

    @classmethod
    def for_directory(cls, directory: str, found: str) -> CheckpointUsageError:
        return cls(
            f"checkpoint directory {directory!r}: {found} is not supported; give a local path, a file:// URL, "
            "or a gs:// or s3:// URL (which Orbax writes through etils epath and tensorstore)",
            "directory",
            directory=directory,
        )

    @classmethod
    def for_layout(cls, directory: str, entry: str) -> CheckpointUsageError:
        return cls(
            f"checkpoint directory {directory}: holds {entry}, a checkpoint of another layout (nnx_save.load_file "
            "reads it); the store writes its steps beside it and the directory would hold two checkpoints, so "
            "nothing was written: give the store a directory of its own",
            "directory",
            directory=directory,
            entry=entry,
        )

    @classmethod
    def for_link(cls, entry: str, target: str, directory: str) -> CheckpointUsageError:
        return cls(
            f"{entry}: this entry of the checkpoint store {directory} is a symbolic link (to {target!r}); "
            "the store renames and deletes its entries and never follows a link, so nothing was written "
            "or deleted: move the link out of the directory (or put the real directory in its place)",
            "link",
            entry=entry,
            target=target,
            directory=directory,
        )

    @classmethod
    def for_retention(cls, recorded: str, given: str, directory: str | os.PathLike[str]) -> CheckpointUsageError:
        return cls(
            f"{directory} keeps steps by {recorded}, not {given}: changing retention can delete steps at the next "
            "save, so it must be asked for: pass change_retention=True, or open the store without retention "
            "arguments to keep the recorded policies",
            "retention",
            recorded=recorded,
            given=given,
            directory=str(directory),
        )

    @classmethod
    def for_template(cls, step: int, problems: Iterable[str], remedy: str = "") -> CheckpointUsageError:
        problems = tuple(sorted(problems))
        lines = "\n  ".join(problems)
        return cls(
            f"step {step}: {len(problems)} template leaves disagree with the checkpoint:\n  {lines}"
            + (f"\n{remedy}" if remedy else ""),
            "template",
            step=step,
            problems=problems,
        )

    @classmethod
    def for_item(
        cls, step: int, missing: Iterable[str], held: Iterable[str], kept: Iterable[str] = ()
    ) -> CheckpointUsageError:
        missing, held, kept = tuple(missing), tuple(held), list(kept)
        return cls(
            f"step {step} holds no item {', '.join(map(repr, missing))}; it holds {', '.join(held)}; "
            f"pass items={kept or list(held)!r} (and templates for those only) to restore what it holds",
            "item",
            step=step,
            missing=missing,
            held=held,
        )


class CheckpointWriteError(CheckpointError, OSError):
    """Writing ``step`` failed (a full disk, an I/O error); the steps stored before in
    ``directory`` are intact and the failed step is not listed."""

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
    """A save of ``step`` was refused; ``directory`` is as before, ``latest_step`` its latest
    step. ``reason``: ``"exists"`` (``overwrite`` off), ``"below_latest"`` or ``"rejected"`` (by Orbax)."""

    def __init__(
        self,
        step: int,
        latest_step: int | None,
        reason: WriteRefusal,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        self.step, self.latest_step, self.reason = step, latest_step, reason
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
    """No checkpoint is stored at ``step`` in ``directory`` (``step`` None: no step at all,
    when the latest was asked for); ``available`` lists the steps it holds, ascending."""

    def __init__(self, step: int | None, directory: str | os.PathLike[str], available: Sequence[int] = ()) -> None:
        self.step, self.directory, self.available = step, str(directory), tuple(available)
        held = ", ".join(map(str, self.available)) if self.available else "none"
        at = "" if step is None else f" at step {step}"  # None: the latest step was asked for
        super().__init__(f"no checkpoint{at} in {self.directory} (steps held: {held})")

    def __str__(self) -> str:  # OSError would format (errno, strerror) pairs
        return str(self.args[0])


class UnsupportedCheckpointError(CheckpointError, ValueError):
    """A checkpoint this nnx_save cannot read (another format, a malformed record, a newer
    version); ``found`` says what it holds, ``step`` and ``directory`` where, when known."""

    def __init__(self, found: str, *, step: int | None = None, directory: str | os.PathLike[str] | None = None) -> None:
        self.found, self.step = found, step
        self.directory = None if directory is None else str(directory)
        super().__init__(
            f"{_where(step, self.directory)}holds {found}; this nnx_save reads format "
            f"{CHECKPOINT_FORMAT_NAME!r} up to version {CHECKPOINT_FORMAT_VERSION}"
        )


def _where(step: int | None, directory: str | None) -> str:
    if step is None:
        return f"{directory} " if directory else "the checkpoint record "
    return f"step {step}{f' in {directory}' if directory else ''} "


class DtypeMismatch(NamedTuple):
    """One array whose restored dtype differs from the ``saved`` one: ``item``, the
    ``/``-joined ``leaf`` path (``"<root>"`` for a bare array), and the ``restored`` dtype."""

    item: str
    leaf: str
    saved: str
    restored: str


class CheckpointDtypeMismatchError(CheckpointError, DtypeMismatchError):
    """Arrays of ``step`` would be (``before_read``: a template disagrees) or were restored
    with another dtype than saved; ``mismatches`` lists them, ``x64_off`` says jax's x64
    mode, off, explains them. ``allow_casts`` (``"lossless"`` or path patterns) accepts
    the casts it names, ``cast_dtypes=True`` every one."""

    def __init__(
        self,
        step: int,
        mismatches: Iterable[DtypeMismatch],
        *,
        before_read: bool = False,
        x64_off: bool = False,
        remedy: str = "pass allow_casts=[...] naming them to accept the casts",
    ) -> None:
        self.step, self.mismatches = step, tuple(sorted(mismatches))
        self.before_read, self.x64_off = before_read, x64_off
        got = "in the template" if before_read else "restored"
        lines = "\n  ".join(f"{m.item}/{m.leaf}: {m.saved} saved, {m.restored} {got}" for m in self.mismatches)
        remedy = f"{_X64_HINT}, or {remedy}" if x64_off else remedy[:1].upper() + remedy[1:]
        what = "leaves change type" if any("(Python)" in m.saved for m in self.mismatches) else "arrays change dtype"
        super().__init__(f"step {step}: {len(self.mismatches)} {what} on restore:\n  {lines}\n{remedy}")
