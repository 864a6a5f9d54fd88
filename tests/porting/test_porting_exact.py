"""Exports that reproduce the source file byte for byte: checkpoints written
here by torch are loaded through rules only into poisoned NNX models, compared with
torch, exported against the source file (``rules.inverse(source=path)``), and then every
source tensor must come back with its exact bytes and torch's
``load_state_dict(strict=True)`` must take the export as it is."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from porting_support import max_abs_diff

import nnx_save
from nnx_save.porting import Rules, ignore, torch_batch_norm, torch_conv, torch_linear, torch_lstm

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOLERANCE = 1e-5  # max |ours - torch| <= TOLERANCE * max |torch|, fp32
WEIGHTS = nnx.Not(nnx.RngState)  # nnx.RNN's carry rng stream has no torch counterpart
IN, HIDDEN, OUT = 6, 8, 5


def _off_zero(module, seed: int):
    """Every float parameter moved off its init (biases off zero: a dropped one shows)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module.eval()


def _poisoned(model: nnx.Module) -> nnx.Module:
    """Every weight and statistic a constant: a no-op load fails the comparisons."""
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))):
        v.set_value(jnp.full(v.get_value().shape, 7.0, v.get_value().dtype))
    return model


def _save(module, path) -> dict[str, np.ndarray]:
    safetensors_torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, path)
    return safetensors.numpy.load_file(path)


def _assert_reproduced(source: dict[str, np.ndarray], path) -> dict[str, np.ndarray]:
    """Every source tensor in the export, with its dtype, shape and exact bytes."""
    exported = safetensors.numpy.load_file(path)
    assert sorted(exported) == sorted(source)
    for key, value in source.items():
        got = exported[key]
        assert (got.dtype, got.shape) == (value.dtype, value.shape), key
        assert got.tobytes() == value.tobytes(), key
    return exported


def _strict_torch(fresh, exported: dict[str, np.ndarray]):
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=True)
    return fresh.eval()


def _close(ours, theirs) -> None:
    diff, scale = max_abs_diff(np.asarray(ours), theirs)
    print(f"max |ours - torch| {diff:.3g}, max |torch| {scale:.3g}")
    assert diff <= TOLERANCE * scale, (diff, scale)


# --- a 2-layer bidirectional nn.LSTM + Linear ------------------------------------------


class TorchTagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(IN, HIDDEN, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(2 * HIDDEN, OUT)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


class Tagger(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        def both(n: int) -> nnx.Bidirectional:
            return nnx.Bidirectional(
                nnx.RNN(nnx.LSTMCell(n, HIDDEN, rngs=rngs)), nnx.RNN(nnx.LSTMCell(n, HIDDEN, rngs=rngs))
            )

        self.lstm = nnx.List([both(IN), both(2 * HIDDEN)])
        self.head = nnx.Linear(2 * HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        for layer in self.lstm:
            x = layer(x)
        return self.head(x)


TAGGER_RULES = Rules(
    torch_lstm(r"lstm", "lstm/{layer}/{direction}/cell", layers=2, bidirectional=True),
    torch_linear(r"head", "head"),
)


@pytest.fixture
def tagger(tmp_path):
    source = _off_zero(TorchTagger(), 0)
    path = tmp_path / "tagger.safetensors"
    tensors = _save(source, path)
    model, report = nnx_save.load_model(
        _poisoned(Tagger(nnx.Rngs(0))), path, rules=TAGGER_RULES, strict=True, filter=WEIGHTS
    )
    assert report.clean and sorted(report.landed) == sorted(tensors)
    return source, path, tensors, model


def test_a_bidirectional_two_layer_lstm_exports_its_source_byte_for_byte(tagger, tmp_path) -> None:
    source, path, tensors, model = tagger
    x = np.random.default_rng(0).standard_normal((2, 7, IN)).astype(np.float32)
    with torch.no_grad():
        expected = source(torch.from_numpy(x)).numpy()
    _close(model(jnp.asarray(x)), expected)

    out = tmp_path / "export.safetensors"
    nnx_save.save_model(model, out, rules=TAGGER_RULES.inverse(source=path), filter=WEIGHTS)
    exported = _assert_reproduced(tensors, out)  # bias_ih and bias_hh as the file had them
    with torch.no_grad():
        assert np.array_equal(
            _strict_torch(_off_zero(TorchTagger(), 1), exported)(torch.from_numpy(x)).numpy(), expected
        )


def test_a_changed_lstm_bias_keeps_the_sources_second_bias(tagger, tmp_path) -> None:
    """A fine-tuned bias: ``bias_hh`` stays the file's, ``bias_ih`` takes the change."""
    _, path, tensors, model = tagger
    cell = model.lstm[1].backward_rnn.cell
    cell.hf.bias.set_value(cell.hf.bias.get_value() + 0.5)
    out = tmp_path / "tuned.safetensors"
    nnx_save.save_model(model, out, rules=TAGGER_RULES.inverse(source=path), filter=WEIGHTS)
    exported = safetensors.numpy.load_file(out)
    assert exported["lstm.bias_hh_l1_reverse"].tobytes() == tensors["lstm.bias_hh_l1_reverse"].tobytes()
    summed = exported["lstm.bias_ih_l1_reverse"] + exported["lstm.bias_hh_l1_reverse"]
    np.testing.assert_allclose(summed[HIDDEN : 2 * HIDDEN], np.asarray(cell.hf.bias.get_value()), rtol=0, atol=1e-6)
    changed = [k for k in tensors if exported[k].tobytes() != tensors[k].tobytes()]
    assert changed == ["lstm.bias_ih_l1_reverse"]


# --- an nn.LSTMCell ---------------------------------------------------------------------


class Cell(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.cell = nnx.LSTMCell(IN, HIDDEN, rngs=rngs)


def test_an_lstm_cell_exports_its_source_byte_for_byte(tmp_path) -> None:
    source = _off_zero(torch.nn.LSTMCell(IN, HIDDEN), 2)
    path = tmp_path / "cell.safetensors"
    tensors = _save(torch.nn.ModuleDict({"cell": source}), path)  # keys cell.weight_ih, ...
    rules = Rules(torch_lstm(r"cell", "cell", layer=None))
    model, report = nnx_save.load_model(_poisoned(Cell(nnx.Rngs(0))), path, rules=rules, strict=True, filter=WEIGHTS)
    assert report.clean

    rng = np.random.default_rng(1)
    x, h, c = (rng.standard_normal((3, n)).astype(np.float32) for n in (IN, HIDDEN, HIDDEN))
    with torch.no_grad():
        h1, c1 = (t.numpy() for t in source(torch.from_numpy(x), (torch.from_numpy(h), torch.from_numpy(c))))
    (c_ours, h_ours), _ = model.cell((jnp.asarray(c), jnp.asarray(h)), jnp.asarray(x))  # flax's carry is (c, h)
    _close(h_ours, h1)
    _close(c_ours, c1)

    out = tmp_path / "export.safetensors"
    nnx_save.save_model(model, out, rules=rules.inverse(source=path), filter=WEIGHTS)
    exported = _assert_reproduced(tensors, out)
    _strict_torch(torch.nn.ModuleDict({"cell": torch.nn.LSTMCell(IN, HIDDEN)}), exported)


# --- a BatchNorm CNN saved from nn.DataParallel ------------------------------------------


def _torch_cnn():
    """Convs at 0 and 4, BatchNorms at 1 and 5 of an nn.Sequential (pools and ReLUs between)."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
    )
    _off_zero(net, 3)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.num_batches_tracked.fill_(200000)
    return torch.nn.DataParallel(net).eval()  # its state_dict says module.0.weight, ...


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        pad = ((1, 1), (1, 1))
        self.convs = nnx.List([nnx.Conv(n, 8, (3, 3), padding=pad, use_bias=False, rngs=rngs) for n in (3, 8)])
        self.bns = nnx.List(
            [nnx.BatchNorm(8, use_running_average=True, epsilon=1e-5, momentum=0.9, rngs=rngs) for _ in range(2)]
        )

    def __call__(self, x):
        x = nnx.relu(self.bns[0](self.convs[0](x)))
        x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        return nnx.relu(self.bns[1](self.convs[1](x)))


CNN_RULES = Rules(
    torch_conv(r"(\d+)", r"convs/\1", bias=False, index={1: [0, 4]}),
    torch_batch_norm(r"(\d+)", r"bns/\1", index={1: [1, 5]}),
    prefix="module.",
)


def test_a_batch_norm_cnn_from_data_parallel_exports_its_source_byte_for_byte(tmp_path) -> None:
    source = _torch_cnn()
    path = tmp_path / "cnn.safetensors"
    tensors = _save(source, path)
    assert "module.1.num_batches_tracked" in tensors
    model, report = nnx_save.load_model(_poisoned(CNN(nnx.Rngs(0))), path, rules=CNN_RULES, strict=True)
    assert report.clean and report.landed["module.5.running_var"] == ("bns/1/var",)

    x = np.random.default_rng(2).standard_normal((2, 3, 12, 12)).astype(np.float32)
    with torch.no_grad():
        expected = source(torch.from_numpy(x)).numpy().transpose(0, 2, 3, 1)
    _close(model(jnp.asarray(x.transpose(0, 2, 3, 1))), expected)

    out = tmp_path / "export.safetensors"
    nnx_save.save_model(model, out, rules=CNN_RULES.inverse(source=path))
    exported = _assert_reproduced(tensors, out)  # num_batches_tracked 200000, not 0
    _strict_torch(torch.nn.DataParallel(torch.nn.Sequential(*_torch_cnn().module)), exported)


# --- a file holding two variants of a model ----------------------------------------------


class TorchMLP(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(IN, width), torch.nn.Linear(width, OUT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class MLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.fc1, self.fc2 = nnx.Linear(IN, width, rngs=rngs), nnx.Linear(width, OUT, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def _variants():
    return _off_zero(torch.nn.ModuleDict({"v16": TorchMLP(16), "v8": TorchMLP(8)}), 4)


def test_a_second_variant_in_the_file_passes_through_the_export_unchanged(tmp_path) -> None:
    source = _variants()
    path = tmp_path / "both.safetensors"
    tensors = _save(source, path)
    rules = Rules(torch_linear(r"fc1", "fc1"), torch_linear(r"fc2", "fc2"), ignore(r"v8\..*"), prefix="v16.")
    model, report = nnx_save.load_model(_poisoned(MLP(16, nnx.Rngs(0))), path, rules=rules, strict=True)
    assert report.clean and len(report.loaded) == 4

    x = np.random.default_rng(3).standard_normal((4, IN)).astype(np.float32)
    with torch.no_grad():
        expected = source["v16"](torch.from_numpy(x)).numpy()
    _close(model(jnp.asarray(x)), expected)

    out = tmp_path / "export.safetensors"
    nnx_save.save_model(model, out, rules=rules.inverse(source=path))
    exported = _assert_reproduced(tensors, out)  # the 8 kHz half too, though the model never held it
    again = _strict_torch(_off_zero(torch.nn.ModuleDict({"v16": TorchMLP(16), "v8": TorchMLP(8)}), 5), exported)
    with torch.no_grad():
        assert np.array_equal(again["v8"](torch.from_numpy(x)).numpy(), source["v8"](torch.from_numpy(x)).numpy())
