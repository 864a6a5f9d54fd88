"""Regex patterns and replacement templates as data, and their inversion.

A *pattern* must match a whole key (``re.fullmatch``); a *template* is literal text plus
group references ``\\1`` / ``\\g<1>`` / ``\\g<name>`` (``\\\\`` is a literal backslash, no
other escape). Inverting swaps the roles: the template becomes a regex (each reference its
group's sub-pattern), the pattern a template; docs/porting.md ("Export") says which
patterns invert.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ._errors import RuleError

__all__ = [
    "Group",
    "Template",
    "check_refs",
    "compile_pattern",
    "invert",
    "parse_pattern",
    "parse_templates",
    "raw",
    "raws",
    "ticked",
]

_META = set(".^$*+?{}[]|)")
_QUANTIFIERS = set("*+?{")
_TEMPLATE_REF = re.compile(r"\\(?:g<([^>]*)>|(\d{1,2})|(\\))")


def text_arg(value: object, what: str) -> str:
    """``value`` when it is a ``str`` (a pattern, a key template), else a :class:`RuleError`
    naming ``what`` and what was given: the rules' one door for names from outside."""
    if not isinstance(value, str):
        shown = repr(value) if isinstance(value, (bytes, int, float)) else type(value).__name__
        raise RuleError(f"{what} must be a str (a regex or a key template), got {shown[:80]}")
    return value


def texts_arg(value: object, what: str) -> tuple[str, ...]:
    """``value`` as a tuple of str: a list or tuple of patterns or templates (one str alone is
    refused: it would be read as its characters), else a :class:`RuleError` naming ``what``."""
    if not isinstance(value, (list, tuple)):
        raise RuleError(f"{what} must be a list or tuple of str, got {type(value).__name__}")
    return tuple(text_arg(v, f"each of {what}") for v in value)


_INT_LIMIT = 1 << 31  # an axis, a size or a count: far past any tensor's


def int_arg(value: object, what: str, low: int = -_INT_LIMIT, high: int = _INT_LIMIT) -> int:
    """``value`` when it is an int (not a bool) in ``[low, high]``, else a :class:`RuleError`."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= int(value) <= high
    if not ok:
        shown = repr(value) if isinstance(value, (int, float)) else type(value).__name__
        raise RuleError(f"{what} must be an int from {low} to {high}, got {shown[:80]}")
    return int(value)  # type: ignore[call-overload]


def ints_arg(value: object, what: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints (a list or tuple of them), else a :class:`RuleError`."""
    if not isinstance(value, (list, tuple)):
        raise RuleError(f"{what} must be a list or tuple of ints, got {type(value).__name__}")
    return tuple(int_arg(v, f"each of {what}") for v in value)


def raw(text: str) -> str:
    """``text`` as a raw string literal, for messages: ``r"h\\.(\\d+)"``."""
    return f'r"{text}"' if '"' not in text and not text.endswith("\\") else repr(text)


def raws(texts: Iterable[str]) -> str:
    """``texts`` as raw string literals joined by commas, for messages."""
    return ", ".join(raw(t) for t in texts)


def ticked(names: Iterable[str]) -> str:
    """``names`` in backticks joined by commas, for messages."""
    return ", ".join(f"`{n}`" for n in names)


@dataclass(frozen=True)
class Template:
    """A parsed replacement: literal strings and group references (int or name)."""

    source: str
    parts: tuple[str | _Ref, ...]

    @classmethod
    def parse(cls, text: str) -> Template:
        """Parse ``text``; a stray backslash escape is a :class:`RuleError`."""
        text = text_arg(text, "a key template")
        parts: list[str | _Ref] = []
        pos = 0
        for m in _TEMPLATE_REF.finditer(text):
            _check_no_escape(text, pos, m.start())
            _append_literal(parts, text[pos : m.start()])
            if m.group(3):
                _append_literal(parts, "\\")
            else:
                parts.append(_ref(m.group(1) if m.group(1) is not None else m.group(2), text))
            pos = m.end()
        _check_no_escape(text, pos, len(text))
        _append_literal(parts, text[pos:])
        return cls(text, tuple(parts))

    @property
    def refs(self) -> tuple[int | str, ...]:
        """The group references, in order of appearance."""
        return tuple(p.ref for p in self.parts if isinstance(p, _Ref))

    def expand(self, groups: Mapping[int | str, str | None]) -> str:
        """Substitute each reference with ``groups[ref]`` (``None``, a group that did not
        take part in the match, gives the empty string, as in :meth:`re.Match.expand`)."""
        return "".join((groups[p.ref] or "") if isinstance(p, _Ref) else p for p in self.parts)

    def expand_match(self, match: re.Match[str], **extra: str) -> str:
        """Substitute the groups of ``match`` (and the named ``extra`` values)."""
        groups: dict[int | str, str | None] = {i: match.group(i) for i in range(1, match.re.groups + 1)}
        groups.update(match.groupdict())
        groups.update(extra)
        return self.expand(groups)


