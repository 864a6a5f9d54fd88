"""Every ``flax.nnx`` module class that holds state saves and loads exactly, strict: the
classes are drawn from ``flax.nnx`` itself, so a new one fails here until it is built
below. Flax's own containers keep keys that are not strings (``nnx.WeightNorm``'s
``scales[('kernel',)]``, ``nnx.SpectralNorm``'s ``batch_stats[('kernel', 'sigma')]``):
the tuple rule of ``format/_paths.py`` writes them as their literal."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import pytest
from _nnx_helpers import assert_same_state, poison, snapshot
from flax import nnx

import nnx_save


def _lora(r: nnx.Rngs) -> nnx.Module:
    return nnx.LoRA(3, 2, 4, rngs=r)


BUILD: dict[str, Callable[[nnx.Rngs], Any]] = {
    "Dict": lambda r: nnx.Dict(a=nnx.Linear(2, 3, rngs=r), b=nnx.Param(jax.numpy.ones(2))),
    "List": lambda r: nnx.List([nnx.Linear(2, 3, rngs=r), nnx.Linear(3, 2, rngs=r)]),
    "Sequential": lambda r: nnx.Sequential(nnx.Linear(2, 3, rngs=r), nnx.Linear(3, 2, rngs=r)),
    "PReLU": lambda r: nnx.PReLU(),
    "MultiHeadAttention": lambda r: nnx.MultiHeadAttention(2, 4, qkv_features=4, decode=False, rngs=r),
    "LSTMCell": lambda r: nnx.LSTMCell(2, 3, rngs=r),
    "GRUCell": lambda r: nnx.GRUCell(2, 3, rngs=r),
    "OptimizedLSTMCell": lambda r: nnx.OptimizedLSTMCell(2, 3, rngs=r),
    "SimpleCell": lambda r: nnx.SimpleCell(2, 3, rngs=r),
    "RNN": lambda r: nnx.RNN(nnx.GRUCell(2, 3, rngs=r)),
    "Bidirectional": lambda r: nnx.Bidirectional(
        nnx.RNN(nnx.GRUCell(2, 3, rngs=r)), nnx.RNN(nnx.GRUCell(2, 3, rngs=r))
    ),
    "Conv": lambda r: nnx.Conv(2, 3, (3, 3), rngs=r),
    "ConvTranspose": lambda r: nnx.ConvTranspose(2, 3, (3,), rngs=r),
    "Embed": lambda r: nnx.Embed(5, 3, rngs=r),
    "Linear": lambda r: nnx.Linear(2, 3, rngs=r),
    "LinearGeneral": lambda r: nnx.LinearGeneral((2, 3), 4, axis=(-2, -1), rngs=r),
    "Einsum": lambda r: nnx.Einsum("ab,bc->ac", (2, 3), (3,), rngs=r),
    "LoRA": _lora,
    "LoRALinear": lambda r: nnx.LoRALinear(3, 2, lora_rank=2, rngs=r),
    "BatchNorm": lambda r: nnx.BatchNorm(3, rngs=r),
    "LayerNorm": lambda r: nnx.LayerNorm(3, rngs=r),
    "RMSNorm": lambda r: nnx.RMSNorm(3, rngs=r),
    "GroupNorm": lambda r: nnx.GroupNorm(4, num_groups=2, rngs=r),
    "InstanceNorm": lambda r: nnx.InstanceNorm(3, rngs=r),
    "SpectralNorm": lambda r: nnx.SpectralNorm(nnx.Linear(3, 4, rngs=r), rngs=r),
    "WeightNorm": lambda r: nnx.WeightNorm(nnx.Linear(3, 4, rngs=r), rngs=r),
    "Dropout": lambda r: nnx.Dropout(0.5, rngs=r),
}
STATELESS = {"Module", "RNNCellBase"}  # the base classes: nothing to build, nothing held


def _classes() -> list[str]:
    return sorted(n for n, c in vars(nnx).items() if inspect.isclass(c) and issubclass(c, nnx.Module))


def test_every_flax_module_class_is_built_here():
    """A class flax adds (or a name this list lacks) fails: the sweep covers them all."""
    assert set(_classes()) - STATELESS == set(BUILD)


@pytest.mark.parametrize("name", sorted(BUILD))
def test_flax_module_state_round_trips_exactly_and_strictly(name, tmp_path):
    model = BUILD[name](nnx.Rngs(0))
    assert jax.tree.leaves(nnx.state(model)), f"{name} holds no state: drop it from the sweep"
    path = tmp_path / "m.safetensors"
    nnx_save.save_model(model, path)
    expected = snapshot(model)
    target = poison(BUILD[name](nnx.Rngs(1)))
    _, report = nnx_save.load_model(target, path, strict=True)
    assert report.clean
    assert_same_state(expected, snapshot(target))


def test_tuple_keys_are_written_as_their_literal_and_read_back(tmp_path):
    """``nnx.WeightNorm`` keeps ``scales[('kernel',)]``: the file key is that literal, and
    a pytree load returns it under the same key, the one the model's path makes."""
    from nnx_save.format._paths import to_key

    model = BUILD["WeightNorm"](nnx.Rngs(0))
    nnx_save.save_model(model, tmp_path / "wn.safetensors")
    keys = sorted(nnx_save.read_header(tmp_path / "wn.safetensors").tensors)
    assert keys == ["layer_instance/bias", "layer_instance/kernel", "scales/('kernel',)"]
    assert to_key(("scales", ("kernel",))) == keys[-1]


RAW_ARRAYS = {"WeightNorm"}  # keeps plain arrays outside Variables, which nnx.eval_shape drops from the state


@pytest.mark.parametrize("name", sorted(set(BUILD) - RAW_ARRAYS))
def test_flax_module_state_loads_exactly_through_a_builder(name, tmp_path):
    model = BUILD[name](nnx.Rngs(0))
    path = tmp_path / "m.safetensors"
    nnx_save.save_model(model, path)
    built, report = nnx_save.load_model(lambda: BUILD[name](nnx.Rngs(1)), path, strict=True)
    assert report.clean
    assert_same_state(snapshot(model), snapshot(built))


@pytest.mark.parametrize("name", sorted(RAW_ARRAYS))
def test_a_builder_that_keeps_plain_arrays_is_refused_loudly_not_filled_silently(name, tmp_path):
    """Under ``nnx.eval_shape`` a plain array attribute is no state, so a builder's model
    has no place for it: a strict load names the key (load into an instance instead)."""
    path = tmp_path / "m.safetensors"
    nnx_save.save_model(BUILD[name](nnx.Rngs(0)), path)
    with pytest.raises(nnx_save.LoadError, match=re.escape("unexpected: scales/('kernel',)")):
        nnx_save.load_model(lambda: BUILD[name](nnx.Rngs(1)), path, strict=True)
