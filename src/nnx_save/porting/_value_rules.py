"""The value rules: they match a model path and change the layout of its tensor
(:class:`TransposeRule`, :class:`ReshapeRule`), after the structural rules made it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ._errors import RuleError
from ._rule_base import Inverts, Patterned, Shape, not_invertible
from ._template import raw
from ._transforms import Reshape, Transpose

__all__ = ["ReshapeRule", "TransposeRule"]


@dataclass(frozen=True)
class _ValueRule(Patterned):
    """A value rule: it changes the layout of the model paths its pattern matches."""

    def matches(self, path: str) -> bool:
        """Whether this rule applies to the model path ``path``."""
        return self._regex.fullmatch(path) is not None


@dataclass(frozen=True)
class TransposeRule(_ValueRule):
    """Model paths matching ``pattern`` hold the source tensor transposed by ``axes``.

    ``of``: the structural rule this transpose belongs to (a helper's weight): it then
    applies only to the tensors that rule makes, so a path another rule makes first
    (first match wins) is never transposed by it.
    """

    axes: tuple[int, ...]
    of: Inverts | None = field(default=None, repr=False)  # a structural rule

    def __post_init__(self) -> None:
        super().__post_init__()
        if sorted(self.axes) != list(range(len(self.axes))):
            raise RuleError(f"{self}: axes must be a permutation of 0..{len(self.axes) - 1}, got {self.axes}")

    def __str__(self) -> str:
        return f"transpose({raw(self.pattern)}, {self.axes})"

    def step(self, path: str, shape: Shape, index: int, errors: list[str]) -> tuple[Transpose, Shape] | None:
        """The step for a tensor of ``shape`` and the shape it gives."""
        if len(shape) != len(self.axes):
            errors.append(f"`{path}`: {self} expects {len(self.axes)} dimensions, found shape {shape}")
            return None
        return Transpose(self.axes, index), tuple(shape[a] for a in self.axes)

    def inverse(self) -> TransposeRule:
        """The inverse permutation (belonging to the inverse of its rule)."""
        of = None if self.of is None else self.of.inverse()
        return TransposeRule(self.pattern, tuple(int(a) for a in np.argsort(self.axes)), of)


@dataclass(frozen=True)
class ReshapeRule(_ValueRule):
    """Model paths matching ``pattern`` hold the source tensor reshaped to ``shape``.

    ``source_shape``, the shape to reshape back to on export, is optional; each may hold one ``-1``.
    """

    shape: Shape
    source_shape: Shape | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for shape in (self.shape, self.source_shape or ()):
            if shape.count(-1) > 1 or any(s < -1 for s in shape):
                raise RuleError(f"{self}: a shape takes sizes >= 0 and at most one -1, got {shape}")

    def __str__(self) -> str:
        return f"reshape({raw(self.pattern)}, {self.shape})"

    def step(self, path: str, shape: Shape, index: int, errors: list[str]) -> tuple[Reshape, Shape] | None:
        """The step for a tensor of ``shape`` and the shape it gives."""
        size = math.prod(shape)
        new = _resolve(self.shape, size)
        if new is None:
            errors.append(f"`{path}`: {self} cannot reshape shape {shape} ({size} elements) to {self.shape}")
            return None
        return Reshape(new, shape, index), new

    def inverse(self, source_shape: Shape | None = None) -> ReshapeRule:
        """Reshape back to ``source_shape`` (this rule's, or the recorded one given)."""
        back = self.source_shape if self.source_shape is not None else source_shape
        if back is None:
            raise not_invertible(self, "the source shape is unknown", "source_shape= to reshape()")
        return ReshapeRule(self.pattern, tuple(back), self.shape)


def _resolve(shape: Shape, size: int) -> Shape | None:
    known = math.prod(s for s in shape if s != -1)
    if -1 not in shape:
        return shape if known == size else None
    if known == 0 or size % known:
        return None
    return tuple(size // known if s == -1 else s for s in shape)
