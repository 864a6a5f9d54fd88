"""What every option object shares: argument checks that raise a typed
:class:`~nnx_save.errors.OptionError` naming the argument, and :func:`merge` of an
``options=`` object with an entry point's keyword shortcuts."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import OptionError

__all__ = ["DEFAULT", "check", "is_int", "merge", "optional"]

Opts = TypeVar("Opts")


class _Default:
    """The default of a keyword shortcut: "not given", so ``options=`` decides."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()


def check(ok: bool, argument: str, expected: str, value: object) -> None:
    """Raise :class:`OptionError` naming ``argument`` unless ``ok``.

    Examples:
        >>> check(False, "num_threads", "an int of at least 1", 0)
        Traceback (most recent call last):
        ...
        nnx_save.errors.OptionError: num_threads must be an int of at least 1, got 0
    """
    if not ok:
        raise OptionError(f"{argument} must be {expected}, got {value!r}", argument)


def is_int(value: object, low: int) -> bool:
    """An integer (a Python or numpy int, not a bool) of at least ``low``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= low


def optional(value: object, is_ok: bool) -> bool:
    return value is None or is_ok


def merge(cls: type[Opts], options: Opts | None, call: str, arguments: Mapping[str, Any]) -> Opts:
    """``options`` (or ``cls()``) with the keyword shortcuts in ``arguments`` (the entry
    point's ``locals()``; :data:`DEFAULT`: not given) applied. A shortcut for a field that
    ``options`` also sets is refused (an :class:`OptionError` naming it, as are an
    ``options`` of another class and a value out of range): one call cannot say two things.

    Examples:
        >>> from nnx_save import LoadOptions
        >>> merge(LoadOptions, LoadOptions(verify=True), "load_file", {"num_threads": 2}).num_threads
        2
        >>> from nnx_save import LoadOptions
        >>> merge(LoadOptions, LoadOptions(verify=True), "load_file", {"verify": False})
        Traceback (most recent call last):
        ...
        nnx_save.errors.OptionError: load_file: verify given both as a keyword and in options=...; give it once
    """
    if options is not None and not isinstance(options, cls):
        raise OptionError(f"{call}: options must be a {cls.__name__}, got {type(options).__name__}", "options")
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    given = {k: arguments[k] for k in names if k in arguments and arguments[k] is not DEFAULT}
    if options is None:
        return cls(**given)
    defaults = cls()
    both = [k for k in given if getattr(options, k) != getattr(defaults, k)]
    if both:
        raise OptionError(
            f"{call}: {', '.join(both)} given both as a keyword and in options=...; give it once", both[0]
        )
    return dataclasses.replace(options, **given) if given else options  # type: ignore[type-var]
