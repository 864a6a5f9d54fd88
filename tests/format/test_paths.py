"""Tree key paths <-> file keys: the int/str rule and the refusals; sizes (``"5GB"``) in bytes."""

import ast
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import nnx_save
from nnx_save.format import _paths, _units

names = st.text(min_size=1, max_size=6).filter(lambda s: "/" not in s)
segments = st.one_of(st.integers(0, 10**6), names)
paths = st.lists(segments, min_size=1, max_size=5).map(tuple)


def canonical(seg):
    """What a segment reads back as: canonical decimal strings become ints, a tuple's
    own literal the tuple."""
    if isinstance(seg, str) and seg.isascii() and seg.isdecimal() and (seg == "0" or not seg.startswith("0")):
        return int(seg)
    if isinstance(seg, str) and seg.startswith("("):
        try:
            value = ast.literal_eval(seg)
        except (ValueError, SyntaxError):
            return seg
        return value if type(value) is tuple and repr(value) == seg else seg
    return seg


def read_key(key):
    """The path a file key names under the module's rules, read back by the test (the
    package never reads a key back): proves a key holds its whole path."""
    return tuple(canonical(s) for s in key.split("/"))


tuple_keys = st.recursive(
    st.tuples(st.one_of(st.integers(0, 99), names)),
    lambda inner: st.lists(st.one_of(st.integers(0, 99), names, inner), min_size=0, max_size=3).map(tuple),
    max_leaves=4,
).filter(lambda t: "/" not in repr(t))


@given(st.lists(st.one_of(segments, tuple_keys), min_size=1, max_size=4).map(tuple))
def test_tuple_keys_round_trip_as_their_literal(path):
    """The tuple rule: a tuple of str / int (flax's ``scales[('kernel',)]``) is written as
    ``repr(key)`` and read back as the tuple."""
    key = _paths.to_key(path)
    assert read_key(key) == tuple(canonical(s) for s in path)
    assert _paths.to_key(read_key(key)) == key


@pytest.mark.parametrize(
    "text, value",
    [("( 'a',)", ("a",)), ("('a', )", ("a",)), ('("a",)', ("a",)), ('("a", 1)', ("a", 1)), ("(1, )", (1,))]
    + [(text, None) for text in ["(", "()x", "(a,)", "(1.5,)", "(True,)"]],
)
def test_only_a_tuple_s_own_literal_makes_the_tuple_s_key(text, value):
    """A name written otherwise than ``repr`` writes the tuple keeps its own key: a tree
    may hold both."""
    assert _paths.to_key(("s", text)) == f"s/{text}"
    if value is not None:
        assert _paths.to_key(("s", value)) == f"s/{value!r}" != f"s/{text}"
        assert len(_paths.check_unique([("s", text), ("s", value)])) == 2


def test_a_name_spelled_as_a_tuple_s_literal_collides_with_the_tuple():
    with pytest.raises(nnx_save.KeyPathError, match=re.escape("both make the file key \"a/('k',)\"")):
        _paths.check_unique([("a", ("k",)), ("a", "('k',)")])


def test_to_key_joins_with_slash_and_writes_ints_in_decimal():
    assert _paths.to_key(("blocks", 0, "attn", 12, "kernel")) == "blocks/0/attn/12/kernel"
    assert _paths.to_key(("é", "名前")) == "é/名前"


@pytest.mark.parametrize(
    "name, number, same",
    [
        ("10", 10, True),
        ("0", 0, True),
        ("007", 7, False),  # not canonical: stays a name
        ("1.5", 1, False),
        ("١٢", 12, False),  # Arabic-Indic digits are decimal but not ASCII
        (" 1", 1, False),
    ],
)
def test_only_a_canonical_decimal_name_makes_the_key_of_an_int(name, number, same):
    assert (_paths.to_key(("a", name)) == _paths.to_key(("a", number))) is same
    assert _paths.to_key(("a", number)) == f"a/{number}"
    if not same:
        assert len(_paths.check_unique([("a", name), ("a", number)])) == 2
    else:
        with pytest.raises(nnx_save.KeyPathError, match=re.escape(f"both make the file key 'a/{number}'")):
            _paths.check_unique([("a", name), ("a", number)])


