"""``Rules`` and the pure planner: source shapes in, a :class:`KeyMapping` out.

Three passes, each collecting every problem before raising once: *claim* (each source
key to the first matching rename or its one other structural rule), *build* (each rule's
claims into target nodes, shapes checked; a target made twice is a conflict), then the
*value rules* (transposes, reshapes): after the structural rule on load, matching the
target path; before it on export, matching the source key (a model path).
"""

from __future__ import annotations

import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeGuard

import numpy as np

from ._checks import against_source, distinct, owners_of, problems_message, table_problems
from ._compose import ConcatUnstackRule, SplitStackRule, SumExportRule, SumRule, TieRule, tie_checked
from ._computed import ComputeExportRule, ComputeRule
from ._errors import RuleError, RuleKind, RuleTableWarning
from ._rules import (
    ConcatRule,
    ConstantRule,
    IgnoreRule,
    Node,
    RenameRule,
    ReshapeRule,
    Rule,
    StructuralRule,
    TransposeRule,
)
from ._shapes import Shape, source_shapes
from ._template import ticked
from ._transforms import Concatenate, Reshape, Step, Transform

__all__ = ["Assignment", "KeyMapping", "Rules"]

Info = Mapping[str, tuple[Shape, np.dtype]]
Direction = Literal["load", "export"]
AnyStructural = StructuralRule | SplitStackRule | ConcatUnstackRule | SumRule | SumExportRule | ComputeRule
AnyRule = AnyStructural | Rule | TieRule | ComputeExportRule


@dataclass(frozen=True)
class Assignment:
    """How one target tensor is made.

    Attributes:
        target: the target name (a model path on load, a file key on export).
        sources: the source keys it is made from, in the order ``transform`` takes them.
        shape: the target's shape.
        dtype: the target's dtype (always the sources' dtype; rules never cast).
        transform: ``None`` when the target is exactly ``sources[0]``, only renamed (read
            straight from the file, sharded); else ``transform(source_arrays) -> np.ndarray``.
        against: on an export made against the source file, the file's tensors the
            transform also takes, after ``sources`` (a sum's parts, kept as the file has them).
    """

    target: str
    sources: tuple[str, ...]
    shape: Shape
    dtype: np.dtype
    transform: Transform | None
    against: tuple[str, ...] = ()

    def materialize(
        self, arrays: Mapping[str, np.ndarray], original: Mapping[str, np.ndarray] | None = None
    ) -> np.ndarray:
        """The target's value from the source arrays (checked against the mapping);
        ``original``: the source file's tensors ``against`` names (default: ``arrays``).

        Raises:
            RuleError: ``kind="shape"``: a source or the result disagrees with the planned shape.
        """
        kept = arrays if original is None else original
        values = [np.asarray(arrays[key]) for key in self.sources] + [np.asarray(kept[k]) for k in self.against]
        out = values[0] if self.transform is None else self.transform(values)
        if out.shape != self.shape or out.dtype != self.dtype:
            raise RuleError(
                f"`{self.target}`: planned {self.shape} {self.dtype}, made {out.shape} {out.dtype} "
                f"from {ticked(self.sources)}",
                kind="shape",
            )
        return out


