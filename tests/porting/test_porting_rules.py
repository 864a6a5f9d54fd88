"""Every rule kind on small numpy tensors, checked against plain numpy."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
from _errors import raises_rule

import nnx_save
from nnx_save.porting import (
    Assignment,
    RuleError,
    Rules,
    concat,
    ignore,
    rename,
    reshape,
    shapes_of,
    split,
    stack,
    transpose,
    unstack,
)

F32 = np.dtype("float32")


def arrays(**shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Distinct values per tensor; keys use '_' for '.' (``h_0_w`` -> ``h.0.w``)."""
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        out[name.replace("_", ".")] = (np.arange(np.prod(shape), dtype=F32) + 1000 * i).reshape(shape)
    return out


def run(rules: Rules, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return rules.mapping(shapes_of(tensors)).apply(tensors)


def raises(kind: type[Exception] | str, message: str):
    """``pytest.raises`` of the whole message; a string is a ``RuleError`` of that kind."""
    match = "^" + re.escape(message) + "$"
    return raises_rule(kind, match) if isinstance(kind, str) else pytest.raises(kind, match=match)


# --- rename / ignore ----------------------------------------------------------------


def test_rename_first_match_wins_and_unmatched_keys_keep_their_name() -> None:
    rules = Rules(rename(r"a\.(\d+)", r"first/\1"), rename(r"a\.(.*)", r"second/\1"))
    mapping = rules.mapping({"a.0": ((2,), F32), "a.x": ((3,), "float16"), "b": ((1,), F32)})
    assert mapping.assignments == {
        "b": Assignment("b", ("b",), (1,), F32, None),
        "first/0": Assignment("first/0", ("a.0",), (2,), F32, None),
        "second/x": Assignment("second/x", ("a.x",), (3,), np.dtype("float16"), None),
    }
    assert mapping.landed == {"a.0": ("first/0",), "a.x": ("second/x",), "b": ("b",)}
    assert mapping.unused == ()


def test_rename_only_values_are_the_source_arrays() -> None:
    tensors = arrays(w=(2, 3))
    out = run(Rules(rename("w", "m/kernel")), tensors)
    assert out["m/kernel"] is tensors["w"]


def test_ignore_drops_keys_on_purpose() -> None:
    mapping = Rules(ignore(r"lm_head\.weight")).mapping({"lm_head.weight": ((2,), F32), "x": ((1,), F32)})
    assert list(mapping.assignments) == ["x"]
    assert mapping.landed == {"lm_head.weight": (), "x": ("x",)}
    assert mapping.unused == ("lm_head.weight",)


def test_ignore_has_no_export_counterpart() -> None:
    assert list(Rules(ignore("a"), rename("b", "c")).inverse()) == [rename("c", "b")]


def test_rename_refuses_a_reference_the_pattern_lacks() -> None:
    with raises(RuleError, 'template r"x/\\2" references group 2, which pattern r"a(\\d)" does not define'):
        rename(r"a(\d)", r"x/\2")


def test_rename_refuses_a_bad_regex() -> None:
    with pytest.raises(RuleError, match=re.escape('pattern r"a(" is not a valid regex: missing ), unterminated')):
        rename("a(", "b")


def test_explicit_inverse_is_used_and_round_trips() -> None:
    explicit = rename("wte/embedding", "transformer.wte.weight")
    rule = rename(r"(?:transformer\.)?wte\.weight", "wte/embedding", inverse=explicit)
    assert rule.inverse() == rename("wte/embedding", "transformer.wte.weight")
    assert rule.inverse().inverse() == rule


def test_uninvertible_rename_names_the_remedy() -> None:
    rule = rename(r"(?:transformer\.)?wte\.weight", "wte/embedding")
    message = (
        'pattern r"(?:transformer\\.)?wte\\.weight" cannot be inverted automatically: group '
        "'(?:transformer\\.)' is not a capturing group; pass inverse= with an explicit rule"
    )
    with raises("not_invertible", message):
        Rules(rule).inverse()


# --- transpose / reshape ------------------------------------------------------------


def test_transpose_matches_the_model_path_after_renaming() -> None:
    tensors = arrays(fc_weight=(4, 3))
    rules = Rules(rename(r"fc\.weight", "fc/kernel"), transpose(r".*/kernel", (1, 0)))
    mapping = rules.mapping(shapes_of(tensors))
    assert mapping.assignments["fc/kernel"].shape == (3, 4)
    np.testing.assert_array_equal(mapping.apply(tensors)["fc/kernel"], tensors["fc.weight"].T)


def test_transpose_checks_the_number_of_dimensions() -> None:
    with raises("shape", '`w`: transpose(r"w", (1, 0)) expects 2 dimensions, found shape (2, 3, 4)'):
        Rules(transpose("w", (1, 0))).mapping({"w": ((2, 3, 4), F32)})


def test_transpose_refuses_axes_that_are_not_a_permutation() -> None:
    with raises(RuleError, 'transpose(r"w", (0, 0)): axes must be a permutation of 0..1, got (0, 0)'):
        transpose("w", (0, 0))


def test_value_rules_compose_in_the_order_listed() -> None:
    tensors = arrays(q=(6, 4))
    rules = Rules(transpose("q", (1, 0)), reshape("q", (4, 2, 3)))
    np.testing.assert_array_equal(run(rules, tensors)["q"], tensors["q"].T.reshape(4, 2, 3))
    back = rules.inverse(recorded=rules.mapping(shapes_of(tensors)))
    np.testing.assert_array_equal(run(back, run(rules, tensors))["q"], tensors["q"])


def test_reshape_takes_one_minus_one() -> None:
    tensors = arrays(cls=(1, 1, 8))
    rules = Rules(reshape("cls", (-1,), source_shape=(1, 1, -1)))
    out = run(rules, tensors)
    assert out["cls"].shape == (8,)
    assert run(rules.inverse(), out)["cls"].shape == (1, 1, 8)


def test_reshape_checks_the_size() -> None:
    with raises("shape", '`w`: reshape(r"w", (4, -1)) cannot reshape shape (2, 3) (6 elements) to (4, -1)'):
        Rules(reshape("w", (4, -1))).mapping({"w": ((2, 3), F32)})


def test_reshape_refuses_two_unknown_sizes() -> None:
    with raises(RuleError, 'reshape(r"w", (-1, -1)): a shape takes sizes >= 0 and at most one -1, got (-1, -1)'):
        reshape("w", (-1, -1))


def test_reshape_inverse_needs_the_source_shape() -> None:
    message = (
        'reshape(r"w", (6,)) cannot be inverted: the source shape is unknown; pass source_shape= to '
        "reshape(), or inverse(recorded=mapping) with a mapping these rules made"
    )
    with raises("not_invertible", message):
        Rules(reshape("w", (6,))).inverse()


def test_reshape_inverse_from_a_recorded_plan() -> None:
    rules = Rules(reshape(r"w\d", (6,)))
    mapping = rules.mapping({"w1": ((2, 3), F32), "w2": ((2, 3), F32)})
    assert list(rules.inverse(recorded=mapping)) == [reshape(r"w\d", (2, 3), source_shape=(6,))]


def test_reshape_inverse_refuses_a_plan_with_two_source_shapes() -> None:
    rules = Rules(reshape(r"w\d", (6,)))
    mapping = rules.mapping({"w1": ((2, 3), F32), "w2": ((3, 2), F32)})
    message = 'reshape(r"w\\d", (6,)) cannot be inverted: the recorded mapping used it with [(2, 3), (3, 2)]'
    with raises("not_invertible", message):
        rules.inverse(recorded=mapping)


# --- split / concat -----------------------------------------------------------------


def test_split_cuts_equal_parts() -> None:
    tensors = arrays(h_0_qkv=(4, 9))
    rules = Rules(split(r"h\.(\d+)\.qkv", [r"h/\1/q", r"h/\1/k", r"h/\1/v"], axis=1))
    mapping = rules.mapping(shapes_of(tensors))
    assert mapping.landed == {"h.0.qkv": ("h/0/k", "h/0/q", "h/0/v")}
    out = mapping.apply(tensors)
    for i, name in enumerate("qkv"):
        np.testing.assert_array_equal(out[f"h/0/{name}"], tensors["h.0.qkv"][:, 3 * i : 3 * i + 3])


def test_split_takes_explicit_sizes_and_negative_axes() -> None:
    tensors = arrays(qkv=(8, 2))
    out = run(Rules(split("qkv", ["q", "k", "v"], axis=-2, sizes=(4, 2, 2))), tensors)
    np.testing.assert_array_equal(out["k"], tensors["qkv"][4:6])
    assert [out[n].shape for n in "qkv"] == [(4, 2), (2, 2), (2, 2)]


def test_split_then_transpose_each_part() -> None:
    tensors = arrays(qkv=(6, 4))  # a torch Linear (out, in) holding q, k, v
    rules = Rules(split("qkv", ["q/kernel", "k/kernel"], axis=0), transpose(".*/kernel", (1, 0)))
    out = run(rules, tensors)
    np.testing.assert_array_equal(out["k/kernel"], tensors["qkv"][3:].T)
    np.testing.assert_array_equal(run(rules.inverse(), out)["qkv"], tensors["qkv"])


def test_split_needs_a_multiple_of_the_part_count() -> None:
    message = '`qkv`: split(r"qkv", (r"q", r"k"), axis=0) needs a multiple of 2 on axis 0, found shape (5,)'
    with raises(RuleError, message):
        Rules(split("qkv", ["q", "k"])).mapping({"qkv": ((5,), F32)})


def test_split_needs_sizes_that_sum_to_the_axis() -> None:
    message = (
        '`qkv`: split(r"qkv", (r"q", r"k"), axis=0, sizes=(2, 2)) needs sizes (2, 2) (sum 4) on axis 0, '
        "found shape (5,)"
    )
    with raises(RuleError, message):
        Rules(split("qkv", ["q", "k"], sizes=(2, 2))).mapping({"qkv": ((5,), F32)})


def test_split_needs_the_axis() -> None:
    with raises(RuleError, '`qkv`: split(r"qkv", (r"q", r"k"), axis=2) needs axis 2, found shape (4,)'):
        Rules(split("qkv", ["q", "k"], axis=2)).mapping({"qkv": ((4,), F32)})


def test_split_refuses_one_target() -> None:
    with raises(RuleError, 'split(r"a", (r"b"), axis=0): a split needs at least two targets, got 1'):
        split("a", ["b"])


def test_concat_joins_parts_in_pattern_order() -> None:
    tensors = arrays(h_0_k=(2, 3), h_0_q=(4, 3), h_1_q=(4, 3), h_1_k=(2, 3))
    rules = Rules(concat([r"h\.(\d+)\.q", r"h\.(\d+)\.k"], r"h/\1/qk", axis=0))
    mapping = rules.mapping(shapes_of(tensors))
    assert mapping.assignments["h/1/qk"].sources == ("h.1.q", "h.1.k")
    out = mapping.apply(tensors)
    np.testing.assert_array_equal(out["h/1/qk"], np.concatenate([tensors["h.1.q"], tensors["h.1.k"]]))


def test_concat_names_a_missing_part() -> None:
    rules = Rules(concat([r"(\d)\.q", r"(\d)\.k"], r"\1/qk"))
    message = (
        '`0/qk`: concat((r"(\\d)\\.q", r"(\\d)\\.k"), r"\\1/qk", axis=0) found `0.q` but no key matching r"(\\d)\\.k"'
    )
    with raises(RuleError, message):
        rules.mapping({"0.q": ((2,), F32)})


def test_concat_checks_shapes_off_the_axis_and_dtypes() -> None:
    rules = Rules(concat(["q", "k"], "qk", axis=1))
    message = (
        '`qk`: concat((r"q", r"k"), r"qk", axis=1) needs shapes that agree off axis 1, found `q` (2, 3), `k` (3, 3)'
    )
    with raises(RuleError, message):
        rules.mapping({"q": ((2, 3), F32), "k": ((3, 3), F32)})
    with raises(RuleError, "`qk`: its sources must share one dtype, found `q` float32, `k` float16"):
        rules.mapping({"q": ((2, 3), F32), "k": ((2, 3), "float16")})


def test_concat_inverse_needs_sizes() -> None:
    rules = Rules(concat(["q", "k"], "qk"))
    message = (
        'concat((r"q", r"k"), r"qk", axis=0) cannot be inverted: the split sizes cannot be read back from the '
        "joined tensor; pass sizes= to concat(), or inverse(recorded=mapping) with a mapping these rules made"
    )
    with raises("not_invertible", message):
        rules.inverse()
    mapping = rules.mapping({"q": ((4,), F32), "k": ((2,), F32)})
    assert list(rules.inverse(recorded=mapping)) == [split("qk", ["q", "k"], sizes=(4, 2))]
    assert list(Rules(concat(["q", "k"], "qk", sizes=(4, 2))).inverse()) == [split("qk", ["q", "k"], sizes=(4, 2))]


def test_concat_checks_declared_sizes() -> None:
    rules = Rules(concat(["q", "k"], "qk", sizes=(4, 2)))
    message = '`qk`: concat((r"q", r"k"), r"qk", axis=0) expects part sizes (4, 2) on axis 0, found (2, 2)'
    with raises(RuleError, message):
        rules.mapping({"q": ((2,), F32), "k": ((2,), F32)})


# --- stack / unstack ----------------------------------------------------------------


def test_stack_orders_layers_by_index_not_by_name() -> None:
    tensors = {f"h.{i}.w": np.full((2, 3), i, F32) for i in (0, 1, 2, 10, 3, 4, 5, 6, 7, 8, 9)}
    rules = Rules(stack(r"h\.(?P<layer>\d+)\.w", "layers/w", axis=1))
    mapping = rules.mapping(shapes_of(tensors))
    assert mapping.assignments["layers/w"].sources == tuple(f"h.{i}.w" for i in range(11))
    out = mapping.apply(tensors)["layers/w"]
    assert out.shape == (2, 11, 3)
    np.testing.assert_array_equal(out[0, :, 0], np.arange(11))


def test_a_layer_index_of_unicode_digits_is_a_rule_error_not_a_value_error() -> None:
    # "²".isdigit() is true, but int("²") raises ValueError; a layer group wider than \d+ can capture it.
    rules = Rules(stack(r"h\.(?P<layer>[^.]+)\.w", "w"))
    message = '`h.².w`: stack(r"h\\.(?P<layer>[^.]+)\\.w", r"w", axis=0) needs a decimal layer index, found \'²\''
    with raises(RuleError, message):
        rules.mapping({"h.0.w": ((2,), F32), "h.².w": ((2,), F32)})


def test_stack_names_missing_layers() -> None:
    rules = Rules(stack(r"h\.(?P<layer>\d+)\.w", "w"))
    message = '`w`: stack(r"h\\.(?P<layer>\\d+)\\.w", r"w", axis=0) found layers [0, 3], missing layers [1, 2]'
    with raises(RuleError, message):
        rules.mapping({"h.0.w": ((2,), F32), "h.3.w": ((2,), F32)})


def test_stack_needs_one_shape() -> None:
    rules = Rules(stack(r"h\.(?P<layer>\d+)\.w", "w"))
    message = (
        '`w`: stack(r"h\\.(?P<layer>\\d+)\\.w", r"w", axis=0) needs layers of one shape, found '
        "`h.0.w` (2,), `h.1.w` (3,)"
    )
    with raises(RuleError, message):
        rules.mapping({"h.0.w": ((2,), F32), "h.1.w": ((3,), F32)})


def test_stack_refuses_two_keys_for_one_layer() -> None:
    rules = Rules(stack(r"h\.(?P<layer>\d+)\.(?:a|b)", "w"))
    message = '`w`: produced twice by stack(r"h\\.(?P<layer>\\d+)\\.(?:a|b)", r"w", axis=0), from `h.0.a` and `h.0.b`'
    with raises(RuleError, message):
        rules.mapping({"h.0.a": ((2,), F32), "h.0.b": ((2,), F32)})


def test_stack_needs_the_layer_group_and_must_not_reference_it() -> None:
    message = 'stack(r"h\\.(\\d+)", r"w", axis=0): the pattern needs a named group (?P<layer>...) for the layer index'
    with raises(RuleError, message):
        stack(r"h\.(\d+)", "w")
    message = 'stack(r"h\\.(?P<layer>\\d+)", r"w/\\1", axis=0): the target must not reference the layer group \'layer\''
    with raises(RuleError, message):
        stack(r"h\.(?P<layer>\d+)", r"w/\1")


def test_unstack_gives_each_entry_its_key() -> None:
    tensors = arrays(experts_w=(3, 2, 4))
    rules = Rules(unstack(r"experts\.w", r"experts/\g<layer>/w", axis=0))
    out = run(rules, tensors)
    assert sorted(out) == ["experts/0/w", "experts/1/w", "experts/2/w"]
    np.testing.assert_array_equal(out["experts/2/w"], tensors["experts.w"][2])
    np.testing.assert_array_equal(run(rules.inverse(), out)["experts.w"], tensors["experts.w"])


def test_unstack_needs_the_index_reference() -> None:
    with raises(RuleError, 'unstack(r"e", r"x", axis=0): the target must reference \\g<layer> for the entry index'):
        unstack("e", "x")


# --- conflicts ----------------------------------------------------------------------


def test_a_source_feeding_two_rules_is_a_conflict() -> None:
    rules = Rules(split(r"(\w+)\.qkv", [r"\1/q", r"\1/k"]), stack(r"(?P<layer>\d+)\.qkv", "qkv"))
    message = (
        '`0.qkv`: matched by both split(r"(\\w+)\\.qkv", (r"\\1/q", r"\\1/k"), axis=0) and '
        'stack(r"(?P<layer>\\d+)\\.qkv", r"qkv", axis=0); a source tensor feeds one rule'
    )
    with raises("conflict", message):
        rules.mapping({"0.qkv": ((4,), F32)})


def test_a_source_matched_by_a_split_and_a_rename_is_a_conflict() -> None:
    rules = Rules(rename(r"(.*)\.weight", r"\1/kernel"), split(r"qkv\.weight", ["q", "k"]))
    message = (
        '`qkv.weight`: matched by both split(r"qkv\\.weight", (r"q", r"k"), axis=0) and '
        'rename(r"(.*)\\.weight", r"\\1/kernel"); a source tensor feeds one rule'
    )
    with raises("conflict", message):
        rules.mapping({"qkv.weight": ((4,), F32)})


def test_a_target_made_twice_is_a_conflict_naming_both() -> None:
    rules = Rules(rename("a", "x"), split("qk", ["x", "y"]))
    message = '`x`: produced twice, from `a` by rename(r"a", r"x") and from `qk` by split(r"qk", (r"x", r"y"), axis=0)'
    with raises("conflict", message):
        rules.mapping({"a": ((2,), F32), "qk": ((4,), F32)})


def test_a_renamed_key_landing_on_a_kept_name_is_a_conflict() -> None:
    message = '`b`: produced twice, from `b` by no rule (name kept) and from `a` by rename(r"a", r"b")'
    with raises("conflict", message):
        Rules(rename("a", "b")).mapping({"a": ((2,), F32), "b": ((2,), F32)})


def test_every_conflict_is_reported_at_once() -> None:
    rules = Rules(rename(r"[ab]", "x"), rename(r"[cd]", "y"))
    message = (
        "2 porting rule problems:\n"
        '  `x`: produced twice, from `a` by rename(r"[ab]", r"x") and from `b` by rename(r"[ab]", r"x")\n'
        '  `y`: produced twice, from `c` by rename(r"[cd]", r"y") and from `d` by rename(r"[cd]", r"y")'
    )
    with raises("conflict", message):
        rules.mapping(dict.fromkeys("abcd", ((1,), F32)))


def test_conflicts_are_nnx_save_errors() -> None:
    assert issubclass(RuleError, nnx_save.NnxSaveError) and RuleError("x", kind="conflict").kind == "conflict"
    assert RuleError("x", kind="shape").kind == "shape" and RuleError("x").kind is None


# --- Rules, KeyMapping, Assignment ---------------------------------------------------------


def test_rules_flatten_nested_sequences_and_compare_by_value() -> None:
    a, b, c = rename("a", "x"), transpose("x", (1, 0)), ignore("z")
    assert list(Rules((a, [b]), Rules(c))) == [a, b, c] == list(Rules(r for r in (a, b, c)))
    assert Rules(a, b) == Rules([a, b]) and Rules(a) != Rules(a, direction="export")
    assert hash(Rules(a, b)) == hash(Rules(a, b))


def test_rules_refuse_other_things() -> None:
    with raises(RuleError, "Rules takes rules, found 'a' of type str"):
        Rules("a")
    with raises(RuleError, "direction must be 'load' or 'export', got 'up'"):
        Rules(direction="up")


def test_rules_repr_lists_one_rule_a_line() -> None:
    assert repr(Rules(rename("a", "b"))) == 'Rules(\n    rename(r"a", r"b"),\n    direction=\'load\',\n)'


def test_inverse_of_inverse_is_the_same_rules() -> None:
    rules = Rules(
        rename(r"h\.(\d+)\.w", r"h/\1/w"),
        split(r"h\.(\d+)\.qkv", [r"h/\1/q", r"h/\1/k"]),
        stack(r"l\.(?P<layer>\d+)\.(\w+)", r"l/\2"),
        transpose(r"h/\d+/w", (1, 0)),
        reshape("c", (-1,), source_shape=(1, -1)),
    )
    assert rules.inverse().direction == "export"
    assert rules.inverse().inverse() == rules


def test_materialize_checks_the_planned_shape() -> None:
    a = Assignment("t", ("s",), (3,), F32, None)
    with raises("shape", "`t`: planned (3,) float32, made (2,) float32 from `s`"):
        a.materialize({"s": np.zeros(2, F32)})


def test_apply_does_not_modify_the_sources() -> None:
    tensors = arrays(w=(2, 3))
    before = {k: v.copy() for k, v in tensors.items()}
    run(Rules(transpose("w", (1, 0))), tensors)
    assert tensors.keys() == before.keys() and all(np.array_equal(tensors[k], before[k]) for k in tensors)


def test_export_applies_value_rules_before_joining() -> None:
    tensors = arrays(qkv=(6, 4))
    rules = Rules(split("qkv", ["q", "k", "v"], axis=0), transpose("[qkv]", (1, 0)))
    model = run(rules, tensors)
    mapping = rules.inverse().mapping(shapes_of(model))
    transform = mapping.assignments["qkv"].transform
    assert [len(steps) for steps in transform.pre] == [1, 1, 1] and transform.post == ()
    np.testing.assert_array_equal(mapping.apply(model)["qkv"], tensors["qkv"])


def test_porting_modules_import_neither_torch_nor_jax() -> None:
    package = Path(nnx_save.__file__).parent / "porting"
    for module in package.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in {"torch", "jax", "flax", "transformers"} for n in names), module


