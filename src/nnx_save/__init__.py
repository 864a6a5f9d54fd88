"""nnx_save: safe, exact and fast saving and loading of JAX / Flax NNX state.

``import nnx_save`` imports neither jax nor flax: the errors, the header types and
``read_header`` are imported with the package; the engine, the writers and the NNX
bridge on first use of their names, so ``read_header`` and ``nnx-save inspect`` start
fast. Type checkers see every name below as re-exported (``X as X``).
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import ByteLengthError as ByteLengthError
from ._errors import ChecksumError as ChecksumError
from ._errors import ConvertError as ConvertError
from ._errors import DtypeMismatchError as DtypeMismatchError
from ._errors import DuplicateKeyError as DuplicateKeyError
from ._errors import FileSizeError as FileSizeError
from ._errors import HeaderEncodingError as HeaderEncodingError
from ._errors import HeaderError as HeaderError
from ._errors import HeaderJSONError as HeaderJSONError
from ._errors import HeaderTooLargeError as HeaderTooLargeError
from ._errors import HeaderTooSmallError as HeaderTooSmallError
from ._errors import IndexFileError as IndexFileError
from ._errors import KeyMismatchError as KeyMismatchError
from ._errors import KeyPathError as KeyPathError
from ._errors import LoadError as LoadError
from ._errors import MetadataError as MetadataError
from ._errors import NnxSaveError as NnxSaveError
from ._errors import NotSafetensorsError as NotSafetensorsError
from ._errors import OffsetError as OffsetError
from ._errors import PieceLayoutError as PieceLayoutError
from ._errors import SaveError as SaveError
from ._errors import ShapeMismatchError as ShapeMismatchError
from ._errors import ShardingError as ShardingError
from ._errors import SliceError as SliceError
from ._errors import SourceError as SourceError
from ._errors import TensorEntryError as TensorEntryError
from ._errors import TruncatedFileError as TruncatedFileError
from ._errors import UnknownDtypeError as UnknownDtypeError
from ._errors import UnsupportedValueError as UnsupportedValueError
from ._header import FileHeader as FileHeader
from ._header import TensorInfo as TensorInfo
from ._report import DtypeCast as DtypeCast
from ._report import IOStats as IOStats
from ._report import LoadReport as LoadReport
from ._report import LoadWarning as LoadWarning
from ._report import LossyCastWarning as LossyCastWarning
from ._report import ShapeMismatch as ShapeMismatch
from ._report import SingleDeviceWarning as SingleDeviceWarning
from ._sources import Header as Header
from ._sources import read_header as read_header
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from ._async import SaveHandle as SaveHandle
    from ._async import wait_for_saves as wait_for_saves
    from ._convert import Converted as Converted
    from ._convert import convert as convert
    from ._lazy import LazyCheckpoint as LazyCheckpoint
    from ._lazy import TensorSlice as TensorSlice
    from ._lazy import iter_tensors as iter_tensors
    from ._lazy import safe_open as safe_open
    from ._load import OverReadWarning as OverReadWarning
    from ._nnx import load_model as load_model
    from ._nnx import save_model as save_model
    from ._pod import save_pod as save_pod
    from ._tree import load_file as load_file
    from ._tree import save_file as save_file

# Imported when first asked for: the NNX bridge imports flax and jax (~1 s), and the
# engine and writers are not needed to read a header (``nnx-save inspect``).
_LAZY = {
    "SaveHandle": "._async",
    "wait_for_saves": "._async",
    "Converted": "._convert",
    "convert": "._convert",
    "LazyCheckpoint": "._lazy",
    "TensorSlice": "._lazy",
    "iter_tensors": "._lazy",
    "safe_open": "._lazy",
    "OverReadWarning": "._load",
    "load_model": "._nnx",
    "save_model": "._nnx",
    "save_pod": "._pod",
    "load_file": "._tree",
    "save_file": "._tree",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
