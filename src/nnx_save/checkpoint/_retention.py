"""Which steps a store keeps: combinable retention policies, as plain data. :func:`doomed`
is a pure function of the steps, their records and the time, so process 0 can decide it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..errors import OptionError
from ..format._header import strict_json
from ..io._lock import STORE_RECORD
from ._errors import UnsupportedCheckpointError
from ._metadata import is_int, is_number

__all__ = ["STORE_RECORD", "UNSET", "Retention", "StepInfo", "Unset", "doomed", "given_retention"]

# STORE_RECORD: the file, at the top of a store's directory, that records its retention policies.
STORE_FORMAT = "nnx_save.checkpoint.store"


@dataclasses.dataclass(frozen=True)
class Retention:
    """Retention policies; a step is kept when any of them keeps it.

    Attributes:
        latest: Keep the latest ``latest`` steps (None: this policy is off).
        best: Keep the ``best`` steps with the lowest (``mode="min"``) or highest
            (``"max"``) value of ``metric``; steps without it, or with NaN or an infinity, never rank.
        metric: The metric ``best`` ranks by (a key of ``save(metrics=...)``).
        mode: ``"min"`` or ``"max"``.
        every: Keep every step divisible by ``every`` (e.g. 1000: a long-term trail).
        newer_than: Keep steps saved less than this many seconds ago.

    The default keeps the latest 5 steps; the latest step is always kept (a run resumes from it).

    Examples:
        >>> Retention(latest=2, best=1, metric="loss").describe()
        'the latest 2 steps + the best 1 by min loss'
        >>> Retention.keep_all().describe()
        'every step (no retention policy)'
    """

    latest: int | None = 5
    best: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    every: int | None = None
    newer_than: float | None = None

    def __post_init__(self) -> None:
        for name in ("latest", "best", "every"):
            value = getattr(self, name)
            if value is not None and not is_int(value, 1):
                raise OptionError(f"Retention.{name} must be an int >= 1 or None, got {value!r}")
        if self.newer_than is not None and not (is_number(self.newer_than) and self.newer_than > 0):
            raise OptionError(
                f"Retention.newer_than must be a positive number of seconds or None, got {self.newer_than!r}"
            )
        if self.mode not in ("min", "max"):
            raise OptionError(f"Retention.mode must be 'min' or 'max', got {self.mode!r}")
        if (self.best is None) != (self.metric is None):
            raise OptionError(
                f"Retention.best and Retention.metric go together, got best={self.best!r}, metric={self.metric!r}"
            )
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise OptionError(f"Retention.metric must be a non-empty str, got {self.metric!r}")

    @classmethod
    def keep_all(cls) -> Retention:
        """No policy: nothing is ever deleted."""
        return cls(latest=None)

    def describe(self) -> str:
        """The policies in words."""
        parts = [
            f"the latest {self.latest} steps" if self.latest is not None else "",
            f"the best {self.best} by {self.mode} {self.metric}" if self.best is not None else "",
            f"every step divisible by {self.every}" if self.every is not None else "",
            f"steps newer than {self.newer_than:g} s" if self.newer_than is not None else "",
        ]
        return " + ".join(p for p in parts if p) or "every step (no retention policy)"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Retention:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What retention looks at: a step, its metrics and its age in seconds."""

    step: int
    metrics: Mapping[str, float]
    age_s: float


def doomed(retention: Retention, steps: Sequence[StepInfo]) -> list[int]:
    """The steps no policy keeps, ascending.

    Examples:
        >>> losses = {10: 0.9, 20: 0.1, 30: 0.5, 40: 0.4, 50: 0.45}
        >>> infos = [StepInfo(s, {"loss": v}, 0.0) for s, v in losses.items()]
        >>> doomed(Retention(latest=2, best=1, metric="loss"), infos)
        [10, 30]
    """
    ordered = sorted(steps, key=lambda i: i.step)
    if not ordered or retention == Retention.keep_all():
        return []
    kept = {ordered[-1].step}
    if retention.latest is not None:
        kept |= {i.step for i in ordered[-retention.latest :]}
    if retention.best is not None:
        kept |= set(ranked(ordered, retention.metric or "", retention.mode)[: retention.best])
    if retention.every is not None:
        kept |= {i.step for i in ordered if i.step % retention.every == 0}
    if retention.newer_than is not None:
        kept |= {i.step for i in ordered if i.age_s < retention.newer_than}
    return [i.step for i in ordered if i.step not in kept]


def ranked(steps: Sequence[StepInfo], metric: str, mode: str) -> list[int]:
    """Steps recording a finite ``metric``, best first; ties go to the later step.

    NaN and the infinities never rank: an overflowed loss (``inf``) or accuracy is a failed
    measurement, not the best one, and must not cost the real best step its place.
    """
    scored = [(i.metrics[metric], i.step) for i in steps if metric in i.metrics and math.isfinite(i.metrics[metric])]
    sign = 1 if mode == "min" else -1
    return [s for _, s in sorted(scored, key=lambda vs: (sign * vs[0], -vs[1]))]


def record_json(retention: Retention) -> str:
    """The text of the store's retention record."""
    return json.dumps({"format": STORE_FORMAT, "version": 1, "retention": retention.to_json()}, indent=1)


def parse_record(text: str) -> Retention:
    """Read a retention record back (:class:`UnsupportedCheckpointError`: not one this version reads)."""
    try:
        data = strict_json(text)
        if (
            not isinstance(data, dict)
            or data.get("format") != STORE_FORMAT
            or not isinstance(data.get("retention"), dict)
        ):
            raise ValueError("not an nnx_save store record")
        return Retention.from_json(data["retention"])
    except (ValueError, TypeError) as error:  # JSONDecodeError is a ValueError
        raise UnsupportedCheckpointError(
            f"a store record {STORE_RECORD} that cannot be read ({error}): {text[:200]!r}"
        ) from None


def age_s(created_at: str, now: datetime.datetime) -> float:
    """Seconds since an ISO 8601 time (``inf`` when it cannot be read)."""
    try:
        return (now - datetime.datetime.fromisoformat(created_at)).total_seconds()
    except (TypeError, ValueError):
        return math.inf


class Unset:
    """The type of :data:`UNSET`: an argument the caller did not pass."""

    def __repr__(self) -> str:
        return "<not given>"


UNSET = Unset()


def given_retention(max_to_keep: int | Unset | None, retention: Retention | None) -> Retention | None:
    """The policies the caller asked for, or None when they asked for none."""
    if isinstance(max_to_keep, Unset):
        if retention is not None and not isinstance(retention, Retention):
            raise OptionError(f"retention must be a Retention or None, got {retention!r}")
        return retention
    if retention is not None:
        raise OptionError("pass max_to_keep or retention, not both (max_to_keep=N is Retention(latest=N))")
    if max_to_keep is not None and not is_int(max_to_keep, 1):
        raise OptionError(f"max_to_keep must be an int >= 1 or None (keep every step), got {max_to_keep!r}")
    return Retention(latest=max_to_keep)
