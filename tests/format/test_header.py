"""Header parsing and validation: one typed error per malformed case, fuzzing, and
the pure encoder."""

import copy
import json
import re
import struct
import tracemalloc

import numpy as np
import pytest
from _errors import raises_check
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save import FileHeader
from nnx_save.format import _dtypes
from nnx_save.format._header import MAX_HEADER_SIZE, encode_header, header_size, parse_header

F = "<bytes>"  # the default file name in messages


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def text(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse(raw: bytes, data: int = 0) -> FileHeader:
    """Parse ``raw`` as the header of a file with ``data`` bytes of tensor data."""
    return parse_header(raw, 8 + len(raw) + data)


def parse_blob(blob: bytes) -> FileHeader:
    """Parse a whole file image, prefix included, as read_file_header does."""
    n = header_size(blob[:8], len(blob))
    return parse_header(blob[8 : 8 + n], len(blob))


# --- the happy path --------------------------------------------------------------------


def test_golden_encoding():
    head, offsets = encode_header([("a", "F32", (2,)), ("b", "U8", (3,))], {"k": "v"})
    assert head == (
        b"\x88\x00\x00\x00\x00\x00\x00\x00"
        b'{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}    '
    )
    assert offsets == [(0, 8), (8, 11)]


def test_parse_makes_offsets_absolute_and_orders_by_offset():
    raw = text({"b": entry("U8", (3,), (8, 11)), "__metadata__": {"k": "v"}, "a": entry("F32", (2,), (0, 8))})
    h = parse(raw, 11)
    assert list(h.tensors) == ["a", "b"]
    assert h.metadata == {"k": "v"}
    a, b = h.tensors["a"], h.tensors["b"]
    assert (a.begin, a.end, a.shape, a.dtype.code, a.nbytes, a.numel) == (
        8 + len(raw),
        16 + len(raw),
        (2,),
        "F32",
        8,
        2,
    )
    assert (b.begin, b.end, b.shape, b.dtype.code) == (16 + len(raw), 19 + len(raw), (3,), "U8")
    assert (h.header_size, h.file_size, h.data_start) == (len(raw), 8 + len(raw) + 11, 8 + len(raw))


def test_zero_size_tensors_may_share_an_offset_and_scalars_are_allowed():
    raw = text({"e": entry("F32", (0, 3), (0, 0)), "f": entry("I8", (5, 0), (0, 0)), "s": entry("F64", (), (0, 8))})
    h = parse(raw, 8)
    assert {k: v.shape for k, v in h.tensors.items()} == {"e": (0, 3), "f": (5, 0), "s": ()}


def test_empty_header_and_null_metadata():
    assert parse(b"{}").tensors == {}
    assert parse(text({"__metadata__": None})).metadata == {}


def test_whitespace_padding_is_accepted():
    assert list(parse(text({"a": entry()}) + b"      ", 8).tensors) == ["a"]


def test_subbyte_lengths_are_counted_by_bits():
    raw = text({"f4": entry("F4", (2, 3), (0, 3)), "f6": entry("F6_E3M2", (4,), (3, 6))})
    h = parse(raw, 6)
    assert (h.tensors["f4"].nbytes, h.tensors["f6"].nbytes) == (3, 3)


def test_header_size_prefix():
    assert header_size(struct.pack("<Q", 16), 24) == 16
    assert header_size(struct.pack("<Q", MAX_HEADER_SIZE), MAX_HEADER_SIZE + 8) == MAX_HEADER_SIZE


# --- one test per malformed case ---------------------------------------------------------


def test_every_header_error_is_a_value_error_and_an_nnx_save_error():
    assert nnx_save.HeaderError("x", check="index").check == "index" and nnx_save.HeaderError("x").check is None
    assert issubclass(nnx_save.HeaderError, nnx_save.NnxSaveError)
    assert issubclass(nnx_save.HeaderError, ValueError)


def test_file_shorter_than_prefix():
    with raises_check("too_small", match=re.escape("f.st: 5 bytes is shorter than the 8-byte header size prefix")):
        header_size(b"\x01\x02\x03\x04\x05", 5, file="f.st")


def test_header_over_cap():
    with raises_check("too_large", match=re.escape(f"{F}: header size 100000001 exceeds the cap of 100000000 bytes")):
        header_size(struct.pack("<Q", MAX_HEADER_SIZE + 1), 2 * MAX_HEADER_SIZE)


def test_header_size_near_two_to_the_64():
    with raises_check("too_large", match=re.escape(f"{F}: header size 18446744073709551615 exceeds the cap")):
        header_size(b"\xff" * 8, 100)


def test_header_larger_than_file():
    with raises_check(
        "too_large",
        match=re.escape(f"{F}: header size 100 at byte 0 runs past the end of the file (50 bytes)"),
    ):
        header_size(struct.pack("<Q", 100), 50)


def test_header_not_utf8():
    raw = b'{"a\xff":1}'
    with raises_check("encoding", match=re.escape(f"{F}: header is not valid UTF-8 (byte 11 of the file: b'\\xff')")):
        parse(raw)


def test_header_not_json():
    with raises_check(
        "json",
        match=re.escape(f"{F}: header is not valid JSON: Expecting ',' delimiter: line 1 column 8 (char 7)"),
    ):
        parse(b'{"a":1 "b":2}')


def test_header_top_level_array():
    with raises_check("json", match=re.escape(f"{F}: header must be a JSON object, found a JSON list")):
        parse(b'[{"dtype":"F32"}]')


@pytest.mark.parametrize("raw, kind", [(b'"x"', "str"), (b"3", "int"), (b"null", "NoneType"), (b"true", "bool")])
def test_header_top_level_scalar(raw, kind):
    with raises_check("json", match=re.escape(f"found a JSON {kind}")):
        parse(raw)


def test_header_integer_with_too_many_digits():
    # Python refuses to convert > 4300 digits with a bare ValueError; it must still be a HeaderError.
    raw = b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}'
    with raises_check("json", match=re.escape(f"{F}: header is not valid JSON: Exceeds the limit (4300 digits)")):
        parse(raw)


