"""Shape hints that name the fix: a file tensor whose shape is the model's transposed, or
the model's reshaped, gets the porting rule that would load it, not only
``allow_shape_mismatch`` (which keeps the model's random values).

A suggestion is a promise, so each is made only where one reading is possible:

- *transpose*: exactly one permutation of the file's axes gives the model's shape (a
  square kernel, or a shape with repeated sizes, has several: nothing is said);
- *reshape*: one shape refines the other (its axes split or merge the other's, in order:
  ``(768,)`` and ``(12, 64)``, ``(1, 1, 8)`` and ``(8,)``), and no permutation moving a
  size above one also fits (``(2, 3)`` and ``(3, 2)`` are a transpose, never a reshape).

Each path gets its own rule (matching that path only), so following the advice changes
nothing else. A path that porting rules already transform gets none: a second transpose
on it is a table problem (refused under ``strict``), and the fix is in the rule that
transforms it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ._target import Target

__all__ = ["shape_fix", "shape_hints", "shape_remedy"]

Shape = tuple[int, ...]
_MAX_AXES = 8  # permutations tried (8! = 40,320); longer shapes get no transpose hint
_SHOWN = 8  # rules shown in a remedy


class Mismatch(Protocol):
    """A shape mismatch as the load report holds it."""

    @property
    def path(self) -> str: ...

    @property
    def model_shape(self) -> Shape: ...

    @property
    def file_shape(self) -> Shape: ...


def _permutations(file: Shape, model: Shape) -> list[tuple[int, ...]]:
    """Every permutation ``axes`` with ``np.transpose(file_tensor, axes).shape == model``."""
    if len(file) != len(model) or sorted(file) != sorted(model) or len(file) > _MAX_AXES:
        return []
    return [p for p in itertools.permutations(range(len(file))) if tuple(file[a] for a in p) == model]


def _moves_data(file: Shape, axes: tuple[int, ...]) -> bool:
    """Whether the transpose reorders elements (moves an axis of size above one)."""
    big = [a for a in axes if file[a] != 1]
    return big != sorted(big)


def _suffixes(shape: Shape) -> set[int]:
    return {math.prod(shape[i:]) for i in range(len(shape))}


def _refines(a: Shape, b: Shape) -> bool:
    """Whether one shape's axes split or merge the other's, in order (same elements)."""
    if math.prod(a) != math.prod(b) or math.prod(a) == 0:
        return False
    sa, sb = _suffixes(a), _suffixes(b)
    return sa <= sb or sb <= sa


def shape_fix(path: str, model: Shape, file: Shape) -> str | None:
    """The one porting rule (source text) that loads the file's ``file``-shaped tensor
    into the model's ``model``-shaped ``path``, or ``None`` when none is certain.

    Examples:
        >>> shape_fix("fc/kernel", (3, 4), (4, 3))
        'transpose(r"fc/kernel", (1, 0))'
        >>> shape_fix("attn/q/kernel", (16, 2, 8), (16, 16))
        'reshape(r"attn/q/kernel", (16, 2, 8))'
        >>> shape_fix("w", (4, 4, 3), (3, 4, 4)) is None  # (1, 2, 0) or (2, 1, 0): ambiguous
        True
    """
    model, file = tuple(model), tuple(file)
    perms = [p for p in _permutations(file, model) if _moves_data(file, p)]
    reshape = _refines(file, model)
    if len(perms) == 1 and not reshape:
        return f"transpose(r{_quoted(path)}, {perms[0]})"
    if reshape and not perms:
        return f"reshape(r{_quoted(path)}, {model})"
    return None


def _quoted(path: str) -> str:
    return '"' + re.escape(path).replace('"', '\\"') + '"'


def shape_hints(mismatches: Sequence[Mismatch], targets: Sequence[Target] = ()) -> list[str]:
    """:func:`shape_fix` of each mismatch that has one, sorted by path; none for a path
    whose target (in ``targets``) porting rules already transform."""
    transformed = {t.path for t in targets if t.transform is not None}
    fixes = (
        shape_fix(m.path, m.model_shape, m.file_shape)
        for m in sorted(mismatches, key=lambda m: m.path)
        if m.path not in transformed
    )
    return [f for f in fixes if f is not None]


def shape_remedy(fixes: Sequence[str]) -> str:
    """The remedy's paragraph naming the rules ``fixes`` (from :func:`shape_hints`; "" when none)."""
    if not fixes:
        return ""
    more = f", ... ({len(fixes) - _SHOWN} more)" if len(fixes) > _SHOWN else ""
    return (
        "File tensors hold the model's shapes transposed or reshaped: port them, rather than "
        f"allowing the mismatch (which keeps the model's values):\n  rules=Rules({', '.join(fixes[:_SHOWN])}{more})  "
        "(from nnx_save.porting import Rules, transpose, reshape; add them to your rules if you pass some)\n"
    )
