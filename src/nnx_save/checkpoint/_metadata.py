"""The metadata record stored (as JSON) with every step, and the checks of a store call's
arguments (steps, items, metadata fields, restore names)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeGuard

from .._version import __version__
from ..errors import OptionError, short_repr
from ._errors import CheckpointUsageError, UnsupportedCheckpointError
from ._format import FORMAT_NAME, FORMAT_VERSION, ITEM_NAMES
from ._tree import check_item, record_of, unknown_item

__all__ = [
    "CheckpointMetadata",
    "Producer",
    "check_items",
    "check_step",
    "is_int",
    "is_number",
    "new_metadata",
    "restore_names",
]

# Distributions whose versions every checkpoint records, for reproducing a run.
_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "orbax-checkpoint", "optax", "numpy")


@dataclasses.dataclass(frozen=True)
class Producer:
    """The program that wrote a checkpoint (a trainer, a conversion script).

    Examples:
        >>> Producer("my_trainer", "2.1").to_dict()
        {'name': 'my_trainer', 'version': '2.1'}
    """

    name: str
    version: str

    def __post_init__(self) -> None:
        for field in ("name", "version"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise OptionError(f"Producer.{field} must be a non-empty str, got {value!r}")

    def to_dict(self) -> dict[str, str]:
        """The JSON object stored in the metadata record."""
        return {"name": self.name, "version": self.version}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Producer:
        """Rebuild a producer from :meth:`to_dict` output.

        Raises:
            UnsupportedCheckpointError: ``data`` is not ``{"name": str, "version": str}``.
        """
        if not isinstance(data, Mapping) or set(data) != {"name", "version"}:
            raise UnsupportedCheckpointError(f"a producer record {data!r} (expected name and version)")
        try:
            return cls(data["name"], data["version"])
        except ValueError:
            raise UnsupportedCheckpointError(
                f"a producer record {dict(data)!r} (expected two non-empty strings)"
            ) from None


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint step says about itself.

    Attributes:
        step: The training step.
        items: The names of the stored items, in :data:`ITEM_NAMES` order.
        epoch: The epoch, when the caller gave one.
        metrics: Named scalar metrics (``best_step`` ranks steps by these).
        extra: Caller-defined JSON data (a run config, a git hash).
        producer: The program that wrote the checkpoint, when given.
        library_versions: Versions of nnx_save, jax, flax, Orbax, ... at save time.
        created_at: Save time, ISO 8601 in UTC.
        format: Always :data:`FORMAT_NAME` for a record this library can read.
        format_version: The layout version, at most :data:`FORMAT_VERSION`.

    Examples:
        >>> meta = CheckpointMetadata(step=3, items=("model",), created_at="2025-01-01T00:00:00+00:00")
        >>> CheckpointMetadata.from_dict(meta.to_dict()) == meta
        True
    """

    step: int
    items: tuple[str, ...]
    epoch: int | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    producer: Producer | None = None
    library_versions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    created_at: str = ""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written with the checkpoint (a fresh, independent copy)."""
        return {
            "format": self.format,
            "format_version": self.format_version,
            "step": self.step,
            "epoch": self.epoch,
            "items": list(self.items),
            "library_versions": dict(self.library_versions),
            "producer": None if self.producer is None else self.producer.to_dict(),
            "metrics": dict(self.metrics),
            "extra": json.loads(json.dumps(self.extra)),
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointMetadata:
        """Validate a stored record and rebuild it.

        Raises:
            UnsupportedCheckpointError: ``data`` names another format, a newer
                format version, or has a missing, unknown or malformed field.
        """
        _check_format(data)
        missing, unknown = sorted(_FIELDS - set(data)), sorted(set(data) - _FIELDS)
        if missing or unknown:
            raise UnsupportedCheckpointError(
                f"a metadata record with missing fields {missing} and unknown fields {unknown}"
            )
        producer = data["producer"]
        return cls(
            step=_field(data, "step"),
            items=tuple(_field(data, "items")),
            epoch=_field(data, "epoch"),
            metrics={k: float(v) for k, v in _field(data, "metrics").items()},
            extra=dict(_field(data, "extra")),
            producer=None if producer is None else Producer.from_dict(producer),
            library_versions=dict(_field(data, "library_versions")),
            created_at=_field(data, "created_at"),
            format=data["format"],
            format_version=data["format_version"],
        )


# The record's own fields (``extra`` may not use these names).
_FIELDS = frozenset(f.name for f in dataclasses.fields(CheckpointMetadata))


def _check_format(data: Any) -> None:
    if not isinstance(data, Mapping):
        raise UnsupportedCheckpointError(f"a metadata record of type {type(data).__name__}, not a JSON object")
    if data.get("format") != FORMAT_NAME:
        raise UnsupportedCheckpointError(f"format {data.get('format')!r}")
    version = data.get("format_version")
    if not is_int(version, 1):
        raise UnsupportedCheckpointError(f"format version {version!r}")
    if version > FORMAT_VERSION:
        raise UnsupportedCheckpointError(f"format version {version}, newer than this nnx_save; upgrade nnx_save")


def is_number(value: Any) -> TypeGuard[int | float]:
    """True for an int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any, low: int = 0) -> TypeGuard[int]:
    """True for an int (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


# What a stored field must hold: a test, and the words the error says it in.
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (is_int, "an int >= 0"),
    "epoch": (lambda v: v is None or is_int(v), "an int >= 0"),
    "items": (
        lambda v: isinstance(v, list) and bool(v) and all(name in ITEM_NAMES for name in v),
        f"a non-empty list of {', '.join(ITEM_NAMES)}",
    ),
    "metrics": (lambda v: isinstance(v, Mapping) and all(map(is_number, v.values())), "numbers"),
    "extra": (lambda v: isinstance(v, Mapping), "a JSON object"),
    "library_versions": (
        lambda v: isinstance(v, Mapping) and all(isinstance(x, str) for x in v.values()),
        "str values",
    ),
    "created_at": (lambda v: isinstance(v, str), "a str"),
}


def _field(data: Mapping[str, Any], key: str) -> Any:
    ok, expected = _CHECKS[key]
    if not ok(data[key]):
        raise UnsupportedCheckpointError(f"{key} {data[key]!r} (expected {expected})")
    return data[key]


def library_versions() -> dict[str, str]:
    """The versions of nnx_save and the libraries it saves through, for the record (a copy)."""
    return dict(_installed_versions())


@functools.cache
def _installed_versions() -> dict[str, str]:
    """Read once per process: installed versions do not change under a running program,
    and asking ``importlib.metadata`` costs tens of milliseconds a save."""
    versions = {"nnx_save": __version__}
    for dist in _DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    return versions


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """Metrics as ``{str: float}``: numbers and 0-d arrays, NaN kept (else ``OptionError``)."""
    out: dict[str, float] = {}
    if metrics is not None and not isinstance(metrics, Mapping):
        raise OptionError(f"metrics must be None or a mapping of names to numbers, got {type(metrics).__name__}")
    for name, value in (metrics or {}).items():
        if not isinstance(name, str):
            raise OptionError(f"metrics keys must be str, got {name!r}")
        if isinstance(value, bool) or getattr(value, "shape", ()) != ():
            raise OptionError(f"metrics[{name!r}] must be a real scalar, got {value!r}")
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            raise OptionError(f"metrics[{name!r}] must be a real scalar, got {value!r}") from None
        except OverflowError:  # an int past float64's range
            raise OptionError(f"metrics[{name!r}] = {short_repr(value)} is too large for a float64 metric") from None
    return out


def check_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra`` as a JSON-ready copy; ``OptionError`` for a name the record uses, and for
    what JSON would change: a key that is not a ``str`` (``1`` would become ``"1"``), a
    float that is not finite. Tuples are stored as JSON arrays and come back as lists."""
    extra = dict(extra or {})
    shadowed = sorted(k for k in extra if k in _FIELDS)
    if shadowed:
        raise OptionError(
            f"extra keys {shadowed} shadow metadata fields; reserved: {', '.join(sorted(_FIELDS))}. "
            "Pass step, epoch, metrics and producer as save() arguments, or rename the key"
        )
    _check_json("extra", extra)
    return json.loads(json.dumps(extra))


