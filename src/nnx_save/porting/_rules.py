"""The rule kinds: frozen dataclasses that say where each source tensor goes.

*Structural* rules (here) match a source key and make its target(s); *value* rules
(transpose, reshape: :mod:`._value_rules`) match a model path. The planner calls ``match``
on every source key, then ``nodes`` once per rule; a rule appends what does not fit to
``errors``, raised at once.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import short_repr
from ._errors import RuleError
from ._parts import (
    MAX_INDEX_DIGITS,
    axis_of,
    complete_layers,
    joined,
    layer_groups,
    refuse_shared_layer,
    same_dtype,
    split_bounds,
    too_many_layers,
)
from ._rule_base import Info, Node, Patterned, not_invertible, set_field, with_inverse
from ._template import Template, check_refs, compile_pattern, invert, parse_pattern, parse_templates, raw, raws, ticked
from ._transforms import Concatenate, Constant, Index, Stack, Take
from ._value_rules import ReshapeRule, TransposeRule

__all__ = [
    "ConcatRule",
    "ConstantRule",
    "IgnoreRule",
    "Node",
    "RenameRule",
    "ReshapeRule",
    "Rule",
    "SplitRule",
    "StackRule",
    "StructuralRule",
    "TransposeRule",
    "UnstackRule",
    "ValueRule",
]

# --- rename / ignore ----------------------------------------------------------------


@dataclass(frozen=True)
class RenameRule(Patterned):
    """Source keys matching ``pattern`` become ``replacement`` (first rename wins).

    ``shift`` adds to a captured index (``((1, -1),)``: ``features.3`` -> ``blocks/2``); a
    key whose shifted index would be negative is not matched, so another rule can take it.
    ``index`` renumbers a captured index through a table (``((1, ((0, 0), (3, 1), (6, 2))),)``:
    ``features.3`` -> ``blocks/1``); an index the table lacks is not matched. ``accept``:
    per group, the regex a renumbered index must still match (set on an inverse, so that
    it gives back exactly the keys the forward rule read).
    """

    replacement: str
    inverse_rule: StructuralRule | None = field(default=None, compare=False, repr=False)
    shift: tuple[tuple[int | str, int], ...] = ()
    index: tuple[tuple[int | str, tuple[tuple[int, int], ...]], ...] = ()
    accept: tuple[tuple[int, str], ...] = ()

    _template: Template = field(init=False, repr=False, compare=False)  # derived in __post_init__
    _shift: dict[int, int] = field(init=False, repr=False, compare=False)  # derived in __post_init__
    _index: dict[int, dict[int, int]] = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        super().__post_init__()
        set_field(self, "_template", Template.parse(self.replacement))
        check_refs(self._template, self._regex)
        set_field(self, "_shift", {_group_index(self._regex, g, self): int(d) for g, d in self.shift})
        set_field(self, "_index", {_group_index(self._regex, g, self): _table(t, self) for g, t in self.index})
        both = sorted(set(self._shift) & set(self._index))
        if both:
            raise RuleError(f"{self}: group {both[0]} is given both shift= and index=; give one")

    def __str__(self) -> str:
        shift = f", shift={dict(self.shift)!r}" if self.shift else ""
        index = "".join(f", index={{{g!r}: {[a for a, _ in t]}}}" for g, t in self.index if _counting(t))
        index += "".join(f", index={{{g!r}: {dict(t)}}}" for g, t in self.index if not _counting(t))
        return f"rename({raw(self.pattern)}, {raw(self.replacement)}{shift}{index})"

    @property
    def renumbered(self) -> frozenset[int]:
        """The groups (numbers) whose index this rule changes."""
        return frozenset(self._shift) | frozenset(self._index)

    def match(self, key: str) -> str | None:
        """The target for ``key``, or ``None``."""
        m = self._regex.fullmatch(key)
        if m is None:
            return None
        if not self.renumbered:
            return self._template.expand_match(m)
        groups: dict[int | str, str | None] = {i: m.group(i) for i in range(1, self._regex.groups + 1)}
        for index in sorted(self.renumbered):
            groups[index] = self._renumber(key, index, groups[index])
            if groups[index] is None:
                return None
        groups.update({name: groups[i] for name, i in self._regex.groupindex.items()})
        return self._template.expand(groups)

    def _renumber(self, key: str, group: int, text: str | None) -> str | None:
        """Group ``group``'s new index text, or ``None`` (no match)."""
        number = _index_number(key, text, self)
        new = number + self._shift[group] if group in self._shift else self._index[group].get(number)
        if new is None or new < 0:
            return None
        body = dict(self.accept).get(group)
        return None if body is not None and re.fullmatch(body, str(new)) is None else str(new)

    def nodes(self, claims: Mapping[str, str], info: Info, errors: list[str]) -> list[Node]:
        """One unchanged node per claimed key."""
        return [Node(target, (key,), info[key][0], info[key][1], None) for key, target in claims.items()]

    def inverse(self) -> StructuralRule:
        """The export rule; automatic for the simple regex forms (see ``_template``)."""
        if self.inverse_rule is not None:
            return with_inverse(self, self.inverse_rule)
        pattern, replacement = invert(self.pattern, self.replacement, widen=self.renumbered)
        # the inverse pattern's group k is the k-th reference of this replacement
        refs = [_group_index(self._regex, r, self) for r in self._template.refs]
        shift = tuple((refs.index(g) + 1, -d) for g, d in self._shift.items())
        index = tuple((refs.index(g) + 1, tuple((b, a) for a, b in t.items())) for g, t in self._index.items())
        bodies = _group_bodies(self.pattern)
        accept = tuple(
            (refs.index(g) + 1, bodies[g - 1])
            for g in sorted(self.renumbered)
            if bodies[g - 1] not in (r"\d+", "[0-9]+")
        )
        return RenameRule(pattern, replacement, inverse_rule=self, shift=shift, index=index, accept=accept)


