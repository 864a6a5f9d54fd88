"""A data-only reader of the pickle opcodes ``torch.jit.save`` writes (``data.pkl``).

Unpickling would import and call whatever the pickle names; this reader interprets the
opcodes on its own stack and builds plain data: a ``GLOBAL`` is a :class:`Global`
(never imported), a ``REDUCE`` / ``NEWOBJ`` a :class:`Call` (never called), a storage
record a :class:`PersistentId`. Any other opcode is refused with its byte offset.
Pure: no I/O, no numpy, no torch.

Bounded whatever the bytes claim: at most :data:`MAX_OPCODES` opcodes, :data:`MAX_VALUES`
values built (the stack and the memo hold at most that many), containers nested at most
:data:`MAX_NESTING` deep; past any of them a :class:`~nnx_save.errors.ConvertError` names
the limit and the byte (a module's structure is far smaller: tensor data is elsewhere).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConvertError

__all__ = ["MAX_NESTING", "MAX_OPCODES", "MAX_VALUES", "Call", "Global", "PersistentId", "read_data_pickle"]

MAX_VALUES = 1 << 20  # values built (each at most a few hundred bytes: well under 1 GiB in all)
MAX_OPCODES = 1 << 23  # opcodes run (a few seconds of this loop)
MAX_NESTING = 1000  # containers inside containers (what repr, hash and == recurse through)


@dataclass(frozen=True)
class Global:
    """A ``module name`` reference, kept as text: nothing is imported."""

    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(eq=False)
class Call:
    """``func(*args)`` as recorded, never run; ``state`` is what ``BUILD`` gave it and
    ``items`` what ``SETITEM(S)`` added."""

    func: Any
    args: tuple
    state: Any = None
    items: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PersistentId:
    """A ``BINPERSID`` record (torch: ``("storage", type, key, location, numel)``)."""

    value: Any


class _Mark:
    """The ``MARK`` opcode's place on the stack."""


_MARK = _Mark()
_FIXED = {  # opcode -> the struct of its fixed-size argument
    b"K": struct.Struct("<B"),
    b"M": struct.Struct("<H"),
    b"J": struct.Struct("<i"),
    b"G": struct.Struct(">d"),
    b"q": struct.Struct("<B"),
    b"r": struct.Struct("<I"),
    b"h": struct.Struct("<B"),
    b"j": struct.Struct("<I"),
    b"\x80": struct.Struct("<B"),
    b"\x95": struct.Struct("<Q"),
}
_SIZED = {  # opcode -> (struct of the length, text?) of a length-prefixed argument
    b"X": (struct.Struct("<I"), True),
    b"\x8c": (struct.Struct("<B"), True),
    b"\x8d": (struct.Struct("<Q"), True),
    b"C": (struct.Struct("<B"), False),
    b"B": (struct.Struct("<I"), False),
    b"\x8e": (struct.Struct("<Q"), False),
    b"\x8a": (struct.Struct("<B"), None),  # LONG1: little-endian two's complement
    b"\x8b": (struct.Struct("<I"), None),  # LONG4
}
_CONSTANTS = {b"N": None, b"\x88": True, b"\x89": False}
_MEMO_OPS = frozenset((b"q", b"r", b"\x94", b"h", b"j", b"0", b"1", b"2"))  # PUT, GET, POP, DUP
_MAX_LONG = 64  # bytes; a longer integer is no tensor size, and huge ones cost quadratic time


