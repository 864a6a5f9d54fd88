"""Patterns and templates as data, and the automatic inversion of renames."""

from __future__ import annotations

import re

import pytest
from _errors import raises_rule
from hypothesis import given
from hypothesis import strategies as st

from nnx_save.porting import RuleError, rename
from nnx_save.porting._template import Group, Template, invert, parse_pattern


def test_template_parses_references_and_literal_backslash() -> None:
    t = Template.parse(r"a/\1/\g<2>/\g<name>/\\x")
    assert t.refs == (1, 2, "name")
    assert t.expand({1: "one", 2: "two", "name": "n"}) == "a/one/two/n/\\x"


def test_template_refuses_other_escapes() -> None:
    with pytest.raises(RuleError, match=re.escape(r"""template r"a\nb": escape '\n' at 1; keys only take""")):
        Template.parse(r"a\nb")


def test_template_refuses_bad_named_reference() -> None:
    with pytest.raises(RuleError, match=re.escape(r"""template r"a\g<1x>": bad group reference \g<1x>""")):
        Template.parse(r"a\g<1x>")


def test_parse_pattern_splits_literals_and_groups() -> None:
    parts, groups = parse_pattern(r"h\.(\d+)\.(?P<kind>[a-z_]+)\.w")
    assert parts == ("h.", 1, ".", 2, ".w")
    assert groups == (Group(None, r"\d+"), Group("kind", "[a-z_]+"))


def test_parse_pattern_keeps_brackets_and_parens_inside_a_class() -> None:
    parts, groups = parse_pattern(r"a([)(]+)b")
    assert parts == ("a", 1, "b") and groups == (Group(None, "[)(]+"),)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"h\..*\.w", "regex operator '.' at 3 outside a capturing group"),
        (r"h\.\d+\.w", "escape '\\d' at 3 outside a capturing group is not literal text"),
        (r"h(\d)+", "group 1 is quantified ('+')"),
        (r"h((\d)x)", "group '((\\d)x)' contains another capturing group; use (?:...) inside"),
        (r"h(?:ab)", "group '(?:ab)' is not a capturing group"),
        (r"a|b", "regex operator '|' at 1 outside a capturing group"),
        (r"h(\d", "unbalanced parenthesis at 1"),
    ],
)
def test_parse_pattern_refuses_what_it_cannot_invert(pattern: str, why: str) -> None:
    message = f'pattern r"{pattern}" cannot be inverted automatically: {why}; pass inverse= with an explicit rule'
    with raises_rule("not_invertible", match=re.escape(message)):
        parse_pattern(pattern)


def test_invert_swaps_pattern_and_template() -> None:
    assert invert(r"h\.(\d+)\.attn\.c_proj\.weight", r"blocks/\1/attn/proj/kernel") == (
        r"blocks/(\d+)/attn/proj/kernel",
        r"h.\g<1>.attn.c_proj.weight",
    )


def test_invert_follows_the_template_order_and_keeps_names() -> None:
    pattern, template = invert(r"(?P<a>[a-z]+)\.(\d+)", r"\2/\g<a>")
    assert (pattern, template) == (r"(\d+)/(?P<a>[a-z]+)", r"\g<2>.\g<1>")
    assert re.fullmatch(pattern, "7/abc").expand(template) == "abc.7"


def test_invert_escapes_literal_text_both_ways() -> None:
    pattern, template = invert(r"a\+b\\(\d+)", r"x.y+\1")
    assert re.fullmatch(pattern, "x.y+3").expand(template) == "a+b\\3"


@pytest.mark.parametrize(
    ("template", "how"),
    [(r"x/\1/\1/\2", "group 1 is referenced 2 times"), (r"x/\2", "group 1 is never referenced")],
)
def test_invert_needs_each_group_once(template: str, how: str) -> None:
    message = (
        rf'rule r"h\.(\d+)\.(\d+)" -> r"{template}" cannot be inverted automatically: {how} '
        "(each group must be referenced exactly once); pass inverse= with an explicit rule"
    )
    with raises_rule("not_invertible", match=re.escape(message)):
        invert(r"h\.(\d+)\.(\d+)", template)


# --- property: inverse(forward(key)) == key for the simple form ---------------------------

_BODIES = {r"\d+": st.integers(0, 999).map(str), "[a-z]+": st.text("abcxyz", min_size=1, max_size=4)}
_SEPARATORS = st.sampled_from([".", "/", "_", "-", "+", ".0.", "/w/"])


@st.composite
def _simple_renames(draw: st.DrawFn) -> tuple[str, str, str]:
    """A pattern of separated groups, a template using each once, and a matching key."""
    bodies = draw(st.lists(st.sampled_from(sorted(_BODIES)), min_size=1, max_size=4))
    seps = draw(st.lists(_SEPARATORS, min_size=len(bodies) + 1, max_size=len(bodies) + 1))
    values = [draw(_BODIES[b]) for b in bodies]
    order = draw(st.permutations(range(len(bodies))))
    out_seps = draw(st.lists(_SEPARATORS, min_size=len(bodies) + 1, max_size=len(bodies) + 1))
    pattern = "".join(re.escape(seps[i]) + f"({b})" for i, b in enumerate(bodies)) + re.escape(seps[-1])
    key = "".join(seps[i] + v for i, v in enumerate(values)) + seps[-1]
    template = "".join(out_seps[j] + f"\\{i + 1}" for j, i in enumerate(order)) + out_seps[-1]
    return pattern, template, key


@given(_simple_renames())
def test_inverted_rename_maps_each_target_back_to_its_key(case: tuple[str, str, str]) -> None:
    pattern, template, key = case
    rule = rename(pattern, template)
    target = rule.match(key)
    assert target is not None
    assert rule.inverse().match(target) == key
    assert rule.inverse().inverse() == rule
