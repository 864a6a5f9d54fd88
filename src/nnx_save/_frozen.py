"""The base of the immutable records a small read makes on its way: a dtype row, a
tensor's entry, a file's header, a checkpoint's header.

They are written out rather than made by ``@dataclass(frozen=True)``, which builds each
class's methods by compiling their source when the class is defined: 1.2-1.7 ms a class
on a 2-core VM, four of them more than a fresh process takes to open a file and read a
slice (docs/performance.md). A subclass lists its ``__init__`` arguments (``_fields``)
and the fields compared (``_compared``), declares ``__slots__`` where it is made in bulk,
and writes its ``__init__`` (setting each field through ``object.__setattr__``); this base gives what the
decorator would: no assignment after ``__init__``, the repr, equality and hash over the
compared fields, copy and pickle through the ``__init__`` arguments, and ``_replace``.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from typing import Self

__all__ = ["Frozen", "frozen_many"]

_T = TypeVar("_T")


class Frozen:
    """An immutable record.

    Examples:
        >>> class Point(Frozen):
        ...     _fields = _compared = ("x", "y")
        ...     def __init__(self, x, y):
        ...         object.__setattr__(self, "x", x)
        ...         object.__setattr__(self, "y", y)
        >>> p = Point(1, 2)
        >>> p, p == Point(1, 2), p == Point(1, 3), hash(p) == hash(Point(1, 2))
        (Point(x=1, y=2), True, False, True)
        >>> p.x = 5
        Traceback (most recent call last):
        ...
        AttributeError: cannot assign to field 'x'
    """

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()
    """The ``__init__`` arguments, in order: what copy and pickle pass back."""
    _shown: ClassVar[tuple[str, ...] | None] = None
    """The fields the repr shows (``None``: ``_fields``)."""
    _compared: ClassVar[tuple[str, ...]] = ()
    """The fields equality and the hash compare."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}")

    def __repr__(self) -> str:
        shown = self._fields if self._shown is None else self._shown
        return f"{type(self).__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"

    def _key(self) -> tuple:
        return tuple(getattr(self, n) for n in self._compared)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self is other or self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple:
        return type(self), tuple(getattr(self, n) for n in self._fields)

    def _replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` made to its ``__init__`` arguments (``dataclasses.replace``).

        Examples:
            >>> from nnx_save.format._header import FileHeader
            >>> FileHeader("a.safetensors", {}, header_size=8)._replace(file="b.safetensors")
            FileHeader(file='b.safetensors', tensors={}, metadata={}, header_size=8, file_size=0)
        """
        unknown = changes.keys() - set(self._fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)[0]!r} to replace")
        return type(self)(**{n: changes.get(n, getattr(self, n)) for n in self._fields})

    __replace__ = _replace  # copy.replace (Python 3.13)


def frozen_many(
    cls: type[_T], count: int, columns: Mapping[str, Sequence[Any]], constants: Mapping[str, Any] | None = None
) -> list[_T]:
    """``count`` instances of the frozen slotted class ``cls``, each field set from
    its column of ``columns`` (``count`` values) or to its value in ``constants``,
    through the slot's own setter: what ``cls(...)`` makes field for field, at half
    the cost per instance (a frozen ``__init__`` sets each field through
    ``object.__setattr__``), for the hundred thousand a load of small tensors makes.
    Every slot must be given: no default, no ``__init__`` or ``__post_init__`` runs.

    Examples:
        >>> class Span(Frozen):
        ...     __slots__ = ("begin", "end")
        ...     _fields = _compared = __slots__
        ...     def __init__(self, begin, end):
        ...         object.__setattr__(self, "begin", begin)
        ...         object.__setattr__(self, "end", end)
        >>> frozen_many(Span, 2, {"begin": [0, 8]}, {"end": 16}) == [Span(0, 16), Span(8, 16)]
        True
    """
    constants = constants or {}
    if set(columns) | set(constants) != set(cls.__slots__) or any(len(c) != count for c in columns.values()):  # type: ignore[attr-defined]
        raise ValueError(f"{cls.__name__}: {count} of each field, every field given once")
    out = list(map(object.__new__, itertools.repeat(cls, count)))
    for name in cls.__slots__:  # type: ignore[attr-defined]
        values = columns[name] if name in columns else itertools.repeat(constants[name], count)
        collections.deque(map(getattr(cls, name).__set__, out, values), maxlen=0)
    return out
