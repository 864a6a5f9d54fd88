"""One hierarchy for every failure nnx_save reports.

Every error is an :class:`NnxSaveError`; malformed files are :class:`HeaderError`
(also a :class:`ValueError`), with one subclass per check so callers and tests can
tell the cases apart. Messages name the tensor or path, what was expected and what
was found.
"""

from __future__ import annotations

__all__ = [
    "ByteLengthError",
    "ChecksumError",
    "ConvertError",
    "DtypeMismatchError",
    "DuplicateKeyError",
    "FileSizeError",
    "HeaderEncodingError",
    "HeaderError",
    "HeaderJSONError",
    "HeaderTooLargeError",
    "HeaderTooSmallError",
    "IndexFileError",
    "KeyMismatchError",
    "KeyPathError",
    "LoadError",
    "MetadataError",
    "NnxSaveError",
    "NotSafetensorsError",
    "OffsetError",
    "PieceLayoutError",
    "SaveError",
    "ShapeMismatchError",
    "ShardingError",
    "SharedReadError",
    "SliceError",
    "SourceError",
    "TensorEntryError",
    "TruncatedFileError",
    "UnknownDtypeError",
    "UnsupportedValueError",
    "short_repr",
]


class NnxSaveError(Exception):
    """Base class of every error raised by nnx_save.

    ``key_path`` is the one tree-path attribute every error carries: the flat key
    (``"layers/0/kernel"``) of the tree leaf the failure concerns, or ``None`` when
    it concerns no single leaf. Errors about a file name it in ``file`` instead.
    """

    key_path: str | None = None


class HeaderError(NnxSaveError, ValueError):
    """A safetensors header (or index) is malformed; nothing was read past it."""


class HeaderTooSmallError(HeaderError):
    """The file is shorter than the 8-byte size prefix or than the declared header."""


class HeaderTooLargeError(HeaderError):
    """The declared header size exceeds the cap or the file."""


class HeaderEncodingError(HeaderError):
    """The header bytes are not valid UTF-8."""


class HeaderJSONError(HeaderError):
    """The header is not a JSON object."""


class DuplicateKeyError(HeaderError):
    """The header's JSON text names the same key twice."""


class MetadataError(HeaderError):
    """``__metadata__`` is not a mapping of strings to strings."""


class TensorEntryError(HeaderError):
    """A tensor entry lacks a field, has an extra one, or a field of the wrong type."""


class PieceLayoutError(HeaderError):
    """A layout's pieces of a tensor (a pod manifest's boxes) are malformed, leave a
    hole, overlap, or fall outside the tensor's shape."""


class UnknownDtypeError(HeaderError):
    """A dtype code the safetensors format does not define (or nnx_save cannot map)."""


class ByteLengthError(HeaderError):
    """A tensor's byte range disagrees with its shape and dtype."""


class OffsetError(HeaderError):
    """Tensor byte ranges overlap, leave a hole, or do not start at zero."""


class FileSizeError(HeaderError):
    """The data section does not end exactly at the end of the file."""


class IndexFileError(HeaderError):
    """A multi-file index (``model.safetensors.index.json``) is malformed or disagrees
    with the files it names."""


class KeyPathError(NnxSaveError, ValueError):
    """A tree path cannot become a file key (``/`` inside a name, an ambiguous key);
    ``key_path`` names it."""

    def __init__(self, message: str, key_path: str | None = None) -> None:
        super().__init__(message)
        self.key_path = key_path


class UnsupportedValueError(NnxSaveError, TypeError):
    """A leaf that cannot be stored: a string, ``None``, an object array, ...;
    ``key_path`` names it."""

    def __init__(self, message: str, key_path: str | None = None) -> None:
        super().__init__(message)
        self.key_path = key_path


class KeyMismatchError(NnxSaveError, KeyError):
    """A tensor the target expects is absent from the source (or the reverse)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(NnxSaveError, ValueError):
    """A tensor's shape in the source differs from the target's."""


class DtypeMismatchError(NnxSaveError, TypeError):
    """A tensor's dtype in the source differs from the target's and casting is refused."""


class LoadError(NnxSaveError, ValueError):
    """A strict load found mismatches; ``report`` holds every one of them."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class SaveError(NnxSaveError, OSError):
    """Writing a checkpoint failed; the previous file at the path is intact. ``file``
    names that file; ``key_path`` the tensor, when one tensor caused the failure."""

    def __init__(self, message: str, file: str | None = None, key_path: str | None = None) -> None:
        super().__init__(message)
        self.file, self.key_path = file, key_path


class SharedReadError(NnxSaveError, OSError):
    """A load with shared reads failed on some process (its error is named), or a
    process did not report within the deadline; raised on every process, before any
    collective. ``file`` names the source."""

    def __init__(self, message: str, file: str | None = None) -> None:
        super().__init__(message)
        self.file = file


class TruncatedFileError(NnxSaveError, OSError):
    """A read of tensor data ended early: the file is shorter than its validated header
    says (truncated after it was opened). ``file`` and ``offset`` say where."""

    def __init__(self, message: str, file: str | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.file, self.offset = file, offset


class SourceError(NnxSaveError, OSError):
    """A source path cannot be read as a checkpoint file: it is not a regular file
    (a directory, a FIFO, a device) or the system refused to read it. ``file``
    names it."""

    def __init__(self, message: str, file: str | None = None) -> None:
        super().__init__(message)
        self.file = file


class ShardingError(NnxSaveError, ValueError):
    """A sharding this process cannot read or write as asked."""


class ChecksumError(NnxSaveError, ValueError):
    """A tensor's bytes do not match the checksum recorded when it was saved: the
    file was modified or corrupted after writing. ``key``, ``file``, ``expected``
    and ``found`` say which tensor, where, and the two digests."""

    def __init__(
        self,
        message: str,
        key: str | None = None,
        file: str | None = None,
        expected: str | None = None,
        found: str | None = None,
    ) -> None:
        super().__init__(message)
        self.key, self.file, self.expected, self.found = key, file, expected, found
        self.key_path = key


class NotSafetensorsError(HeaderError):
    """The source is another checkpoint format (PyTorch zip or pickle, Orbax,
    TensorStore), recognised by its magic bytes or directory entries; nothing was
    unpickled. ``format`` says what it is; the message says what to run."""

    def __init__(self, message: str, format: str = "") -> None:
        super().__init__(message)
        self.format = format


class ConvertError(NnxSaveError, ValueError):
    """A checkpoint that cannot be converted (:func:`nnx_save.convert`): an unknown or
    unsafe source format, a value that is not a tensor, an output path of the wrong kind."""


class SliceError(NnxSaveError, IndexError):
    """``safe_open``: a key the checkpoint does not hold, or an index of a tensor that
    is out of range or not made of ints, slices and one Ellipsis."""


def short_repr(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to about ``limit`` characters at a word boundary (never in
    the middle of a word or number), the cut marked with ``...`` and the full length.

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