def test_header_nested_too_deep():
    with raises_check("json", match=re.escape(f"{F}: header is not valid JSON: ")):
        parse(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def test_duplicate_tensor_key():
    raw = b'{"a":' + text(entry()) + b',"a":' + text(entry("F32", (2,), (8, 16))) + b"}"
    with raises_check("duplicate_key", match=re.escape(f"{F}: key 'a' appears more than once in the header JSON")):
        parse(raw, 16)


def test_duplicate_field_inside_an_entry():
    raw = b'{"a":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}}'
    with raises_check("duplicate_key", match=re.escape(f"{F}: key 'dtype' appears more than once in the header JSON")):
        parse(raw, 8)


def test_duplicate_metadata_key():
    raw = b'{"__metadata__":{"k":"1","k":"2"}}'
    with raises_check("duplicate_key", match=re.escape(f"{F}: key 'k' appears more than once")):
        parse(raw)


@pytest.mark.parametrize("meta, found", [([1, 2], "list"), ("s", "str"), (3, "int")])
def test_metadata_not_an_object(meta, found):
    with raises_check("metadata", match=re.escape(f"{F}: __metadata__ must be an object of strings, found {found}")):
        parse(text({"__metadata__": meta}))


@pytest.mark.parametrize(
    "value, found",
    [(1, "int 1"), (None, "NoneType None"), ([], "list []"), ({"x": "y"}, "dict {'x': 'y'}"), (1.5, "float 1.5")],
)
def test_metadata_value_not_a_string(value, found):
    with raises_check("metadata", match=re.escape(f"{F}: __metadata__['v'] must be a string, found {found}")):
        parse(text({"__metadata__": {"ok": "x", "v": value}}))


@pytest.mark.parametrize("value, found", [([], "list"), ("F32", "str"), (None, "NoneType"), (4, "int")])
def test_entry_not_an_object(value, found):
    with raises_check("tensor_entry", match=re.escape(f"{F}: tensor 'w': entry must be an object, found {found}")):
        parse(text({"w": value}))


def test_entry_missing_field():
    with raises_check(
        "tensor_entry", match=re.escape(f"{F}: tensor 'w': fields missing ['data_offsets'], unexpected []")
    ):
        parse(text({"w": {"dtype": "F32", "shape": [2]}}), 8)


def test_entry_extra_field():
    with raises_check("tensor_entry", match=re.escape(f"{F}: tensor 'w': fields missing [], unexpected ['extra']")):
        parse(text({"w": {**entry(), "extra": 1}}), 8)


@pytest.mark.parametrize(
    "shape, shown",
    [
        ([-1, 2], "[-1, 2]"),
        ([2.0], "[2.0]"),
        ([True], "[True]"),
        (["2"], "['2']"),
        ("2", "'2'"),
        (2, "2"),
        (None, "None"),
        ([[2]], "[[2]]"),
        ([2, None], "[2, None]"),
    ],
)
def test_shape_not_non_negative_ints(shape, shown):
    with raises_check(
        "tensor_entry",
        match=re.escape(f"{F}: tensor 'w': shape must be a list of non-negative integers, found {shown}"),
    ):
        parse(text({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]}}), 8)


