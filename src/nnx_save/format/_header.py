"""Pure parsing, validation and encoding of safetensors headers (no I/O, no jax).

A safetensors file is ``[8-byte little-endian N][N bytes of UTF-8 JSON][data]``.
:func:`parse_header` validates the whole header before anything downstream trusts an
offset: each failed check raises its own :class:`~nnx_save.HeaderError` subclass with
the tensor and the numbers involved. Nothing is allocated in proportion to a size the
file declares until every check has passed.

Every header is first checked the fast way (:func:`_parse_fast`), which only answers
"valid" or "ask the exact one": on any doubt the exact path (:func:`_parse_exact`)
runs and raises the error it always raised.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .._frozen import Frozen, frozen_many
from ..errors import HeaderError, KeyPathError, OptionError, UnsupportedValueError, short_repr
from . import _dtypes

__all__ = ["MAX_HEADER_SIZE", "FileHeader", "TensorInfo", "encode_header", "header_size", "parse_header"]

MAX_HEADER_SIZE = 100_000_000  # the reference implementation's cap
_PREFIX = struct.Struct("<Q")
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_MAX_NUMEL = 2**63 - 1  # beyond any real buffer; refuses 10^30-element claims early


class TensorInfo(Frozen):
    """One tensor of a file: where its bytes are and what they mean.

    ``begin`` and ``end`` are absolute byte offsets in ``file`` (data start included).
    """

    __slots__ = ("begin", "dtype", "end", "file", "name", "nbytes", "shape")  # made per tensor
    _fields = _compared = ("name", "dtype", "shape", "begin", "end", "file")
    name: str
    dtype: _dtypes.DtypeInfo
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str
    nbytes: int  # an attribute: asked per tensor and per piece

    def __init__(
        self, name: str, dtype: _dtypes.DtypeInfo, shape: tuple[int, ...], begin: int, end: int, file: str = ""
    ) -> None:
        set_field = object.__setattr__
        set_field(self, "name", name)
        set_field(self, "dtype", dtype)
        set_field(self, "shape", shape)
        set_field(self, "begin", begin)
        set_field(self, "end", end)
        set_field(self, "file", file)
        set_field(self, "nbytes", end - begin)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FileHeader(Frozen):
    """The validated header of one file: tensors in offset order, and metadata."""

    __slots__ = ("file", "file_size", "header_size", "metadata", "tensors")
    _fields = _compared = ("file", "tensors", "metadata", "header_size", "file_size")
    file: str
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    header_size: int
    file_size: int

    def __init__(
        self,
        file: str,
        tensors: Mapping[str, TensorInfo],
        metadata: Mapping[str, str] | None = None,
        header_size: int = 0,
        file_size: int = 0,
    ) -> None:
        set_field = object.__setattr__
        set_field(self, "file", file)
        set_field(self, "tensors", tensors)
        set_field(self, "metadata", {} if metadata is None else metadata)
        set_field(self, "header_size", header_size)
        set_field(self, "file_size", file_size)

    @property
    def data_start(self) -> int:
        return 8 + self.header_size


def header_size(prefix: bytes, file_size: int, *, file: str = "<bytes>") -> int:
    """Validate the 8-byte size prefix against the cap and the file size.

    Examples:
        >>> header_size(b"\\x10" + bytes(7), 24)
        16
    """
    if len(prefix) < 8 or file_size < 8:
        raise HeaderError(
            f"{file}: {max(file_size, len(prefix))} bytes is shorter than the 8-byte header size prefix",
            check="too_small",
        )
    (n,) = _PREFIX.unpack(prefix[:8])
    if n > MAX_HEADER_SIZE:
        raise HeaderError(f"{file}: header size {n} exceeds the cap of {MAX_HEADER_SIZE} bytes", check="too_large")
    if 8 + n > file_size:
        raise HeaderError(
            f"{file}: header size {n} at byte 0 runs past the end of the file ({file_size} bytes)", check="too_large"
        )
    return n


def unique_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A ``json.loads`` object hook refusing a key given twice (``json.loads`` alone
    keeps the last in silence); callers say which JSON it was."""
    out = dict(pairs)  # in C: a manifest or index has a hundred thousand objects
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise HeaderError(f"key {key!r} appears more than once", check="duplicate_key")
            seen.add(key)
    return out


