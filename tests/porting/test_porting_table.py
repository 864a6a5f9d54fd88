"""Rule tables checked as a whole: every table here lands every tensor somewhere, so a
per-tensor check would accept it in silence; each is refused under ``strict``, warned
otherwise, or ported right, and the problems name the rules involved."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_rule
from flax import nnx

import nnx_save
from nnx_save.porting import (
    RuleError,
    Rules,
    RuleTableWarning,
    rename,
    shapes_of,
    torch_batch_norm,
    torch_conv,
    torch_layer_norm,
    torch_linear,
    torch_lstm,
    transpose,
)

RNG = np.random.default_rng(0)


def _tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Random float32 tensors of these shapes."""
    return {k: RNG.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _poisoned(model: nnx.Module) -> nnx.Module:
    for _, v in nnx.to_flat_state(nnx.state(model)):
        v.set_value(jnp.full(v.get_value().shape, 7.0, v.get_value().dtype))
    return model


class _FC(nnx.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        self.fc = nnx.Linear(n_in, n_out, rngs=nnx.Rngs(0))


@pytest.fixture
def square_linear(tmp_path):
    tensors = _tensors({"fc.weight": (4, 4), "fc.bias": (4,)})
    path = tmp_path / "fc.safetensors"
    nnx_save.save_file(tensors, path)
    return tensors, path


# --- 1. a transform applied twice, or cancelled ---------------------------------------


def test_a_helper_given_twice_transposes_once_and_is_named(square_linear) -> None:
    tensors, path = square_linear
    twice = Rules(torch_linear(r"fc", "fc"), torch_linear(r"fc", "fc"))
    mapping = twice.mapping(shapes_of(tensors))
    np.testing.assert_array_equal(mapping.apply(tensors)["fc/kernel"], tensors["fc.weight"].T)
    assert mapping.problems[0] == 'rename(r"fc\\.weight", r"fc/kernel") is given twice (rules 0 and 3); it applies once'
    with raises_rule("table", match=re.escape('transpose(r"fc/kernel", (1, 0)) is given twice (rules 1 and 4)')):
        nnx_save.load_model(_poisoned(_FC(4, 4)), path, rules=twice, strict=True)
    with pytest.warns(RuleTableWarning, match=re.escape("is given twice")):
        model, _ = nnx_save.load_model(_poisoned(_FC(4, 4)), path, rules=twice)
    np.testing.assert_array_equal(model.fc.kernel.get_value(), tensors["fc.weight"].T)


def test_a_hand_transpose_on_a_helper_is_refused_as_cancelling(square_linear) -> None:
    tensors, path = square_linear
    rules = Rules(torch_linear(r"fc", "fc"), transpose("fc/kernel", (1, 0)))
    message = (
        '`fc/kernel`: transposed by both transpose(r"fc/kernel", (1, 0)) and transpose(r"fc/kernel", (1, 0)): '
        "they cancel, the tensor lands as the file has it"
    )
    assert rules.mapping(shapes_of(tensors)).problems == (message,)
    with raises_rule("table", match="^" + re.escape(message) + "$"):
        nnx_save.load_model(_poisoned(_FC(4, 4)), path, rules=rules, strict=True)
    with raises_rule("table", match=re.escape(message)):  # the table's own strict, on export
        nnx_save.save_model(_FC(4, 4), path.with_name("out.safetensors"), rules=Rules(rules, strict=True).inverse())


# --- 2. a prefix rename placed before the helpers; the prefix option ------------------


def test_a_prefix_rename_before_the_helpers_is_named_and_prefix_ports_it(tmp_path) -> None:
    tensors = _tensors({"module.fc.weight": (3, 5), "module.fc.bias": (3,)})
    path = tmp_path / "dp.safetensors"
    nnx_save.save_file(tensors, path)
    chained = Rules(rename(r"module\.(.*)", r"\1"), torch_linear(r"fc", "fc"))
    problems = chained.mapping(shapes_of(tensors)).problems
    assert problems[0] == (
        'rename(r"fc\\.weight", r"fc/kernel") matches no key: rename(r"module\\.(.*)", r"\\1") renames '
        '`module.fc.weight` to `fc.weight`, which rename(r"fc\\.weight", r"fc/kernel") would take, but rules do '
        "not chain: give the common prefix as Rules(..., prefix=...) instead"
    )
    with raises_rule("table", match=re.escape("rules do not chain")):
        nnx_save.load_model(_poisoned(_FC(5, 3)), path, rules=chained, strict=True)

    rules = Rules(torch_linear(r"fc", "fc"), prefix="module.")
    model, report = nnx_save.load_model(_poisoned(_FC(5, 3)), path, rules=rules, strict=True)
    np.testing.assert_array_equal(model.fc.kernel.get_value(), tensors["module.fc.weight"].T)
    assert report.landed["module.fc.weight"] == ("fc/kernel",)
    nnx_save.save_model(model, tmp_path / "back.safetensors", rules=rules.inverse())
    back = nnx_save.load_file(tmp_path / "back.safetensors")
    assert sorted(back) == sorted(tensors) and all(np.array_equal(back[k], v) for k, v in tensors.items())


# --- 3. a rule that matches nothing ---------------------------------------------------


def test_a_rule_that_matches_nothing_is_named(square_linear) -> None:
    tensors, path = square_linear
    rules = Rules(torch_linear(r"fc", "fc"), torch_layer_norm(r"norm", "norm", bias=False))
    message = 'rename(r"norm\\.weight", r"norm/scale") matches no key of the source'
    assert rules.mapping(shapes_of(tensors)).problems == (message,)
    with raises_rule("table", match="^" + re.escape(message) + "$"):
        nnx_save.load_model(_poisoned(_FC(4, 4)), path, rules=rules, strict=True)


# --- 4. shift= with a narrowed index pattern ------------------------------------------


def test_shift_with_a_narrowed_index_pattern_transposes_and_exports_every_block() -> None:
    tensors = _tensors(
        {"features.1.weight": (4, 2, 3, 3), "features.2.weight": (4, 4, 3, 3), "features.10.weight": (4, 4, 3, 3)}
    )
    rules = Rules(
        torch_conv(r"features\.1", "blocks/0/conv", bias=False),
        torch_conv(r"features\.(\d\d|[2-9])", r"blocks/\1/conv", bias=False, shift={1: -1}),
    )
    mapping = rules.mapping(shapes_of(tensors))
    values = mapping.apply(tensors)
    for i, key in ((0, "features.1.weight"), (1, "features.2.weight"), (9, "features.10.weight")):
        np.testing.assert_array_equal(values[f"blocks/{i}/conv/kernel"], tensors[key].transpose(2, 3, 1, 0))
    exported = rules.inverse().mapping(mapping.shapes())
    assert sorted(exported.assignments) == sorted(tensors)
    back = exported.apply(values)
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())
    assert mapping.problems == exported.problems == ()


# --- 5. first match wins for every rule: transposes and counters follow it -----------


def test_a_specific_conv_before_a_generic_one_is_transposed_once() -> None:
    tensors = _tensors({"features.0.weight": (32, 1, 3, 3), "features.1.weight": (32, 32, 3, 3)})
    rules = Rules(
        torch_conv(r"features\.0", "blocks/0/conv", bias=False),
        torch_conv(r"features\.(\d+)", r"blocks/\1/conv", bias=False),
    )
    mapping = rules.mapping(shapes_of(tensors))
    assert mapping.assignments["blocks/0/conv/kernel"].shape == (3, 3, 1, 32)
    np.testing.assert_array_equal(
        mapping.apply(tensors)["blocks/0/conv/kernel"], tensors["features.0.weight"].transpose(2, 3, 1, 0)
    )
    back = rules.inverse().mapping(mapping.shapes()).apply(mapping.apply(tensors))
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())