@pytest.mark.parametrize(
    "offsets, shown",
    [
        ([0], "[0]"),
        ([0, 8, 16], "[0, 8, 16]"),
        ([-8, 0], "[-8, 0]"),
        ([0.0, 8], "[0.0, 8]"),
        ([0, True], "[0, True]"),
        ({"b": 0}, "{'b': 0}"),
        (None, "None"),
    ],
)
def test_offsets_not_two_non_negative_ints(offsets, shown):
    with raises_check(
        "tensor_entry",
        match=re.escape(f"{F}: tensor 'w': data_offsets must be two non-negative integers, found {shown}"),
    ):
        parse(text({"w": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}), 8)


@pytest.mark.parametrize("code, shown", [("F128", "'F128'"), ("float32", "'float32'"), (7, "7"), (None, "None")])
def test_unknown_dtype_names_file_tensor_and_code(code, shown):
    with raises_check(
        "dtype",
        match=re.escape(f"{F}: tensor 'w': unknown dtype code {shown}; the safetensors format defines BOOL, F4,"),
    ):
        parse(text({"w": {"dtype": code, "shape": [2], "data_offsets": [0, 8]}}), 8)


def test_begin_after_end():
    with raises_check("offsets", match=re.escape(f"{F}: tensor 'w': data_offsets begin 8 > end 0")):
        parse(text({"w": entry("F32", (0,), (8, 0))}), 8)


def test_byte_length_disagrees_with_shape():
    with raises_check(
        "byte_length",
        match=re.escape(f"{F}: tensor 'w': shape [2, 3] of F32 needs 24 bytes, data_offsets [0, 20] hold 20"),
    ):
        parse(text({"w": entry("F32", (2, 3), (0, 20))}), 20)


def test_byte_length_of_subbyte_tensor():
    with raises_check(
        "byte_length",
        match=re.escape(f"{F}: tensor 'w': shape [8] of F6_E2M3 needs 6 bytes, data_offsets [0, 8] hold 8"),
    ):
        parse(text({"w": entry("F6_E2M3", (8,), (0, 8))}), 8)


