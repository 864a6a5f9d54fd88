"""The dtype table: every safetensors code, its numpy type, bit width and packing."""

import re

import ml_dtypes
import numpy as np
import pytest
from _errors import raises_check
from hypothesis import given
from hypothesis import strategies as st

import nnx_save
from nnx_save.format import _dtypes

# The format's codes with their widths, written out independently of the module.
EXPECTED = {
    "BOOL": (np.bool_, 8),
    "U8": (np.uint8, 8),
    "I8": (np.int8, 8),
    "U16": (np.uint16, 16),
    "I16": (np.int16, 16),
    "U32": (np.uint32, 32),
    "I32": (np.int32, 32),
    "U64": (np.uint64, 64),
    "I64": (np.int64, 64),
    "F16": (np.float16, 16),
    "BF16": (ml_dtypes.bfloat16, 16),
    "F32": (np.float32, 32),
    "F64": (np.float64, 64),
    "C64": (np.complex64, 64),
    "F8_E4M3": (ml_dtypes.float8_e4m3fn, 8),
    "F8_E5M2": (ml_dtypes.float8_e5m2, 8),
    "F8_E8M0": (ml_dtypes.float8_e8m0fnu, 8),
    "F8_E4M3FNUZ": (ml_dtypes.float8_e4m3fnuz, 8),
    "F8_E5M2FNUZ": (ml_dtypes.float8_e5m2fnuz, 8),
    "F4": (ml_dtypes.float4_e2m1fn, 4),
    "F6_E2M3": (ml_dtypes.float6_e2m3fn, 6),
    "F6_E3M2": (ml_dtypes.float6_e3m2fn, 6),
}
SUBBYTE = ["F4", "F6_E2M3", "F6_E3M2"]


def test_table_has_every_code_of_the_format_and_nothing_else():
    assert set(_dtypes.DTYPES) == set(EXPECTED)


@pytest.mark.parametrize("code", sorted(EXPECTED))
def test_code_maps_to_numpy_dtype_and_bits(code):
    dtype, bits = EXPECTED[code]
    row = _dtypes.from_code(code, "t")
    assert (row.code, row.numpy, row.bits) == (code, np.dtype(dtype), bits)
    assert row.byte_aligned == (bits % 8 == 0)
    assert _dtypes.to_code(np.dtype(dtype)) is row
    if row.byte_aligned:
        assert row.itemsize == np.dtype(dtype).itemsize


def test_reference_rank_order():
    # The reference writer's Dtype enum order (checked byte for byte in test_interop).
    assert list(_dtypes.DTYPES) == [
        "BOOL",
        "F4",
        "F6_E2M3",
        "F6_E3M2",
        "U8",
        "I8",
        "F8_E5M2",
        "F8_E4M3",
        "F8_E8M0",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "I16",
        "U16",
        "F16",
        "BF16",
        "I32",
        "U32",
        "F32",
        "C64",
        "F64",
        "I64",
        "U64",
    ]
    assert [_dtypes.RANK[c] for c in _dtypes.DTYPES] == list(range(22))


@pytest.mark.parametrize(
    "code, shown",
    [("F128", "'F128'"), ("f32", "'f32'"), ("", "''"), (5, "5"), (None, "None"), (["F32"], "['F32']")],
)
def test_unknown_code_names_code_and_tensor(code, shown):
    with raises_check(
        "dtype",
        match=re.escape(f"tensor 'layer/w': unknown dtype code {shown}; the safetensors format defines BOOL, F4, "),
    ):
        _dtypes.from_code(code, "layer/w")


def test_an_unknown_dtype_is_a_header_error_of_the_dtype_check():
    from nnx_save.format import _dtypes

    with pytest.raises(
        ValueError, match=re.escape("tensor 'w': unknown dtype code 'Q7'; the safetensors format defines")
    ) as info:
        _dtypes.from_code("Q7", "w")
    assert isinstance(info.value, nnx_save.HeaderError) and info.value.check == "dtype"


