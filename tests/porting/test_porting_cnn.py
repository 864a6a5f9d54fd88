"""A torchvision-style CNN (conv + BatchNorm blocks under ``features.{i}``) ported into
an NNX model written from scratch: BatchNorm conventions, an index shift
(``features.{i}`` -> ``blocks/{i-1}``), torch's symmetric padding with stride 2, and
reports that name what an unexpected key was renamed to. Compared with torch's output."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.porting import RenameRule, Rules, rename, torch_batch_norm, torch_conv

torch = pytest.importorskip("torch")

PAD = ((1, 1), (1, 1))  # torch's padding=1, on both sides (not 'SAME' under stride 2)


def _torch_net():
    torch.manual_seed(0)

    def block(cin, cout, stride):
        return torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            torch.nn.BatchNorm2d(cout),
            torch.nn.ReLU(),
        )

    net = torch.nn.Module()
    net.features = torch.nn.Sequential(block(3, 8, 2), block(8, 8, 1), block(8, 4, 2))
    for m in net.modules():  # non-trivial running statistics, as after training
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
            m.num_batches_tracked.fill_(100)
    return net.eval()


class Block(nnx.Module):
    def __init__(self, cin, cout, stride, rngs):
        self.conv = nnx.Conv(cin, cout, (3, 3), strides=stride, padding=PAD, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(cout, use_running_average=True, momentum=0.9, epsilon=1e-5, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.conv(x)))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.stem = Block(3, 8, 2, rngs)
        self.blocks = nnx.List([Block(8, 8, 1, rngs), Block(8, 4, 2, rngs)])

    def __call__(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x


RULES = Rules(
    torch_conv(r"features\.0\.0", "stem/conv", bias=False),
    torch_batch_norm(r"features\.0\.1", "stem/bn"),
    torch_conv(r"features\.(\d+)\.0", r"blocks/\1/conv", bias=False, shift={1: -1}),
    torch_batch_norm(r"features\.(\d+)\.1", r"blocks/\1/bn", shift={1: -1}),
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    net = _torch_net()
    path = tmp_path_factory.mktemp("cnn") / "model.safetensors"
    nnx_save.save_file({k: v.numpy() for k, v in net.state_dict().items()}, path)
    return net, path


def _poisoned():
    model = Net(nnx.Rngs(0))
    for _, v in nnx.to_flat_state(nnx.state(model)):
        v.set_value(jnp.full(v.get_value().shape, 7.0, v.get_value().dtype))
    return model


def test_ported_cnn_matches_torch(checkpoint):
    net, path = checkpoint
    model, report = nnx_save.load_model(_poisoned(), path, rules=RULES, strict=True)
    assert report.clean and len(report.loaded) == 15
    assert sorted(report.landed["features.2.1.running_var"]) == ["blocks/1/bn/var"]
    assert report.landed["features.1.1.num_batches_tracked"] == ()  # ignored, not unexpected
    x = np.random.default_rng(0).standard_normal((2, 3, 17, 17)).astype(np.float32)  # odd size: padding matters
    with torch.no_grad():
        expected = net.features(torch.from_numpy(x)).numpy().transpose(0, 2, 3, 1)
    np.testing.assert_allclose(model(jnp.asarray(x.transpose(0, 2, 3, 1))), expected, rtol=1e-5, atol=1e-5)


def test_same_padding_differs_from_torch_under_stride_2():
    """The docs' warning, measured: 'SAME' with stride 2 pads (0, 1), torch pads (1, 1)."""
    conv = torch.nn.Conv2d(1, 1, 3, stride=2, padding=1, bias=False)
    kernel = conv.weight.detach().numpy().transpose(2, 3, 1, 0)
    x = np.random.default_rng(1).standard_normal((1, 1, 8, 8)).astype(np.float32)
    with torch.no_grad():
        expected = conv(torch.from_numpy(x)).numpy().transpose(0, 2, 3, 1)
    outs = {}
    for padding in ("SAME", PAD):
        ours = nnx.Conv(1, 1, (3, 3), strides=2, padding=padding, use_bias=False, rngs=nnx.Rngs(0))
        ours.kernel.set_value(jnp.asarray(kernel))
        outs[str(padding)] = np.asarray(ours(jnp.asarray(x.transpose(0, 2, 3, 1))))
    np.testing.assert_allclose(outs[str(PAD)], expected, rtol=1e-5, atol=1e-6)
    assert np.abs(outs["SAME"] - expected).max() > 1e-2


def test_shift_inverts_on_export_with_the_buffers_torch_expects(checkpoint, tmp_path):
    net, path = checkpoint
    model, _ = nnx_save.load_model(_poisoned(), path, rules=RULES, strict=True)
    nnx_save.save_model(model, tmp_path / "back.safetensors", rules=RULES.inverse())
    back = nnx_save.load_file(tmp_path / "back.safetensors")
    state = {k: v.numpy() for k, v in net.state_dict().items()}
    assert sorted(back) == sorted(state)  # num_batches_tracked included: written as constants
    for k, v in state.items():
        if k.endswith("num_batches_tracked"):
            assert back[k].shape == () and back[k].dtype == np.int64 and back[k] == 0
        else:
            assert np.array_equal(back[k], v), k
    again = _torch_net()
    missing, unexpected = again.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in back.items()})
    assert (missing, unexpected) == ([], [])


def test_unexpected_keys_name_their_renamed_target(checkpoint):
    _, path = checkpoint
    # the helper's own rename of that key dropped: a rename shadowing it is refused as a table problem
    kept = [r for r in RULES if not (isinstance(r, RenameRule) and r.pattern == r"features\.0\.1\.running_var")]
    wrong = Rules(rename(r"features\.0\.1\.running_var", "stem/bn/variance"), kept)
    with pytest.raises(nnx_save.LoadError) as raised:
        nnx_save.load_model(_poisoned(), path, rules=wrong, strict=True)
    text = str(raised.value)
    assert "  missing: stem/bn/var\n" in text
    assert "  unexpected: features.0.1.running_var -> stem/bn/variance: no such model path\n" in text
    assert re.search(r"allow_unexpected=\['features.0.1.running_var'\]", text)


def test_a_long_missing_list_does_not_hide_the_unexpected_keys():
    report = nnx_save.LoadReport(
        missing=[f"blocks/{i}/kernel" for i in range(60)],
        unexpected=["features.9.weight"],
        renamed={"features.9.weight": ("blocks/x/kernel",)},
    )
    with pytest.raises(nnx_save.LoadError) as raised:
        report.raise_or_warn(True)
    text = str(raised.value)
    assert "  ... and 40 more missing\n  unexpected: features.9.weight -> blocks/x/kernel: no such model path\n" in text
