"""nnx_save: safe, exact and fast saving and loading of JAX / Flax NNX state.

The API is the names in ``__all__`` (docs/api.md lists them). Every error and warning
lives in :mod:`nnx_save.errors`; the more specific ones are also reachable here. The
environment variables: docs/configuration.md.

``import nnx_save`` imports neither jax nor flax: the bridges are imported on first use
of their names. ``X as X``: type checkers see every name as re-exported.
"""

import typing as _typing

from . import errors as errors
from ._lazy_import import lazy_getattr as _lazy_getattr
from ._version import __version__ as __version__
from .errors import ChecksumError as ChecksumError
from .errors import ConfigError as ConfigError
from .errors import ConvertError as ConvertError
from .errors import DirectoryLockedError as DirectoryLockedError
from .errors import DtypeMismatchError as DtypeMismatchError
from .errors import HeaderError as HeaderError
from .errors import HostMemoryError as HostMemoryError
from .errors import KeyMismatchError as KeyMismatchError
from .errors import KeyPathError as KeyPathError
from .errors import LoadError as LoadError
from .errors import LoadWarning as LoadWarning
from .errors import LossyCastWarning as LossyCastWarning
from .errors import NnxSaveError as NnxSaveError
from .errors import NnxSaveWarning as NnxSaveWarning
from .errors import NotSafetensorsError as NotSafetensorsError
from .errors import OptionError as OptionError
from .errors import OverReadWarning as OverReadWarning
from .errors import RemoteError as RemoteError
from .errors import SafetensorError as SafetensorError
from .errors import SaveError as SaveError
from .errors import ShapeMismatchError as ShapeMismatchError
from .errors import ShardingError as ShardingError
from .errors import SingleDeviceWarning as SingleDeviceWarning
from .errors import SliceError as SliceError
from .errors import SourceChangedError as SourceChangedError
from .errors import SourceError as SourceError
from .errors import SourceNotFoundError as SourceNotFoundError
from .errors import TruncatedFileError as TruncatedFileError
from .errors import UnsupportedValueError as UnsupportedValueError

__all__ = [
    # saving and loading
    "save_file",
    "load_file",
    "save_model",
    "load_model",
    "save_pod",
    "safe_open",
    "iter_tensors",
    "read_header",
    "convert",
    "wait_for_saves",
    # how they run, and what they return
    "LoadOptions",
    "SaveOptions",
    "LoadReport",
    "SaveHandle",
    "Header",
    # the base errors and warning (all of them: nnx_save.errors)
    "errors",
    "NnxSaveError",
    "HeaderError",
    "KeyMismatchError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "LoadError",
    "SaveError",
    "ChecksumError",
    "NnxSaveWarning",
    "LoadWarning",
]

if _typing.TYPE_CHECKING:
    from .bridges._lazy import LazyCheckpoint as LazyCheckpoint
    from .bridges._lazy import TensorSlice as TensorSlice
    from .bridges._lazy import iter_tensors as iter_tensors
    from .bridges._lazy import safe_open as safe_open
    from .bridges._nnx import load_model as load_model
    from .bridges._nnx import save_model as save_model
    from .bridges._pytree import load_file as load_file
    from .bridges._pytree import save_file as save_file
    from .bridges._save_pod import save_pod as save_pod
    from .conversion._convert import Converted as Converted
    from .conversion._convert import convert as convert
    from .format._header import FileHeader as FileHeader
    from .format._header import TensorInfo as TensorInfo
    from .layouts._registry import read_header as read_header
    from .load._options import LoadOptions as LoadOptions
    from .load._report import DtypeCast as DtypeCast
    from .load._report import IOStats as IOStats
    from .load._report import LoadReport as LoadReport
    from .load._report import ShapeMismatch as ShapeMismatch
    from .load._source import Header as Header
    from .save._background import SaveHandle as SaveHandle
    from .save._background import wait_for_saves as wait_for_saves
    from .save._options import SaveOptions as SaveOptions

# Imported when first asked for: the bridges import jax (and flax), which reading a
# header (``nnx-save inspect``) does not need, and ``import nnx_save`` alone loads only
# the errors: each call's modules load with its first use.
_MODULES = {
    ".format._header": ("FileHeader", "TensorInfo"),
    ".layouts._registry": ("read_header",),
    ".load._options": ("LoadOptions",),
    ".load._report": ("DtypeCast", "IOStats", "LoadReport", "ShapeMismatch"),
    ".load._source": ("Header",),
    ".save._options": ("SaveOptions",),
    ".save._background": ("SaveHandle", "wait_for_saves"),
    ".conversion._convert": ("Converted", "convert"),
    ".bridges._lazy": ("LazyCheckpoint", "TensorSlice", "iter_tensors", "safe_open"),
    ".bridges._nnx": ("load_model", "save_model"),
    ".bridges._save_pod": ("save_pod",),
    ".bridges._pytree": ("load_file", "save_file"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
# The types the API hands back: reachable here for annotations, not in __all__ (docs/api.md).
_RECEIVED = (
    "FileHeader",
    "TensorInfo",
    "DtypeCast",
    "ShapeMismatch",
    "IOStats",
    "LazyCheckpoint",
    "TensorSlice",
    "Converted",
)
_THROWN = (errors.NnxSaveError, errors.NnxSaveWarning)


__getattr__ = _lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    """The documented names (docs/api.md): the API, the types it hands back, the errors
    and warnings; not the subpackages that importing the package binds as a side effect."""
    errors_here = {n for n, v in globals().items() if isinstance(v, type) and issubclass(v, _THROWN)}
    return sorted({*__all__, *_RECEIVED, *errors_here, "__version__"})