def _counting(table: tuple[tuple[int, int], ...]) -> bool:
    """A table of the form ``index={g: [n0, n1, ...]}`` (``n_i`` -> ``i``)."""
    return [b for _, b in table] == list(range(len(table)))


def _table(pairs: tuple[tuple[int, int], ...], rule: object) -> dict[int, int]:
    table: dict[int, int] = {}
    for a, b in pairs:
        if not (isinstance(a, int) and isinstance(b, int)) or a < 0 or b < 0 or a in table:
            raise RuleError(f"{rule}: index= maps each index (an int >= 0) once to an int >= 0, got {pairs!r}")
        table[a] = b
    if len(set(table.values())) != len(table):
        raise RuleError(f"{rule}: index= sends two indices to one, so export could not tell them apart: {pairs!r}")
    return table


def _group_bodies(pattern: str) -> list[str]:
    """Each capturing group's regex body, in order (the pattern is of the invertible form)."""
    return [g.body for g in parse_pattern(pattern)[1]]


def _group_index(regex: re.Pattern[str], group: int | str, rule: object) -> int:
    index = regex.groupindex.get(group) if isinstance(group, str) else group
    if not isinstance(index, int) or not 0 < index <= regex.groups:
        raise RuleError(f"{rule}: shift / index names group {group!r}, which the pattern does not define")
    return index


def _index_number(key: str, text: str | None, rule: object) -> int:
    """The decimal index captured in ``text``."""
    if text is None or not (text.isascii() and text.isdigit()):  # "²".isdigit() is true, int("²") fails
        raise RuleError(f"`{key}`: {rule} renumbers group text {text!r}, which is not a decimal index")
    if len(text) > MAX_INDEX_DIGITS:  # int() refuses 4,300 digits; no index is past 10**18
        raise RuleError(
            f"`{short_repr(key, 80)}`: {rule} renumbers an index of {len(text)} digits; at most {MAX_INDEX_DIGITS}"
        )
    return int(text)


@dataclass(frozen=True)
class IgnoreRule(Patterned):
    """Source keys matching ``pattern`` are dropped on purpose (``KeyMapping.unused``).

    ``export``: a :class:`ConstantRule` the inverse writes instead (``num_batches_tracked``).
    """

    export: ConstantRule | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"ignore({raw(self.pattern)})"

    def match(self, key: str) -> bool | None:
        """``True`` for a key to drop, else ``None``."""
        return True if self._regex.fullmatch(key) else None

    def nodes(self, claims: Mapping[str, object], info: Info, errors: list[str]) -> list[Node]:
        """No target at all."""
        return []


# --- split / concat -----------------------------------------------------------------


