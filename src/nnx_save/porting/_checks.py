"""The rule table checked as a whole, and exports made against the source file.

A table can be wrong with every tensor landing somewhere: a helper given twice transposes
a square weight twice, a prefix rename placed first takes every key from the helpers
after it, a rule matches nothing. :func:`table_problems` names each such case and the
rules involved (``KeyMapping.problems``; refused under ``strict``, warned otherwise).
:func:`against_source` makes an export keep what the model does not hold as the source
file has it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ._compose import TieRule
from ._computed import ComputedPart, restored_from
from ._rules import ConstantRule, IgnoreRule, Node, RenameRule, ReshapeRule, TransposeRule
from ._template import ticked
from ._transforms import Constant, Restore

__all__ = ["against_source", "distinct", "owners_of", "problems_message", "table_problems"]

Shape = tuple[int, ...]
Info = Mapping[str, tuple[Shape, np.dtype]]
_SHOWN = 3  # keys named per problem


def distinct(rules: Sequence[Any]) -> tuple[list[int], list[str]]:
    """The positions of the rules that apply (the first of equal ones) and a problem
    per rule given again: a helper listed twice would transpose twice."""
    first: dict[Any, int] = {}
    problems = []
    for i, rule in enumerate(rules):
        if rule in first:
            problems.append(f"{rule} is given twice (rules {first[rule]} and {i}); it applies once")
        else:
            first[rule] = i
    return sorted(first.values()), problems


def owners_of(rule: Any, rules: Sequence[Any], active: Sequence[int]) -> set[int]:
    """The positions of the structural rule a value or constant rule belongs to (``of``)."""
    return {i for i in active if rules[i] == rule.of} if rule.of is not None else set()


def table_problems(
    rules: Sequence[Any],
    active: Sequence[int],
    claims: Mapping[int, Mapping[str, object]],
    seen: Mapping[int, Sequence[str]],
    applied: Mapping[str, Sequence[int]],
) -> list[str]:
    """Every rule that matches nothing (or only keys an earlier rule took), and every
    tensor two transposes change, each naming the rules involved."""
    problems = [_twice(path, [rules[i] for i in used]) for path, used in sorted(applied.items())]
    for i in active:
        rule = rules[i]
        quiet = isinstance(rule, (IgnoreRule, TieRule, ConstantRule)) or getattr(rule, "of", None) is not None
        if quiet or i in claims or (isinstance(rule, (TransposeRule, ReshapeRule)) and seen.get(i)):
            continue  # (a value rule of a structural rule is reported with that rule)
        problems.append(_idle(i, rules, claims, seen))
    return [p for p in problems if p]


def _twice(path: str, used: Sequence[Any]) -> str:
    transposes = [r for r in used if isinstance(r, TransposeRule)]
    if len(transposes) < 2:
        return ""
    axes = tuple(range(len(transposes[0].axes)))
    for t in transposes:
        axes = tuple(axes[a] for a in t.axes) if len(t.axes) == len(axes) else axes
    names = " and ".join(str(t) for t in transposes)
    if axes == tuple(range(len(axes))):
        return f"`{path}`: transposed by both {names}: they cancel, the tensor lands as the file has it"
    return f"`{path}`: transposed by both {names}: the file tensor is transposed twice"


def _idle(
    index: int, rules: Sequence[Any], claims: Mapping[int, Mapping[str, object]], seen: Mapping[int, Sequence[str]]
) -> str:
    """Why rule ``index`` takes nothing: earlier rules took its keys, an earlier rename's
    output is what it would match (rules do not chain), or nothing matches it."""
    rule = rules[index]
    if isinstance(rule, (TransposeRule, ReshapeRule)):
        return f"{rule} matches no model path"
    if seen.get(index):
        keys = seen[index]
        takers = sorted({str(rules[j]) for j, c in claims.items() if j < index and any(k in c for k in keys)})
        by = f" by {takers[0]}" if takers else ""
        return f"{rule} takes no key: {ticked(keys[:_SHOWN])} {'is' if len(keys) == 1 else 'are'} taken first{by} (first match wins)"
    for j in sorted(claims):
        made = claims[j]
        if j < index and isinstance(rules[j], RenameRule):
            hit = next(((k, t) for k, t in made.items() if isinstance(t, str) and rule.match(t) is not None), None)
            if hit is not None:
                return (
                    f"{rule} matches no key: {rules[j]} renames `{hit[0]}` to `{hit[1]}`, which {rule} would "
                    "take, but rules do not chain: give the common prefix as Rules(..., prefix=...) instead"
                )
    return f"{rule} matches no key of the source"


def against_source(nodes: Sequence[Node], against: Info) -> list[Node]:
    """Export nodes made against the source file ``against``: a sum's part written as the
    file holds it (:class:`Restore`) and a constant the file holds left to pass through,
    where the file's tensors have the node's shape and dtype."""
    out = []
    for node in nodes:
        fits = lambda key, n=node: against.get(key) == (n.shape, n.dtype)  # noqa: E731
        if isinstance(node.combine, Constant) and fits(node.target):
            continue  # the file's own value is copied (a count, a sum's other part)
        if isinstance(node.combine, ComputedPart):
            node = restored_from(node, against)  # the file's own parts, while they still make the model's value
        if node.restore is not None and all(fits(k) for k in node.restore[0]):
            keys, into = node.restore
            node = replace(node, combine=Restore(node.combine, len(keys), into), against=keys)  # type: ignore[arg-type]
        out.append(node)
    return out


_GROUPED = 5  # more problems than this are shown one line per kind, with a hint
_HINTS = {
    "produced twice": "a target made twice often means a pattern captures an index (a layer) that the "
    "target does not use: reference it (\\g<layer>), or stack the layers (stack(), split(..., "
    "stacked=True), a helper given a (?P<layer>\\d+) pattern)",
    "matched by both": "a file key feeds one rule: narrow the broader pattern, or drop the rename",
}


def problems_message(lines: Sequence[str], what: str = "porting rule problem") -> str:
    """One line per problem; past a few, one line per kind of problem (the same text
    but for the names in backticks) with the count and the first names, and a hint."""
    if len(lines) == 1:
        return lines[0]
    if len(lines) <= _GROUPED:
        return "\n  ".join([f"{len(lines)} {what}s:", *lines])
    kinds: dict[str, list[str]] = defaultdict(list)
    for line in lines:
        kinds[re.sub(r"`[^`]*`", "``", line)].append(line)
    out = [f"{len(lines)} {what}s, {len(kinds)} kind(s):"]
    for same in kinds.values():
        names = list(dict.fromkeys(m.group(0) for line in same[1:] if (m := re.match(r"`[^`]*`", line))))
        more = f" (and {len(same) - 1} more like it, on {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
        out.append(same[0] + (more if len(same) > 1 else ""))
    hints = [hint for marker, hint in _HINTS.items() if any(marker in line for line in lines)]
    return "\n  ".join(out) + "".join(f"\nhint: {h}" for h in hints)
