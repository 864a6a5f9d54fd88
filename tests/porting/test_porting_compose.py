"""Ties, stacked helpers, split + stack on one tensor, sums and LSTMs: the rule kinds
that real checkpoints needed beyond renames (planning only; torch where it checks
the numbers)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _errors import raises_rule

from nnx_save.porting import (
    RuleError,
    Rules,
    add,
    hf_conv1d,
    rename,
    split,
    tie,
    torch_conv,
    torch_layer_norm,
    torch_linear,
    torch_lstm,
)

F32 = np.dtype("float32")
RNG = np.random.default_rng(0)


def _arrays(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    return {k: RNG.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _round_trip(rules: Rules, file: dict[str, np.ndarray]) -> tuple[dict, dict]:
    model = rules.mapping(file).apply(file)
    back = rules.inverse().mapping(model).apply(model)
    return model, back


# --- tie ------------------------------------------------------------------------------

TIED = Rules(rename(r"wte\.weight", "wte/embedding"), tie(r"wte\.weight", "lm_head.weight"))


def test_tie_reads_the_source_checks_the_copy_and_writes_both_back() -> None:
    wte = RNG.standard_normal((6, 4)).astype(np.float32)
    file = {"wte.weight": wte, "lm_head.weight": wte.copy()}
    mapping = TIED.mapping(file)
    assert mapping.tied == {"lm_head.weight": "wte.weight"} and mapping.unused == ()
    assert mapping.landed["lm_head.weight"] == ("wte/embedding",)  # read, to be checked
    model, back = _round_trip(TIED, file)
    assert sorted(model) == ["wte/embedding"] and np.array_equal(model["wte/embedding"], wte)
    assert sorted(back) == ["lm_head.weight", "wte.weight"]
    assert all(np.array_equal(v, wte) for v in back.values())


def test_tie_refuses_copies_that_differ() -> None:
    wte = np.zeros((6, 4), np.float32)
    head = wte.copy()
    head[2, 1] = 0.5
    message = "`lm_head.weight` is declared tied to `wte.weight` but holds other values (max |difference| 0.5)"
    with raises_rule("tied", match=re.escape(message)):
        TIED.mapping({"wte.weight": wte, "lm_head.weight": head}).apply({"wte.weight": wte, "lm_head.weight": head})


def test_tie_without_check_reports_the_copy_and_reads_only_the_source() -> None:
    rules = Rules(rename(r"wte\.weight", "wte/embedding"), tie(r"wte\.weight", "lm_head.weight", check=False))
    mapping = rules.mapping({"wte.weight": ((6, 4), F32), "lm_head.weight": ((6, 4), F32)})
    assert mapping.tied == {"lm_head.weight": "wte.weight"}
    assert mapping.unused == ("lm_head.weight",) and mapping.assignments["wte/embedding"].transform is None


def test_tie_refuses_a_copy_of_another_shape() -> None:
    message = '`lm_head.weight`: tie(r"wte\\.weight", r"lm_head.weight") ties it to `wte.weight`, found (6, 5)'
    with pytest.raises(RuleError, match=re.escape(message)):
        TIED.mapping({"wte.weight": ((6, 4), F32), "lm_head.weight": ((6, 5), F32)})


def test_tie_without_the_copy_in_the_file_still_writes_it() -> None:
    """``save_pretrained`` drops the tied head; ``load_state_dict(strict=True)`` wants it."""
    file = _arrays({"wte.weight": (6, 4)})
    _, back = _round_trip(TIED, file)
    assert sorted(back) == ["lm_head.weight", "wte.weight"]


# --- layer patterns and split + stack ----------------------------------------------------

_L = r"h\.(?P<layer>\d+)\."


def test_helpers_given_a_layer_pattern_stack_and_transpose_each_layer() -> None:
    rules = Rules(
        torch_linear(_L + "fc", "blocks/fc"),
        hf_conv1d(_L + "proj", "blocks/proj"),
        torch_layer_norm(_L + "ln", "blocks/ln"),
    )
    file = _arrays({f"h.{i}.{n}": s for i in range(3) for n, s in _PER_LAYER.items()})
    model, back = _round_trip(rules, file)
    for i in range(3):
        assert np.array_equal(model["blocks/fc/kernel"][i], file[f"h.{i}.fc.weight"].T)
        assert np.array_equal(model["blocks/proj/kernel"][i], file[f"h.{i}.proj.weight"])
        assert np.array_equal(model["blocks/ln/scale"][i], file[f"h.{i}.ln.weight"])
    assert model["blocks/fc/kernel"].shape == (3, 5, 7)
    assert sorted(back) == sorted(file) and all(np.array_equal(back[k], file[k]) for k in file)


_PER_LAYER = {
    "fc.weight": (7, 5),
    "fc.bias": (7,),
    "proj.weight": (5, 2),
    "proj.bias": (2,),
    "ln.weight": (5,),
    "ln.bias": (5,),
}


def test_split_stacked_gives_separate_q_k_v_in_a_scanned_model_and_back() -> None:
    rules = Rules(split(_L + r"c_attn\.weight", [f"blocks/{n}/kernel" for n in "qkv"], axis=1, stacked=True))
    file = _arrays({f"h.{i}.c_attn.weight": (4, 12) for i in range(2)})
    model, back = _round_trip(rules, file)
    assert model["blocks/k/kernel"].shape == (2, 4, 4)
    assert np.array_equal(model["blocks/k/kernel"][1], file["h.1.c_attn.weight"][:, 4:8])
    assert sorted(back) == sorted(file) and all(np.array_equal(back[k], file[k]) for k in file)


def test_split_refuses_targets_that_ignore_the_layer_group() -> None:
    message = (
        'split(r"h\\.(?P<layer>\\d+)\\.qkv", (r"q", r"k"), axis=0): the pattern captures the layer index '
        "(?P<layer>...) but no target references it"
    )
    with pytest.raises(RuleError, match=re.escape(message)):
        split(_L + "qkv", ["q", "k"])


def test_many_conflicts_are_grouped_by_kind_with_a_hint() -> None:
    rules = Rules(rename(r"h\.(\d+)\.(\w+)", r"blocks/\2"))
    file = {f"h.{i}.{n}": ((2,), F32) for i in range(4) for n in "abc"}
    with raises_rule("conflict") as caught:
        rules.mapping(file)
    message = str(caught.value)
    lines = message.splitlines()
    assert lines[0] == "9 porting rule problems, 1 kind(s):"
    assert lines[1].startswith(
        '  `blocks/a`: produced twice, from `h.0.a` by rename(r"h\\.(\\d+)\\.(\\w+)", r"blocks/\\2")'
    )
    assert lines[1].endswith("(and 8 more like it, on `blocks/a`, `blocks/b`, `blocks/c`)")
    assert lines[2].startswith("hint: a target made twice often means a pattern captures an index")
    assert len(lines) == 3 and len(message) < 700


# --- sums and LSTMs -------------------------------------------------------------------------


def test_add_sums_on_load_and_exports_the_sum_and_zeros() -> None:
    rules = Rules(add((r"(\w+)\.bias_ih", r"(\w+)\.bias_hh"), r"\1/bias"))
    file = _arrays({"rnn.bias_ih": (8,), "rnn.bias_hh": (8,)})
    model, back = _round_trip(rules, file)
    np.testing.assert_array_equal(model["rnn/bias"], file["rnn.bias_ih"] + file["rnn.bias_hh"])
    np.testing.assert_array_equal(back["rnn.bias_ih"], model["rnn/bias"])
    np.testing.assert_array_equal(back["rnn.bias_hh"], np.zeros(8, np.float32))
    other = Rules(add((r"(\w+)\.bias_ih", r"(\w+)\.bias_hh"), r"\1/bias", into=1))
    moved = other.inverse().mapping(model).apply(model)
    assert np.array_equal(moved["rnn.bias_hh"], model["rnn/bias"]) and not moved["rnn.bias_ih"].any()


def test_add_names_a_missing_part() -> None:
    rules = Rules(add((r"(\w+)\.bias_ih", r"(\w+)\.bias_hh"), r"\1/bias"))
    with pytest.raises(RuleError, match=re.escape("`rnn/bias`: add(")):
        rules.mapping({"rnn.bias_ih": ((8,), F32)})


def test_add_export_refuses_parts_of_different_ranks() -> None:
    # the export once indexed past the shorter shape (an IndexError) instead of naming the parts
    rules = Rules(add((r"(\w+)\.bias_ih", r"(\w+)\.bias_hh"), (r"\1/a", r"\1/b"), axis=-1))
    message = "`rnn.bias_ih`: the inverse of add(("
    with pytest.raises(RuleError, match=re.escape(message) + ".*agree off axis -1, found \\[\\(2, 3\\), \\(2,\\)\\]"):
        rules.inverse().mapping({"rnn/a": ((2, 3), F32), "rnn/b": ((2,), F32)})


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("cell", ["lstm", "optimized"])
def test_torch_lstm_rules_reproduce_torch_lstm(cell: str) -> None:
    from flax import nnx

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 5, batch_first=True)
    file = {k: v.detach().numpy().copy() for k, v in lstm.state_dict().items()}
    rules = Rules(torch_lstm(r"lstm", "cell", cell=cell))
    file = {f"lstm.{k}": v for k, v in file.items()}
    model_state = rules.mapping(file).apply(file)
    kind = nnx.LSTMCell if cell == "lstm" else nnx.OptimizedLSTMCell
    flax_cell = kind(3, 5, rngs=nnx.Rngs(0))
    _, state = nnx.split(flax_cell)
    flat = dict(nnx.to_flat_state(state))
    assert sorted("cell/" + "/".join(map(str, p)) for p in flat) == sorted(model_state)
    nnx.update(
        flax_cell,
        nnx.from_flat_state([(p, v.replace(model_state["cell/" + "/".join(map(str, p))])) for p, v in flat.items()]),
    )
    x = RNG.standard_normal((2, 6, 3)).astype(np.float32)
    with torch.no_grad():
        expected = lstm(torch.from_numpy(x))[0].numpy()
    ours = nnx.RNN(flax_cell)(x)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5)
    back = rules.inverse().mapping(model_state).apply(model_state)
    lstm.load_state_dict({k.removeprefix("lstm."): torch.from_numpy(v) for k, v in back.items()}, strict=True)
    with torch.no_grad():
        np.testing.assert_allclose(lstm(torch.from_numpy(x))[0].numpy(), expected, rtol=1e-6, atol=1e-6)


def test_a_conv_kernel_kept_as_a_buffer_is_ported_by_torch_conv() -> None:
    filters = RNG.standard_normal((8, 1, 5)).astype(np.float32)  # (out, in, k), used with F.conv1d
    rules = Rules(torch_conv(r"frontend", "frontend/conv", spatial_dims=1, bias=False, weight="filters"))
    model, back = _round_trip(rules, {"frontend.filters": filters})
    np.testing.assert_array_equal(model["frontend/conv/kernel"], np.transpose(filters, (2, 1, 0)))
    np.testing.assert_array_equal(back["frontend.filters"], filters)


def test_the_new_rule_kinds_invert_back_to_themselves() -> None:
    rules = Rules(
        split(_L + "qkv", ["q", "k"], axis=1, stacked=True),
        add((r"(\w+)\.bias_ih", r"(\w+)\.bias_hh"), [r"\1/a", r"\1/b"]),
        tie(r"wte\.weight", "lm_head.weight", check=False),
        torch_lstm(r"lstm", "cell"),
    )
    twice = rules.inverse().inverse()
    # the same rules (the inverse lists structural rules first, then value rules)
    assert len(twice) == len(rules) and set(twice) == set(rules) and twice.direction == "load"
