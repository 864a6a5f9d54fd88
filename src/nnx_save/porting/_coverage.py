"""Coverage: which model params a mapping fills, from where, and what it leaves out."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import KeyMismatchError, ShapeMismatchError
from ._mapping import KeyMapping
from ._template import compile_pattern, ticked

__all__ = ["Coverage", "coverage"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Coverage:
    """How a mapping covers a model. All names sorted.

    Attributes:
        filled: model path -> the file keys it is made from.
        missing: model paths no file tensor fills (and no ``allow_missing`` allows).
        unexpected: file key -> its targets the model does not have (not allowed).
        allowed_missing: missing paths that ``allow_missing`` allows.
        allowed_unexpected: unexpected file keys that ``allow_unexpected`` allows.
        ignored: file keys dropped on purpose by ``ignore`` rules.
        mismatched: model path -> (shape in the model, shape the mapping makes).
    """

    filled: dict[str, tuple[str, ...]]
    missing: tuple[str, ...]
    unexpected: dict[str, tuple[str, ...]]
    allowed_missing: tuple[str, ...]
    allowed_unexpected: tuple[str, ...]
    ignored: tuple[str, ...]
    mismatched: dict[str, tuple[Shape, Shape]]

    @property
    def complete(self) -> bool:
        """No missing, unexpected or mismatched tensor (allowed ones aside)."""
        return not (self.missing or self.unexpected or self.mismatched)

    def check(self, source: str = "the checkpoint") -> None:
        """Raise one error listing every problem, or return.

        Raises:
            KeyMismatchError: a param is missing or a file tensor unexpected (the
                message also lists any shape mismatch).
            ShapeMismatchError: only shapes disagree.
        """
        lines = [
            *(f"`{p}`: in the model, not in {source} (allow_missing= to keep its value)" for p in self.missing),
            *(
                f"`{key}`: in {source}, goes to {ticked(targets)}, which the model does not have"
                for key, targets in self.unexpected.items()
            ),
            *(
                f"`{p}`: shape {model} in the model, {made} from {source} ({ticked(self.filled[p])})"
                for p, (model, made) in self.mismatched.items()
            ),
        ]
        if not lines:
            return
        kind = KeyMismatchError if self.missing or self.unexpected else ShapeMismatchError
        head = f"{len(lines)} mismatch{'es' if len(lines) > 1 else ''} between the model and {source}:"
        raise kind("\n  ".join([head, *lines]))


def coverage(
    mapping: KeyMapping,
    expected: Mapping[str, Sequence[int]] | Iterable[str],
    *,
    allow_missing: Iterable[str] = (),
    allow_unexpected: Iterable[str] = (),
) -> Coverage:
    """Compare a key mapping with the model's paths.

    Args:
        mapping: a key mapping (``rules.mapping(file_shapes)``).
        expected: the model's paths, or ``{path: shape}`` to also compare shapes.
        allow_missing: regexes (``re.fullmatch``) of model paths that may stay unfilled.
        allow_unexpected: regexes of file keys (or their targets) the model may lack.

    Returns:
        The :class:`Coverage`; call ``.check()`` to raise on any problem.

    Examples:
        >>> import numpy as np
        >>> from nnx_save.porting import Rules, rename
        >>> mapping = Rules(rename(r"w", "fc/kernel")).mapping({"w": ((2,), np.float32), "extra": ((1,), np.float32)})
        >>> c = coverage(mapping, {"fc/kernel": (2,), "fc/bias": (2,)}, allow_missing=[r".*/bias"])
        >>> c.allowed_missing, c.unexpected
        (('fc/bias',), {'extra': ('extra',)})
    """
    shapes = dict(expected) if isinstance(expected, Mapping) else dict.fromkeys(expected)
    may_miss = _compile(allow_missing)
    may_surprise = _compile(allow_unexpected)
    filled = {p: a.sources for p, a in mapping.assignments.items() if p in shapes}
    absent = sorted(p for p in shapes if p not in mapping.assignments)
    dangling = _dangling(mapping, shapes)
    allowed_unexp = {k for k, ts in dangling.items() if _any(may_surprise, (k, *ts))}
    mismatched = {
        p: (tuple(shapes[p]), mapping.assignments[p].shape)  # type: ignore[arg-type]
        for p in sorted(filled)
        if shapes[p] is not None and tuple(shapes[p]) != mapping.assignments[p].shape  # type: ignore[arg-type]
    }
    return Coverage(
        filled=dict(sorted(filled.items())),
        missing=tuple(p for p in absent if not _any(may_miss, (p,))),
        unexpected={k: ts for k, ts in dangling.items() if k not in allowed_unexp},
        allowed_missing=tuple(p for p in absent if _any(may_miss, (p,))),
        allowed_unexpected=tuple(sorted(allowed_unexp)),
        ignored=mapping.unused,
        mismatched=mismatched,
    )


def _dangling(mapping: KeyMapping, shapes: Mapping[str, object]) -> dict[str, tuple[str, ...]]:
    """``{file key: its targets the model lacks}``, for the keys with any."""
    extra = {key: tuple(t for t in targets if t not in shapes) for key, targets in sorted(mapping.landed.items())}
    return {key: targets for key, targets in extra.items() if targets}


def _compile(patterns: Iterable[str]) -> list[re.Pattern[str]]:
    if isinstance(patterns, str):
        patterns = (patterns,)
    return [compile_pattern(p) for p in patterns]


def _any(patterns: Sequence[re.Pattern[str]], names: Iterable[str]) -> bool:
    return any(p.fullmatch(n) for p in patterns for n in names)