def _check_json(where: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for key, child in value.items():
            if not isinstance(key, str):
                raise OptionError(f"{where}: key {key!r} is a {type(key).__name__}; JSON keys must be str")
            _check_json(f"{where}/{key}", child)
    elif isinstance(value, (list, tuple)):
        for i, child in enumerate(value):
            _check_json(f"{where}/{i}", child)
    elif isinstance(value, float) and not math.isfinite(value):
        raise OptionError(f"{where}: {value!r} is not a finite float; JSON cannot store it")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise OptionError(
            f"{where}: a {type(value).__name__} is not JSON data (str, int, float, bool, None, list, dict)"
        )


def check_step(step: Any) -> int:
    """A step as an int in ``[0, 2**63)`` (Orbax and its metadata count steps in int64)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise OptionError(f"step must be a non-negative int, got {step!r}")
    if int(step) >= 2**63:
        raise OptionError(f"step must be below 2**63 (Orbax counts steps in int64), got {step!r}")
    return int(step)


def check_items(items: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The item names in canonical order and their dtype record (items in that order),
    made in the one pass that validates every leaf."""
    if not isinstance(items, Mapping) or not items:
        raise OptionError(f"items must be a non-empty mapping of {', '.join(ITEM_NAMES)}, got {items!r}")
    rows = {name: check_item(name, tree) for name, tree in items.items()}  # refused in the caller's order
    names = tuple(name for name in ITEM_NAMES if name in items)
    return names, record_of({name: rows[name] for name in names})


def new_metadata(
    step: int,
    names: tuple[str, ...],
    epoch: int | None,
    metrics: Mapping[str, Any] | None,
    producer: Producer | None,
    extra: Mapping[str, Any] | None,
) -> CheckpointMetadata:
    if epoch is not None and not is_int(epoch):
        raise OptionError(f"epoch must be a non-negative int or None, got {epoch!r}")
    if producer is not None and not isinstance(producer, Producer):
        raise OptionError(f"producer must be a Producer(name, version) or None, got {producer!r}")
    return CheckpointMetadata(
        step=step,
        items=names,
        epoch=epoch,
        metrics=check_metrics(metrics),
        extra=check_extra(extra),
        producer=producer,
        library_versions=library_versions(),
        created_at=datetime.datetime.now(datetime.UTC).isoformat(),  # with an explicit UTC offset
    )


def restore_names(metadata: CheckpointMetadata, templates: Mapping[str, Any], items: Iterable[str] | None) -> list[str]:
    wanted = list(metadata.items if items is None else items)
    for name in [*wanted, *templates]:
        if name not in ITEM_NAMES:
            raise OptionError(unknown_item(name), "items")
    unused = sorted(set(templates) - set(wanted))
    if unused:
        raise OptionError(f"templates given for {unused}, which items={wanted} does not restore")
    absent = [name for name in wanted if name not in metadata.items]
    if absent:
        kept = [name for name in wanted if name in metadata.items]
        raise CheckpointUsageError.for_item(metadata.step, absent, metadata.items, kept)
    return [name for name in metadata.items if name in wanted]
