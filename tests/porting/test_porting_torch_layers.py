"""Each ``torch_*`` helper against torch: one torch layer with trained-looking values,
saved as torch saves it, loaded strictly through the helper into the flax module the
docs' table names, outputs compared with torch's; exported back and loaded into torch
strictly, giving torch's outputs again."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from _nnx_helpers import poison
from flax import nnx

import nnx_save
from nnx_save.porting import (
    RuleError,
    Rules,
    torch_batch_norm,
    torch_conv,
    torch_conv_transpose,
    torch_embedding,
    torch_group_norm,
    torch_gru,
    torch_layer_norm,
    torch_linear,
    torch_lstm,
    torch_weight_norm,
)

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOLERANCE = 1e-5  # max |ours - torch| <= TOLERANCE * max |torch|, fp32
WEIGHTS = (nnx.Param, nnx.BatchStat)  # not an RNN's rngs


class Wrap(nnx.Module):
    """The flax layer at path ``m`` (the torch layer is ``m`` too)."""

    def __init__(self, layer: Any) -> None:
        self.m = layer


@dataclass
class Case:
    torch_layer: Callable[[], Any]
    flax_layer: Callable[[nnx.Rngs], Any]
    rules: Callable[[], Rules]
    x: tuple[int, ...]  # torch input shape (channels first where torch has them)
    to_flax: Callable[[np.ndarray], Any] = lambda x: x  # torch input -> flax input
    ours: Callable[[Any, Any], Any] = lambda m, x: m(x)  # flax layer, input -> torch's layout
    theirs: Callable[[Any, Any], Any] = lambda m, x: m(x)
    integer: bool = False


def _cl(x):  # channels first -> channels last
    return np.moveaxis(x, 1, -1)


def _cf(y):  # channels last -> channels first
    return np.moveaxis(np.asarray(y), -1, 1)


def _rnn(m, x):
    return m(x)


def _torch_rnn(m, x):
    return m(x)[0]


def _stacked_gru(r):
    def both(n):
        return nnx.Bidirectional(nnx.RNN(nnx.GRUCell(n, 4, rngs=r)), nnx.RNN(nnx.GRUCell(n, 4, rngs=r)))

    return nnx.List([both(3), both(8)])


def _through(m, x):
    for layer in m:
        x = layer(x)
    return x


def _wn_linear():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nn.utils.weight_norm(torch.nn.Linear(4, 3))


CASES = {
    "Linear": Case(
        lambda: torch.nn.Linear(4, 3),
        lambda r: nnx.Linear(4, 3, rngs=r),
        lambda: Rules(torch_linear(r"m", "m")),
        (2, 4),
    ),
    "Conv1d": Case(
        lambda: torch.nn.Conv1d(3, 4, 3, padding=1),
        lambda r: nnx.Conv(3, 4, (3,), padding=((1, 1),), rngs=r),
        lambda: Rules(torch_conv(r"m", "m", spatial_dims=1)),
        (2, 3, 6),
        _cl,
        lambda m, x: _cf(m(x)),
    ),
    "Conv2d": Case(
        lambda: torch.nn.Conv2d(3, 4, (3, 2), padding=(1, 0)),
        lambda r: nnx.Conv(3, 4, (3, 2), padding=((1, 1), (0, 0)), rngs=r),
        lambda: Rules(torch_conv(r"m", "m", spatial_dims=2)),
        (2, 3, 5, 4),
        _cl,
        lambda m, x: _cf(m(x)),
    ),
    "Conv3d": Case(
        lambda: torch.nn.Conv3d(2, 3, 2),
        lambda r: nnx.Conv(2, 3, (2, 2, 2), padding="VALID", rngs=r),
        lambda: Rules(torch_conv(r"m", "m", spatial_dims=3)),
        (1, 2, 3, 4, 3),
        _cl,
        lambda m, x: _cf(m(x)),
    ),
    "ConvTranspose1d": Case(
        lambda: torch.nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1),
        lambda r: nnx.ConvTranspose(2, 3, (3,), strides=(2,), padding=((1, 1),), transpose_kernel=True, rngs=r),
        lambda: Rules(torch_conv_transpose(r"m", "m", spatial_dims=1)),
        (2, 2, 5),
        _cl,
        lambda m, x: _cf(m(x)),
    ),
    "ConvTranspose2d": Case(
        lambda: torch.nn.ConvTranspose2d(2, 3, (3, 2)),
        lambda r: nnx.ConvTranspose(2, 3, (3, 2), padding=((2, 2), (1, 1)), transpose_kernel=True, rngs=r),
        lambda: Rules(torch_conv_transpose(r"m", "m")),
        (2, 2, 4, 3),
        _cl,
        lambda m, x: _cf(m(x)),
    ),
    "GroupNorm": Case(
        lambda: torch.nn.GroupNorm(2, 4),
        lambda r: nnx.GroupNorm(4, num_groups=2, epsilon=1e-5, rngs=r),
        lambda: Rules(torch_group_norm(r"m", "m")),
        (2, 4, 5),
        _cl,
        lambda m, x: _cf(m(x)),
    ),
    "LayerNorm": Case(
        lambda: torch.nn.LayerNorm(4),
        lambda r: nnx.LayerNorm(4, epsilon=1e-5, rngs=r),
        lambda: Rules(torch_layer_norm(r"m", "m")),
        (2, 3, 4),
    ),
    "BatchNorm2d": Case(
        lambda: torch.nn.BatchNorm2d(3),
        lambda r: nnx.BatchNorm(3, use_running_average=True, epsilon=1e-5, momentum=0.9, rngs=r),
        lambda: Rules(torch_batch_norm(r"m", "m")),
        (2, 3, 4, 4),
        _cl,
        lambda m, x: _cf(m(x)),
    ),
    "Embedding": Case(
        lambda: torch.nn.Embedding(7, 3),
        lambda r: nnx.Embed(7, 3, rngs=r),
        lambda: Rules(torch_embedding(r"m", "m")),
        (2, 5),
        integer=True,
    ),
    "LSTM": Case(
        lambda: torch.nn.LSTM(3, 4, batch_first=True),
        lambda r: nnx.RNN(nnx.LSTMCell(3, 4, rngs=r)),
        lambda: Rules(torch_lstm(r"m", "m/cell")),
        (2, 5, 3),
        ours=_rnn,
        theirs=_torch_rnn,
    ),
    "GRU": Case(
        lambda: torch.nn.GRU(3, 4, batch_first=True),
        lambda r: nnx.RNN(nnx.GRUCell(3, 4, rngs=r)),
        lambda: Rules(torch_gru(r"m", "m/cell")),
        (2, 5, 3),
        ours=_rnn,
        theirs=_torch_rnn,
    ),
    "GRU 2 layers bidirectional": Case(
        lambda: torch.nn.GRU(3, 4, num_layers=2, bidirectional=True, batch_first=True),
        _stacked_gru,
        lambda: Rules(torch_gru(r"m", "m/{layer}/{direction}/cell", layers=2, bidirectional=True)),
        (2, 5, 3),
        ours=_through,
        theirs=_torch_rnn,
    ),
    "weight norm": Case(
        _wn_linear, lambda r: nnx.Linear(4, 3, rngs=r), lambda: Rules(torch_weight_norm(r"m", "m")), (2, 4)
    ),
}


class TorchWrap(torch.nn.Module):
    def __init__(self, layer) -> None:
        super().__init__()
        self.m = layer


def _trained(case: Case, name: str):
    torch.manual_seed(0)
    net = TorchWrap(case.torch_layer())
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))  # biases and scales off their initial values
        for b_name, b in net.named_buffers():
            if "running_mean" in b_name:
                b.uniform_(-0.5, 0.5)
            elif "running_var" in b_name:
                b.uniform_(0.5, 2.0)
        for p_name, p in net.named_parameters():
            if name.startswith("GRU") and ".bias_hh" in p_name:  # nnx.GRUCell has no hidden bias for gate n
                p[2 * 4 :] = 0  # (torch_gru refuses a GRU that has one)
    return net.eval()


def _input(case: Case) -> np.ndarray:
    rng = np.random.default_rng(1)
    if case.integer:
        return rng.integers(0, 7, case.x)
    return rng.standard_normal(case.x).astype(np.float32)


def _theirs(case: Case, net, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return np.asarray(case.theirs(net.m, torch.from_numpy(x)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_helper_ports_the_torch_layer_and_exports_it_back(name, tmp_path):
    case = CASES[name]
    net = _trained(case, name)
    source = tmp_path / "torch.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in net.state_dict().items()}, source)
    model = poison(Wrap(case.flax_layer(nnx.Rngs(0))))
    _, report = nnx_save.load_model(model, source, rules=case.rules(), strict=True, filter=WEIGHTS)
    assert report.clean
    x = _input(case)
    theirs = _theirs(case, net, x)
    ours = np.asarray(case.ours(model.m, jnp.asarray(case.to_flax(x))))
    assert ours.shape == theirs.shape
    assert np.max(np.abs(ours - theirs)) <= TOLERANCE * np.max(np.abs(theirs))

    exported = tmp_path / "export.safetensors"
    nnx_save.save_model(model, exported, rules=case.rules().inverse(), filter=WEIGHTS)
    fresh = TorchWrap(case.torch_layer())
    fresh.load_state_dict(safetensors_torch.load_file(exported), strict=True)
    again = _theirs(case, fresh.eval(), x)
    assert np.max(np.abs(again - theirs)) <= TOLERANCE * np.max(np.abs(theirs))


def test_a_gru_with_a_hidden_bias_on_gate_n_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    net = TorchWrap(torch.nn.GRU(3, 4, batch_first=True))
    source = tmp_path / "gru.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in net.state_dict().items()}, source)
    with pytest.raises(
        nnx_save.NnxSaveError, match="`bias_hh_l0`: torch's GRU keeps a hidden bias on the candidate gate n"
    ) as info:
        nnx_save.load_model(
            Wrap(nnx.RNN(nnx.GRUCell(3, 4, rngs=nnx.Rngs(0)))),
            source,
            rules=Rules(torch_gru(r"m", "m/cell")),
            filter=WEIGHTS,
        )
    assert isinstance(info.value, RuleError) or isinstance(info.value.__cause__, RuleError)
