"""Every error and warning nnx_save raises or emits, in one public module.

Every error is an :class:`NnxSaveError` and also the builtin a caller would naturally catch
(``ValueError``, ``OSError``, ...); malformed files are :class:`HeaderError`, whose ``check`` names
the check that failed. ``nnx_save.checkpoint`` and ``nnx_save.porting`` re-export theirs; docs/errors.md
draws the hierarchy.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

from ._version import CHECKPOINT_FORMAT_NAME, CHECKPOINT_FORMAT_VERSION

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDamageWarning",
    "CheckpointDtypeMismatchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointNotWrittenError",
    "CheckpointUsageError",
    "CheckpointWriteError",
    "ChecksumError",
    "ConfigError",
    "ConvertError",
    "DirectoryLockedError",
    "DtypeMismatch",
    "DtypeMismatchError",
    "HeaderCheck",
    "HeaderError",
    "HostMemoryError",
    "KeyMismatchError",
    "KeyPathError",
    "LoadError",
    "LoadWarning",
    "LossyCastWarning",
    "NnxSaveError",
    "NnxSaveWarning",
    "NotSafetensorsError",
    "OptionError",
    "OverReadWarning",
    "RemoteError",
    "RuleError",
    "RuleKind",
    "RuleTableWarning",
    "SafetensorError",
    "SaveError",
    "ShapeMismatchError",
    "ShardingError",
    "SingleDeviceWarning",
    "SliceError",
    "SourceChangedError",
    "SourceError",
    "SourceNotFoundError",
    "TruncatedFileError",
    "UnsupportedCheckpointError",
    "UnsupportedValueError",
    "UsageReason",
    "WriteRefusal",
    "short_repr",
]


class NnxSaveError(Exception):
    """Base class of every error raised by nnx_save. ``key_path`` is the flat key
    (``"layers/0/kernel"``) of the leaf the failure concerns, or ``None``; errors about a
    file name it in ``file``."""

    key_path: str | None = None

    def __init__(self, message: str = "", key_path: str | None = None) -> None:
        super().__init__(message)
        self.key_path = key_path


HeaderCheck = Literal[
    "too_small",
    "too_large",
    "encoding",
    "json",
    "duplicate_key",
    "metadata",
    "tensor_entry",
    "pieces",
    "manifest",
    "dtype",
    "byte_length",
    "offsets",
    "file_size",
    "index",
    "layout",
    "format",
]
"""The header checks, in the order they run: ``"too_small"`` (shorter than the 8-byte prefix
or the declared header), ``"too_large"`` (a declared size over the cap or the file),
``"encoding"`` (not UTF-8), ``"json"`` (not a JSON object), ``"duplicate_key"`` (a key given
twice at any level), ``"metadata"`` (``__metadata__`` not strings to strings),
``"tensor_entry"`` (a field missing, extra or of the wrong type), ``"dtype"`` (a code the
format does not define), ``"byte_length"`` (a byte range that disagrees with shape and
dtype), ``"offsets"`` (ranges that overlap, leave a hole or do not start at zero),
``"file_size"`` (data that does not end at the end of the file), ``"pieces"`` (a layout's
boxes of a tensor malformed, overlapping, listed twice, leaving a hole or outside its shape),
``"manifest"`` (a pod manifest's ``num_processes``, a piece's ``process`` or its ``save_id``
out of range, or a shard file of another save), ``"index"``
(a multi-file index malformed or disagreeing with the files it names), ``"layout"`` (a
directory two layouts claim: the message names both records, ``file`` the directory) and
``"format"`` (:class:`NotSafetensorsError`)."""


class HeaderError(NnxSaveError, ValueError):
    """A safetensors header (or index, or manifest) is malformed; nothing was read past it.
    ``check`` names the check that failed (:data:`HeaderCheck`): one class, an attribute
    per check, since no caller handles one check differently from another; ``file`` names
    the file or directory, when one is known.

    Examples:
        >>> import os, tempfile, nnx_save
        >>> path = os.path.join(tempfile.mkdtemp(), "short.safetensors")
        >>> with open(path, "wb") as f:
        ...     _ = f.write(b"\\x02\\x00")
        >>> try:
        ...     nnx_save.read_header(path)
        ... except nnx_save.HeaderError as e:
        ...     print(e.check)
        too_small
    """

    check: HeaderCheck | None = None
    file: str | None = None

    def __init__(self, message: str = "", *, check: HeaderCheck | None = None, file: str | None = None) -> None:
        super().__init__(message)
        if check is not None:
            self.check = check
        self.file = file


class KeyPathError(NnxSaveError, ValueError):
    """A tree path cannot become a file key (``/`` inside a name, an ambiguous key);
    ``key_path`` names it."""


class UnsupportedValueError(NnxSaveError, TypeError):
    """A leaf that cannot be stored (a string, ``None``, an object array; ``key_path``
    names it), or a value of a kind an argument cannot take."""


class KeyMismatchError(NnxSaveError, KeyError):
    """A tensor the target expects is absent from the source (or the reverse)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(NnxSaveError, ValueError):
    """A tensor's shape in the source differs from the target's."""


