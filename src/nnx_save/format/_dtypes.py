"""The one dtype table: safetensors dtype codes <-> numpy / ml_dtypes types.

Every code the safetensors format defines is listed with its bit width. Byte sizes
of sub-byte codes (``F4``, ``F6_*``) are counted by bits, as the format does: a
tensor of ``n`` F4 elements takes ``ceil(n * 4 / 8)`` bytes on disk, packed.
In memory such tensors are one element per byte (ml_dtypes' representation).

ml_dtypes (whose extension costs more to import than the rest of a small read) is
imported when a row of one of its types is first asked for its numpy dtype, or when
a numpy dtype is first looked up (:func:`to_code`): a file of numpy's own types is
read without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import numpy as np

from .._frozen import Frozen
from ..errors import HeaderError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["DTYPES", "RANK", "DtypeInfo", "from_code", "nbytes_for", "to_code"]


class DtypeInfo(Frozen):
    """One row of the table: the file code, the numpy dtype and the bits per element."""

    _fields = ("code", "numpy", "bits")
    _shown = _compared = ("code", "numpy", "bits", "byte_aligned", "itemsize")
    code: str
    numpy: np.dtype
    bits: int
    # Plain attributes, not properties: the engine asks them per tensor and per piece.
    byte_aligned: bool
    itemsize: int
    """Bytes per element on disk, for byte-aligned codes only."""

    def __init__(self, code: str, numpy: np.dtype, bits: int) -> None:
        set_field = object.__setattr__
        set_field(self, "code", code)
        set_field(self, "numpy", numpy)
        set_field(self, "bits", bits)
        set_field(self, "byte_aligned", bits % 8 == 0)
        set_field(self, "itemsize", bits // 8)

    def __getattr__(self, name: str) -> np.dtype:
        """``numpy`` of an ml_dtypes row, on first use (normal lookup found none); then
        a plain attribute like every other row's."""
        if name != "numpy" or self.code not in _ML_DTYPES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = np.dtype(getattr(importlib.import_module("ml_dtypes"), _ML_DTYPES[self.code]))
        object.__setattr__(self, "numpy", value)
        return value


# The codes whose numpy type is ml_dtypes': its attribute names.
_ML_DTYPES = {
    "F4": "float4_e2m1fn",
    "F6_E2M3": "float6_e2m3fn",
    "F6_E3M2": "float6_e3m2fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "BF16": "bfloat16",
}


def _row(code: str, dtype: npt.DTypeLike | None, bits: int) -> DtypeInfo:
    if dtype is None:  # ml_dtypes': resolved on first use
        row = DtypeInfo(code, np.dtype(np.uint8), bits)
        object.__delattr__(row, "numpy")
        return row
    return DtypeInfo(code, np.dtype(dtype), bits)


# In the order of the reference implementation's ``Dtype`` enum: writers lay tensors
# out by descending rank (then name), which keeps every tensor aligned to its item
# size and makes our files byte-identical to the reference writer's.
DTYPES: dict[str, DtypeInfo] = {
    row.code: row
    for row in (
        _row("BOOL", np.bool_, 8),
        _row("F4", None, 4),
        _row("F6_E2M3", None, 6),
        _row("F6_E3M2", None, 6),
        _row("U8", np.uint8, 8),
        _row("I8", np.int8, 8),
        _row("F8_E5M2", None, 8),
        _row("F8_E4M3", None, 8),
        _row("F8_E8M0", None, 8),
        _row("F8_E4M3FNUZ", None, 8),
        _row("F8_E5M2FNUZ", None, 8),
        _row("I16", np.int16, 16),
        _row("U16", np.uint16, 16),
        _row("F16", np.float16, 16),
        _row("BF16", None, 16),
        _row("I32", np.int32, 32),
        _row("U32", np.uint32, 32),
        _row("F32", np.float32, 32),
        _row("C64", np.complex64, 64),
        _row("F64", np.float64, 64),
        _row("I64", np.int64, 64),
        _row("U64", np.uint64, 64),
    )
}
RANK: dict[str, int] = {code: i for i, code in enumerate(DTYPES)}

_BY_NUMPY: dict[np.dtype, DtypeInfo] = {}  # filled by the first lookup (it imports ml_dtypes)


def _by_numpy() -> dict[np.dtype, DtypeInfo]:
    if not _BY_NUMPY:
        _BY_NUMPY.update({row.numpy: row for row in DTYPES.values()})
    return _BY_NUMPY


def from_code(code: object, tensor: str = "?") -> DtypeInfo:
    """The table row for a file dtype code.

    Raises:
        HeaderError: the code is not one the safetensors format defines.

    Examples:
        >>> from_code("BF16").numpy
        dtype(bfloat16)
        >>> from_code("F4").bits
        4
    """
    row = DTYPES.get(code) if isinstance(code, str) else None
    if row is None:
        raise HeaderError(
            f"tensor {tensor!r}: unknown dtype code {code!r}; the safetensors format defines {', '.join(DTYPES)}",
            check="dtype",
        )
    return row


def to_code(dtype: object, tensor: str = "?") -> DtypeInfo:
    """The table row for a numpy (or jax) dtype.

    Raises:
        HeaderError: safetensors has no code for this dtype (e.g. complex128).
    """
    by_numpy = _by_numpy()  # first: ml_dtypes' types are known to numpy from here on
    try:
        key = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        key = None
    row = by_numpy.get(key.newbyteorder("=")) if key is not None else None
    if row is None:
        shown = key if key is not None else dtype  # "int4", not "<class 'ml_dtypes.int4'>"
        raise HeaderError(f"tensor {tensor!r}: dtype {shown} has no safetensors code", check="dtype")
    return row


def nbytes_for(row: DtypeInfo, numel: int) -> int:
    """Bytes on disk for ``numel`` elements, counted by bits (sub-byte codes pack)."""
    return (numel * row.bits + 7) // 8


def pack_subbyte(array: np.ndarray, row: DtypeInfo) -> bytes:
    """Pack a one-element-per-byte ml_dtypes array into the format's bit stream.

    Elements are laid out little-endian in bit order: element ``i`` occupies bits
    ``[i*b, (i+1)*b)`` of the stream, bit 0 being the low bit of byte 0 (for F4 that
    is the low nibble first, as torch's ``float4_e2m1fn_x2``).
    """
    b = row.bits
    codes = np.ascontiguousarray(array).reshape(-1).view(np.uint8) & np.uint8((1 << b) - 1)
    bits = np.unpackbits(codes[:, None], axis=1, bitorder="little")[:, :b]
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack_subbyte(data: bytes | memoryview | np.ndarray, row: DtypeInfo, numel: int) -> np.ndarray:
    """Inverse of :func:`pack_subbyte`: a flat array of ``numel`` elements."""
    b = row.bits
    raw = np.frombuffer(data, dtype=np.uint8)
    bits = np.unpackbits(raw, bitorder="little")[: numel * b].reshape(numel, b)
    codes = np.packbits(bits, axis=1, bitorder="little").reshape(numel)
    return codes.view(row.numpy)