# --- every remaining refusal, with its message ---------------------------------------


@pytest.mark.parametrize(
    ("make", "kind", "message"),
    [
        (
            lambda: split("a", ["b", "c"], sizes=(1,)),
            RuleError,
            'split(r"a", (r"b", r"c"), axis=0, sizes=(1,)): sizes must be 2 non-negative ints, got (1,)',
        ),
        (
            lambda: concat(["a"], "b"),
            RuleError,
            'concat((r"a"), r"b", axis=0): needs at least two patterns and one target template per pattern',
        ),
        (
            lambda: Rules(concat([r"a.", r".b"], "t")).mapping({"ab": ((1,), F32)}),
            RuleError,
            '`ab`: matches parts r"a." and r".b" of concat((r"a.", r".b"), r"t", axis=0); each key must match one part',
        ),
        (
            lambda: Rules(stack(r"h\.(?P<layer>\w+)", "t")).mapping({"h.x": ((1,), F32)}),
            RuleError,
            '`h.x`: stack(r"h\\.(?P<layer>\\w+)", r"t", axis=0) needs a decimal layer index, found \'x\'',
        ),
        (
            lambda: Rules(stack(r"h\.(?P<layer>\d+)", "t", axis=3)).mapping({"h.0": ((1,), F32)}),
            RuleError,
            '`t`: stack(r"h\\.(?P<layer>\\d+)", r"t", axis=3) cannot stack shape (1,) on axis 3',
        ),
        (
            lambda: Rules(unstack(r"e", r"t/\g<layer>", axis=1)).mapping({"e": ((2,), F32)}),
            RuleError,
            '`e`: unstack(r"e", r"t/\\g<layer>", axis=1) needs axis 1, found shape (2,)',
        ),
        (
            lambda: unstack(r"(?P<layer>e)", r"t/\g<layer>"),
            RuleError,
            (
                'unstack(r"(?P<layer>e)", r"t/\\g<layer>", axis=0): the pattern must not define the group '
                "'layer', the target's index"
            ),
        ),
        (
            lambda: Rules(concat([r"(\d)\.q", r"(?P<i>\w)\.k"], r"\1/qk", sizes=(1, 1))).inverse(),
            "not_invertible",
            (
                'concat((r"(\\d)\\.q", r"(?P<i>\\w)\\.k"), r"\\1/qk", axis=0) cannot be inverted automatically: '
                'its parts give different target patterns r"(?P<i>\\w)/qk", r"(\\d)/qk"; '
                "pass inverse= with an explicit rule"
            ),
        ),
    ],
)
def test_refusals_name_the_rule_and_what_was_found(make, kind: type[Exception] | str, message: str) -> None:
    with raises(kind, message):
        make()
