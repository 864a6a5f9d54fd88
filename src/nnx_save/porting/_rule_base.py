"""What every porting rule shares: the :class:`Node` a structural rule makes, a rule's
whole-name pattern, the link from a rule to its inverse, and the error of a rule that
cannot be inverted."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import numpy as np

from ._errors import RuleError
from ._template import compile_pattern
from ._transforms import Combine

__all__ = ["Info", "Inverts", "Node", "Patterned", "Shape", "not_invertible", "set_field", "with_inverse"]

Shape = tuple[int, ...]
Info = Mapping[str, tuple[Shape, np.dtype]]
_R = TypeVar("_R")


@dataclass(frozen=True)
class Node:
    """One target as a structural rule makes it, before value rules."""

    target: str
    sources: tuple[str, ...]
    shape: Shape
    dtype: np.dtype
    combine: Combine | None
    rule: int = -1  # the position of the rule that made it in its Rules (-1: none)
    restore: tuple[tuple[str, ...], int] | None = None  # a sum's export: (its file keys, into)
    against: tuple[str, ...] = ()  # the source file's tensors it also takes (export against the source)


class Inverts(Protocol):
    """A rule with an inverse: what a value rule needs of the structural rule it belongs
    to (``TransposeRule.of``), whose own module it cannot import."""

    def inverse(self) -> Any: ...


def set_field(obj: object, name: str, value: object) -> None:
    """Set a derived field of frozen dataclass ``obj`` (in its ``__post_init__``)."""
    object.__setattr__(obj, name, value)


def with_inverse(rule: object, inverse: _R) -> _R:
    """The inverse given (or derived before), pointing back to ``rule``."""
    return replace(inverse, inverse_rule=rule)  # type: ignore[type-var]  # every rule with an inverse_rule is a dataclass


@dataclass(frozen=True)
class Patterned:
    """A rule's regex ``pattern``, matched against whole names."""

    pattern: str

    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        set_field(self, "_regex", compile_pattern(self.pattern))


def not_invertible(rule: object, why: str, give: str) -> RuleError:
    """The error of ``rule.inverse()`` without what it needs: ``why``, and what to ``give``."""
    return RuleError(
        f"{rule} cannot be inverted: {why}; pass {give}, or inverse(recorded=mapping) with a mapping these rules made",
        kind="not_invertible",
    )
