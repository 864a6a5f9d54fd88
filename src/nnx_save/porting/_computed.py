"""Computed rules: a target made by a function of its source tensors, with a declared
inverse for export (``compute``; weight norm is built on it).

On load the function runs in the copy, as the other transforms do, on the sources read
whole: a function of several tensors (weight norm's ``g`` and ``v``) has no per-box map,
so a sharded load reads its sources whole on each process that needs the target. Its
result's shape and dtype are checked against the plan. On export the inverse runs on the
model's tensor and the round trip is verified: ``fn(*inverse(w))`` must give ``w`` back
within ``tolerance`` units of the dtype's precision (else :class:`RuleError`,
``kind="round_trip"``). Against the source file (``rules.inverse(source=...)``) the file's
own source tensors are written, byte for byte, while ``fn`` of them still gives the
model's tensor bit for bit.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ._compose import _complete_groups, _part_hit
from ._compute_steps import Computed, ComputedPart, name_of
from ._errors import RuleError
from ._parts import same_dtype
from ._rule_base import Node, set_field, with_inverse
from ._template import Template, compile_pattern, invert, parse_templates, raw, raws, text_arg, texts_arg

__all__ = ["ComputeExportRule", "ComputeRule", "compute", "restored_from"]

Shape = tuple[int, ...]
Info = Mapping[str, tuple[Shape, np.dtype]]
Fn = Callable[..., Any]
ShapeFn = Callable[..., "Shape | None"]
PartShapes = Callable[[Shape], "Sequence[Shape] | None"]


def restored_from(node: Node, against: Info) -> Node:
    """An export node of a computed rule made against the source file: the file's own
    parts as extra inputs, where the file holds every part with the planned shape and dtype."""
    part = node.combine
    assert isinstance(part, ComputedPart)
    if any(against.get(k) != (s, node.dtype) for k, s in zip(part.keys, part.shapes, strict=True)):
        return node
    return replace(node, combine=replace(part, against=True), against=part.keys)


@dataclass(frozen=True)
class ComputeRule:
    """Tensors matching ``patterns`` (one each, capturing the same groups) make the target
    ``fn(*parts)``; ``inverse(target) -> parts`` on export (see :func:`compute`)."""

    patterns: tuple[str, ...]
    target: str
    fn: Fn
    undo: Fn
    shape: ShapeFn | None = None
    part_shapes: PartShapes | None = None
    tolerance: float = 16.0
    inverse_rule: object = field(default=None, compare=False, repr=False)

    _regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__
    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        if not self.patterns or not callable(self.fn) or not callable(self.undo):
            raise RuleError(f"{self}: a computed rule needs at least one pattern, a function and its inverse")
        _tolerance(self.tolerance)
        set_field(self, "_regexes", tuple(compile_pattern(p) for p in self.patterns))
        set_field(self, "_templates", parse_templates((self.target,), self._regexes))

    def __str__(self) -> str:
        return f"compute(({raws(self.patterns)}), {raw(self.target)}, {name_of(self.fn)}, inverse={name_of(self.undo)})"

    def match(self, key: str) -> tuple[int, tuple[str, ...]] | None:
        """``(part, (target,))`` for ``key``, or ``None``."""
        hit = _part_hit(self, self._regexes, key)
        return None if hit is None else (hit[0], (self._templates[0].expand_match(hit[1]),))

    def nodes(self, claims: Mapping[str, tuple[int, tuple[str, ...]]], info: Info, errors: list[str]) -> list[Node]:
        """One computed node per target whose parts are all present."""
        groups = _complete_groups(self, len(self.patterns), claims, 0, errors)
        return [n for (target,), keys in groups if (n := self._node(target, keys, info, errors)) is not None]

    def _node(self, target: str, keys: tuple[str, ...], info: Info, errors: list[str]) -> Node | None:
        shapes = [info[k][0] for k in keys]
        dtype = same_dtype(keys, info, target, errors)
        shape = shapes[0] if self.shape is None else self.shape(*shapes)
        if shape is None:
            found = ", ".join(f"`{k}` {s}" for k, s in zip(keys, shapes, strict=True))
            errors.append(f"`{target}`: {self} cannot make a tensor from {found}")
            return None
        shape = tuple(int(s) for s in shape)
        return None if dtype is None else Node(target, keys, shape, dtype, Computed(self.fn, target, shape, str(dtype)))

    def inverse(self) -> object:
        """A :class:`ComputeExportRule`: each model tensor's inverse, written as the parts."""
        if self.inverse_rule is not None:
            return with_inverse(self, self.inverse_rule)
        model = invert(self.patterns[0], self.target)[0]
        files = tuple(invert(p, self.target)[1] for p in self.patterns)
        return ComputeExportRule(model, files, self, self)