def strict_json(text: str) -> object:
    """``json.loads`` refusing a key given twice (:class:`HeaderError`) and
    nesting deeper than the recursion limit allows: every JSON read from a file.

    Raises:
        ValueError: Not JSON (``JSONDecodeError``), an int over 4300 digits, nested
            too deeply, or a duplicate key (:class:`HeaderError`, a ``ValueError``).

    Examples:
        >>> strict_json('{"a": [1, 2]}')
        {'a': [1, 2]}
        >>> strict_json("[" * 100_000)
        Traceback (most recent call last):
        ...
        ValueError: nested too deeply (the depth is capped by the interpreter's recursion limit)
    """
    import json  # the exact path: a small read parses with the C scanner alone (_SCAN)

    try:
        obj = json.loads(text, object_pairs_hook=unique_pairs)
    except RecursionError:
        raise ValueError("nested too deeply (the depth is capped by the interpreter's recursion limit)") from None
    refuse_lone_surrogates(text)
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate(text: str) -> int | None:
    r"""The offset in JSON ``text`` of its first escape of a lone UTF-16 surrogate
    (``\ud800`` not followed by a low one, or a low one alone), or ``None``: JSON allows
    the escape, but the string it makes is no Unicode text (UTF-8 cannot encode it, the
    safetensors reference refuses it). A high escape right before a low one is one
    character (an emoji): allowed. C-speed when no surrogate escape is present.

    Examples:
        >>> lone_surrogate(r'{"a\ud83d\ude00": 1}'), lone_surrogate(r'{"a\ud800": 1}'), lone_surrogate(r'"\\ud800"')
        (None, 3, None)
    """
    paired = -1  # the offset of a low escape already taken by the high one before it
    for m in _SURROGATE_ESCAPE.finditer(text):
        start = m.start()
        if start == paired or _escaped(text, start):
            continue
        unit = int(text[start + 2 : start + 6], 16)
        after = _SURROGATE_ESCAPE.match(text, m.end())
        if unit < 0xDC00 and after is not None and int(text[m.end() + 2 : m.end() + 6], 16) >= 0xDC00:
            paired = m.end()
            continue
        return start
    return None


def _escaped(text: str, at: int) -> bool:
    """Whether the backslash at ``at`` is itself escaped (an odd run of backslashes before it)."""
    run = at
    while run and text[run - 1] == "\\":
        run -= 1
    return (at - run) % 2 == 1


def refuse_lone_surrogates(text: str, base: int = 0, what: str = "the JSON", file: str | None = None) -> None:
    """Raise :class:`HeaderError` (check ``"encoding"``) at the first lone-surrogate escape
    of JSON ``text`` (which starts at byte ``base`` of ``what``), naming its byte offset
    and the string it is in."""
    at = lone_surrogate(text) if "\\u" in text else None
    if at is not None:
        around = text[max(0, text.rfind('"', 0, at)) : text.find('"', at) + 1 or at + 6]
        raise HeaderError(
            f"{file + ': ' if file else ''}a lone UTF-16 surrogate escape {text[at : at + 6]} at byte "
            f"{base + len(text[:at].encode('utf-8'))} of {what}, in the string {around}; a key or string must be "
            "Unicode text (safetensors refuses it too)",
            check="encoding",
            file=file,
        )


