"""The porting errors: all :class:`~nnx_save.errors.NnxSaveError`.

They live here rather than in ``nnx_save.errors`` only because this package was
written alongside the core; each one names the rule, the key, what was expected and
what was found.
"""

from __future__ import annotations

from ..errors import NnxSaveError, ShapeMismatchError

__all__ = ["NotInvertibleError", "RuleConflictError", "RuleError", "RuleShapeError", "TiedValuesError"]


class RuleError(NnxSaveError, ValueError):
    """A rule is malformed, or the tensors it matches do not fit it."""


class RuleConflictError(RuleError):
    """A file tensor feeds two rules, or two rules produce the same target."""


class RuleShapeError(RuleError, ShapeMismatchError):
    """A tensor's shape does not fit the rule that transforms it."""


class NotInvertibleError(RuleError):
    """A rule has no automatic inverse; pass ``inverse=`` to give one."""


class TiedValuesError(RuleError):
    """Copies a ``tie`` rule declares equal hold different values in the file."""