@given(paths)
def test_decode_encode_round_trip(path):
    assert read_key(_paths.to_key(path)) == tuple(canonical(s) for s in path)


@given(paths)
def test_encode_decode_encode_is_stable(path):
    key = _paths.to_key(path)
    assert _paths.to_key(read_key(key)) == key


def test_jax_key_entries_by_duck_typing():
    import jax

    tree = {"a": [{"b": 1}], "c": (2,)}
    got = [tuple(_paths.segment(k) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert got == [("a", 0, "b"), ("c", 0)]
    assert _paths.segment(jax.tree_util.GetAttrKey("kernel")) == "kernel"
    assert _paths.segment(jax.tree_util.FlattenedIndexKey(3)) == 3


def test_slash_in_a_name_is_refused():
    with pytest.raises(
        nnx_save.KeyPathError,
        match=re.escape(
            "layers/0/'q/k': name contains /; file keys join names with '/' so this one could not be read "
            "back to the same place. Rename the attribute or key."
        ),
    ) as info:
        _paths.to_key(("layers", 0, "q/k"))
    assert info.value.key_path == "layers/0/q/k"


def test_slash_in_the_first_name_is_refused():
    with pytest.raises(nnx_save.KeyPathError, match=re.escape("'a/b': name contains /;")):
        _paths.to_key(("a/b",))


def test_empty_name_is_refused():
    with pytest.raises(nnx_save.KeyPathError, match=re.escape("a/'': empty name; file keys join names")):
        _paths.to_key(("a", ""))


def test_negative_index_is_refused():
    with pytest.raises(nnx_save.KeyPathError, match=re.escape("a/-1: negative index -1 cannot be a file key")):
        _paths.to_key(("a", -1))


@pytest.mark.parametrize(
    "entry, shown",
    [
        (True, "key True of type bool"),
        (1.5, "key 1.5 of type float"),
        ((1.5,), "key (1.5,) of type tuple"),
        (None, "key None of type NoneType"),
    ],
)
def test_non_str_int_keys_are_refused(entry, shown):
    with pytest.raises(
        nnx_save.KeyPathError,
        match=re.escape(f": {shown} cannot be a file key; use str or int keys (or tuples of them)"),
    ):
        _paths.to_key(("a", entry))


def test_lone_surrogate_is_refused():
    with pytest.raises(
        nnx_save.KeyPathError,
        match=re.escape(
            "a/\ud800x: name '\\ud800x' is not valid Unicode (a lone surrogate); file keys are UTF-8 text."
        ),
    ):
        _paths.to_key(("a", "\ud800x"))


def test_int_and_str_zero_collide():
    with pytest.raises(
        nnx_save.KeyPathError,
        match=re.escape(
            "layers/0: paths ('layers', 0) and ('layers', '0') both make the file key 'layers/0' "
            "(int and str keys such as 0 and '0' write the same name); rename one of them"
        ),
    ):
        _paths.check_unique([("layers", 0), ("layers", "0")])


def test_check_unique_maps_keys_to_paths():
    assert _paths.check_unique([("a", 0), ("a", "1"), ("b",)]) == {"a/0": ("a", 0), "a/1": ("a", "1"), "b": ("b",)}


def test_parse_size():
    """The sizes ``max_shard_size`` and ``nnx-save convert --max-shard-size`` take (moved from
    the CLI's tests: its ``parse_size`` only rewords this one's error)."""
    assert _units.parse_size("5GB") == 5 * 10**9
    assert _units.parse_size("200MiB") == 200 << 20
    assert _units.parse_size("1000") == 1000
    assert _units.parse_size("1.5 KB") == 1500


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(_paths)
    assert result.failed == 0 and result.attempted >= 4
