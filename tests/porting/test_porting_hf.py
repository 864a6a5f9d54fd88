"""The HF / torch convention helpers, checked against torch modules themselves."""

from __future__ import annotations

import doctest

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from porting_support import abstract, fill

import nnx_save.porting
from nnx_save.porting import (
    Rules,
    hf_conv1d,
    rename,
    shapes_of,
    torch_conv,
    torch_embedding,
    torch_layer_norm,
    torch_linear,
    torch_rms_norm,
    transpose,
)

torch = pytest.importorskip("torch")


def _state(module: object) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def test_helpers_make_the_documented_rules() -> None:
    weight = rename(r"h\.(\d+)\.fc\.weight", r"h/\1/fc/kernel")
    assert torch_linear(r"h\.(\d+)\.fc", r"h/\1/fc") == (
        weight,
        transpose(r"h/(\d+)/fc/kernel", (1, 0), of=weight),  # it transposes only what `weight` makes
        rename(r"h\.(\d+)\.fc\.bias", r"h/\1/fc/bias"),
    )
    assert hf_conv1d("c", "c", bias=False) == (rename(r"c\.weight", "c/kernel"),)
    assert torch_embedding("e", "e") == (rename(r"e\.weight", "e/embedding"),)
    assert torch_layer_norm("n", "n") == (rename(r"n\.weight", "n/scale"), rename(r"n\.bias", "n/bias"))
    assert torch_rms_norm("n", "n") == (rename(r"n\.weight", "n/scale"),)
    conv = torch_conv("p", "p", spatial_dims=1, bias=False)
    assert conv[1] == transpose("p/kernel", (2, 1, 0), of=conv[0])


def test_torch_linear_rules_reproduce_torch_linear() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 5)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    tensors = {f"fc.{k}": v for k, v in _state(linear).items()}
    mapping = Rules(torch_linear(r"fc", "fc")).mapping(shapes_of(tensors))
    model = abstract(lambda: nnx.Linear(3, 5, rngs=nnx.Rngs(0)))
    ours = fill(model, {k.removeprefix("fc/"): v for k, v in mapping.apply(tensors).items()})
    np.testing.assert_allclose(ours(jnp.asarray(x)), linear(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_torch_conv_rules_reproduce_torch_conv2d() -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, kernel_size=(2, 3), stride=(2, 1))
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 7)).astype(np.float32)
    tensors = {f"conv.{k}": v for k, v in _state(conv).items()}
    mapping = Rules(torch_conv(r"conv", "conv")).mapping(shapes_of(tensors))
    model = abstract(lambda: nnx.Conv(3, 4, (2, 3), strides=(2, 1), padding="VALID", rngs=nnx.Rngs(0)))
    ours = fill(model, {k.removeprefix("conv/"): v for k, v in mapping.apply(tensors).items()})
    expected = conv(torch.from_numpy(x)).detach().numpy().transpose(0, 2, 3, 1)
    np.testing.assert_allclose(ours(jnp.asarray(x.transpose(0, 2, 3, 1))), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "module",
    [m for m in vars(nnx_save.porting).values() if getattr(m, "__name__", "").startswith("nnx_save.porting")]
    + [nnx_save.porting],
    ids=lambda m: m.__name__,
)
def test_docstring_examples_run(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, raise_on_error=False)
    assert result.failed == 0
