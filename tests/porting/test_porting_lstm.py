"""A conv + LSTM speech-style model, plain torch: a fixed filter bank kept as a buffer
(applied with ``F.conv1d``), a conv + BatchNorm, a two-layer ``nn.LSTM`` and a linear
head, ported into NNX (``nnx.Conv``, ``nnx.BatchNorm``, ``nnx.RNN`` over
``nnx.LSTMCell`` or ``nnx.OptimizedLSTMCell``) through ``load_model`` with rules
only, compared with torch, exported and loaded back into torch strictly."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from porting_support import max_abs_diff

import nnx_save
from nnx_save.porting import Rules, torch_batch_norm, torch_conv, torch_linear, torch_lstm

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOLERANCE = 1e-4  # max |ours - torch| <= TOLERANCE * max |torch logits|, fp32
HIDDEN, FILTERS, CHANNELS, LABELS = 16, 8, 12, 10


class Frontend(torch.nn.Module):
    """A fixed filter bank: a buffer, not a conv module's ``weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("filters", torch.randn(FILTERS, 1, 5))

    def forward(self, x):
        return torch.nn.functional.conv1d(x, self.filters, stride=2)


class TorchSpeech(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frontend = Frontend()
        self.conv = torch.nn.Conv1d(FILTERS, CHANNELS, 3, padding=1)
        self.bn = torch.nn.BatchNorm1d(CHANNELS)
        self.lstm = torch.nn.LSTM(CHANNELS, HIDDEN, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(HIDDEN, LABELS)

    def forward(self, x):  # (batch, 1, time)
        x = torch.relu(self.bn(self.conv(self.frontend(x))))
        y, _ = self.lstm(x.transpose(1, 2))
        return self.head(y)


def _torch_model(seed: int) -> TorchSpeech:
    torch.manual_seed(seed)
    model = TorchSpeech()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # biases off zero: a dropped one shows
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.num_batches_tracked.fill_(100)
    return model.eval()


class Speech(nnx.Module):
    def __init__(self, cell: type, *, rngs: nnx.Rngs) -> None:
        self.frontend = nnx.Conv(1, FILTERS, (5,), strides=(2,), padding="VALID", use_bias=False, rngs=rngs)
        self.conv = nnx.Conv(FILTERS, CHANNELS, (3,), padding=((1, 1),), rngs=rngs)
        self.bn = nnx.BatchNorm(CHANNELS, use_running_average=True, epsilon=1e-5, momentum=0.9, rngs=rngs)
        self.rnn = nnx.List([nnx.RNN(cell(n, HIDDEN, rngs=rngs)) for n in (CHANNELS, HIDDEN)])
        self.head = nnx.Linear(HIDDEN, LABELS, rngs=rngs)

    def __call__(self, x):  # (batch, time, 1)
        x = nnx.relu(self.bn(self.conv(self.frontend(x))))
        for rnn in self.rnn:
            x = rnn(x)
        return self.head(x)


def speech_rules(cell: str) -> Rules:
    return Rules(
        torch_conv(r"frontend", "frontend", spatial_dims=1, bias=False, weight="filters"),
        torch_conv(r"conv", "conv", spatial_dims=1),
        torch_batch_norm(r"bn", "bn"),
        *(torch_lstm(r"lstm", f"rnn/{i}/cell", layer=i, cell=cell) for i in range(2)),
        torch_linear(r"head", "head"),
    )


CELLS = {"lstm": nnx.LSTMCell, "optimized": nnx.OptimizedLSTMCell}
WEIGHTS = nnx.Not(nnx.RngState)  # nnx.RNN's carry rng stream has no torch counterpart
FORWARD = nnx.jit(lambda model, x: model(x))


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_conv_lstm_ports_through_the_rules_and_back_into_torch_strictly(cell: str, tmp_path) -> None:
    source = _torch_model(0)
    path = tmp_path / "speech.safetensors"
    safetensors_torch.save_file(source.state_dict(), path)
    rules = speech_rules(cell)
    builder = lambda: Speech(CELLS[cell], rngs=nnx.Rngs(0))  # noqa: E731
    model, report = nnx_save.load_model(builder, path, rules=rules, strict=True, filter=WEIGHTS)
    assert report.clean and report.unexpected == []

    x = np.random.default_rng(0).standard_normal((2, 1, 40)).astype(np.float32)
    with torch.no_grad():
        expected = source(torch.from_numpy(x)).numpy()
    ours = np.asarray(FORWARD(model, np.transpose(x, (0, 2, 1))))
    diff, scale = max_abs_diff(ours, expected)
    print(f"conv+lstm/{cell}: max abs diff {diff:.3g}, max |logits| {scale:.3g}")
    assert diff <= TOLERANCE * scale

    out = tmp_path / "export.safetensors"
    nnx_save.save_model(model, out, rules=rules.inverse(), filter=WEIGHTS)
    again = _torch_model(1)  # other values everywhere: a no-op load would show
    again.load_state_dict(safetensors_torch.load_file(out), strict=True)
    with torch.no_grad():
        back = again(torch.from_numpy(x)).numpy()
    # the two LSTM biases come back as their sum and zeros: the same numbers, summed
    # in another order
    np.testing.assert_allclose(back, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    exported = safetensors_torch.load_file(out)
    assert not exported["lstm.bias_hh_l1"].any()
    np.testing.assert_array_equal(exported["frontend.filters"].numpy(), source.frontend.filters.numpy())
