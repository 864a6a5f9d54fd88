"""Every ``NNX_SAVE_*`` environment variable: read, validated and documented here only.

Each is one :class:`Variable`, read by :meth:`~Variable.get` where the value is used,
never at import, so it may be set any time before the operation it tunes. An unset or
empty variable means its default; a value that cannot be used is a
:class:`~nnx_save.errors.ConfigError` naming the variable, what it must hold and what
it holds. docs/configuration.md shows :data:`VARIABLES` as a table.

Examples:
    >>> import os
    >>> os.environ["NNX_SAVE_MAX_ASYNC_SAVES"] = "4"
    >>> MAX_ASYNC_SAVES.get()
    4
    >>> os.environ["NNX_SAVE_MAX_ASYNC_SAVES"] = "many"
    >>> MAX_ASYNC_SAVES.get()
    Traceback (most recent call last):
    ...
    nnx_save.errors.ConfigError: NNX_SAVE_MAX_ASYNC_SAVES='many': expected a positive integer
    >>> del os.environ["NNX_SAVE_MAX_ASYNC_SAVES"]
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import ConfigError

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "DIRECT_IO",
    "FORCE_HOST_STAGING",
    "HTTP_MIN_RATE",
    "HTTP_TIMEOUT",
    "MAX_ASYNC_SAVES",
    "PROGRESS_MIN_BYTES",
    "SAVE_INFLIGHT_BYTES",
    "SAVE_STAGING",
    "SAVE_STAGING_KINDS",
    "STAGING",
    "STREAM",
    "VARIABLES",
    "Variable",
    "store_environment",
]

T = TypeVar("T")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: its ``name``, its ``default`` (when unset or empty),
    what a value must be in words (``expected``, said by the error), what it tunes
    (``meaning``, the docs table's last column), ``parse`` (text -> value, ``ValueError``
    for a value it refuses), and the retired variables it ``replaces`` (setting one is an
    error, never silently ignored)."""

    name: str
    default: T
    expected: str
    meaning: str
    parse: Callable[[str], T]
    replaces: tuple[str, ...] = ()

    def get(self) -> T:
        """The variable's value now: parsed, or the default when unset or empty.

        Raises:
            ConfigError: the value is not one :attr:`expected` allows, or a
                variable this one replaces is set.
        """
        for old in self.replaces:
            if os.environ.get(old, "").strip():
                raise ConfigError(old, f"it unset: {self.name} replaces it ({self.meaning})", os.environ[old])
        raw = os.environ.get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError:
            raise ConfigError(self.name, self.expected, raw) from None


def _flag(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _flag_or_auto(text: str) -> bool | None:
    return None if text.lower() == "auto" else _flag(text)


def _staging(text: str) -> str:
    if text.lower() not in ("auto", "pinned", "pageable"):
        raise ValueError(text)
    return text.lower()


# Where a save's device -> host copies may land (NNX_SAVE_SAVE_STAGING; see nnx_save.save._stage).
SAVE_STAGING_KINDS = ("numpy", "pinned_host", "unpinned_host")


def _save_staging(text: str) -> str:
    if text.lower() not in SAVE_STAGING_KINDS:
        raise ValueError(text)
    return text.lower()


def _positive_float(text: str, high: float = 1e15) -> float:
    value = float(text)
    if not 0 < value <= high:  # NaN and infinity too; past ``high`` a wait or a count overflows C
        raise ValueError(text)
    return value


def _seconds(text: str) -> float:
    return _positive_float(text, 1e9)  # threading's waits take at most ~9.2e9 s


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text) if len(text) <= 24 else low - 1  # int() of 400 digits works; no count is that large
        if not low <= value <= 1 << 62:
            raise ValueError(text)
        return value

    return parse