@dataclass(frozen=True)
class SplitRule(Patterned):
    """One source tensor cut along ``axis`` into ``len(targets)`` targets."""

    targets: tuple[str, ...]
    axis: int = 0
    sizes: tuple[int, ...] | None = None
    inverse_rule: StructuralRule | None = field(default=None, compare=False, repr=False)

    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        super().__post_init__()
        set_field(self, "_templates", parse_templates(self.targets, (self._regex,)))
        refuse_shared_layer(self, self._regex, self._templates, "layer")
        if len(self.targets) < 2:
            raise RuleError(f"{self}: a split needs at least two targets, got {len(self.targets)}")
        if self.sizes is not None and (len(self.sizes) != len(self.targets) or min(self.sizes) < 0):
            raise RuleError(f"{self}: sizes must be {len(self.targets)} non-negative ints, got {self.sizes}")

    def __str__(self) -> str:
        sizes = "" if self.sizes is None else f", sizes={self.sizes}"
        return f"split({raw(self.pattern)}, ({raws(self.targets)}), axis={self.axis}{sizes})"

    def match(self, key: str) -> tuple[str, ...] | None:
        """The targets for ``key``, or ``None``."""
        m = self._regex.fullmatch(key)
        return None if m is None else tuple(t.expand_match(m) for t in self._templates)

    def nodes(self, claims: Mapping[str, tuple[str, ...]], info: Info, errors: list[str]) -> list[Node]:
        """One sliced node per target."""
        nodes: list[Node] = []
        for key, targets in claims.items():
            shape, dtype = info[key]
            bounds = split_bounds(self, key, shape, (self.axis, self.sizes, len(self.targets)), errors)
            if bounds is None:
                continue
            axis, starts = bounds
            for target, start, stop in zip(targets, starts, starts[1:], strict=False):
                part = (*shape[:axis], stop - start, *shape[axis + 1 :])
                nodes.append(Node(target, (key,), part, dtype, Take(axis, start, stop)))
        return nodes

    def inverse(self) -> StructuralRule:
        """A :class:`ConcatRule` joining the targets back into the source."""
        if self.inverse_rule is not None:
            return with_inverse(self, self.inverse_rule)
        pairs = [invert(self.pattern, target) for target in self.targets]
        patterns = tuple(p for p, _ in pairs)
        templates = tuple(t for _, t in pairs)
        return ConcatRule(patterns, templates, self.axis, self.sizes, inverse_rule=self)


