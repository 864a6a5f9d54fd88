"""Round trips a newcomer reaches for: what ``load_file`` returns saves back
under the same keys, and ``save_file(nnx.state(model))`` writes the keys ``load_model``
reads, so a strict load fills the model."""

import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nnx_helpers import assert_differs, assert_same_state, poison, snapshot
from flax import nnx
from hypothesis import given, settings

import nnx_save

names = st.text(st.sampled_from("ab_.0"), min_size=1, max_size=3)
arrays = st.builds(lambda n, d: np.arange(n, dtype=d), st.integers(0, 4), st.sampled_from([np.float32, np.int8]))
trees = st.recursive(
    arrays,
    lambda inner: st.dictionaries(names, inner, min_size=1, max_size=3) | st.lists(inner, min_size=1, max_size=3),
    max_leaves=6,
)


@settings(max_examples=25)
@given(tree=st.dictionaries(names, trees, min_size=1, max_size=3))
def test_what_load_file_returns_saves_back_under_the_same_keys(tree, tmp_path_factory):
    """save_file(load_file(p), q): the flat dict of file keys (``a/0/b``) is written
    as those keys, each tensor's bytes unchanged."""
    d = tmp_path_factory.mktemp("rt")
    nnx_save.save_file(tree, d / "p.safetensors")
    flat = nnx_save.load_file(d / "p.safetensors")
    nnx_save.save_file(flat, d / "q.safetensors")
    again = nnx_save.load_file(d / "q.safetensors")
    assert list(again) == list(flat)
    for key, value in flat.items():
        assert again[key].dtype == value.dtype and again[key].tobytes() == value.tobytes(), key


def test_a_flat_mapping_with_an_empty_key_segment_is_refused_naming_it(tmp_path):
    with pytest.raises(nnx_save.KeyPathError, match=re.escape("'a//b': a file key with an empty name")):
        nnx_save.save_file({"a//b": np.ones(2, np.float32)}, tmp_path / "x.safetensors")


class _Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(2, 3, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(3, 3, rngs=rngs)])
        self.rngs = rngs
        self.count = nnx.Variable(7)  # a Python scalar


@pytest.mark.parametrize("what", ["state", "model", "dict of states"])
def test_save_file_of_nnx_state_loads_strictly_into_a_model(tmp_path, what):
    """save_file(nnx.state(model)) writes the model's keys, as save_model does, not
    ``lin/kernel/value`` (which a strict load_model would find nothing under)."""
    model = _Model(nnx.Rngs(0))
    tree = {"state": nnx.state(model), "model": model, "dict of states": {"m": nnx.state(model)}}[what]
    nnx_save.save_file(tree, tmp_path / "s.safetensors")
    keys = sorted(nnx_save.read_header(tmp_path / "s.safetensors"))
    prefix = "m/" if what == "dict of states" else ""
    want = [
        "blocks/0/bias",
        "blocks/0/kernel",
        "count",
        "lin/bias",
        "lin/kernel",
        "rngs/default/count",
        "rngs/default/key",
    ]
    assert keys == [prefix + k for k in want]
    if prefix:
        return
    target = poison(_Model(nnx.Rngs(1)))
    assert_differs(snapshot(model), snapshot(target))
    _, report = nnx_save.load_model(target, tmp_path / "s.safetensors", strict=True)
    assert report.clean and len(report.loaded) == 7
    assert_same_state(snapshot(model), snapshot(target))
    assert type(target.count.get_value()) is int


def test_save_file_of_a_state_with_a_typed_key_records_its_implementation(tmp_path):
    model = _Model(nnx.Rngs(jax.random.key(3, impl="rbg")))
    nnx_save.save_file(nnx.state(model), tmp_path / "s.safetensors")
    target = poison(_Model(nnx.Rngs(jax.random.key(0, impl="rbg"))))
    nnx_save.load_model(target, tmp_path / "s.safetensors", strict=True)
    got, want = target.rngs.default.key.get_value(), model.rngs.default.key.get_value()
    assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want)) == "rbg"
    assert jnp.array_equal(jax.random.key_data(got), jax.random.key_data(want))