STREAM: Variable[bool | None] = Variable(
    "NNX_SAVE_STREAM",
    None,
    "1, 0 or auto",
    "1 forces the streaming load path (staging buffers, also on the CPU backend), 0 forbids it; "
    "used when a load leaves `stream` unset",
    _flag_or_auto,
)
STAGING: Variable[str] = Variable(
    "NNX_SAVE_STAGING",
    "auto",
    "auto, pinned or pageable",
    "the streaming path's staging memory, when a load leaves `staging` at auto",
    _staging,
)
HTTP_TIMEOUT: Variable[float] = Variable(
    "NNX_SAVE_HTTP_TIMEOUT",
    60.0,
    "a positive number of seconds",
    "seconds every HTTP range request may take, plus its length at NNX_SAVE_HTTP_MIN_RATE",
    _seconds,
)
HTTP_MIN_RATE: Variable[float] = Variable(
    "NNX_SAVE_HTTP_MIN_RATE",
    float(256 << 10),
    "a positive number of bytes per second",
    "the slowest transfer rate (bytes per second) an HTTP request's deadline allows for",
    _positive_float,
)
COLLECTIVE_TIMEOUT_S: Variable[float] = Variable(
    "NNX_SAVE_COLLECTIVE_TIMEOUT_S",
    1800.0,
    "a positive number of seconds",
    "seconds a process waits for the others at each step of every multi-process exchange: collective "
    "and pod saves, shared reads, the checkpoint store's decisions",
    _seconds,
    replaces=("NNX_SAVE_STORE_TIMEOUT_S",),
)
MAX_ASYNC_SAVES: Variable[int] = Variable(
    "NNX_SAVE_MAX_ASYNC_SAVES",
    2,
    "a positive integer",
    "saves with `blocking=False` in flight at once; the next one waits for the oldest",
    _int_at_least(1),
)
SAVE_INFLIGHT_BYTES: Variable[int] = Variable(
    "NNX_SAVE_SAVE_INFLIGHT_BYTES",
    1 << 30,
    "a positive number of bytes",
    "host bytes of device -> host copies a save holds at once",
    _int_at_least(1),
)
SAVE_STAGING: Variable[str] = Variable(
    "NNX_SAVE_SAVE_STAGING",
    "numpy",
    "numpy, pinned_host or unpinned_host",
    "host memory of a save's device -> host copies: numpy (freed as each is written), or jax's "
    "pinned_host / unpinned_host memory of the device (numpy where the device has none)",
    _save_staging,
)
FORCE_HOST_STAGING: Variable[bool] = Variable(
    "NNX_SAVE_FORCE_HOST_STAGING",
    False,
    "1 or 0",
    "1 makes saves stage device -> host copies on the CPU backend too (a testing aid)",
    _flag,
)
DIRECT_IO: Variable[bool] = Variable(
    "NNX_SAVE_DIRECT_IO",
    True,
    "1 or 0",
    "1 writes a saved file's whole 4 MiB chunks with O_DIRECT where the filesystem allows it (no page cache); "
    "0 writes through the page cache, starting each chunk's write-back at once",
    _flag,
)
PROGRESS_MIN_BYTES: Variable[int] = Variable(
    "NNX_SAVE_PROGRESS_MIN_BYTES",
    256 << 20,
    "a number of bytes, 0 or more",
    "bytes an operation must move for `progress=None` to show a bar",
    _int_at_least(0),
)

VARIABLES: tuple[Variable, ...] = (
    STREAM,
    STAGING,
    HTTP_TIMEOUT,
    HTTP_MIN_RATE,
    COLLECTIVE_TIMEOUT_S,
    MAX_ASYNC_SAVES,
    SAVE_INFLIGHT_BYTES,
    SAVE_STAGING,
    FORCE_HOST_STAGING,
    DIRECT_IO,
    PROGRESS_MIN_BYTES,
)


def store_environment() -> tuple[tuple[str, str], ...]:
    """The object stores' own variables (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``), sorted:
    not this library's (each store's client reads them itself, as its SDK does), read
    here so a client made under other credentials or another endpoint is not reused."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_", "AZURE_"))))
