"""What every option object shares: argument checks that raise a typed
:class:`~nnx_save.errors.OptionError` naming the argument, and :func:`merge` of an
``options=`` object with an entry point's keyword shortcuts."""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import OptionError

__all__ = ["DEFAULT", "MAX_SIZE", "check", "is_int", "merge", "optional", "path_arg", "seconds_arg"]

MAX_SIZE = 1 << 62  # the largest byte count or count taken from outside: C and numpy int64 hold it

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


def is_int(value: object, low: int, high: int = MAX_SIZE) -> bool:
    """An integer (a Python or numpy int, not a bool) of at least ``low`` and at most
    ``high`` (default :data:`MAX_SIZE`: larger ones overflow C and numpy integers)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= int(value) <= high


def _brief(value: object) -> str:
    text = repr(value) if isinstance(value, (str, bytes, int, float)) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def path_arg(value: object, argument: str, call: str) -> str:
    """``value`` as a path (``str``): a non-empty ``str`` or ``os.PathLike`` of one, with no
    NUL byte, no name over 255 bytes and at most 4095 bytes in all (what POSIX can open);
    a URL (``scheme://...``) only non-empty and without a NUL byte.

    Raises:
        OptionError: naming ``call`` and ``argument``, with what was given.

    Examples:
        >>> path_arg(5, "path", "save_file")
        Traceback (most recent call last):
        ...
        nnx_save.errors.OptionError: save_file: path must be a path (a non-empty str or os.PathLike), got 5
    """
    try:
        text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise OptionError(
            f"{call}: {argument} must be a path (a non-empty str or os.PathLike), got {_brief(value)}", argument
        )
    if "\x00" in text:
        raise OptionError(f"{call}: {argument} must be a path with no NUL byte, got {_brief(text)}", argument)
    raw = os.fsencode(text)
    if _URL.match(text):  # a URL: the server's limits, not POSIX's (a presigned query string is long)
        return text
    if len(raw) > 4095 or any(len(part) > 255 for part in raw.split(b"/")):
        raise OptionError(
            f"{call}: {argument} must be a path of at most 4095 bytes whose names have at most 255, got {_brief(text)}",
            argument,
        )
    return text


def seconds_arg(value: object, argument: str, call: str) -> float | None:
    """``None``, or a finite number of seconds >= 0 (at most a year's worth past which
    ``threading`` waits overflow), as a float.

    Raises:
        OptionError: naming ``call`` and ``argument``.
    """
    if value is None:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    seconds = float(value) if ok and abs(value) < 1e300 else math.nan  # type: ignore[arg-type]
    if not (0 <= seconds <= 1e9):
        raise OptionError(
            f"{call}: {argument} must be None or seconds between 0 and 1e9, got {_brief(value)}", argument
        )
    return seconds


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
    import dataclasses  # here: the options' own modules import it, a small read does not

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