def _text(raw: bytes, file: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(
            f"{file}: header is not valid UTF-8 (byte {8 + e.start} of the file: {raw[e.start : e.start + 1]!r})",
            check="encoding",
        ) from None


def _decode_json(text: str, file: str) -> dict[str, object]:
    """The header's JSON object, every key at every level checked unique as it is parsed,
    every string Unicode text."""
    refuse_lone_surrogates(text, 8, "the file", file)
    try:
        obj = strict_json(text)
    except HeaderError as e:
        raise HeaderError(f"{file}: {e} in the header JSON", check=e.check, file=file) from None
    except ValueError as e:  # JSONDecodeError, an int over 4300 digits, too deep
        raise HeaderError(f"{file}: header is not valid JSON: {e}", check="json") from None
    if not isinstance(obj, dict):
        raise HeaderError(f"{file}: header must be a JSON object, found a JSON {type(obj).__name__}", check="json")
    return obj


def _parse_metadata(value: object, file: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HeaderError(
            f"{file}: __metadata__ must be an object of strings, found {type(value).__name__}", check="metadata"
        )
    for k, v in value.items():
        if not isinstance(v, str):
            raise HeaderError(
                f"{file}: __metadata__[{k!r}] must be a string, found {type(v).__name__} {short_repr(v, 60)}",
                check="metadata",
            )
    return dict(value)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(name: str, entry: object, file: str) -> tuple[_dtypes.DtypeInfo, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        raise HeaderError(
            f"{file}: tensor {name!r}: entry must be an object, found {type(entry).__name__}", check="tensor_entry"
        )
    if set(entry) != _ENTRY_FIELDS:
        missing, extra = sorted(_ENTRY_FIELDS - set(entry)), sorted(set(entry) - _ENTRY_FIELDS)
        raise HeaderError(
            f"{file}: tensor {name!r}: fields missing {missing}, unexpected {extra}", check="tensor_entry"
        )
    try:
        dtype = _dtypes.from_code(entry["dtype"], name)
    except HeaderError as e:
        raise HeaderError(f"{file}: {e}", check="dtype") from None
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise HeaderError(
            f"{file}: tensor {name!r}: shape must be a list of non-negative integers, found {short_repr(shape, 80)}",
            check="tensor_entry",
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise HeaderError(
            f"{file}: tensor {name!r}: data_offsets must be two non-negative integers, found {short_repr(offsets, 80)}",
            check="tensor_entry",
        )
    begin, end = offsets
    if begin > end:
        raise HeaderError(f"{file}: tensor {name!r}: data_offsets begin {begin} > end {end}", check="offsets")
    return dtype, tuple(shape), begin, end


def _check_length(name: str, dtype: _dtypes.DtypeInfo, shape: tuple[int, ...], begin: int, end: int, file: str) -> None:
    numel, addressable = 1, -(-dtype.bits // 8)
    for d in shape:  # stop early so a 10^1000-element claim costs nothing
        numel *= d
        addressable *= d or 1  # numpy refuses a shape whose non-zero dimensions overflow, even if one is 0
        if numel > _MAX_NUMEL:
            raise HeaderError(
                f"{file}: tensor {name!r}: shape {list(shape)} has more than 2**63 elements", check="byte_length"
            )
        if addressable > _MAX_NUMEL:
            raise HeaderError(
                f"{file}: tensor {name!r}: shape {list(shape)} of {dtype.code} cannot be addressed: its non-zero "
                "dimensions times the item size exceed 2**63 - 1 bytes",
                check="byte_length",
            )
    if numel * dtype.bits % 8:  # as the reference: a tensor never ends inside a byte
        raise HeaderError(
            f"{file}: tensor {name!r}: shape {list(shape)} of {dtype.code} is {numel * dtype.bits} bits, "
            "not a whole number of bytes",
            check="byte_length",
        )
    expected = _dtypes.nbytes_for(dtype, numel)
    if end - begin != expected:
        raise HeaderError(
            f"{file}: tensor {name!r}: shape {list(shape)} of {dtype.code} needs {expected} bytes, "
            f"data_offsets [{begin}, {end}] hold {end - begin}",
            check="byte_length",
        )


def _check_layout(entries: list[tuple[str, int, int]], data_size: int, file: str) -> None:
    """Ranges must tile ``[0, data_size)`` exactly: start at 0, no overlap, no hole."""
    position, previous = 0, None
    for name, begin, end in sorted(entries, key=lambda e: (e[1], e[2])):
        if begin != position:
            what = "overlaps" if begin < position else "leaves a hole after"
            after = f"tensor {previous!r} (ends at {position})" if previous else "the start of the data (0)"
            raise HeaderError(f"{file}: tensor {name!r} at [{begin}, {end}] {what} {after}", check="offsets")
        position, previous = end, name
    if position != data_size:
        raise HeaderError(
            f"{file}: tensor data ends at byte {position} of the data section, "
            f"but the file holds {data_size} bytes of data",
            check="file_size",
        )


def parse_header(raw: bytes, file_size: int, *, file: str = "<bytes>") -> FileHeader:
    """Validate the JSON part of a header (``raw``, N bytes) for a file of ``file_size``.

    Args:
        raw: the N header bytes that follow the 8-byte prefix.
        file_size: the whole file's size in bytes.
        file: a name for messages and :attr:`TensorInfo.file`.

    Returns:
        The :class:`FileHeader`, tensors in offset order, offsets made absolute.

    Raises:
        HeaderError: one subclass per failed check.

    Examples:
        >>> h = parse_header(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8 + 54 + 8)
        >>> h.tensors["a"].shape, h.tensors["a"].begin
        ((2,), 62)
    """
    text = _text(raw, file)
    try:
        found = _parse_fast(text, 8 + len(raw), file_size, file)
    except (StopIteration, ValueError, RecursionError):  # not JSON (or too deep): the exact path names what is wrong
        found = None
    if found is not None and "\\u" in text and lone_surrogate(text) is not None:
        found = None  # the exact path refuses it, naming where
    return _parse_exact(text, 8 + len(raw), file_size, file) if found is None else found


def _parse_exact(text: str, data_start: int, file_size: int, file: str) -> FileHeader:
    """Every check in turn, each failure raised as its own error (the reference path)."""
    obj = _decode_json(text, file)
    metadata = _parse_metadata(obj.pop("__metadata__", None), file)
    parsed = []
    for name, entry in obj.items():
        dtype, shape, begin, end = _parse_entry(name, entry, file)
        _check_length(name, dtype, shape, begin, end, file)
        parsed.append((name, dtype, shape, begin, end))
    _check_layout([(n, b, e) for n, _, _, b, e in parsed], file_size - data_start, file)
    parsed.sort(key=lambda p: (p[3], p[4]))
    tensors = {n: TensorInfo(n, dt, sh, data_start + b, data_start + e, file) for n, dt, sh, b, e in parsed}
    return FileHeader(file, tensors, metadata, data_start - 8, file_size)


def _parse_fast(text: str, data_start: int, file_size: int, file: str) -> FileHeader | None:
    """The same checks, each over every tensor at once in C-level builtins, the JSON
    parsed without a hook (:func:`_keys_unique` proves no key repeats): ``None`` as
    soon as one fails or might, and :func:`_parse_exact` says which."""
    obj, end = _SCAN(text, 0)  # json.loads less its wrappers: leading space and a BOM go the exact way
    if type(obj) is not dict or (end != len(text) and text[end:].strip(" \t\n\r")):
        return None
    has_meta = "__metadata__" in obj
    meta = obj.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if type(meta) is not dict or not _STR.issuperset(map(type, meta.values())):
        return None
    names, rows = list(obj), _fast_rows(list(obj.values()))
    if rows is None or not _keys_unique(text, names, meta, has_meta):
        return None
    order, begins, ends, nbytes, dtypes, shapes = rows
    if not isinstance(order, range):  # into offset order
        names, dtypes, shapes = [names[i] for i in order], [dtypes[i] for i in order], [shapes[i] for i in order]
        begins, ends, nbytes = [begins[i] for i in order], [ends[i] for i in order], [nbytes[i] for i in order]
    if not _tiles(begins, ends, file_size - data_start):
        return None
    columns = {
        "name": names,
        "dtype": dtypes,
        "shape": shapes,
        "begin": list(map(data_start.__add__, begins)),
        "end": list(map(data_start.__add__, ends)),
        "nbytes": nbytes,
    }
    tensors = dict(zip(names, frozen_many(TensorInfo, len(names), columns, {"file": file}), strict=True))
    return FileHeader(file, tensors, dict(meta), data_start - 8, file_size)


class _Plain:
    """What the scanner of CPython's ``_json`` reads off a decoder: ``json.JSONDecoder()``'s settings."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int  # these very types: the scanner's own conversions
    parse_constant = {"-Infinity": -math.inf, "Infinity": math.inf, "NaN": math.nan}.__getitem__


def _plain_scanner() -> Callable[[str, int], tuple[Any, int]]:
    """``json.JSONDecoder().scan_once``: ``(value, end)`` of the JSON value at an index,
    ``StopIteration`` where none starts there; made of CPython's ``_json`` alone, as the
    ``json`` package (which a small read would spend more on importing than on its
    header) makes it."""
    try:
        from _json import make_scanner
    except ImportError:  # another interpreter: the package's own
        import json

        return json.JSONDecoder().scan_once  # type: ignore[attr-defined]  # set by __init__, not in the stubs
    return make_scanner(_Plain())  # type: ignore[arg-type]  # any object with the decoder's settings


_SCAN = _plain_scanner()
_STR = frozenset({str})
_INT = frozenset({int})  # a JSON number is an int or a float; bool is its own type
_FIELDS = tuple(map(operator.itemgetter, ("dtype", "shape", "data_offsets")))
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_ITEMSIZE = {code: -(-row.bits // 8) for code, row in _dtypes.DTYPES.items()}  # bytes one element spans


def _fast_rows(entries: list[Any]) -> tuple[Sequence[int], list, list, list, list, list] | None:
    """``(order, begins, ends, nbytes, dtypes, shapes)`` of tensor entries that pass
    every check of :func:`_parse_entry` and :func:`_check_length` (``order``: by
    ``(begin, end)``, then position; a ``range`` when that is their own order), else ``None``."""
    if not entries:
        return range(0), [], [], [], [], []
    if set(map(type, entries)) != {dict} or set(map(len, entries)) != {3}:
        return None
    try:  # three members, each of the fields: exactly the fields
        codes, shapes, offsets = (list(map(field, entries)) for field in _FIELDS)
        dtypes = list(map(_dtypes.DTYPES.__getitem__, codes))
    except (KeyError, TypeError):  # KeyError: a field missing or an unknown dtype; TypeError: an unhashable one
        return None
    if set(map(type, shapes)) | set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}:
        return None
    begins, ends = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
    dims = list(itertools.chain.from_iterable(shapes))
    if not _INT.issuperset(map(type, itertools.chain(dims, begins, ends))):
        return None
    if min(dims, default=0) < 0 or max(dims, default=0) > _MAX_NUMEL or max(map(len, shapes)) > 64:
        return None  # bounded: each product below is of at most 64 numbers under 2**63
    if min(begins) < 0 or not all(map(operator.le, begins, ends)):
        return None
    numels = list(map(math.prod, shapes))
    if max(map(operator.mul, numels, map(_ITEMSIZE.__getitem__, codes))) > _MAX_NUMEL or (
        0 in numels
        and any(
            _ITEMSIZE[c] * math.prod(d or 1 for d in s) > _MAX_NUMEL
            for c, s, n in zip(codes, shapes, numels, strict=True)
            if not n
        )
    ):
        return None  # numpy refuses a shape whose non-zero dimensions overflow, even if one is 0
    nbytes = list(map(operator.sub, ends, begins))
    bits = map(operator.attrgetter("bits"), dtypes)  # whole bytes, exactly the bytes the offsets hold:
    if list(map(operator.mul, numels, bits)) != list(map(operator.mul, nbytes, itertools.repeat(8))):
        return None
    order: Sequence[int] = range(len(begins))  # in offset order already (a file this package wrote)
    if not all(map(operator.lt, begins, begins[1:])):
        order = [i for _, _, i in sorted(zip(begins, ends, range(len(begins)), strict=True))]
    return order, begins, ends, nbytes, dtypes, list(map(tuple, shapes))


def _tiles(begins: list[int], ends: list[int], data_size: int) -> bool:
    """Whether sorted ranges tile ``[0, data_size)`` exactly (as :func:`_check_layout`)."""
    if not begins:
        return data_size == 0
    return begins[0] == 0 and ends[-1] == data_size and begins[1:] == ends[:-1]


def _keys_unique(text: str, names: list[str], meta: dict[str, str], has_meta: bool) -> bool:
    """Whether no key of the JSON ``text`` repeats at any level, for a text that
    parsed into valid entries of tensors ``names`` (three members each, no ``:`` in
    their fields or dtype codes) and metadata ``meta`` (present if ``has_meta``).

    Every member of a JSON object is written with one ``:`` outside strings, and a
    repeated key drops a member (and whatever its value held) from the parsed
    objects; so the text's ``:`` count equals the parsed objects' members plus the
    ``:`` inside their strings exactly when no key repeats. An escaped colon
    (``\\u003a``) would break the count: such a text goes to the hook instead.
    """
    if "u003a" in text or "u003A" in text:
        return False
    members = len(names) * 4 + has_meta + len(meta)  # a tensor: its name's member and its entry's three
    colons = "".join(names).count(":") + "".join(meta).count(":") + "".join(meta.values()).count(":")
    return text.count(":") == members + colons


def _not_text(body: Mapping[str, Any]) -> Exception:
    """The typed refusal of a header whose names or metadata are no Unicode text (a lone
    surrogate, ``"\\ud800"``): the file would be refused by every reader, ours included."""
    for name in body:
        if not _is_text(name):
            return KeyPathError(f"{name!a}: a tensor name must be Unicode text (it holds a lone surrogate)", name)
    meta = body.get("__metadata__") or {}
    bad = next(k for k, v in meta.items() if not (_is_text(k) and _is_text(v)))
    return OptionError(f"metadata {bad!a}: keys and values must be Unicode text (a lone surrogate)", "metadata")


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def encode_header(
    entries: Iterable[tuple[str, str, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[tuple[int, int]]]:
    """Encode the prefix and header for ``(name, dtype code, shape)`` entries.

    Tensors are laid out in the given order; the JSON is padded with spaces to a
    multiple of 8 bytes so the data section starts 8-byte aligned.

    Raises:
        KeyPathError: a tensor named ``__metadata__`` (the format reserves it), or a
            name that is no Unicode text (a lone surrogate).
        OptionError: metadata that is no Unicode text.
        UnsupportedValueError: a sub-byte tensor (``F4``, ``F6_*``) whose bits do not
            fill whole bytes; the reference refuses to read such a file.

    Returns:
        ``(prefix + header bytes, [(begin, end) relative to the data section, ...])``.

    Examples:
        >>> head, offsets = encode_header([("x", "F32", (2,))])
        >>> len(head) % 8, offsets
        (0, [(0, 8)])
    """
    body: dict[str, object] = {}
    if metadata:
        body["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets, position = [], 0
    for name, code, shape in entries:
        row, numel = _dtypes.DTYPES.get(code) or _dtypes.from_code(code, name), math.prod(shape)
        if name == "__metadata__":
            raise KeyPathError(
                "'__metadata__': the safetensors format reserves this key for metadata; rename the tensor", name
            )
        if numel * row.bits % 8:
            raise UnsupportedValueError(
                f"{name}: {numel} {code} elements are {numel * row.bits} bits, not a whole number of bytes; "
                "safetensors readers refuse such a tensor. Pad it to a multiple of "
                f"{8 // math.gcd(8, row.bits)} elements",
                name,
            )
        nbytes = numel * row.bits // 8  # whole bytes: checked above
        offsets.append((position, position + nbytes))
        body[name] = {"dtype": code, "shape": [int(d) for d in shape], "data_offsets": [position, position + nbytes]}
        position += nbytes
    import json

    try:
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _not_text(body) from None
    text += b" " * (-len(text) % 8)
    return _PREFIX.pack(len(text)) + text, offsets
