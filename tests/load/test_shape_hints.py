"""Shape refusals name the fix: a file tensor that is the model's shape transposed gets
the transpose rule, a reshape of it the reshape rule, and an ambiguous one nothing; the
advice, followed, loads the file's values where they belong (property-tested)."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.load._hints import shape_fix
from nnx_save.porting import Rules, reshape, transpose

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


def _follow(fix: str, path: str, value: np.ndarray) -> np.ndarray:
    """The model's value after loading ``value`` through the suggested rule."""
    rules = Rules(eval(fix, {"transpose": transpose, "reshape": reshape}))  # the rule's own source text
    return rules.mapping({path: value}).apply({path: value})[path]


def _moving(shape, model):
    """The permutations that give ``model`` from ``shape`` and move an axis of size above one."""
    return [
        p
        for p in itertools.permutations(range(len(shape)))
        if tuple(shape[a] for a in p) == model
        and [a for a in p if shape[a] > 1] != sorted(a for a in p if shape[a] > 1)
    ]


def _refines(a, b):
    sa, sb = ({math.prod(s[i:]) for i in range(len(s))} for s in (a, b))
    return sa <= sb or sb <= sa


@settings(max_examples=200)
@given(shape=shapes, data=st.data())
def test_a_hint_followed_loads_the_file_tensor_as_the_model_holds_it(shape, data):
    """Over shapes and permutations: a suggested rule, followed, gives the file's tensor
    back in the model's layout (the permutation that built it); nothing is suggested
    only when two readings fit (two data-moving permutations, or one and a reshape)."""
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    model = tuple(shape[a] for a in perm)
    value = np.arange(math.prod(shape)).reshape(shape)
    fix = shape_fix("p", model, shape)
    if model == shape:
        return
    if fix is None:
        moving = _moving(shape, model)
        assert len(moving) > 1 or (len(moving) == 1 and _refines(shape, model))
        return
    got = _follow(fix, "p", value)
    assert got.shape == model and np.array_equal(got, np.transpose(value, perm))


@settings(max_examples=100)
@given(shape=shapes, cut=st.integers(0, 3))
def test_a_reshape_hint_splits_or_merges_axes_in_order(shape, cut):
    merged = (*shape[:cut], math.prod(shape[cut:])) if cut < len(shape) else shape
    fix = shape_fix("p", shape, merged)
    if merged == shape:
        return
    assert fix == f'reshape(r"p", {shape})'
    value = np.arange(math.prod(shape)).reshape(merged)
    assert np.array_equal(_follow(fix, "p", value), value.reshape(shape))


@pytest.mark.parametrize(
    "model, file",
    [((4, 4, 3), (3, 4, 4)), ((2, 3), (4, 5)), ((6, 4), (8, 3)), ((2, 2), (4,))],
)
def test_nothing_is_suggested_without_one_certain_rule(model, file):
    if model == (2, 2):  # (4,) -> (2, 2) refines: a reshape, the one reading
        assert shape_fix("p", model, file) == 'reshape(r"p", (2, 2))'
        return
    assert shape_fix("p", model, file) is None


class _Two(nnx.Module):
    def __init__(self) -> None:
        self.fc = nnx.Linear(3, 5, rngs=nnx.Rngs(0))
        self.proj = nnx.LinearGeneral(4, (2, 3), rngs=nnx.Rngs(0))


def test_a_strict_refusal_proposes_the_transpose_and_reshape_rules_that_load_it(tmp_path):
    fc = np.arange(15, dtype=np.float32).reshape(5, 3)  # torch's (out, in)
    proj = np.arange(24, dtype=np.float32).reshape(4, 6)  # heads merged
    bias = np.arange(5, dtype=np.float32)
    path = tmp_path / "m.safetensors"
    nnx_save.save_file(
        {"fc/kernel": fc, "fc/bias": bias, "proj/kernel": proj, "proj/bias": np.zeros((2, 3), np.float32)}, path
    )
    with pytest.raises(nnx_save.LoadError) as info:
        nnx_save.load_model(_Two(), path, strict=True)
    text = str(info.value)
    assert 'rules=Rules(transpose(r"fc/kernel", (1, 0)), reshape(r"proj/kernel", (4, 2, 3)))' in text
    assert text.index("rules=Rules(transpose") < text.index("allow_shape_mismatch")
    rules = Rules(transpose(r"fc/kernel", (1, 0)), reshape(r"proj/kernel", (4, 2, 3)))
    model, report = nnx_save.load_model(_Two(), path, strict=True, rules=rules)
    assert report.clean
    np.testing.assert_array_equal(model.fc.kernel.get_value(), fc.T)
    np.testing.assert_array_equal(model.proj.kernel.get_value(), proj.reshape(4, 2, 3))


def test_a_model_whose_every_tensor_is_transposed_gets_the_rule_not_a_configuration_question(tmp_path):
    path = tmp_path / "m.safetensors"
    nnx_save.save_file({"kernel": np.ones((5, 3), np.float32), "bias": np.ones(5, np.float32)}, path)
    with pytest.raises(nnx_save.LoadError, match=re.escape('rules=Rules(transpose(r"kernel", (1, 0)))')):
        nnx_save.load_model(nnx.Linear(3, 5, use_bias=False, rngs=nnx.Rngs(0)), path)


def test_docstring_examples_run():
    import doctest

    from nnx_save.load import _hints

    result = doctest.testmod(_hints)
    assert result.failed == 0 and result.attempted >= 3


def test_a_path_the_rules_already_transpose_gets_no_second_transpose(tmp_path):
    """torch_linear on a file that already holds (in, out) (an HF Conv1D): adding a
    transpose would be a table problem, refused under strict; the fix is the rule itself,
    so nothing is proposed for that path. A plain rename's path still gets its hint."""
    from nnx_save.porting import rename, torch_linear

    path = tmp_path / "m.safetensors"
    nnx_save.save_file({"c.weight": np.ones((3, 5), np.float32), "d.weight": np.ones((5, 3), np.float32)}, path)

    class M(nnx.Module):
        def __init__(self):
            self.c = nnx.Linear(3, 5, use_bias=False, rngs=nnx.Rngs(0))
            self.d = nnx.Linear(3, 5, use_bias=False, rngs=nnx.Rngs(0))

    rules = Rules(torch_linear(r"c", "c", bias=False), rename(r"d\.weight", "d/kernel"))
    with pytest.raises(nnx_save.LoadError) as info:
        nnx_save.load_model(M(), path, rules=rules, strict=True)
    assert info.value.report.suggested_shape_rules == ['transpose(r"d/kernel", (1, 0))']
    assert 'rules=Rules(transpose(r"d/kernel", (1, 0)))' in str(info.value)
    assert 'transpose(r"c/kernel"' not in str(info.value).split("To accept them")[0]