@pytest.mark.parametrize("code, shape, bits", [("F4", [3], 12), ("F6_E3M2", [2, 3], 36), ("F4", [1, 1], 4)])
def test_subbyte_tensor_ending_inside_a_byte(code, shape, bits):
    # The reference refuses these ("does not end up at a byte boundary"); so do we.
    with raises_check(
        "byte_length",
        match=re.escape(f"{F}: tensor 'w': shape {shape} of {code} is {bits} bits, not a whole number of bytes"),
    ):
        parse(text({"w": entry(code, shape, (0, (bits + 7) // 8))}), (bits + 7) // 8)


def test_trillion_elements_with_small_offsets():
    with raises_check(
        "byte_length",
        match=re.escape(
            f"{F}: tensor 'w': shape [1000000, 1000000] of F32 needs 4000000000000 bytes, data_offsets [0, 8] hold 8"
        ),
    ):
        parse(text({"w": entry("F32", (10**6, 10**6), (0, 8))}), 8)


def test_more_than_two_to_the_63_elements():
    with raises_check(
        "byte_length",
        match=re.escape(f"{F}: tensor 'w': shape [4294967296, 4294967296, 0] has more than 2**63 elements"),
    ):
        parse(text({"w": entry("U8", (2**32, 2**32, 0), (0, 0))}))


def test_overlapping_offsets():
    raw = text({"a": entry("F32", (2,), (0, 8)), "b": entry("F32", (2,), (4, 12))})
    with raises_check("offsets", match=re.escape(f"{F}: tensor 'b' at [4, 12] overlaps tensor 'a' (ends at 8)")):
        parse(raw, 12)


def test_two_tensors_on_the_same_bytes():
    raw = text({"a": entry(), "b": entry()})
    with raises_check("offsets", match=re.escape(f"{F}: tensor 'b' at [0, 8] overlaps tensor 'a' (ends at 8)")):
        parse(raw, 8)


def test_hole_between_tensors():
    raw = text({"a": entry("F32", (2,), (0, 8)), "b": entry("F32", (2,), (12, 20))})
    with raises_check(
        "offsets", match=re.escape(f"{F}: tensor 'b' at [12, 20] leaves a hole after tensor 'a' (ends at 8)")
    ):
        parse(raw, 20)


def test_data_not_starting_at_zero():
    with raises_check(
        "offsets",
        match=re.escape(f"{F}: tensor 'a' at [4, 12] leaves a hole after the start of the data (0)"),
    ):
        parse(text({"a": entry("F32", (2,), (4, 12))}), 12)


def test_truncated_data():
    with raises_check(
        "file_size",
        match=re.escape(f"{F}: tensor data ends at byte 8 of the data section, but the file holds 5 bytes of data"),
    ):
        parse(text({"a": entry()}), 5)


def test_trailing_bytes_after_data():
    with raises_check(
        "file_size",
        match=re.escape(f"{F}: tensor data ends at byte 8 of the data section, but the file holds 9 bytes of data"),
    ):
        parse(text({"a": entry()}), 9)


def test_data_without_tensors():
    with raises_check(
        "file_size",
        match=re.escape(f"{F}: tensor data ends at byte 0 of the data section, but the file holds 4 bytes of data"),
    ):
        parse(b"{}", 4)


def test_huge_claimed_tensor_in_a_small_file():
    with raises_check(
        "file_size",
        match=re.escape(f"{F}: tensor data ends at byte 4000000000000 of the data section, but the file holds 8 bytes"),
    ):
        parse(text({"w": entry("F32", (10**6, 10**6), (0, 4 * 10**12))}), 8)


def test_messages_name_the_file():
    with raises_check("offsets", match=re.escape("/ckpt/model.safetensors: tensor 'w': data_offsets")):
        parse_header(text({"w": entry("F32", (0,), (8, 0))}), 100, file="/ckpt/model.safetensors")


# --- no allocation proportional to a declared size -----------------------------------------


@pytest.mark.parametrize(
    "shape, offsets, cls",
    [
        ((10**6, 10**6), (0, 8), "byte_length"),
        ((10**6, 10**6), (0, 4 * 10**12), "file_size"),
        ((10**12,), (0, 4 * 10**12), "file_size"),
        ((2**40, 2**40), (0, 0), "byte_length"),
    ],
)
def test_hostile_sizes_allocate_nothing(shape, offsets, cls):
    raw = text({"w": entry("F32", shape, offsets)})
    tracemalloc.start()
    try:
        with raises_check(cls):
            parse(raw, 8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10, peak


# --- fuzzing: only a valid header or a HeaderError ---------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
near_int = st.one_of(st.integers(-3, 40), st.sampled_from([2**63, 2**64, 10**12, -(2**63)]), json_values)
near_entry = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "dtype": st.one_of(st.sampled_from([*list(_dtypes.DTYPES), "F128", "f32", ""]), json_values),
            "shape": st.one_of(st.lists(near_int, max_size=3), json_values),
            "data_offsets": st.one_of(st.lists(near_int, min_size=2, max_size=2), st.lists(near_int, max_size=3)),
        }
    ),
)
near_header = st.dictionaries(
    st.one_of(st.sampled_from(["a", "b", "__metadata__"]), st.text(max_size=4)),
    st.one_of(
        near_entry, st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3), json_values), max_size=3)
    ),
    max_size=4,
)


