"""Rule kinds that compose two moves on one tensor (each layer cut and its parts
stacked; a sum, optionally cut) and ties of copies of one tensor, with their inverses."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ._errors import RuleError
from ._parts import axis_of, complete_layers, joined, layer_groups, same_dtype, split_bounds, too_many_layers
from ._rule_base import Node, Patterned, set_field, with_inverse
from ._template import Template, compile_pattern, invert, parse_templates, raw, raws, ticked
from ._transforms import Chain, Concatenate, Constant, Each, Index, Same, Stack, Sum, Take

__all__ = ["ConcatUnstackRule", "SplitStackRule", "SumExportRule", "SumRule", "TieRule", "tie_checked"]

Shape = tuple[int, ...]
Info = Mapping[str, tuple[Shape, np.dtype]]


def _part_hit(rule: object, regexes: Sequence[re.Pattern[str]], key: str) -> tuple[int, re.Match[str]] | None:
    """``(part, match)`` of the one pattern ``key`` matches; two is a refusal."""
    hits = [(i, m) for i, r in enumerate(regexes) if (m := r.fullmatch(key)) is not None]
    if len(hits) > 1:
        raise RuleError(f"`{key}`: matches several parts of {rule}; each key must match one part")
    return hits[0] if hits else None


def _complete_parts(rule: object, name: object, parts: Mapping[int, str], count: int, errors: list[str]) -> bool:
    absent = [i for i in range(count) if i not in parts]
    if absent:
        errors.append(f"`{name}`: {rule} found {ticked(parts[i] for i in sorted(parts))} but not part(s) {absent}")
    return not absent


def _complete_groups(
    rule: object, count: int, claims: Mapping[str, tuple[int, tuple[str, ...]]], lead: int, errors: list[str]
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """``(names, keys in part order)`` of each group of claims ``(part, names)`` whose
    ``count`` parts are all present; the others go to ``errors``, named by ``names[lead]``."""
    groups: dict[tuple[str, ...], dict[int, str]] = defaultdict(dict)
    for key, (part, names) in sorted(claims.items()):
        groups[names][part] = key
    complete = [
        (names, parts) for names, parts in groups.items() if _complete_parts(rule, names[lead], parts, count, errors)
    ]
    return [(names, tuple(parts[i] for i in range(count))) for names, parts in complete]


def _origin(rule: Any, what: str) -> object:
    """The inverse of an export-only rule: the rule it was made from."""
    if rule.inverse_rule is None:
        raise RuleError(f"{rule} is the inverse of {what}; invert that rule instead")
    return rule.inverse_rule


# --- split each layer, stack each part ----------------------------------------------


@dataclass(frozen=True)
class SplitStackRule(Patterned):
    """Per-layer tensors matching ``pattern`` (layer index in the named group
    ``group``) cut along ``axis`` into ``targets``, each part stacked over the layers
    on ``stack_axis`` (the targets must not reference the layer group)."""

    targets: tuple[str, ...]
    axis: int = 0
    sizes: tuple[int, ...] | None = None
    group: str = "layer"
    stack_axis: int = 0
    inverse_rule: object = field(default=None, compare=False, repr=False)

    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        super().__post_init__()
        set_field(self, "_templates", parse_templates(self.targets, (self._regex,)))
        number = self._regex.groupindex.get(self.group)
        if number is None or any(self.group in t.refs or number in t.refs for t in self._templates):
            raise RuleError(
                f"{self}: stacked=True needs a named group (?P<{self.group}>...) in the pattern that no target references"
            )
        if len(self.targets) < 2:
            raise RuleError(f"{self}: a split needs at least two targets, got {len(self.targets)}")

    def __str__(self) -> str:
        return f"split({raw(self.pattern)}, ({raws(self.targets)}), axis={self.axis}, stacked=True)"

    def match(self, key: str) -> tuple[str, tuple[str, ...]] | None:
        """``(layer text, targets)`` for ``key``, or ``None``."""
        m = self._regex.fullmatch(key)
        return None if m is None else (m.group(self.group), tuple(t.expand_match(m) for t in self._templates))

    def nodes(self, claims: Mapping[str, tuple[str, tuple[str, ...]]], info: Info, errors: list[str]) -> list[Node]:
        """One stacked node per part, for each group of complete layers."""
        nodes: list[Node] = []
        for targets, layers in layer_groups(self, claims, errors).items():
            found = complete_layers(self, targets[0], layers, info, errors)
            if found is None:
                continue
            keys, shape = found
            bounds = split_bounds(self, keys[0], shape, (self.axis, self.sizes, len(self.targets)), errors)
            stack_at = axis_of(self.stack_axis, len(shape) + 1)
            dtype = same_dtype(keys, info, targets[0], errors)
            if bounds is None or stack_at is None or dtype is None:
                continue
            axis, starts = bounds
            for target, start, stop in zip(targets, starts, starts[1:], strict=False):
                part = [*shape[:axis], stop - start, *shape[axis + 1 :]]
                part.insert(stack_at, len(keys))
                nodes.append(Node(target, keys, tuple(part), dtype, Each(Take(axis, start, stop), Stack(stack_at))))
        return nodes

    def inverse(self) -> object:
        """A :class:`ConcatUnstackRule` giving each layer its fused tensor back."""
        if self.inverse_rule is not None:
            return with_inverse(self, self.inverse_rule)
        pairs = [invert(self.pattern, t, consumed=self.group) for t in self.targets]
        return ConcatUnstackRule(
            tuple(p for p, _ in pairs), pairs[0][1], self.axis, self.sizes, self.group, self.stack_axis, self
        )


@dataclass(frozen=True)
class ConcatUnstackRule:
    """Stacked parts (one pattern each, same groups) joined layer by layer along
    ``axis`` into the per-layer key ``target`` (which references ``\\g<group>``)."""

    patterns: tuple[str, ...]
    target: str
    axis: int = 0
    sizes: tuple[int, ...] | None = None
    group: str = "layer"
    stack_axis: int = 0
    inverse_rule: object = field(default=None, compare=False, repr=False)

    _regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__
    _template: Template = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        set_field(self, "_regexes", tuple(compile_pattern(p) for p in self.patterns))
        (template,) = parse_templates((self.target,), self._regexes, extra=(self.group,))
        set_field(self, "_template", template)

    def __str__(self) -> str:
        if self.inverse_rule:
            return f"the inverse of {self.inverse_rule}"
        return f"concat_unstack(({raws(self.patterns)}), {raw(self.target)})"

    def match(self, key: str) -> tuple[int, re.Match[str]] | None:
        """``(part, match)`` for ``key``, or ``None``."""
        return _part_hit(self, self._regexes, key)

    def nodes(self, claims: Mapping[str, tuple[int, re.Match[str]]], info: Info, errors: list[str]) -> list[Node]:
        """One node per layer of each complete group of parts."""
        groups: dict[str, dict[int, tuple[str, re.Match[str]]]] = defaultdict(dict)
        for key, (part, m) in sorted(claims.items()):
            groups[self._template.expand_match(m, **{self.group: "*"})][part] = (key, m)
        nodes: list[Node] = []
        for name, parts in groups.items():
            keys = {i: k for i, (k, _) in parts.items()}
            if _complete_parts(self, name, keys, len(self.patterns), errors):
                nodes.extend(self._layers(name, [parts[i] for i in range(len(self.patterns))], info, errors))
        return nodes

    def _layers(self, name: str, parts: list, info: Info, errors: list[str]) -> list[Node]:
        keys = tuple(k for k, _ in parts)
        shapes = [info[k][0] for k in keys]
        at = axis_of(self.stack_axis, len(shapes[0]))
        axis_in_range = axis_of(self.axis, len(shapes[0]) - 1) is not None
        dtype = same_dtype(keys, info, name, errors)
        if at is None or not axis_in_range or len({s[at] for s in shapes}) != 1 or len({len(s) for s in shapes}) != 1:
            errors.append(f"`{name}`: {self} needs parts with one layer count, found {shapes}")
            return []
        made = joined([s[:at] + s[at + 1 :] for s in shapes], self.axis)
        if made is None or dtype is None:
            errors.append(f"`{name}`: {self} needs parts that agree off axis {self.axis}, found {shapes}")
            return []
        axis, sizes, shape = made
        if too_many_layers(self, name, shapes[0][at], errors):
            return []
        combine = Concatenate(axis, sizes)
        m = parts[0][1]
        return [
            Node(
                self._template.expand_match(m, **{self.group: str(i)}), keys, shape, dtype, Each(Index(at, i), combine)
            )
            for i in range(shapes[0][at])
        ]

    def inverse(self) -> object:
        """The :class:`SplitStackRule` it came from."""
        return _origin(self, "a stacked split")


# --- sum ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parts:
    """What a sum and its export share: one pattern per part, each part's match
    expanding the same names (targets, or file keys)."""

    patterns: tuple[str, ...]

    _regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)  # derived in _compile
    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)  # derived in _compile

    def _compile(self, names: Sequence[str]) -> None:
        set_field(self, "_regexes", tuple(compile_pattern(p) for p in self.patterns))
        set_field(self, "_templates", parse_templates(names, self._regexes))

    def match(self, key: str) -> tuple[int, tuple[str, ...]] | None:
        """``(part, names)`` for ``key``, or ``None``."""
        hit = _part_hit(self, self._regexes, key)
        return None if hit is None else (hit[0], tuple(t.expand_match(hit[1]) for t in self._templates))


@dataclass(frozen=True)
class SumRule(_Parts):
    """Tensors matching ``patterns`` (one each) added into ``targets``: one target,
    or several that cut the sum along ``axis`` in equal parts. ``into``: the part
    that holds the whole sum on export (the others are written as zeros)."""

    targets: tuple[str, ...]
    axis: int = 0
    into: int = 0
    inverse_rule: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.patterns) < 2 or not self.targets:
            raise RuleError(f"{self}: a sum needs at least two patterns and a target")
        if not 0 <= self.into < len(self.patterns):
            raise RuleError(f"{self}: into={self.into} must name one of the {len(self.patterns)} parts")
        self._compile(self.targets)

    def __str__(self) -> str:
        return f"add(({raws(self.patterns)}), ({raws(self.targets)}), axis={self.axis}, into={self.into})"

    def nodes(self, claims: Mapping[str, tuple[int, tuple[str, ...]]], info: Info, errors: list[str]) -> list[Node]:
        """The summed node(s) of each group whose parts are all present."""
        groups = _complete_groups(self, len(self.patterns), claims, 0, errors)
        return [n for targets, keys in groups for n in self._summed(targets, keys, info, errors)]

    def _summed(self, targets: tuple[str, ...], keys: tuple[str, ...], info: Info, errors: list[str]) -> list[Node]:
        shapes = {info[k][0] for k in keys}
        dtype = same_dtype(keys, info, targets[0], errors)
        if len(shapes) != 1 or dtype is None:
            errors.append(f"`{targets[0]}`: {self} adds tensors of one shape, found {[info[k][0] for k in keys]}")
            return []
        (shape,) = shapes
        if len(targets) == 1:
            return [Node(targets[0], keys, shape, dtype, Sum())]
        bounds = split_bounds(self, keys[0], shape, (self.axis, None, len(targets)), errors)
        if bounds is None:
            return []
        axis, starts = bounds
        return [
            Node(t, keys, (*shape[:axis], b - a, *shape[axis + 1 :]), dtype, Chain(Sum(), Take(axis, a, b)))
            for t, a, b in zip(targets, starts, starts[1:], strict=False)
        ]

    def inverse(self) -> object:
        """A :class:`SumExportRule`: the sum into part ``into``, zeros into the rest."""
        if self.inverse_rule is not None:
            return with_inverse(self, self.inverse_rule)
        model = tuple(invert(self.patterns[self.into], t)[0] for t in self.targets)
        files = tuple(invert(p, self.targets[0])[1] for p in self.patterns)
        return SumExportRule(model, files, self.axis, self.into, self)


@dataclass(frozen=True)
class SumExportRule(_Parts):
    """Model params matching ``patterns`` (one per part of the sum, joined along
    ``axis``) written to the file key ``files[into]``; the other ``files`` are zeros of
    its shape, so the sum on load gives the params back exactly."""

    files: tuple[str, ...]
    axis: int = 0
    into: int = 0
    inverse_rule: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._compile(self.files)

    def __str__(self) -> str:
        return f"the inverse of {self.inverse_rule}" if self.inverse_rule else f"add_export(({raws(self.files)}))"

    def nodes(self, claims: Mapping[str, tuple[int, tuple[str, ...]]], info: Info, errors: list[str]) -> list[Node]:
        """The joined node and its zero companions, per complete group."""
        groups = _complete_groups(self, len(self.patterns), claims, self.into, errors)
        return [n for files, keys in groups for n in self._written(files, keys, info, errors)]

    def _written(self, files: tuple[str, ...], keys: tuple[str, ...], info: Info, errors: list[str]) -> list[Node]:
        dtype = same_dtype(keys, info, files[self.into], errors)
        shapes = [info[k][0] for k in keys]
        made = joined(shapes, self.axis)
        if dtype is None or made is None:
            errors.append(f"`{files[self.into]}`: {self} needs parts that agree off axis {self.axis}, found {shapes}")
            return []
        axis, sizes, shape = made
        combine = Concatenate(axis, sizes) if len(keys) > 1 else None
        whole = Node(files[self.into], keys, shape, dtype, combine, restore=(files, self.into))
        zeros = Constant(0, str(dtype), shape)
        return [whole, *(Node(f, (), shape, dtype, zeros) for i, f in enumerate(files) if i != self.into)]

    def inverse(self) -> object:
        """The :class:`SumRule` it came from."""
        return _origin(self, "a sum")


# --- tie ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TieRule:
    """File keys ``copies`` (templates expanded from a ``source`` match) hold the same
    tensor as the key matching ``source``: on load (``writes=False``) checked equal or only
    listed (``check``), on export (``writes=True``) written under each copy's name too."""

    source: str
    copies: tuple[str, ...]
    check: bool = True
    writes: bool = False

    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)  # derived in __post_init__
    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        if not self.copies:
            raise RuleError(f"{self}: a tie needs at least one copy")
        set_field(self, "_regex", compile_pattern(self.source))
        set_field(self, "_templates", parse_templates(self.copies, (self._regex,)))

    def __str__(self) -> str:
        return f"tie({raw(self.source)}, {raws(self.copies)}{'' if self.check else ', check=False'})"

    def copies_of(self, key: str) -> tuple[str, ...]:
        """The copies' names for a source ``key`` (``()`` when it is no source)."""
        m = self._regex.fullmatch(key)
        return () if m is None else tuple(t.expand_match(m) for t in self._templates)

    def tied(self, info: Info, errors: list[str]) -> dict[str, str]:
        """On load: ``{copy key: source key}`` for the copies present in ``info``."""
        out = {}
        for key in sorted(info):
            for copy in self.copies_of(key):
                if copy in info and info[copy] != info[key]:
                    found = f"{info[copy][0]} {info[copy][1]}, the source {info[key][0]} {info[key][1]}"
                    errors.append(f"`{copy}`: {self} ties it to `{key}`, found {found}")
                elif copy in info:
                    out[copy] = key
        return out

    def written(self, nodes: Sequence[Node]) -> list[Node]:
        """On export: a copy of each node whose target is a source, under each copy's name."""
        return [replace(n, target=c) for n in nodes for c in self.copies_of(n.target)]

    def inverse(self) -> TieRule:
        """The same tie for the other direction."""
        return replace(self, writes=not self.writes)


def tie_checked(node: Node, copies: Sequence[str]) -> Node:
    """On load with ``check``: ``node`` (a plain rename of the source) also reads the
    copies and checks them equal."""
    keys = (*node.sources, *copies)
    return replace(node, sources=keys, combine=Same(keys))