@pytest.mark.parametrize(
    "dtype, shown",
    [
        (np.complex128, "complex128"),
        (np.float128 if hasattr(np, "float128") else np.clongdouble, None),
        (np.dtype("datetime64[s]"), "datetime64[s]"),
        (np.dtype([("a", "f4")]), None),
        (ml_dtypes.int4, "int4"),
        (ml_dtypes.float8_e4m3b11fnuz, "float8_e4m3b11fnuz"),
    ],
)
def test_dtype_without_a_code_is_refused(dtype, shown):
    shown = shown or str(np.dtype(dtype))
    with raises_check("dtype", match=re.escape(f"tensor 'k': dtype {shown} has no safetensors code")):
        _dtypes.to_code(dtype, "k")


def test_non_dtype_is_refused():
    with raises_check("dtype", match=re.escape("tensor 'k': dtype banana has no safetensors code")):
        _dtypes.to_code("banana", "k")


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "=f4", ">i8", ">c8", "<u2"])
def test_byte_order_does_not_change_the_code(dtype):
    assert _dtypes.to_code(np.dtype(dtype)).numpy == np.dtype(dtype).newbyteorder("=")


def test_jax_dtypes_map():
    import jax.numpy as jnp

    assert _dtypes.to_code(jnp.bfloat16).code == "BF16"
    assert _dtypes.to_code(jnp.float8_e4m3fn).code == "F8_E4M3"
    assert _dtypes.to_code(jnp.zeros(2, jnp.int8).dtype).code == "I8"


@pytest.mark.parametrize(
    "code, numel, nbytes",
    [
        ("F32", 3, 12),
        ("BOOL", 5, 5),
        ("C64", 2, 16),
        ("F4", 2, 1),
        ("F4", 6, 3),
        ("F6_E2M3", 4, 3),
        ("F6_E3M2", 8, 6),
        ("F4", 0, 0),
        ("F8_E8M0", 7, 7),
        ("F32", 10**12, 4 * 10**12),
    ],
)
def test_bytes_are_counted_by_bits(code, numel, nbytes):
    assert _dtypes.nbytes_for(_dtypes.DTYPES[code], numel) == nbytes


def test_f4_packs_low_nibble_first():
    # 0.5, 1.0, -2.0, 6.0 are e2m1 codes 0x1, 0x2, 0xC, 0x7; element 0 in the low nibble
    # of byte 0 (torch's float4_e2m1fn_x2 and NVIDIA's packing).
    x = np.array([0.5, 1.0, -2.0, 6.0], ml_dtypes.float4_e2m1fn)
    assert _dtypes.pack_subbyte(x, _dtypes.DTYPES["F4"]) == bytes([0x21, 0x7C])
    back = _dtypes.unpack_subbyte(bytes([0x21, 0x7C]), _dtypes.DTYPES["F4"], 4)
    assert back.dtype == ml_dtypes.float4_e2m1fn
    assert back.astype(np.float32).tolist() == [0.5, 1.0, -2.0, 6.0]


def test_f6_packs_little_endian_bit_stream():
    # Four 6-bit codes 0b000001, 0b000010, 0b000011, 0b111111 -> 24 bits, element 0 lowest.
    row = _dtypes.DTYPES["F6_E2M3"]
    codes = np.array([1, 2, 3, 63], np.uint8).view(row.numpy)
    stream = 1 | 2 << 6 | 3 << 12 | 63 << 18
    assert _dtypes.pack_subbyte(codes, row) == stream.to_bytes(3, "little")
    assert _dtypes.unpack_subbyte(stream.to_bytes(3, "little"), row, 4).view(np.uint8).tolist() == [1, 2, 3, 63]


@given(code=st.sampled_from(SUBBYTE), data=st.data())
def test_subbyte_pack_unpack_round_trip(code, data):
    row = _dtypes.DTYPES[code]
    n = data.draw(st.integers(0, 40))
    codes = np.array(data.draw(st.lists(st.integers(0, (1 << row.bits) - 1), min_size=n, max_size=n)), np.uint8)
    packed = _dtypes.pack_subbyte(codes.view(row.numpy), row)
    assert len(packed) == _dtypes.nbytes_for(row, n)
    assert _dtypes.unpack_subbyte(packed, row, n).view(np.uint8).tolist() == codes.tolist()