def accepts_only_valid_or_header_error(fn, *args):
    try:
        result = fn(*args)
    except nnx_save.HeaderError:
        return None
    assert isinstance(result, FileHeader)
    return result


def check_structured(header, data):
    h = accepts_only_valid_or_header_error(parse, text(header), data)
    if h is not None:  # everything downstream may trust it: ranges tile the data exactly
        position = h.data_start
        for t in h.tensors.values():
            assert t.begin == position and t.end - t.begin == _dtypes.nbytes_for(t.dtype, t.numel)
            position = t.end
        assert position == h.file_size


def check_random_bytes(raw, size):
    accepts_only_valid_or_header_error(parse_header, raw, size)
    accepts_only_valid_or_header_error(parse_blob, raw)


def fuzz(check, fast, slow, **strategies):
    """A quick run for every test session and a long one under ``-m slow``."""
    quick = settings(max_examples=fast)(given(**strategies)(check))
    deep = pytest.mark.slow(settings(max_examples=slow)(given(**strategies)(check)))
    return quick, deep


test_fuzz_structured_headers, test_fuzz_structured_headers_long = fuzz(
    check_structured, 60, 3000, header=near_header, data=st.integers(0, 64)
)
test_fuzz_random_bytes, test_fuzz_random_bytes_long = fuzz(
    check_random_bytes, 100, 5000, raw=st.binary(max_size=200), size=st.integers(0, 400)
)


VALID_BLOB = (lambda head: head + bytes(8 + 6 + 3 + 1 + 2))(
    encode_header([("w", "F32", (2,)), ("v", "F16", (3,)), ("b", "BOOL", ()), ("f", "F4", (2, 2))], {"m": "x"})[0]
)


def check_mutated(data):
    blob = bytearray(VALID_BLOB)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, len(blob) - 1))
        if op == "flip":
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            blob[i] = data.draw(st.sampled_from(b'{}[]",:0123456789-. \x00\xff'))
        elif op == "insert":
            blob.insert(i, data.draw(st.integers(0, 255)))
        elif op == "delete":
            del blob[i]
        else:
            del blob[i:]
        if not blob:
            break
    accepts_only_valid_or_header_error(parse_blob, bytes(blob))


test_fuzz_mutated_valid_header, test_fuzz_mutated_valid_header_long = fuzz(check_mutated, 100, 5000, data=st.data())


# --- the encoder -------------------------------------------------------------------------------

entries_strategy = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
        st.sampled_from(list(_dtypes.DTYPES)),
        st.lists(st.integers(0, 5), max_size=3),
    ),
    max_size=6,
    unique_by=lambda e: e[0],
)


def _whole_bytes(code, shape):
    row = _dtypes.DTYPES[code]
    numel = 1
    for d in shape:
        numel *= d
    return numel * row.bits % 8 == 0


@settings(max_examples=40)
@given(entries=entries_strategy, metadata=st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5)))
def test_encode_parse_round_trip(entries, metadata):
    entries = [(n, c, tuple(s) if _whole_bytes(c, s) else (*s, 8)) for n, c, s in entries]
    before = copy.deepcopy((entries, metadata))
    head, offsets = encode_header(entries, metadata)
    assert (entries, metadata) == before  # pure: inputs untouched
    assert len(head) % 8 == 0 and head[8:].rstrip(b" ").endswith(b"}")
    data = offsets[-1][1] if offsets else 0
    h = parse_blob(head + bytes(data))
    assert h.metadata == (metadata or {})
    assert {n: (t.dtype.code, t.shape) for n, t in h.tensors.items()} == {n: (c, s) for n, c, s in entries}
    assert [(h.tensors[n].begin - h.data_start, h.tensors[n].end - h.data_start) for n, _, _ in entries] == offsets
    assert encode_header(entries, metadata) == (head, offsets)  # deterministic