def test_a_generic_batch_norm_writes_only_its_own_counters() -> None:
    f32, i64 = np.dtype("float32"), np.dtype("int64")
    source = {
        f"{m}.{n}": ((8,), f32)
        for m in ("head.bn", "features.1")
        for n in ("weight", "bias", "running_mean", "running_var")
    } | {"head.bn.num_batches_tracked": ((), i64), "features.1.num_batches_tracked": ((), i64)}
    rules = Rules(torch_batch_norm(r"head\.bn", "blocks/0/bn"), torch_batch_norm(r"features\.(\d+)", r"blocks/\1/bn"))
    mapping = rules.mapping(source)
    exported = rules.inverse().mapping(mapping.shapes())
    assert sorted(exported.assignments) == sorted(source)


# --- 6. suggestions for a rule with a wrong target ------------------------------------


class _Final(nnx.Module):
    def __init__(self) -> None:
        self.ln_f = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
        self.scale = nnx.Param(jnp.ones(2))  # in the file too: the load is not empty (an empty one is refused apart)


def test_a_wrong_target_is_suggested_fixed_before_the_allow_options(tmp_path) -> None:
    path = tmp_path / "ln.safetensors"
    nnx_save.save_file(_tensors({"transformer.ln_f.weight": (4,), "transformer.ln_f.bias": (4,), "scale": (2,)}), path)
    rules = Rules(torch_layer_norm(r"transformer\.ln_f", "final_norm"))
    with pytest.raises(nnx_save.LoadError) as raised:
        nnx_save.load_model(_poisoned(_Final()), path, rules=rules, strict=True)
    text = str(raised.value)
    fix = (
        "fix the rules' targets, rather than allowing either:\n"
        "  `final_norm/...` -> `ln_f/...` (`transformer.ln_f.bias` goes to `final_norm/bias`, the model has `ln_f/bias`)\n"
    )
    assert fix in text and text.index(fix) < text.index("allow_missing=")
    assert raised.value.report.suggested_targets == [fix.splitlines()[1].strip()]


