"""Strict loads that name the right fix: a renamed submodule gets the rename rule,
a bf16 checkpoint into an f32 model gets ``allow_casts`` (key checks kept)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.porting import Rules, rename


class Net(nnx.Module):
    """Two Linear layers under a submodule whose name the test chooses."""

    def __init__(self, name: str, dtype=jnp.float32, *, rngs: nnx.Rngs) -> None:
        layers = nnx.List(
            [nnx.Linear(3, 4, param_dtype=dtype, rngs=rngs), nnx.Linear(4, 2, param_dtype=dtype, rngs=rngs)]
        )
        setattr(self, name, layers)
        self.head = nnx.Linear(2, 5, param_dtype=dtype, rngs=rngs)


def _poisoned(name: str, dtype=jnp.float32) -> Net:
    model = Net(name, dtype, rngs=nnx.Rngs(1))
    for _, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(jnp.full(var.shape, 7.0, var.dtype))
    return model


def _arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture
def body_file(tmp_path):
    model = Net("body", rngs=nnx.Rngs(0))
    path = tmp_path / "body.safetensors"
    nnx_save.save_model(model, path)
    return path, _arrays(model)


def test_a_renamed_submodule_is_answered_with_the_rename_rule(body_file) -> None:
    path, _ = body_file
    with pytest.raises(nnx_save.LoadError) as raised:
        nnx_save.load_model(_poisoned("encoder"), path, strict=True)
    message = str(raised.value)
    assert 'rules=Rules(rename(r"body/(.*)", r"encoder/\\1"))' in message
    # the rename comes first, before the options that would accept random weights
    assert message.index("rules=Rules(") < message.index("allow_missing=")


def test_the_suggested_rename_loads_strictly_and_exactly(body_file) -> None:
    path, saved = body_file
    model, report = nnx_save.load_model(
        _poisoned("encoder"), path, strict=True, rules=Rules(rename(r"body/(.*)", r"encoder/\1"))
    )
    loaded = _arrays(model)
    assert report.clean
    assert all(np.array_equal(loaded[k.replace("body/", "encoder/")], v) for k, v in saved.items())


def test_no_rename_is_proposed_when_shapes_differ(tmp_path) -> None:
    nnx_save.save_file({"body": {"w": np.zeros((2, 3), np.float32)}}, tmp_path / "a.safetensors")
    with pytest.raises(nnx_save.LoadError) as raised:
        nnx_save.load_file(tmp_path / "a.safetensors", {"encoder": {"w": np.zeros((3, 2), np.float32)}}, strict=True)
    assert "rename(" not in str(raised.value)


@pytest.fixture
def bf16_file(tmp_path):
    model = Net("body", jnp.bfloat16, rngs=nnx.Rngs(0))
    path = tmp_path / "bf16.safetensors"
    nnx_save.save_model(model, path)
    return path, _arrays(model)


def test_strict_bf16_into_f32_names_allow_casts_lossless(bf16_file) -> None:
    path, _ = bf16_file
    message = (
        'allow_casts="lossless" (every cast here is lossless: the values load exactly; strict key and shape checks '
        "stay on)"
    )
    with pytest.raises(nnx_save.LoadError, match=re.escape(message)):
        nnx_save.load_model(_poisoned("body"), path, strict=True)


def test_allow_casts_lossless_keeps_strict_key_checks_and_loads_exactly(bf16_file) -> None:
    path, saved = bf16_file
    model, report = nnx_save.load_model(_poisoned("body"), path, strict=True, allow_casts="lossless")
    loaded = _arrays(model)
    assert report.clean and len(report.allowed_casts) == len(saved)
    assert all(
        loaded[k].dtype == np.float32 and np.array_equal(loaded[k], v.astype(np.float32)) for k, v in saved.items()
    )
    with pytest.raises(nnx_save.LoadError, match=re.escape("missing: encoder/0/bias")):
        nnx_save.load_model(_poisoned("encoder"), path, strict=True, allow_casts="lossless")


def test_lossless_does_not_accept_a_lossy_cast_but_a_named_path_does(tmp_path) -> None:
    nnx_save.save_model(Net("body", rngs=nnx.Rngs(0)), tmp_path / "f32.safetensors")
    with pytest.raises(nnx_save.LoadError, match=re.escape("allow_casts=['body/0/bias', 'body/0/kernel',")):
        nnx_save.load_model(
            _poisoned("body", jnp.bfloat16), tmp_path / "f32.safetensors", strict=True, allow_casts="lossless"
        )
    _, report = nnx_save.load_model(
        _poisoned("body", jnp.bfloat16), tmp_path / "f32.safetensors", strict=True, allow_casts=[".*"]
    )
    assert report.clean and all(c.lossy for c in report.allowed_casts)


def test_allow_casts_refuses_another_word(bf16_file) -> None:
    path, _ = bf16_file
    with pytest.raises(
        nnx_save.LoadError, match=re.escape("allow_casts takes \"lossless\" or a list of path patterns, got 'safe'")
    ):
        nnx_save.load_model(_poisoned("body"), path, strict=True, allow_casts="safe")
