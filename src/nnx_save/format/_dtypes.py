"""The one dtype table: safetensors dtype codes <-> numpy / ml_dtypes types.

Every code the safetensors format defines is listed with its bit width. Byte sizes
of sub-byte codes (``F4``, ``F6_*``) are counted by bits, as the format does: a
tensor of ``n`` F4 elements takes ``ceil(n * 4 / 8)`` bytes on disk, packed.
In memory such tensors are one element per byte (ml_dtypes' representation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ..errors import HeaderError

__all__ = ["DTYPES", "RANK", "DtypeInfo", "from_code", "nbytes_for", "to_code"]


@dataclass(frozen=True)
class DtypeInfo:
    """One row of the table: the file code, the numpy dtype and the bits per element."""

    code: str
    numpy: np.dtype
    bits: int
    # Plain attributes, not properties: the engine asks them per tensor and per piece.
    byte_aligned: bool = field(init=False)
    itemsize: int = field(init=False)
    """Bytes per element on disk, for byte-aligned codes only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "byte_aligned", self.bits % 8 == 0)
        object.__setattr__(self, "itemsize", self.bits // 8)


def _row(code: str, dtype: npt.DTypeLike, bits: int) -> DtypeInfo:
    return DtypeInfo(code, np.dtype(dtype), bits)


# In the order of the reference implementation's ``Dtype`` enum: writers lay tensors
# out by descending rank (then name), which keeps every tensor aligned to its item
# size and makes our files byte-identical to the reference writer's.
DTYPES: dict[str, DtypeInfo] = {
    row.code: row
    for row in (
        _row("BOOL", np.bool_, 8),
        _row("F4", ml_dtypes.float4_e2m1fn, 4),
        _row("F6_E2M3", ml_dtypes.float6_e2m3fn, 6),
        _row("F6_E3M2", ml_dtypes.float6_e3m2fn, 6),
        _row("U8", np.uint8, 8),
        _row("I8", np.int8, 8),
        _row("F8_E5M2", ml_dtypes.float8_e5m2, 8),
        _row("F8_E4M3", ml_dtypes.float8_e4m3fn, 8),
        _row("F8_E8M0", ml_dtypes.float8_e8m0fnu, 8),
        _row("F8_E4M3FNUZ", ml_dtypes.float8_e4m3fnuz, 8),
        _row("F8_E5M2FNUZ", ml_dtypes.float8_e5m2fnuz, 8),
        _row("I16", np.int16, 16),
        _row("U16", np.uint16, 16),
        _row("F16", np.float16, 16),
        _row("BF16", ml_dtypes.bfloat16, 16),
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

_BY_NUMPY: dict[np.dtype, DtypeInfo] = {row.numpy: row for row in DTYPES.values()}


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
    try:
        key = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        key = None
    row = _BY_NUMPY.get(key.newbyteorder("=")) if key is not None else None
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