@dataclass(frozen=True)
class KeyMapping:
    """Where every source tensor goes: the output of :meth:`Rules.mapping`.

    Attributes:
        assignments: target name -> :class:`Assignment`, sorted by target.
        landed: source key -> the targets it went into (``()``: nowhere), sorted.
        unused: the source keys dropped on purpose by ``ignore`` rules (and tied
            copies not checked), sorted.
        tied: tied copy -> its source key (``tie`` rules), checked or not.
        problems: what is wrong with the rule table as a whole (a rule given twice, two
            transposes on one tensor, a rule that matches nothing or is shadowed by an
            earlier one), each naming the rules; :meth:`check` raises or warns them.
        passed: on an export made against the source file, the file's keys no assignment
            writes, which the export copies unchanged.
    """

    assignments: dict[str, Assignment]
    landed: dict[str, tuple[str, ...]]
    unused: tuple[str, ...]
    tied: dict[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    passed: tuple[str, ...] = ()

    def check(self, strict: bool = False, *, stacklevel: int = 2) -> None:
        """Refuse (``strict``) or warn about the rule table's :attr:`problems`.

        Raises:
            RuleError: ``strict`` and a problem; the message lists them all.

        Warns:
            RuleTableWarning: not ``strict`` and a problem.
        """
        if not self.problems:
            return
        text = problems_message(self.problems, "rule table problem")
        if strict:
            raise RuleError(text, kind="table", problems=self.problems)
        warnings.warn(text + "\n(strict=True refuses them)", RuleTableWarning, stacklevel=stacklevel)

    def apply(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every target's value, all in memory (small models, tests, tools); the results
        may share memory with ``arrays``, which is never modified."""
        return {target: a.materialize(arrays) for target, a in self.assignments.items()}

    def shapes(self) -> dict[str, tuple[Shape, np.dtype]]:
        """``{target: (shape, dtype)}``, the input an export mapping takes."""
        return {t: (a.shape, a.dtype) for t, a in self.assignments.items()}


class Rules:
    """An ordered set of porting rules; :meth:`mapping` maps source tensors to targets.

    Args:
        *rules: rules, or sequences of rules (as the ``torch_*`` helpers return), or
            other :class:`Rules` (without a prefix of their own); flattened in order.
        direction: ``"load"`` (file keys -> model paths, the default) or ``"export"``
            (model paths -> file keys; what :meth:`inverse` returns). Value rules
            always match model paths.
        prefix: literal text every file key carries (``"module."`` from
            ``nn.DataParallel``): removed before the rules see a key on load, put back
            on every key an export writes; a key without it is matched as it is.
        strict: refuse the table's :attr:`KeyMapping.problems` (``RuleError``)
            wherever it is used, as ``load_model(..., strict=True)`` does; else they warn.
        source: on an export table (``inverse(source=...)``), the file it was loaded
            from: the export then reproduces it (see :meth:`inverse`).

    Examples:
        >>> import numpy as np
        >>> from nnx_save.porting import Rules, rename, transpose
        >>> rules = Rules(rename(r"fc\\.weight", "fc/kernel"), transpose("fc/kernel", (1, 0)))
        >>> mapping = rules.mapping({"fc.weight": ((4, 2), np.dtype("float32"))})
        >>> mapping.assignments["fc/kernel"].shape
        (2, 4)
        >>> rules.inverse().mapping(mapping.shapes()).assignments["fc.weight"].shape
        (4, 2)
        >>> Rules(rules, prefix="module.").mapping({"module.fc.weight": ((4, 2), np.float32)}).landed
        {'module.fc.weight': ('fc/kernel',)}
    """

    def __init__(
        self,
        *rules: AnyRule | Rules | Iterable[AnyRule],
        direction: Direction = "load",
        prefix: str = "",
        strict: bool = False,
        source: str | None = None,
    ) -> None:
        if direction not in ("load", "export"):
            raise RuleError(f"direction must be 'load' or 'export', got {direction!r}")
        if not isinstance(prefix, str):
            raise RuleError(f"prefix must be a str (literal text, not a regex), got {prefix!r}")
        nested = [r.prefix for r in rules if isinstance(r, Rules) and r.prefix and r.prefix != prefix]
        if nested:
            raise RuleError(
                f"a Rules with prefix={nested[0]!r} inside Rules(prefix={prefix!r}) would lose its prefix; "
                "give the prefix to the outer Rules"
            )
        self.rules: tuple[AnyRule, ...] = tuple(_flatten(rules))
        self.direction: Direction = direction
        self.prefix: str = prefix
        self.strict: bool = bool(strict)
        self.source: str | None = None if source is None else str(source)

    def __iter__(self) -> Iterator[AnyRule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def _key(self) -> tuple:
        return (self.rules, self.direction, self.prefix, self.strict, self.source)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        body = "".join(f"\n    {rule}," for rule in self.rules)
        extra = "".join(
            f"\n    {name}={value!r},"
            for name, value in (("prefix", self.prefix), ("strict", self.strict), ("source", self.source))
            if value
        )
        return f"Rules({body}\n    direction={self.direction!r},{extra}\n)"

    def mapping(
        self, sources: Mapping[str, tuple[Sequence[int], object]] | object, *, against: object = None
    ) -> KeyMapping:
        """Map source tensors to targets; pure, no I/O.

        Args:
            sources: ``{key: (shape, dtype)}``, or a header
                (``nnx_save.read_header(path)``: mapping reads no tensor data), or
                ``{key: array}``.
            against: export only: the source file's tensors (any form ``sources``
                takes): the mapping then keeps what the model does not hold as the file
                has it, and lists in ``passed`` the file keys it does not write.

        Raises:
            RuleError: a source feeds two rules or a target is made twice.
            RuleError: ``kind="shape"``: a tensor's shape does not fit its rule.
            RuleError: a rule's parts or layers are incomplete, or ``against`` on a load.
        """
        if against is not None and self.direction != "export":
            raise RuleError("against= is for export mappings (rules.inverse()); a load reads the source itself")
        info = source_shapes(sources)
        kept = None if against is None else source_shapes(against)
        if not self.prefix:
            return _Mapper(self, info, kept).run()
        if self.direction == "load":
            return _with_prefix_sources(self, info)
        stripped, real = _unprefixed(self.prefix, kept or {})
        inner = _Mapper(self, info, None if kept is None else stripped).run()
        return _with_prefix_targets(inner, self.prefix, real)

    def check(
        self, sources: Mapping[str, tuple[Sequence[int], object]] | object, strict: bool | None = None
    ) -> KeyMapping:
        """:meth:`mapping`, its table :attr:`~KeyMapping.problems` refused (``strict``,
        default this table's ``strict``) or warned, before anything is read.

        Raises:
            RuleError: a problem under ``strict``.

        Warns:
            RuleTableWarning: a problem otherwise.

        Examples:
            >>> import numpy as np, pytest
            >>> from nnx_save.porting import Rules, rename
            >>> rules = Rules(rename(r"a", "x"), rename(r"b", "y"))
            >>> rules.check({"a": ((1,), np.float32)}, strict=True)
            Traceback (most recent call last):
            nnx_save.porting._errors.RuleError: rename(r"b", r"y") matches no key of the source
        """
        mapping = self.mapping(sources)
        mapping.check(self.strict if strict is None else strict, stacklevel=3)
        return mapping

    def inverse(self, recorded: KeyMapping | None = None, *, source: str | os.PathLike[str] | None = None) -> Rules:
        """The rules for the other direction (load <-> export); ``ignore`` rules are dropped.
        A reshape needs its source shape and a concat its part sizes: from the rule, or
        from ``recorded``, a mapping these same rules made.

        ``source``: the file the model was loaded from. ``save_model(..., rules=...)`` then
        reproduces it: every tensor the rules saw and the model left unchanged is written
        byte for byte as the file has it (an LSTM's two biases, a BatchNorm's
        ``num_batches_tracked``), and every file tensor the export does not write (an
        ignored one, a second model in the file) is copied unchanged.

        Raises:
            RuleError: a rule has no automatic inverse and none was given.
        """
        structural = [_invert(r, i, recorded) for i, r in enumerate(self.rules) if _is_structural(r)]
        value = [_invert(r, i, recorded) for i, r in enumerate(self.rules) if not _is_structural(r)]
        other: Direction = "export" if self.direction == "load" else "load"
        kept = [r for r in structural if r is not None] + [r for r in reversed(value) if r is not None]
        where = None if other == "load" or source is None else os.fspath(source)
        return Rules(*kept, direction=other, prefix=self.prefix, strict=self.strict, source=where)  # type: ignore[arg-type]  # each inverse is a rule


def _unprefixed(prefix: str, info: Info) -> tuple[dict[str, tuple[Shape, np.dtype]], dict[str, str]]:
    """``info`` under the names the rules see, and ``{name seen: file key}``."""
    seen = {key: key[len(prefix) :] if key.startswith(prefix) else key for key in info}
    clash = sorted(k for k, v in seen.items() if v != k and v in info)
    if clash:
        raise RuleError(
            f"`{clash[0]}`: without the prefix {prefix!r} it is `{seen[clash[0]]}`, a key the file also holds",
            kind="conflict",
        )
    return {seen[k]: v for k, v in info.items()}, {v: k for k, v in seen.items()}


def _with_prefix_sources(rules: Rules, info: Info) -> KeyMapping:
    """A load mapping of prefixed file keys: planned on the names without the prefix,
    reported under the file's own keys."""
    stripped, real = _unprefixed(rules.prefix, info)
    inner = _Mapper(rules, stripped).run()
    back = real.__getitem__
    assignments = {t: replace(a, sources=tuple(map(back, a.sources))) for t, a in inner.assignments.items()}
    return replace(
        inner,
        assignments=assignments,
        landed={back(k): v for k, v in inner.landed.items()},
        unused=tuple(sorted(map(back, inner.unused))),
        tied={back(k): back(v) for k, v in inner.tied.items()},
    )


def _with_prefix_targets(inner: KeyMapping, prefix: str, real: Mapping[str, str]) -> KeyMapping:
    """An export mapping's targets (file keys) with the prefix put back; ``real``: the
    source file's keys by the names the rules saw (``against``)."""
    assignments = {
        prefix + t: replace(a, target=prefix + t, against=tuple(real[k] for k in a.against))
        for t, a in inner.assignments.items()
    }
    return replace(
        inner,
        assignments=dict(sorted(assignments.items())),
        landed={k: tuple(prefix + t for t in v) for k, v in inner.landed.items()},
        passed=tuple(sorted(real[k] for k in inner.passed)),
    )


def _flatten(items: Iterable[object]) -> Iterator[AnyRule]:
    for item in items:
        if isinstance(item, (*_STRUCTURAL, TransposeRule, ReshapeRule, ConstantRule, TieRule)):
            yield item  # type: ignore[misc]
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            yield from _flatten(item)
        else:
            raise RuleError(f"Rules takes rules, found {item!r} of type {type(item).__name__}")


_STRUCTURAL = (*AnyStructural.__args__, ComputeExportRule)


def _is_structural(rule: AnyRule) -> TypeGuard[AnyStructural]:
    return isinstance(rule, _STRUCTURAL)


def _invert(rule: AnyRule, index: int, recorded: KeyMapping | None) -> object:
    if isinstance(rule, IgnoreRule):
        return rule.export  # what the inverse writes instead (None: nothing)
    if isinstance(rule, ConstantRule):
        return None  # a written constant is not read back
    if isinstance(rule, ReshapeRule) and rule.source_shape is None and recorded is not None:
        return rule.inverse(_recorded(recorded, index, Reshape, "source_shape", rule))
    if isinstance(rule, ConcatRule) and rule.sizes is None and recorded is not None:
        return rule.inverse(_recorded(recorded, index, Concatenate, "sizes", rule))
    return rule.inverse()


def _recorded(mapping: KeyMapping, index: int, kind: type, attr: str, rule: Rule) -> tuple[int, ...] | None:
    seen = {
        getattr(step, attr)
        for step in _steps(mapping)
        if isinstance(step, kind) and getattr(step, "rule", None) == index
    }
    if len(seen) > 1:
        raise RuleError(
            f"{rule} cannot be inverted: the recorded mapping used it with {sorted(seen)}", kind="not_invertible"
        )
    return seen.pop() if seen else None


def _steps(mapping: KeyMapping) -> Iterator[object]:
    for a in mapping.assignments.values():
        if a.transform is not None:
            yield from (s for pre in a.transform.pre for s in pre)
            yield a.transform.combine
            yield from a.transform.post


class _Mapper:
    """One planning run; holds the collected errors of each pass.

    ``against``: on export, the source file's ``{key: (shape, dtype)}`` (prefix removed);
    what the model does not hold (a sum's parts, a count written as a constant) is then
    taken from it, and the keys no assignment writes are passed through.
    """

    def __init__(self, rules: Rules, info: dict[str, tuple[Shape, np.dtype]], against: Info | None = None) -> None:
        self.rules, self.info, self.against = rules, info, against
        self.active, self.problems = distinct(rules.rules)
        self.value_rules = [(i, r) for i, r in self._active(TransposeRule, ReshapeRule)]
        self.owners = {
            i: owners_of(r, rules.rules, self.active) for i, r in self.value_rules if getattr(r, "of", None) is not None
        }
        self.ties = [r for _, r in self._active(TieRule)]
        self.tied: dict[str, str] = {}
        self.checked: set[str] = set()
        self.errors: list[str] = []
        self.conflicts: list[str] = []
        self.seen: dict[int, list[str]] = defaultdict(list)  # rule -> the keys or paths it matched
        self.applied: dict[str, list[int]] = defaultdict(list)  # path -> the value rules that changed it

    def _active(self, *kinds: type) -> list[tuple[int, Any]]:
        return [(i, self.rules.rules[i]) for i in self.active if isinstance(self.rules.rules[i], kinds)]

    def run(self) -> KeyMapping:
        claims, renamed = self._claim()
        self._raise(self.conflicts, "conflict")
        owner = {key: index for index, claimed in claims.items() for key in claimed}
        pre = self._pre_steps(owner) if self.rules.direction == "export" else {}
        self._raise(self.errors, "shape")
        info = {k: (shape, dtype) for k, (_, shape, dtype) in pre.items()} if pre else self.info
        nodes = self._build(claims, renamed, info)
        self._raise(self.conflicts, "conflict")
        self._raise(self.errors)
        assignments = {n.target: self._assign(n, pre) for n in sorted(nodes, key=lambda n: n.target)}
        self._raise(self.errors, "shape")
        self.problems += table_problems(self.rules.rules, self.active, claims, self.seen, self.applied)
        return self._finish(assignments, claims)

    def _raise(self, messages: list[str], kind: RuleKind | None = None) -> None:
        if messages:
            raise RuleError(problems_message(sorted(set(messages))), kind=kind)

    def _claim(self) -> tuple[dict[int, dict[str, object]], dict[str, str]]:
        """Each source key to its one structural rule (``claims[rule index][key]``)."""
        claims: dict[int, dict[str, object]] = defaultdict(dict)
        renamed: dict[str, str] = {}
        for tie in self.ties:
            if not tie.writes:
                found = tie.tied(self.info, self.errors)
                self.tied.update(found)
                self.checked.update(found if tie.check else ())
        structural = self._active(*_STRUCTURAL)
        for key in sorted(set(self.info) - set(self.tied)):
            hit = self._claim_one(key, structural)
            if hit is None:
                renamed[key] = key
            elif hit[0] >= 0:
                claims[hit[0]][key] = hit[1]
        return claims, renamed

    def _claim_one(self, key: str, structural: Sequence[tuple[int, Any]]) -> tuple[int, object] | None:
        """``(rule index, match)``; ``None``: no rule; index -1: a conflict (recorded)."""
        hits = [(i, m) for i, r in structural if (m := r.match(key)) is not None]
        for i, _ in hits:
            self.seen[i].append(key)
        others = [h for h in hits if not isinstance(self.rules.rules[h[0]], RenameRule)]
        if len(others) > 1 and all(isinstance(self.rules.rules[i], IgnoreRule) for i, _ in others):
            others = others[:1]  # ignore rules that overlap agree: the key is dropped
        renames = [h for h in hits if isinstance(self.rules.rules[h[0]], RenameRule)]
        if len(others) > 1 or (others and renames):
            a, b = self.rules.rules[others[0][0]], self.rules.rules[(others[1:] or renames)[0][0]]
            self.conflicts.append(f"`{key}`: matched by both {a} and {b}; a source tensor feeds one rule")
            return -1, None
        first = others or renames
        return first[0] if first else None

    def _build(self, claims: Mapping[int, dict[str, object]], renamed: Mapping[str, str], info) -> list[Node]:
        nodes = [Node(k, (k,), info[k][0], info[k][1], None) for k in renamed]
        for index, claimed in sorted(claims.items()):
            rule = self.rules.rules[index]
            assert _is_structural(rule)  # only structural rules claim keys
            made = rule.nodes(claimed, info, self.errors)  # type: ignore[arg-type]  # each rule reads the claims it made
            nodes.extend(_tagged(n, index) for n in made)
        for _, rule in self._active(ConstantRule):
            keys = (
                info
                if rule.of is None
                else [k for i in owners_of(rule, self.rules.rules, self.active) for k in claims.get(i, ())]
            )
            nodes.extend(rule.nodes_for(keys))
        if self.against is not None:
            nodes = against_source(nodes, self.against)
        nodes = self._tie(nodes)
        self._check_unique(nodes, claims)
        return nodes

    def _tie(self, nodes: list[Node]) -> list[Node]:
        """Export: every tied copy written; load: checked copies read with their source."""
        for tie in self.ties:
            if tie.writes:
                nodes = nodes + tie.written(nodes)
        checked: dict[str, list[str]] = defaultdict(list)
        for copy, source in self.tied.items():
            if copy in self.checked:
                checked[source].append(copy)
        out = []
        for node in nodes:
            copies = checked.pop(node.sources[0], None) if len(node.sources) == 1 else None
            if copies and node.combine is None:
                node = tie_checked(node, copies)
            elif copies:
                self.errors.append(
                    f"`{copies[0]}`: tied to `{node.sources[0]}`, which no plain rename reads; "
                    "tie(..., check=False) keeps the source and reports the copy"
                )
            out.append(node)
        self.errors.extend(f"`{c[0]}`: tied to `{s}`, which lands nowhere" for s, c in checked.items())
        return out

    def _check_unique(self, nodes: Sequence[Node], claims: Mapping[int, dict[str, object]]) -> None:
        """Record a conflict for every target made twice, naming both origins."""
        rule_of = {key: str(self.rules.rules[i]) for i, claimed in claims.items() for key in claimed}
        first: dict[str, Node] = {}
        for node in nodes:
            if node.target in first:
                made = [
                    f"from {ticked(n.sources)} by {rule_of.get(n.sources[0], 'no rule (name kept)') if n.sources else 'a constant'}"
                    for n in (first[node.target], node)
                ]
                self.conflicts.append(f"`{node.target}`: produced twice, {made[0]} and {made[1]}")
            first.setdefault(node.target, node)

    def _pre_steps(self, owner: Mapping[str, int]) -> dict[str, tuple[tuple[Step, ...], Shape, np.dtype]]:
        return {
            key: (*self._value_steps(key, shape, owner.get(key, -1)), dtype)
            for key, (shape, dtype) in self.info.items()
        }

    def _value_steps(self, path: str, shape: Shape, owner: int) -> tuple[tuple[Step, ...], Shape]:
        """The value rules' steps for ``path`` (made by rule ``owner``): each matching rule
        in order, save those that belong to another structural rule (``TransposeRule.of``)."""
        steps: list[Step] = []
        for index, rule in self.value_rules:
            if rule.matches(path) and (index not in self.owners or owner in self.owners[index]):
                self.seen[index].append(path)
                self.applied[path].append(index)
                made = rule.step(path, shape, index, self.errors)
                if made is None:
                    break
                steps.append(made[0])
                shape = made[1]
        return tuple(steps), shape

    def _assign(self, node: Node, pre: Mapping[str, tuple[tuple[Step, ...], Shape, np.dtype]]) -> Assignment:
        pre_steps = tuple(pre[k][0] for k in node.sources) if pre else ()
        post, shape = ((), node.shape) if pre else self._value_steps(node.target, node.shape, node.rule)
        plain = node.combine is None and not post and not any(pre_steps)
        transform = None if plain else Transform(pre_steps if any(pre_steps) else (), node.combine, post)
        return Assignment(node.target, node.sources, shape, node.dtype, transform, node.against)

    def _finish(self, assignments: dict[str, Assignment], claims: Mapping[int, dict[str, object]]) -> KeyMapping:
        landed: dict[str, list[str]] = {k: [] for k in sorted(self.info)}
        for target, a in assignments.items():
            for key in a.sources:
                landed[key].append(target)
        ignored = {k for i, c in claims.items() if isinstance(self.rules.rules[i], IgnoreRule) for k in c}
        unused = tuple(sorted(ignored | {k for k in self.tied if not landed[k]}))
        passed = () if self.against is None else tuple(sorted(set(self.against) - set(assignments)))
        return KeyMapping(
            assignments,
            {k: tuple(v) for k, v in landed.items()},
            unused,
            dict(sorted(self.tied.items())),
            problems=tuple(self.problems),
            passed=passed,
        )


def _tagged(node: Node, index: int) -> Node:
    """The node tagged with the rule that made it (its concatenation too, for inverse)."""
    if isinstance(node.combine, Concatenate):
        return replace(node, combine=replace(node.combine, rule=index), rule=index)
    return replace(node, rule=index)