@dataclass(frozen=True)
class ConcatRule:
    """Several source tensors (one per pattern) joined along ``axis`` into one target.

    Part ``i`` is the key matching ``patterns[i]``; ``targets[i]`` is its target
    template (all parts of one target must expand to the same name).
    """

    patterns: tuple[str, ...]
    targets: tuple[str, ...]
    axis: int = 0
    sizes: tuple[int, ...] | None = None
    inverse_rule: StructuralRule | None = field(default=None, compare=False, repr=False)

    _regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__
    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)  # derived in __post_init__

    def __post_init__(self) -> None:
        if len(self.patterns) < 2 or len(self.targets) != len(self.patterns):
            raise RuleError(f"{self}: needs at least two patterns and one target template per pattern")
        set_field(self, "_regexes", tuple(compile_pattern(p) for p in self.patterns))
        set_field(self, "_templates", tuple(Template.parse(t) for t in self.targets))
        for regex, template in zip(self._regexes, self._templates, strict=True):
            check_refs(template, regex)

    def __str__(self) -> str:
        target = raw(self.targets[0]) if len(set(self.targets)) == 1 else str(tuple(self.targets))
        return f"concat(({raws(self.patterns)}), {target}, axis={self.axis})"

    def match(self, key: str) -> tuple[int, str] | None:
        """``(part, target)`` for ``key``; a key matching two parts is refused."""
        found = [(i, r.fullmatch(key)) for i, r in enumerate(self._regexes)]
        hits = [(i, self._templates[i].expand_match(m)) for i, m in found if m is not None]
        if len(hits) > 1:
            parts = " and ".join(raw(self.patterns[i]) for i, _ in hits)
            raise RuleError(f"`{key}`: matches parts {parts} of {self}; each key must match one part")
        return hits[0] if hits else None

    def nodes(self, claims: Mapping[str, tuple[int, str]], info: Info, errors: list[str]) -> list[Node]:
        """One concatenated node per target whose parts are all present."""
        groups: dict[str, dict[int, str]] = defaultdict(dict)
        for key, (part, target) in sorted(claims.items()):
            if part in groups[target]:
                errors.append(f"`{target}`: produced twice by {self}, from `{groups[target][part]}` and `{key}`")
            groups[target].setdefault(part, key)
        return [n for t, parts in groups.items() if (n := self._node(t, parts, info, errors)) is not None]

    def _node(self, target: str, parts: Mapping[int, str], info: Info, errors: list[str]) -> Node | None:
        absent = [raw(self.patterns[i]) for i in range(len(self.patterns)) if i not in parts]
        if absent:
            have = ticked(parts[i] for i in sorted(parts))
            errors.append(f"`{target}`: {self} found {have} but no key matching {', '.join(absent)}")
            return None
        keys = tuple(parts[i] for i in range(len(self.patterns)))
        shapes = [info[k][0] for k in keys]
        made = joined(shapes, self.axis)
        if made is None:
            found = ", ".join(f"`{k}` {s}" for k, s in zip(keys, shapes, strict=True))
            errors.append(f"`{target}`: {self} needs shapes that agree off axis {self.axis}, found {found}")
            return None
        axis, sizes, shape = made
        if self.sizes is not None and sizes != self.sizes:
            errors.append(f"`{target}`: {self} expects part sizes {self.sizes} on axis {self.axis}, found {sizes}")
            return None
        dtype = same_dtype(keys, info, target, errors)
        return None if dtype is None else Node(target, keys, shape, dtype, Concatenate(axis, sizes))

    def inverse(self, sizes: tuple[int, ...] | None = None) -> StructuralRule:
        """A :class:`SplitRule`; needs the part sizes (given here, or ``sizes=``)."""
        if self.inverse_rule is not None:
            return with_inverse(self, self.inverse_rule)
        sizes = self.sizes if self.sizes is not None else sizes
        if sizes is None:
            raise not_invertible(
                self, "the split sizes cannot be read back from the joined tensor", "sizes= to concat()"
            )
        pairs = [invert(p, t) for p, t in zip(self.patterns, self.targets, strict=True)]
        if len({p for p, _ in pairs}) != 1:
            raise RuleError(
                f"{self} cannot be inverted automatically: its parts give different target patterns "
                f"{', '.join(sorted({raw(p) for p, _ in pairs}))}; pass inverse= with an explicit rule",
                kind="not_invertible",
            )
        return SplitRule(pairs[0][0], tuple(t for _, t in pairs), self.axis, sizes, inverse_rule=self)


# --- stack / unstack ----------------------------------------------------------------


@dataclass(frozen=True)
class _LayerRule(Patterned):
    """What stack and unstack share: a pattern, a target, an axis and the layer group."""

    target: str
    axis: int = 0
    group: str = "layer"
    inverse_rule: StructuralRule | None = field(default=None, compare=False, repr=False)

    _template: Template = field(init=False, repr=False, compare=False)  # derived in _compile

    def _compile(self, extra: tuple[str, ...] = ()) -> None:
        super().__post_init__()
        set_field(self, "_template", Template.parse(self.target))
        check_refs(self._template, self._regex, extra=extra)