def test_encode_keeps_non_ascii_names_as_utf8():
    head, _ = encode_header([("poids/é", "F32", (1,))])
    assert '"poids/é"'.encode() in head


def test_encode_refuses_metadata_as_a_tensor_name():
    with pytest.raises(
        nnx_save.KeyPathError,
        match=re.escape("'__metadata__': the safetensors format reserves this key for metadata; rename the tensor"),
    ):
        encode_header([("__metadata__", "F32", (1,))])


def test_encode_refuses_subbyte_tensor_ending_inside_a_byte():
    with pytest.raises(
        nnx_save.UnsupportedValueError,
        match=re.escape(
            "w: 3 F4 elements are 12 bits, not a whole number of bytes; safetensors readers refuse such a "
            "tensor. Pad it to a multiple of 2 elements"
        ),
    ):
        encode_header([("w", "F4", (3,))])
    with pytest.raises(nnx_save.UnsupportedValueError, match=re.escape("Pad it to a multiple of 4 elements")):
        encode_header([("w", "F6_E2M3", (2,))])


def test_encode_refuses_unknown_code():
    with raises_check("dtype", match=re.escape("tensor 'w': unknown dtype code 'F128'")):
        encode_header([("w", "F128", (1,))])


# --- the fast path: the same checks over every tensor at once, the exact path replayed when one declines ---


def _pairs(pairs, escape=False) -> str:
    """A JSON object written from ``pairs`` as given (a key may repeat), values nested the same way."""

    def value(v):
        return _pairs(v, escape) if isinstance(v, tuple) else json.dumps(v, ensure_ascii=escape)

    return "{" + ",".join(f"{json.dumps(k, ensure_ascii=escape)}:{value(v)}" for k, v in pairs) + "}"


def _outcome(parse, *args):
    try:
        return parse(*args)
    except nnx_save.HeaderError as e:
        return type(e), str(e), e.check


def _agree(raw: str, data: int):
    """``parse_header`` gives what the exact path gives, error for error; returns both
    outcomes, the fast path's (a header, or None where it declines) first."""
    from nnx_save.format import _header

    size = 8 + len(raw.encode()) + data
    fast = _outcome(_header._parse_fast, raw, 8 + len(raw.encode()), size, F)
    exact = _outcome(_header._parse_exact, raw, 8 + len(raw.encode()), size, F)
    assert _outcome(parse_header, raw.encode(), size) == exact
    if isinstance(fast, FileHeader):  # the fast path never accepts what the exact path refuses
        assert fast == exact
        assert list(fast.tensors) == list(exact.tensors) and fast.tensors == exact.tensors
    return fast, exact


E8 = (("dtype", "F32"), ("shape", [2]), ("data_offsets", [0, 8]))
E8b = (("dtype", "F32"), ("shape", [2]), ("data_offsets", [8, 16]))


@pytest.mark.parametrize(
    "raw, data",
    [
        (_pairs([("a", E8), ("a", E8)]), 8),  # a repeated tensor whose last copy alone is a valid header
        (_pairs([("a", E8), ("b", E8b), ("a", E8)]), 16),
        (_pairs([("a", (*E8, ("dtype", "F32")))]), 8),  # a repeated field with the same value
        (_pairs([("a", E8), ("__metadata__", (("k", "v"), ("k", "v")))]), 8),
        (_pairs([("__metadata__", ()), ("a", E8), ("__metadata__", ())]), 8),
        (_pairs([("a", E8), ("a", (("x", (("p", 1), ("q", 2))),)), ("a", E8)]), 8),  # colons in a dropped value
        ('{"\u00e9":' + _pairs(E8) + ',"\\u00e9":' + _pairs(E8) + "}", 8),  # one key, spelled twice
    ],
)
def test_fast_path_refuses_every_repeated_key(raw, data):
    fast, exact = _agree(raw, data)
    assert fast is None and exact[0] is nnx_save.HeaderError and exact[2] == "duplicate_key"