@dataclass(frozen=True)
class ComputeExportRule:
    """Model params matching ``pattern`` written as the file keys ``files``: the parts
    ``rule.undo`` makes of each, its round trip through ``rule.fn`` checked."""

    pattern: str
    files: tuple[str, ...]
    rule: ComputeRule
    inverse_rule: object = field(default=None, compare=False, repr=False)

    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)  # derived in __post_init__
    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        set_field(self, "_regex", compile_pattern(self.pattern))
        set_field(self, "_templates", parse_templates(self.files, (self._regex,)))

    def __str__(self) -> str:
        return f"the inverse of {self.rule}"

    def match(self, key: str) -> tuple[str, ...] | None:
        """The file keys for ``key``, or ``None``."""
        m = self._regex.fullmatch(key)
        return None if m is None else tuple(t.expand_match(m) for t in self._templates)

    def nodes(self, claims: Mapping[str, tuple[str, ...]], info: Info, errors: list[str]) -> list[Node]:
        """One node per part of each claimed model tensor."""
        nodes: list[Node] = []
        for key, files in claims.items():
            shape, dtype = info[key]
            shapes = self._part_shapes(key, shape, errors)
            if shapes is None:
                continue
            for i, (file, part) in enumerate(zip(files, shapes, strict=True)):
                combine = ComputedPart(
                    self.rule.fn, self.rule.undo, i, files, shapes, str(dtype), key, self.rule.tolerance
                )
                nodes.append(Node(file, (key,), part, dtype, combine))
        return nodes

    def _part_shapes(self, key: str, shape: Shape, errors: list[str]) -> tuple[Shape, ...] | None:
        count = len(self.files)
        made = (shape,) * count if self.rule.part_shapes is None else self.rule.part_shapes(shape)
        shapes = None if made is None else tuple(tuple(int(d) for d in s) for s in made)
        if shapes is None or len(shapes) != count:
            errors.append(f"`{key}`: {self} cannot make {count} part(s) of shape {shape}")
            return None
        return shapes

    def inverse(self) -> object:
        """The :class:`ComputeRule` it came from."""
        return self.rule


def compute(
    patterns: str | Sequence[str],
    target: str,
    fn: Fn,
    *,
    inverse: Fn,
    shape: ShapeFn | None = None,
    part_shapes: PartShapes | None = None,
    tolerance: float = 16.0,
) -> ComputeRule:
    """The model param ``target`` is ``fn`` of the file tensors ``patterns`` match.

    ``fn`` takes numpy arrays (one per pattern, in order) and returns the target's value
    in their dtype; ``inverse`` takes the model's value and returns the parts (one array
    per pattern; a single array for one pattern). On export the round trip is checked:
    ``fn(*inverse(w))`` within ``tolerance`` eps of ``w``'s dtype, scaled by ``w``'s largest
    magnitude (exact for integers), else :class:`RuleError` ``kind="round_trip"``; against
    the source file (``rules.inverse(source=...)``), the file's own parts are written while
    ``fn`` of them is the model's value bit for bit. The sources of a computed target are
    read whole (a function has no per-box map).

    Args:
        patterns: one regex per source tensor (they must capture the same groups).
        target: the model path template.
        fn: ``fn(*parts) -> value``, pure numpy.
        inverse: ``inverse(value) -> parts``, pure numpy.
        shape: ``shape(*part_shapes) -> target shape`` (``None``: the parts do not fit);
            default: the first part's shape.
        part_shapes: ``part_shapes(target shape) -> the parts' shapes`` for export;
            default: every part has the target's shape.
        tolerance: the round trip's bound, in eps of the dtype.

    Examples:
        >>> import numpy as np
        >>> from nnx_save.porting import Rules, compute
        >>> def gemma_scale(w): return w + np.ones((), w.dtype)  # stores scale - 1
        >>> def gemma_weight(s): return s - np.ones((), s.dtype)
        >>> rules = Rules(compute(r"norm\\.weight", "norm/scale", gemma_scale, inverse=gemma_weight))
        >>> mapping = rules.mapping({"norm.weight": np.zeros(3, np.float32)})
        >>> mapping.apply({"norm.weight": np.zeros(3, np.float32)})["norm/scale"].tolist()
        [1.0, 1.0, 1.0]
        >>> back = rules.inverse().mapping(mapping.shapes())
        >>> back.apply({"norm/scale": np.full(3, 2.0, np.float32)})["norm.weight"].tolist()
        [1.0, 1.0, 1.0]
    """
    parts = (patterns,) if isinstance(patterns, str) else texts_arg(patterns, "compute: patterns")
    for name, given in (("fn", fn), ("inverse", inverse), ("shape", shape), ("part_shapes", part_shapes)):
        if not callable(given) and (given is not None or name in ("fn", "inverse")):
            raise RuleError(f"compute: {name} must be a function, got {type(given).__name__}")
    return ComputeRule(
        tuple(parts), text_arg(target, "compute: target"), fn, inverse, shape, part_shapes, _tolerance(tolerance)
    )


def _tolerance(value: object) -> float:
    """``value`` as a finite number >= 0 (a multiple of the dtype's epsilon), else a :class:`RuleError`."""
    try:
        ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 <= float(value) < math.inf
    except OverflowError:  # an int past float's range
        ok = False
    if not ok:
        shown = repr(value) if isinstance(value, float) else type(value).__name__
        raise RuleError(f"compute: tolerance must be a finite number >= 0, got {shown}")
    return float(value)  # type: ignore[arg-type]
