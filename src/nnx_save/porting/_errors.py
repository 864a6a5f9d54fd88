"""Porting's error and warning (public as ``nnx_save.porting.X``): a malformed rule or a
table that would port wrongly (:class:`RuleError`, its ``kind`` the case)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..errors import NnxSaveError, NnxSaveWarning

__all__ = ["RuleError", "RuleKind", "RuleTableWarning"]

RuleKind = Literal["conflict", "not_invertible", "tied", "table", "shape", "round_trip"]
"""What a :class:`RuleError` is about: ``"conflict"`` (a file tensor feeds two rules, or two
rules make one target), ``"not_invertible"`` (a rule has no automatic inverse: pass
``inverse=``), ``"tied"`` (copies a ``tie`` rule declares equal differ in the file),
``"table"`` (a table that would port wrongly though every tensor lands somewhere: a
transform applied twice or cancelled, a rule matching nothing or only what an earlier rule
took; refused under ``strict``, its ``problems`` naming the rules), ``"shape"`` (a tensor's
shape does not fit the rule that transforms it), ``"round_trip"`` (a computed rule's inverse,
on export, makes tensors that its function does not turn back into the model's: writing
them would load back other values)."""


class RuleError(NnxSaveError, ValueError):
    """A rule is malformed, or the tensors it matches do not fit it. ``kind`` says which
    case (:data:`RuleKind`, ``None`` for a malformed rule); ``problems`` lists a table's
    problems, one line each."""

    kind: RuleKind | None = None
    problems: tuple[str, ...] = ()

    def __init__(self, message: str = "", *, kind: RuleKind | None = None, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind
        self.problems = tuple(problems)


class RuleTableWarning(NnxSaveWarning):
    """The findings of a ``RuleError`` of kind ``"table"``, without ``strict``: the port
    went ahead with the table as written."""