@dataclass(frozen=True)
class StackRule(_LayerRule):
    """Per-layer source tensors stacked along ``axis`` into one target.

    ``pattern`` holds a named group (``group``, default ``layer``) with the layer
    index; ``target`` must not reference it. Layers must be exactly ``0 .. L-1``.
    """

    def __post_init__(self) -> None:
        self._compile()
        number = self._regex.groupindex.get(self.group)
        if number is None:
            raise RuleError(f"{self}: the pattern needs a named group (?P<{self.group}>...) for the layer index")
        if self.group in self._template.refs or number in self._template.refs:
            raise RuleError(f"{self}: the target must not reference the layer group {self.group!r}")

    def __str__(self) -> str:
        return f"stack({raw(self.pattern)}, {raw(self.target)}, axis={self.axis})"

    def match(self, key: str) -> tuple[str, str] | None:
        """``(layer text, target)`` for ``key``, or ``None``."""
        m = self._regex.fullmatch(key)
        return None if m is None else (m.group(self.group), self._template.expand_match(m))

    def nodes(self, claims: Mapping[str, tuple[str, str]], info: Info, errors: list[str]) -> list[Node]:
        """One stacked node per target whose layers are exactly ``0 .. L-1``."""
        groups = layer_groups(self, claims, errors)
        return [n for t, layers in groups.items() if (n := self._node(t, layers, info, errors)) is not None]

    def _node(self, target: str, layers: Mapping[int, str], info: Info, errors: list[str]) -> Node | None:
        found = complete_layers(self, target, layers, info, errors)
        if found is None:
            return None
        keys, shape = found
        axis = axis_of(self.axis, len(shape) + 1)
        if axis is None:
            errors.append(f"`{target}`: {self} cannot stack shape {shape} on axis {self.axis}")
            return None
        dtype = same_dtype(keys, info, target, errors)
        stacked = (*shape[:axis], len(keys), *shape[axis:])
        return None if dtype is None else Node(target, keys, stacked, dtype, Stack(axis))

    def inverse(self) -> StructuralRule:
        """An :class:`UnstackRule` giving each layer back its own key."""
        if self.inverse_rule is not None:
            return with_inverse(self, self.inverse_rule)
        pattern, template = invert(self.pattern, self.target, consumed=self.group)
        return UnstackRule(pattern, template, self.axis, self.group, inverse_rule=self)


@dataclass(frozen=True)
class UnstackRule(_LayerRule):
    """One source tensor cut along ``axis`` into one target per entry.

    ``target`` references ``\\g<layer>`` (``group``), filled with the entry index.
    """

    def __post_init__(self) -> None:
        self._compile(extra=(self.group,))
        if self.group in self._regex.groupindex:
            raise RuleError(f"{self}: the pattern must not define the group {self.group!r}, the target's index")
        if self.group not in self._template.refs:
            raise RuleError(f"{self}: the target must reference \\g<{self.group}> for the entry index")

    def __str__(self) -> str:
        return f"unstack({raw(self.pattern)}, {raw(self.target)}, axis={self.axis})"

    def match(self, key: str) -> re.Match[str] | None:
        """The match of ``key``, or ``None``."""
        return self._regex.fullmatch(key)

    def nodes(self, claims: Mapping[str, re.Match[str]], info: Info, errors: list[str]) -> list[Node]:
        """One node per entry along ``axis``."""
        nodes: list[Node] = []
        for key, m in claims.items():
            shape, dtype = info[key]
            axis = axis_of(self.axis, len(shape))
            if axis is None:
                errors.append(f"`{key}`: {self} needs axis {self.axis}, found shape {shape}")
                continue
            if too_many_layers(self, key, shape[axis], errors):
                continue
            part = shape[:axis] + shape[axis + 1 :]
            for i in range(shape[axis]):
                target = self._template.expand_match(m, **{self.group: str(i)})
                nodes.append(Node(target, (key,), part, dtype, Index(axis, i)))
        return nodes

    def inverse(self) -> StructuralRule:
        """A :class:`StackRule` stacking the entries back."""
        if self.inverse_rule is not None:
            return with_inverse(self, self.inverse_rule)
        pattern, template = invert(self.pattern, self.target, produced=(self.group, r"\d+"))
        return StackRule(pattern, template, self.axis, self.group, inverse_rule=self)


@dataclass(frozen=True)
class ConstantRule:
    """For each source key ``emit`` matches, a target ``emit`` names holding the 0-d
    ``value`` of ``dtype``, made from no source (on export: a file key the model has
    no parameter for, so loaders that expect it do not report it missing)."""

    emit: RenameRule
    value: int | float = 0
    dtype: str = "int64"
    of: RenameRule | None = field(default=None, repr=False)  # only the keys this rule takes

    def __str__(self) -> str:
        return f"constant({self.emit}, {self.value!r}, {self.dtype!r})"

    def nodes_for(self, keys: Iterable[str]) -> list[Node]:
        """One constant node per key ``emit`` matches (of those ``of`` takes, when set)."""
        targets = sorted({t for k in keys if (t := self.emit.match(k)) is not None})
        return [Node(t, (), (), np.dtype(self.dtype), Constant(self.value, self.dtype)) for t in targets]


StructuralRule = RenameRule | IgnoreRule | SplitRule | ConcatRule | StackRule | UnstackRule
ValueRule = TransposeRule | ReshapeRule
Rule = StructuralRule | ValueRule | ConstantRule