# --- 7. index maps and whole LSTMs: one call each -------------------------------------


def test_an_index_map_ports_a_sequentials_scattered_convs_in_one_call() -> None:
    at = (0, 3, 6, 8, 11, 14, 18)
    tensors = {f"features.{n}.weight": RNG.standard_normal((4, 4, 3, 3)).astype(np.float32) for n in at}
    tensors["features.5.weight"] = np.zeros((2,), np.float32)  # not a conv: left to other rules
    rules = Rules(torch_conv(r"features\.(\d+)", r"convs/\1", bias=False, index={1: at}))
    mapping = rules.mapping(shapes_of(tensors))
    values = mapping.apply(tensors)
    for i, n in enumerate(at):
        np.testing.assert_array_equal(
            values[f"convs/{i}/kernel"], tensors[f"features.{n}.weight"].transpose(2, 3, 1, 0)
        )
    assert mapping.landed["features.5.weight"] == ("features.5.weight",)
    del values["features.5.weight"]
    back = rules.inverse().mapping({k: (v.shape, v.dtype) for k, v in values.items()}).apply(values)
    assert sorted(back) == sorted(f"features.{n}.weight" for n in at)


def test_one_torch_lstm_call_ports_every_layer_and_direction() -> None:
    f32 = np.dtype("float32")
    keys = {
        f"lstm.{name}_l{layer}{side}": ((32, 8), f32) if name.startswith("weight") else ((32,), f32)
        for layer in range(2)
        for side in ("", "_reverse")
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    }
    rules = Rules(torch_lstm(r"lstm", "lstm/{layer}/{direction}/cell", layers=2, bidirectional=True))
    mapping = rules.mapping(keys)
    assert all(targets for targets in mapping.landed.values()) and mapping.problems == ()
    assert mapping.landed["lstm.weight_hh_l1_reverse"][0] == "lstm/1/backward_rnn/cell/hf/kernel"
    assert mapping.assignments["lstm/1/backward_rnn/cell/hf/kernel"].shape == (8, 8)
    with pytest.raises(RuleError, match=re.escape("needs the field(s) {direction}")):
        torch_lstm(r"lstm", "lstm/{layer}/cell", layers=2, bidirectional=True)


# --- the new options refuse what they cannot honour -----------------------------------


def test_the_new_options_refuse_bad_input_by_name() -> None:
    f32 = np.dtype("float32")
    with pytest.raises(RuleError, match=re.escape("index= sends two indices to one, so export could not tell them")):
        rename(r"f\.(\d+)", r"c/\1", index={1: {0: 0, 3: 0}})
    with pytest.raises(RuleError, match=re.escape("group 1 is given both shift= and index=; give one")):
        rename(r"f\.(\d+)", r"c/\1", shift={1: -1}, index={1: [0, 3]})
    with pytest.raises(RuleError, match=re.escape("would lose its prefix; give the prefix to the outer Rules")):
        Rules(Rules(rename("a", "b"), prefix="module."))
    with pytest.raises(RuleError, match=re.escape("against= is for export mappings")):
        Rules(rename("a", "b")).mapping({"a": ((1,), f32)}, against={"a": ((1,), f32)})
    clash = "`module.a`: without the prefix 'module.' it is `a`, a key the file also holds"
    with raises_rule("conflict", match="^" + re.escape(clash) + "$"):
        Rules(rename("a", "b"), prefix="module.").mapping({"module.a": ((1,), f32), "a": ((1,), f32)})
