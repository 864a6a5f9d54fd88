"""Every error and warning nnx_save raises or emits, in one public module.

Every error is an :class:`NnxSaveError` and also the builtin a caller would naturally catch
(``ValueError``, ``OSError``, ...); malformed files are :class:`HeaderError`, whose ``check`` names
the check that failed. The training store's errors live beside it (``checkpoint/_errors``) and
porting's beside the rules (``porting/_errors``), public as ``nnx_save.checkpoint.X`` and
``nnx_save.porting.X``; docs/errors.md draws the whole hierarchy.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "ChecksumError",
    "ConfigError",
    "ConvertError",
    "DirectoryLockedError",
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
    "UnsupportedValueError",
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