@dataclass(frozen=True)
class _Ref:
    ref: int | str


@dataclass(frozen=True)
class Group:
    """A capturing group of a pattern: its name (or None) and its regex body."""

    name: str | None
    body: str


def _ref(token: str, text: str) -> _Ref:
    if token.isascii() and token.isdigit():
        return _Ref(int(token))
    if not token.isidentifier():
        raise RuleError(f"template {raw(text)}: bad group reference \\g<{token}>")
    return _Ref(token)


def _append_literal(parts: list[str | _Ref] | list[str | int], text: str) -> None:
    if not text:
        return
    if parts and isinstance(parts[-1], str):
        parts[-1] += text
    else:
        parts.append(text)


def _check_no_escape(text: str, start: int, stop: int) -> None:
    where = text.find("\\", start, stop)
    if where >= 0:
        raise RuleError(
            f"template {raw(text)}: escape '{text[where : where + 2]}' at {where}; keys only take "
            "group references (\\1, \\g<1>, \\g<name>) and \\\\ for a backslash"
        )


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile ``pattern``, re-raising a regex syntax error as :class:`RuleError`."""
    pattern = text_arg(pattern, "a pattern")
    try:
        return re.compile(pattern)
    except re.error as err:
        raise RuleError(f"pattern {raw(pattern)} is not a valid regex: {err}") from None


def check_refs(template: Template, pattern: re.Pattern[str], extra: Sequence[str] = ()) -> None:
    """Refuse a reference to a group the pattern does not define."""
    for ref in template.refs:
        known = ref in extra or (ref in pattern.groupindex if isinstance(ref, str) else 0 < ref <= pattern.groups)
        if not known:
            raise RuleError(
                f"template {raw(template.source)} references group {ref!r}, which pattern "
                f"{raw(pattern.pattern)} does not define"
            )


def parse_templates(
    texts: Sequence[str], regexes: Sequence[re.Pattern[str]], extra: Sequence[str] = ()
) -> tuple[Template, ...]:
    """Parse ``texts``, each checked to reference only groups every one of ``regexes`` defines."""
    templates = tuple(Template.parse(t) for t in texts)
    for regex in regexes:
        for template in templates:
            check_refs(template, regex, extra=extra)
    return templates


# --- pattern parsing ----------------------------------------------------------------


def parse_pattern(pattern: str) -> tuple[tuple[str | int, ...], tuple[Group, ...]]:
    """Split a pattern into literal text and group indices (1-based), plus its groups.

    Raises:
        RuleError: the pattern is not literal text around plain groups.
    """
    parts: list[str | int] = []
    groups: list[Group] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            _append_literal(parts, _escaped_literal(pattern, i))
            i += 2
        elif char == "(":
            end = _group_end(pattern, i)
            groups.append(_group(pattern, pattern[i + 1 : end]))
            parts.append(len(groups))
            i = end + 1
            if i < len(pattern) and pattern[i] in _QUANTIFIERS:
                raise _cannot(pattern, f"group {len(groups)} is quantified ({pattern[i]!r})")
        elif char in _META:
            raise _cannot(pattern, f"regex operator {char!r} at {i} outside a capturing group")
        else:
            _append_literal(parts, char)
            i += 1
    return tuple(parts), tuple(groups)


def _cannot(pattern: str, why: str) -> RuleError:
    return RuleError(
        f"pattern {raw(pattern)} cannot be inverted automatically: {why}; pass inverse= with an explicit rule",
        kind="not_invertible",
    )


def _escaped_literal(pattern: str, i: int) -> str:
    if i + 1 >= len(pattern):
        raise _cannot(pattern, "it ends with a backslash")
    nxt = pattern[i + 1]
    if nxt.isalnum() or nxt == "_":
        raise _cannot(pattern, f"escape '\\{nxt}' at {i} outside a capturing group is not literal text")
    return nxt


def _group_end(pattern: str, start: int) -> int:
    depth, i, in_class = 0, start, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 2 if pattern[i + 1 : i + 2] in ("]", "^") else 1
            continue
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise _cannot(pattern, f"unbalanced parenthesis at {start}")


def _group(pattern: str, inner: str) -> Group:
    name = None
    if inner.startswith("?P<"):
        name, _, inner = inner[3:].partition(">")
    elif inner.startswith("?"):
        raise _cannot(pattern, f"group '({inner})' is not a capturing group")
    if compile_pattern(inner).groups:
        raise _cannot(pattern, f"group '({inner})' contains another capturing group; use (?:...) inside")
    return Group(name, inner)


# --- inversion ----------------------------------------------------------------------


def invert(
    pattern: str,
    template: str,
    *,
    consumed: str | None = None,
    produced: tuple[str, str] | None = None,
    widen: Iterable[int] = (),
) -> tuple[str, str]:
    """The (pattern, template) pair that maps ``template``'s outputs back to keys.

    Args:
        pattern: the forward regex (full match).
        template: the forward replacement.
        consumed: a named group of ``pattern`` that ``template`` does not reference (a
            stack's layer index); the inverse template references it by name.
        produced: ``(name, body)`` of a reference in ``template`` that ``pattern`` does
            not define (an unstack's layer index); a named group of the inverse pattern.
        widen: groups of ``pattern`` (numbers) renumbered on the way (``shift=``, ``index=``):
            the inverse pattern takes any decimal index there (``\\d+``), since the
            renumbered indices need not match the forward group's narrowed body.

    Returns:
        ``(inverse_pattern, inverse_template)``.

    Raises:
        RuleError: the pattern is not of the simple form, or a group is not
            referenced exactly once.

    Examples:
        >>> invert(r"h\\.(\\d+)\\.attn\\.weight", r"blocks/\\1/attn/kernel")
        ('blocks/(\\\\d+)/attn/kernel', 'h.\\\\g<1>.attn.weight')
    """
    parts, groups = parse_pattern(pattern)
    wide = set(widen)
    groups = tuple(Group(g.name, r"\d+") if i + 1 in wide else g for i, g in enumerate(groups))
    names = {g.name: i + 1 for i, g in enumerate(groups) if g.name}
    if produced is not None:
        groups = (*groups, Group(produced[0], produced[1]))
        names[produced[0]] = len(groups)
    order = _reference_order(Template.parse(template), names, len(groups), pattern, template, consumed)
    new_pattern = "".join(re.escape(p) if isinstance(p, str) else _group_text(groups[p - 1]) for p in order)
    slots = {number: i + 1 for i, number in enumerate(p for p in order if isinstance(p, int))}
    new_template = "".join(_template_part(p, groups, slots, consumed) for p in parts)
    return new_pattern, new_template


def _reference_order(
    parsed: Template, names: Mapping[str, int], count: int, pattern: str, template: str, consumed: str | None
) -> list[str | int]:
    """The template's parts with every reference resolved to its group number, checked."""
    resolved: list[str | int] = []
    seen: dict[int, int] = {}
    for part in parsed.parts:
        if isinstance(part, _Ref):
            number = names.get(part.ref) if isinstance(part.ref, str) else part.ref
            if number is None or not 0 < number <= count:
                raise RuleError(f"template {raw(template)} references group {part.ref!r}, absent from {raw(pattern)}")
            seen[number] = seen.get(number, 0) + 1
            resolved.append(number)
        else:
            resolved.append(part)
    skip = {names[consumed]} if consumed is not None and consumed in names else set()
    for number in range(1, count + 1):
        used = seen.get(number, 0)
        if number in skip and used:
            raise RuleError(f"template {raw(template)} must not reference group {consumed!r} of {raw(pattern)}")
        if number not in skip and used != 1:
            how = "never referenced" if used == 0 else f"referenced {used} times"
            raise RuleError(
                f"rule {raw(pattern)} -> {raw(template)} cannot be inverted automatically: group {number} "
                f"is {how} (each group must be referenced exactly once); "
                "pass inverse= with an explicit rule",
                kind="not_invertible",
            )
    return resolved


def _group_text(group: Group) -> str:
    return f"(?P<{group.name}>{group.body})" if group.name else f"({group.body})"


def _template_part(part: str | int, groups: Sequence[Group], slots: Mapping[int, int], consumed: str | None) -> str:
    if isinstance(part, str):
        return part.replace("\\", "\\\\")
    name = groups[part - 1].name
    if consumed is not None and name == consumed:
        return f"\\g<{consumed}>"
    return f"\\g<{slots[part]}>"