class _Reader:
    def __init__(self, data: bytes, name: str) -> None:
        self.data, self.name, self.pos = data, name, 0
        self.at = 0  # where the opcode being run starts: what errors name
        self.stack: list[Any] = []
        self.memo: dict[int, Any] = {}
        self.values = 0  # values built so far (MAX_VALUES)
        self.depth: dict[int, int] = {}  # id(container) -> how deep it nests (kept alive by stack or memo)

    def built(self, value: Any, children: Any = ()) -> Any:
        """Count a value built from ``children`` (and their nesting); refuse past the limits."""
        self.values += 1
        if self.values > MAX_VALUES:
            raise self.fail(f"more than {MAX_VALUES} values built (a limit of this reader)")
        if children:
            depth = 1 + max((self.depth.get(id(c), 0) for c in children), default=0)
            if depth > MAX_NESTING:
                raise self.fail(f"values nested more than {MAX_NESTING} deep (a limit of this reader)")
            self.depth[id(value)] = max(depth, self.depth.get(id(value), 0))
        return value

    def fail(self, what: str) -> ConvertError:
        return ConvertError(f"{self.name}: byte {self.at}: {what}; nothing was executed")

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise self.fail(f"the pickle ends inside an argument of {n} bytes")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            raise self.fail("a GLOBAL name runs to the end of the pickle")
        out = self.data[self.pos : end].decode("utf-8", "replace")
        self.pos = end + 1
        return out

    def pop(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise self.fail("an opcode takes a value from an empty stack")
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is _MARK:
                items = self.stack[i + 1 :]
                del self.stack[i:]
                return items
        raise self.fail("no MARK for an opcode that needs one")

    def argument(self, op: bytes) -> Any:
        if op in _FIXED:
            return _FIXED[op].unpack(self.take(_FIXED[op].size))[0]
        length, text = _SIZED[op]
        n = length.unpack(self.take(length.size))[0]
        if text is None and n > _MAX_LONG:
            raise self.fail(f"an integer of {n} bytes")
        raw = self.take(n)
        if text is None:
            return int.from_bytes(raw, "little", signed=True)
        if not text:
            return raw
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise self.fail(f"a string that is not UTF-8 ({e.reason} at its byte {e.start})") from None


def _set_items(reader: _Reader, target: Any, pairs: list[Any]) -> None:
    if len(pairs) % 2:
        raise reader.fail("SETITEMS with an odd number of values")
    into = target.items if isinstance(target, Call) else target
    if not isinstance(into, dict):
        raise reader.fail(f"SETITEM(S) on a {type(target).__name__}")
    reader.built(target, pairs)  # deeper now, maybe
    for k, v in zip(pairs[::2], pairs[1::2], strict=True):
        try:
            into[k] = v
        except (TypeError, RecursionError):  # unhashable, or a key tuple nested too deep to hash
            raise reader.fail(f"a dict key of type {type(k).__name__} that cannot be hashed") from None


def _append(reader: _Reader, values: list[Any]) -> None:
    target = reader.stack[-1] if reader.stack else None
    if not isinstance(target, list):
        raise reader.fail(f"APPEND(S) on a {type(target).__name__}")
    reader.built(target, values)
    target.extend(values)


def _structural(reader: _Reader, op: bytes) -> bool:
    """Run one opcode that builds containers, calls or memo entries; False if unknown."""
    s = reader.stack
    if op == b"(":
        s.append(_MARK)
    elif op in (b")", b"}", b"]"):
        s.append(reader.built({b")": (), b"}": {}, b"]": []}[op]))
    elif op == b"t":
        items = reader.pop_mark()
        s.append(reader.built(tuple(items), items))
    elif op in (b"\x85", b"\x86", b"\x87"):
        n = {b"\x85": 1, b"\x86": 2, b"\x87": 3}[op]
        items = [reader.pop() for _ in range(n)][::-1]
        s.append(reader.built(tuple(items), items))
    elif op == b"s":
        v, k = reader.pop(), reader.pop()
        _set_items(reader, s[-1] if s else None, [k, v])
    elif op == b"u":
        pairs = reader.pop_mark()
        _set_items(reader, s[-1] if s else None, pairs)
    elif op == b"a":
        _append(reader, [reader.pop()])
    elif op == b"e":
        _append(reader, reader.pop_mark())
    elif op == b"c":
        s.append(reader.built(Global(reader.line(), reader.line())))
    elif op == b"\x93":  # STACK_GLOBAL
        name, module = reader.pop(), reader.pop()
        if not (isinstance(module, str) and isinstance(name, str)):
            raise reader.fail("STACK_GLOBAL on values that are not names")
        s.append(reader.built(Global(module, name)))
    elif op in (b"R", b"\x81"):  # REDUCE, NEWOBJ: recorded, never called
        args, func = reader.pop(), reader.pop()
        s.append(reader.built(Call(func, args if isinstance(args, tuple) else (args,)), (func, args)))
    elif op == b"b":  # BUILD
        state = reader.pop()
        if not s or not isinstance(s[-1], Call):
            raise reader.fail("BUILD on a value that no call made")
        s[-1].state = state
        reader.built(s[-1], (state,))
    elif op == b"Q":
        value = reader.pop()
        s.append(reader.built(PersistentId(value), (value,)))
    else:
        return False
    return True


def _memo(reader: _Reader, op: bytes) -> None:
    """Run one of the memo and stack opcodes ``_MEMO_OPS``."""
    s = reader.stack
    if op in (b"q", b"r"):
        reader.memo[reader.argument(op)] = s[-1] if s else reader.pop()
    elif op == b"\x94":  # MEMOIZE
        reader.memo[len(reader.memo)] = s[-1] if s else reader.pop()
    if op in (b"q", b"r", b"\x94") and len(reader.memo) > MAX_VALUES:
        raise reader.fail(f"more than {MAX_VALUES} memo entries (a limit of this reader)")
    elif op in (b"h", b"j"):
        index = reader.argument(op)
        if index not in reader.memo:
            raise reader.fail(f"a memo entry {index} that was never stored")
        s.append(reader.memo[index])
    elif op == b"0":
        reader.pop()
    elif op == b"1":
        reader.pop_mark()
    elif op == b"2":
        s.append(s[-1] if s else reader.pop())
    if len(s) > MAX_VALUES:
        raise reader.fail(f"more than {MAX_VALUES} values on the stack (a limit of this reader)")


def read_data_pickle(data: bytes, name: str) -> Any:
    """The value a pickle describes, as plain data: nothing is imported or called.

    Args:
        data: the pickle's bytes.
        name: what to call it in errors (``archive.pt:ts/data.pkl``).

    Raises:
        ConvertError: an opcode this reader does not take (with its byte offset),
            a malformed or truncated pickle.

    Examples:
        >>> read_data_pickle(b"\\x80\\x02}q\\x00X\\x01\\x00\\x00\\x00aK\\x07s.", "x")
        {'a': 7}
        >>> read_data_pickle(b"\\x80\\x02cos\\nsystem\\nX\\x02\\x00\\x00\\x00lsR.", "x")
        Call(func=Global(module='os', name='system'), args=('ls',), state=None, items={})
    """
    reader = _Reader(data, name)
    for _ in range(MAX_OPCODES):
        reader.at = reader.pos
        op = reader.take(1)
        if op == b".":
            value = reader.pop()
            if reader.stack:
                raise reader.fail("STOP with values left on the stack")
            return value
        if op in _CONSTANTS:
            reader.stack.append(_CONSTANTS[op])
        elif op in (b"\x80", b"\x95"):  # PROTO, FRAME: nothing to build
            reader.argument(op)
        elif op in _MEMO_OPS:
            _memo(reader, op)
        elif op in _FIXED or op in _SIZED:
            reader.stack.append(reader.built(reader.argument(op)))
        elif not _structural(reader, op):
            raise reader.fail(f"opcode {op!r} is not one a data-only reader takes")
    reader.at = reader.pos
    raise reader.fail(f"more than {MAX_OPCODES} opcodes (a limit of this reader)")
