"""Rename suggestions for a strict load's refusal: the model's missing paths paired with
the file's unexpected keys by structure, and written as ``rename(...)`` rules that are
proven, on every key of the file, to send each key to its own pair and nothing else.

A pair must agree index for index (the same integer components, in order), name for
name (the same leaf name; the most components in place at either end), and shape for
shape, and be the only best choice from either side: where two candidates tie, no rule
is proposed for them. Rules are written as general as they stay true: one indexed regex
for a module renamed in every layer, else one per path template, else one per key.
"""

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import NnxSaveError

__all__ = ["pair_by_structure", "suggest_renames"]

_SPLIT = re.compile(r"([/.])")
_MAX_BUCKET = 1 << 16  # candidate pairs compared within one signature; more: no suggestion there
_MAX_TRIED = 32  # general rules checked against every file key; past them: one rule per template

Shape = tuple[int, ...]


def _parts(key: str) -> list[str]:
    """``key`` as components and separators, alternating (``a/0.b`` -> ``a / 0 . b``)."""
    return _SPLIT.split(key)


def _names(parts: Sequence[str]) -> list[str]:
    return list(parts[0::2])


def _signature(key: str, shape: Sequence[int]) -> tuple:
    """What a pair must share: the shape, the integer components in order, the leaf name."""
    names = _names(_parts(key))
    return (tuple(shape), tuple(n for n in names if n.isdigit()), names[-1])


def _likeness(a: Sequence[str], b: Sequence[str]) -> int:
    """Components equal in place from the start plus from the end (not overlapping)."""
    top = min(len(a), len(b))
    head = next((i for i in range(top) if a[i] != b[i]), top)
    tail = next((i for i in range(top - head) if a[-1 - i] != b[-1 - i]), top - head)
    return head + tail