@pytest.mark.parametrize(
    "pairs, data",
    [
        ([("a:b", E8), ("__metadata__", (("x:y", "1:2:3"), ("", ":")))], 8),  # colons inside strings are counted
        ([("a", E8), ("b", (("dtype", "F32"), ("shape", [0, 3]), ("data_offsets", [8, 8])))], 8),
        ([("b", E8b), ("a", E8)], 16),  # out of JSON order on disk
        ([("__metadata__", None)], 0),
        ([], 0),
    ],
)
def test_fast_path_takes_valid_headers(pairs, data):
    assert isinstance(_agree(_pairs(pairs), data)[0], FileHeader)


def test_fast_path_declines_an_escaped_colon_and_the_exact_path_parses_it():
    raw = '{"a\\u003ab":' + _pairs(E8) + "}"
    assert _agree(raw, 8)[0] is None and parse_header(raw.encode(), 8 + len(raw) + 8).tensors["a:b"].shape == (2,)


_keys = st.sampled_from(["a", "b", "a:b", "__metadata__", "dtype", "\u00e9", ":"])
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 20) | st.sampled_from(["F32", "F16", "U8", "F4", "X", "k:v"]),
    lambda inner: st.lists(inner, max_size=3) | st.lists(st.tuples(_keys, inner), max_size=3).map(tuple),
    max_leaves=8,
)


@st.composite
def _texts(draw):
    """Headers near valid ones: real entries, then repeated, reordered, mistyped or misplaced members."""
    pairs, position = [], 0
    for name in draw(st.lists(_keys, max_size=4, unique=draw(st.booleans()))):
        code = draw(st.sampled_from(["F32", "U8", "F4", "X"]))
        shape = draw(st.lists(st.integers(-1, 3), max_size=2))
        n = int(np.prod(shape)) * {"F32": 4, "U8": 1, "F4": 1, "X": 1}[code] if all(d >= 0 for d in shape) else 1
        fields = [("dtype", code), ("shape", shape), ("data_offsets", [position, position + max(n, 0)])]
        if draw(st.integers(0, 3)) == 0:  # a member too many: repeated or unknown
            fields.append((draw(st.sampled_from(["dtype", "shape", "data_offsets", "x"])), draw(_values)))
        pairs.append((name, tuple(draw(st.permutations(fields)))))
        position += max(n, 0)
    if draw(st.booleans()):
        pairs.append(
            ("__metadata__", tuple(draw(st.lists(st.tuples(_keys, st.sampled_from(["v", "1:2"])), max_size=2))))
        )
    return _pairs(pairs, draw(st.booleans())), position + draw(st.sampled_from([0, 0, 1, -1]))


@settings(max_examples=400)
@given(case=_texts())
def test_fast_path_agrees_with_the_exact_path(case):
    raw, data = case
    _agree(raw, max(data, 0))


@settings(max_examples=200)
@given(
    number=st.floats() | st.sampled_from(["2.0", "1e400", "1E2", "NaN", "-Infinity"]),
    where=st.sampled_from(["shape", "begin", "end"]),
)
def test_a_non_integer_number_in_a_shape_or_offsets_is_refused_by_both_paths(number, where):
    """Any JSON number but an integer where the format wants one (a float, ``NaN``,
    ``Infinity``, an exponent) is refused, the fast path declining as the exact one refuses:
    its scanner never turns a constant or a float into an int."""
    token = json.dumps(number) if isinstance(number, float) else number
    shape, offsets = "[2]", "[0,8]"
    if where == "shape":
        shape = f"[{token}]"
    else:
        offsets = f"[{token},8]" if where == "begin" else f"[0,{token}]"
    raw = f'{{"a":{{"dtype":"F32","shape":{shape},"data_offsets":{offsets}}}}}'
    fast, exact = _agree(raw, 8)
    assert fast is None and isinstance(exact, tuple), (fast, exact)  # exact: (error type, message, check)