class DtypeMismatchError(NnxSaveError, TypeError):
    """A tensor's dtype in the source differs from the target's and casting is refused, or
    the target's device cannot hold the dtype (F6 on CPU), refused before any data is read."""


class LoadError(NnxSaveError, ValueError):
    """A strict load found mismatches, or a load found nothing to load into a target that
    has tensors; ``report`` holds every finding."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class HostMemoryError(NnxSaveError, MemoryError):
    """The host memory a load needs for a tensor (``file``, ``key``) cannot be allocated
    (``nbytes``: a process limit, a tensor larger than the machine); nothing was read."""

    def __init__(self, message: str, file: str, key: str, nbytes: int) -> None:
        super().__init__(message)
        self.file, self.key, self.nbytes = file, key, nbytes


class SaveError(NnxSaveError, OSError):
    """Writing a checkpoint failed; the previous file at the path is intact. ``file``
    names that file; ``key_path`` the tensor, when one tensor caused the failure."""

    def __init__(self, message: str, file: str | None = None, key_path: str | None = None) -> None:
        super().__init__(message, key_path)
        self.file = file


class DirectoryLockedError(NnxSaveError, OSError):
    """Another writer holds ``directory`` (one writer at a time per store, and per directory
    of a multi-file or pod save); ``holder`` names it (what, host, process id, process start
    time). Nothing was written. A holder found dead on this host is taken over without this
    error."""

    def __init__(self, directory: str, holder: str) -> None:
        self.directory, self.holder = directory, holder
        super().__init__(
            f"{directory} is being written by {holder}; one writer at a time: wait for it to finish (a store "
            "holds it until close()), or write to another directory. Reading needs no lock"
        )

    def __str__(self) -> str:  # OSError's own would show the arguments tuple
        return str(self.args[0])


class TruncatedFileError(NnxSaveError, OSError):
    """A read of tensor data ended early: ``file`` was truncated after its header was
    validated; ``offset`` says where."""

    def __init__(self, message: str, file: str | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.file, self.offset = file, offset


class SourceError(NnxSaveError, OSError):
    """A source path (``file``) is not a regular file (a directory, a FIFO, a device)
    or the system refused to read it; under ``share_reads=True``, also a load that
    failed on another process (the message names it and its error), raised on every
    process before any collective."""

    def __init__(self, message: str, file: str | None = None) -> None:
        super().__init__(message)
        self.file = file


class OptionError(NnxSaveError, ValueError):
    """An argument or option of a call is out of range, of the wrong kind, or given
    twice (as a keyword and in ``options=``). ``argument`` names it."""

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument


class ShardingError(NnxSaveError, ValueError):
    """A sharding this process cannot read or write as asked."""


class ChecksumError(NnxSaveError, ValueError):
    """A tensor's bytes do not match the checksum recorded at save time, or hold a value
    no save writes (a BOOL byte other than 0 or 1); ``key``, ``file``, ``expected`` and
    ``found`` say which, where, and the two digests (or what a byte must be and was)."""

    def __init__(
        self,
        message: str,
        key: str | None = None,
        file: str | None = None,
        expected: str | None = None,
        found: str | None = None,
    ) -> None:
        super().__init__(message, key)
        self.key, self.file, self.expected, self.found = key, file, expected, found


class NotSafetensorsError(HeaderError):
    """The source is another format (PyTorch, Orbax, TensorStore), told by its bytes, nothing
    unpickled; ``format`` says which, the message what to run."""

    check: HeaderCheck | None = "format"

    def __init__(self, message: str, format: str = "") -> None:
        super().__init__(message)
        self.format = format


class ConvertError(NnxSaveError, ValueError):
    """A checkpoint that cannot be converted (:func:`nnx_save.convert`): an unknown or
    unsafe source format, a value that is not a tensor, an output path of the wrong kind."""


class SafetensorError(NnxSaveError):
    """``safe_open`` refused a call where ``safetensors.safe_open`` raises its own
    ``SafetensorError`` (a closed handle, an unknown framework, device or backend); also a
    ``safetensors.SafetensorError`` when ``safetensors`` is imported in the process."""


class SliceError(SafetensorError, IndexError):
    """``safe_open``: a key the checkpoint does not hold, or an index safetensors refuses
    too (docs/lazy.md)."""


class SourceChangedError(SourceError):
    """The source (``file``: a multi-file checkpoint's index, a URL) changed while it was
    read: files of two saves, a file the index named gone, another size or version of a
    remote object. Nothing of the mix is returned: load again."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """``safe_open``: the file or directory ``file`` does not exist."""


class RemoteError(NnxSaveError, OSError):
    """A remote read failed after its retries, or the server does not serve ranges."""


class ConfigError(NnxSaveError, ValueError):
    """An ``NNX_SAVE_*`` environment variable holds a value nnx_save cannot use (raised where
    it is used); ``variable``, ``expected`` and ``found`` say which, what it must hold, what it holds."""

    def __init__(self, variable: str, expected: str, found: str) -> None:
        super().__init__(f"{variable}={found!r}: expected {expected}")
        self.variable, self.expected, self.found = variable, expected, found


class NnxSaveWarning(UserWarning):
    """Base class of every warning nnx_save emits: ``warnings.filterwarnings("error",
    category=nnx_save.errors.NnxSaveWarning)`` turns them all into errors."""


class LoadWarning(NnxSaveWarning):
    """A load finished with mismatches (missing, unexpected, cast ...); see its report."""


class SingleDeviceWarning(LoadWarning):
    """A process with several devices loaded arrays that had no sharding: all of them
    landed on its first device."""


class LossyCastWarning(LoadWarning):
    """A load cast values to a dtype that cannot hold them all (float to int, a
    narrower float or int): the loaded values differ from the file's."""


class OverReadWarning(LoadWarning):
    """The automatic over-read ratio made this process read much more than it needed."""


# --------------------------------------------------------------------------- checkpoint store
# (``nnx_save.checkpoint`` re-exports these under the same names)

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


# --------------------------------------------------------------------------- porting
# (``nnx_save.porting`` re-exports these under the same names)


RuleKind = Literal["conflict", "not_invertible", "tied", "table", "shape", "round_trip"]
"""What a :class:`RuleError` is about: ``"conflict"`` (a file tensor feeds two rules, or two
rules make one target), ``"not_invertible"`` (a rule has no automatic inverse: pass
``inverse=``), ``"tied"`` (copies a ``tie`` rule declares equal differ in the file),
``"table"`` (a table that would port wrongly though every tensor lands somewhere: a
transform applied twice or cancelled, a rule matching nothing or only what an earlier rule
took; refused under ``strict``, its ``problems`` naming the rules), ``"shape"`` (a tensor's
shape does not fit the rule that transforms it), ``"round_trip"`` (a computed rule's inverse,
on export, makes tensors that its function does not turn back into the model's: writing
them would load back other values)."""


class RuleError(NnxSaveError, ValueError):
    """A rule is malformed, or the tensors it matches do not fit it. ``kind`` says which
    case (:data:`RuleKind`, ``None`` for a malformed rule); ``problems`` lists a table's
    problems, one line each."""

    kind: RuleKind | None = None
    problems: tuple[str, ...] = ()

    def __init__(self, message: str = "", *, kind: RuleKind | None = None, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind
        self.problems = tuple(problems)


class RuleTableWarning(NnxSaveWarning):
    """The findings of a ``RuleError`` of kind ``"table"``, without ``strict``: the port
    went ahead with the table as written."""


def short_repr(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to about ``limit`` characters at a word boundary, the cut
    marked with ``...`` and the full length.

    Examples:
        >>> short_repr("a sentence of several words, longer than the limit", 30)
        "'a sentence of several words, ... (52 characters)"
        >>> short_repr(12345)
        '12345'
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    cut = max(text.rfind(sep, 0, limit + 1) for sep in " ,:;)]}")
    head = text[: cut + 1] if cut > 0 else text[:limit]
    return f"{head.rstrip()} ... ({len(text)} characters)"