def pair_by_structure(missing: Mapping[str, Shape], unexpected: Mapping[str, Shape]) -> dict[str, str]:
    """Unexpected key -> missing path, for the pairs that are each other's only best match.

    Examples:
        >>> pair_by_structure({"l/0/attn/k/w": (2,), "l/0/attn/q/w": (2,)}, {"l/0/sa/k/w": (2,), "l/0/sa/q/w": (2,)})
        {'l/0/sa/k/w': 'l/0/attn/k/w', 'l/0/sa/q/w': 'l/0/attn/q/w'}
        >>> pair_by_structure({"l/0/query/w": (2,), "l/0/key/w": (2,)}, {"l/0/q/w": (2,), "l/0/k/w": (2,)})
        {}
    """
    sides: dict[tuple, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for m, shape in missing.items():
        sides[_signature(m, shape)][1].append(m)
    for u, shape in unexpected.items():
        sides[_signature(u, shape)][0].append(u)
    pairs: dict[str, str] = {}
    for us, ms in sides.values():
        if us and ms and len(us) * len(ms) <= _MAX_BUCKET:
            pairs.update(_mutual_best(us, ms))
    return pairs


def _mutual_best(us: Sequence[str], ms: Sequence[str]) -> dict[str, str]:
    """The pairs (u, m) whose likeness is the strict maximum of u's row and m's column."""
    names_u = [_names(_parts(u)) for u in us]
    names_m = [_names(_parts(m)) for m in ms]
    score = [[_likeness(a, b) for b in names_m] for a in names_u]
    column_best = [max(row[j] for row in score) for j in range(len(ms))]
    pairs = {}
    for i, row in enumerate(score):
        j = max(range(len(ms)), key=row.__getitem__)
        if row.count(row[j]) == 1 and row[j] == column_best[j] and [r[j] for r in score].count(row[j]) == 1:
            pairs[us[i]] = ms[j]
    return pairs


@dataclass(frozen=True)
class _Split:
    """A pair cut into prefix, middle and suffix: the prefix and suffix components are
    equal on both sides, the middles are what the file renamed."""

    u: tuple[str, str, str]
    m: tuple[str, str, str]


def _cut(u: str, m: str) -> _Split:
    pu, pm = _parts(u), _parts(m)
    nu, nm = _names(pu), _names(pm)
    top = min(len(nu), len(nm))
    head = next((i for i in range(top) if nu[i] != nm[i]), top)
    tail = next((i for i in range(top - head) if nu[-1 - i] != nm[-1 - i]), top - head)

    def three(parts: list[str], n: int) -> tuple[str, str, str]:
        a, b = 2 * head, 2 * (n - tail)
        return "".join(parts[:a]), "".join(parts[a:b]), "".join(parts[b:])

    return _Split(three(pu, len(nu)), three(pm, len(nm)))


def _pattern(text: str) -> str:
    """``text`` as a regex: integer components captured, the rest literal."""
    return "".join(r"(\d+)" if i % 2 == 0 and p.isdigit() else re.escape(p) for i, p in enumerate(_parts(text)))


def _template(text: str, first: int) -> str:
    """``text`` as a replacement: integer components as group references from ``first``."""
    out, g = [], first
    for i, p in enumerate(_parts(text)):
        if i % 2 == 0 and p.isdigit():
            out.append(_ref(g))
            g += 1
        else:
            out.append(p.replace("\\", "\\\\"))
    return "".join(out)


def _ref(group: int) -> str:
    return f"\\g<{group}>" if group > 9 else f"\\{group}"


def _ints(text: str) -> int:
    return sum(1 for p in _names(_parts(text)) if p.isdigit())


def _by_module(c: _Split) -> tuple[str, str] | None:
    """One rule for a renamed module in every layer: the prefix's template and the
    middle, then any suffix (``layers/(\\d+)/self_attn/(.*)`` -> ``layers/\\1/attn/\\2``)."""
    if c.u[2] != c.m[2]:
        return None
    head = _pattern(c.u[0]) + _pattern(c.u[1])
    n = _ints(c.u[0] + c.u[1])
    return head + "(.*)", _template(c.m[0], 1) + _template(c.m[1], 1 + _ints(c.m[0])) + _ref(n + 1)


def _by_change(c: _Split) -> tuple[str, str] | None:
    """One rule for the same change under any prefix (a wrapper inserted above every
    ``kernel``: ``(.*/)kernel`` -> ``\\1base_module/kernel``)."""
    if c.u[0] != c.m[0] or not c.u[0]:
        return None
    rest_u, rest_m = c.u[1] + c.u[2], c.m[1] + c.m[2]
    return r"(.*[/.])" + _pattern(rest_u), "\\1" + _template(rest_m, 2)


def _by_template(c: _Split) -> tuple[str, str]:
    u, m = "".join(c.u), "".join(c.m)
    return _pattern(u), _template(m, 1)


def _source(rule: tuple[str, str]) -> str:
    return f'rename(r"{rule[0]}", r"{rule[1]}")'


def suggest_renames(
    missing: Mapping[str, Shape],
    unexpected: Mapping[str, Shape],
    *,
    keys: Iterable[str] = (),
    paths: Iterable[str] = (),
) -> list[str]:
    """``rename(...)`` rules (source text) pairing ``unexpected`` file keys with
    ``missing`` model paths by structure, the most keys first.

    Args:
        missing: the model paths that found no file key, with their shapes.
        unexpected: the file keys that went nowhere (no porting rule took them), with shapes.
        keys: every other key of the file: no rule may match one.
        paths: every model path: a rule may send an unpaired key nowhere else.

    Returns:
        The rules; empty when nothing pairs without a tie.

    Examples:
        >>> suggest_renames({"encoder/0/kernel": (2, 3)}, {"body/0/kernel": (2, 3), "head/b": (3,)})
        ['rename(r"body/(.*)", r"encoder/\\\\1")']
    """
    pairs = pair_by_structure(_plain(missing), _plain(unexpected))
    if not pairs:
        return []
    checker = _Checker(pairs, set(unexpected), set(keys) - set(unexpected), set(paths) | set(missing))
    rules: dict[tuple[str, str], int] = {}
    general = {**_candidates(_by_module, pairs, 1), **_candidates(_by_change, pairs, 2)}
    for rule, group in sorted(general.items(), key=lambda item: (-len(item[1]), item[0]))[:_MAX_TRIED]:
        if not checker.ruled.intersection(group) and checker.accept(rule, group):
            rules[rule] = len(group)
    for rule, group in _candidates(_by_template, checker.left(), 1).items():
        if checker.accept(rule, group, exact=True):
            rules[rule] = len(group)
    for u, m in checker.left().items():  # the rest: one literal rule per key
        rules[(re.escape(u), m)] = 1
    return [_source(r) for r in sorted(rules, key=lambda r: (-rules[r], r))]


def _plain(names: Mapping[str, Shape]) -> dict[str, Shape]:
    """The names a raw string literal can hold as they are (no quote, backslash or line end)."""
    return {k: v for k, v in names.items() if not any(c in k for c in '"\\\n\r')}


def _candidates(level, pairs: Mapping[str, str], least: int) -> dict[tuple[str, str], list[str]]:
    """The rules of ``level`` for ``pairs``, each with the keys it should take (at least ``least``)."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for u, m in pairs.items():
        rule = level(_cut(u, m))
        if rule is not None:
            groups[rule].append(u)
    return {r: g for r, g in groups.items() if len(g) >= least}


class _Checker:
    """Proves rules on every key of the file: a rule sends each of its keys to the
    key's pair, matches no key that loads (or that another rule takes), and sends an
    unpaired unexpected key only to a name that is nobody's."""

    def __init__(self, pairs: Mapping[str, str], unexpected: set[str], others: set[str], paths: set[str]) -> None:
        self.pairs, self.unexpected, self.others, self.paths = dict(pairs), unexpected, others, paths
        self.ruled: set[str] = set()
        self.strays: set[str] = set()  # names unpaired keys were sent to by accepted rules
        self.keys = sorted(unexpected | others)
        self.by_template: dict[str, list[str]] = defaultdict(list)  # what a per-template rule can match
        for key in self.keys:
            self.by_template[_pattern(key)].append(key)

    def left(self) -> dict[str, str]:
        return {u: m for u, m in self.pairs.items() if u not in self.ruled}

    def accept(self, rule: tuple[str, str], group: Sequence[str], exact: bool = False) -> bool:
        """Whether ``rule`` holds (then its keys are ruled); ``exact``: a per-template
        rule, which matches only the keys of its template."""
        from ..porting._constructors import rename  # the rule kinds: imported by the first refusal that pairs keys

        try:
            matcher, mine = rename(*rule), set(group)
        except NnxSaveError:  # a key no regex of ours can hold: no rule
            return False
        strays = set()
        for key in self.by_template[rule[0]] if exact else self.keys:
            made = matcher.match(key)
            if made is None:
                continue
            if key in mine and made == self.pairs[key]:
                continue
            if key in self.others or key in self.pairs or made in self.paths or made in self.strays or made in strays:
                return False
            strays.add(made)
        self.ruled |= mine
        self.strays |= strays
        return True
