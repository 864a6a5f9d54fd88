"""Weight-normed torch layers (``weight_g`` / ``weight_v`` and the parametrizations'
``original0`` / ``original1``) ported into plain ``nnx.Linear`` and ``nnx.Conv`` with the
computed rule, checked against torch's outputs, and exported: byte-identical to the
source file with ``inverse(source=)``, or as ``g = ||w||``, ``v = w`` that torch loads
strictly back to the same outputs."""

from __future__ import annotations

import re
import warnings

import jax
import numpy as np
import pytest
from _nnx_helpers import poison
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.porting import RuleError, Rules, compute, torch_weight_norm, weight_norm

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOLERANCE = 1e-5  # max |ours - torch| <= TOLERANCE * max |torch|, fp32


def _norm(module, names: str, dim: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's old weight_norm is deprecated
        if names == "weight_g":
            return torch.nn.utils.weight_norm(module, dim=dim)
        return torch.nn.utils.parametrizations.weight_norm(module, dim=dim)


class TorchNet(torch.nn.Module):
    def __init__(self, names: str, dim: int) -> None:
        super().__init__()
        self.conv = _norm(torch.nn.Conv1d(3, 5, 3, padding=1), names, dim)
        self.conv2 = _norm(torch.nn.Conv2d(5, 4, (3, 2), bias=False), names, dim)
        self.head = _norm(torch.nn.Linear(4, 6), names, dim)

    def forward(self, x):  # (batch, 3, time)
        x = torch.relu(self.conv(x))  # (batch, 5, time)
        x = self.conv2(x[:, :, None, :].expand(-1, -1, 3, -1))  # (batch, 4, 1, time - 1)
        return self.head(x[:, :, 0, :].transpose(1, 2))  # (batch, time - 1, 6)


class Net(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(3, 5, (3,), padding=((1, 1),), rngs=rngs)
        self.conv2 = nnx.Conv(5, 4, (3, 2), padding="VALID", use_bias=False, rngs=rngs)
        self.head = nnx.Linear(4, 6, rngs=rngs)

    def __call__(self, x):  # (batch, time, 3)
        x = nnx.relu(self.conv(x))
        x = self.conv2(jax.numpy.broadcast_to(x[:, None], (x.shape[0], 3, *x.shape[1:])))
        return self.head(x[:, 0])


def _rules(names: str, dim: int) -> Rules:
    return Rules(
        torch_weight_norm(r"conv", "conv", spatial_dims=1, dim=dim, names=names),
        torch_weight_norm(r"conv2", "conv2", spatial_dims=2, dim=dim, names=names, bias=False),
        torch_weight_norm(r"head", "head", dim=dim, names=names),
        strict=True,
    )


def _torch_net(names: str, dim: int) -> TorchNet:
    torch.manual_seed(0)
    net = TorchNet(names, dim)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.2 * torch.randn_like(p))  # g off ||v||: a rule that drops g shows
    return net.eval()


CASES = [(names, dim) for names in ("weight_g", "parametrizations") for dim in (0, 1, None)]


@pytest.mark.parametrize("names, dim", CASES)
def test_weight_normed_layers_port_into_plain_layers_and_export_byte_identical(names, dim, tmp_path):
    net = _torch_net(names, dim)
    source = tmp_path / "wn.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in net.state_dict().items()}, source)
    keys = set(nnx_save.read_header(source).tensors)
    assert ("head.weight_g" in keys) == (names == "weight_g")
    assert ("head.parametrizations.weight.original0" in keys) == (names == "parametrizations")

    model = poison(Net(rngs=nnx.Rngs(0)))
    _, report = nnx_save.load_model(model, source, rules=_rules(names, dim), strict=True)
    assert report.clean
    x = np.random.default_rng(0).standard_normal((2, 7, 3)).astype(np.float32)
    with torch.no_grad():
        theirs = net(torch.from_numpy(x.transpose(0, 2, 1).copy())).numpy()
    ours = np.asarray(model(x))
    assert ours.shape == theirs.shape
    assert np.max(np.abs(ours - theirs)) <= TOLERANCE * np.max(np.abs(theirs))

    same = tmp_path / "same.safetensors"
    nnx_save.save_model(model, same, rules=_rules(names, dim).inverse(source=source))
    original, exported = nnx_save.load_file(source), nnx_save.load_file(same)
    assert sorted(original) == sorted(exported)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key

    plain = tmp_path / "plain.safetensors"
    nnx_save.save_model(model, plain, rules=_rules(names, dim).inverse())
    fresh = TorchNet(names, dim)
    fresh.load_state_dict(safetensors_torch.load_file(plain), strict=True)
    with torch.no_grad():
        again = fresh.eval()(torch.from_numpy(x.transpose(0, 2, 1).copy())).numpy()
    assert np.max(np.abs(again - theirs)) <= TOLERANCE * np.max(np.abs(theirs))
    head_g = safetensors_torch.load_file(plain)[
        "head.weight_g" if names == "weight_g" else "head.parametrizations.weight.original0"
    ]
    kernel = np.asarray(model.head.kernel.get_value()).T
    axes = tuple(a for a in range(2) if a != dim) if dim is not None else (0, 1)
    np.testing.assert_array_equal(
        head_g.numpy().reshape(-1), np.sqrt(np.sum(kernel.astype(np.float32) ** 2, axis=axes)).reshape(-1)
    )


def test_a_changed_kernel_exports_its_own_norm_against_the_source(tmp_path):
    """A fine-tuned kernel no longer comes from the file's g, v: the export writes
    g = ||w||, v = w for it, the untouched layers' own bytes for the others."""
    net = _torch_net("weight_g", 0)
    source = tmp_path / "wn.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in net.state_dict().items()}, source)
    model, _ = nnx_save.load_model(Net(rngs=nnx.Rngs(0)), source, rules=_rules("weight_g", 0), strict=True)
    model.head.kernel.set_value(model.head.kernel.get_value() * 2)
    out = tmp_path / "tuned.safetensors"
    nnx_save.save_model(model, out, rules=_rules("weight_g", 0).inverse(source=source))
    original, exported = nnx_save.load_file(source), nnx_save.load_file(out)
    for key in ("conv.weight_g", "conv.weight_v", "conv2.weight_v"):
        assert exported[key].tobytes() == original[key].tobytes(), key
    np.testing.assert_array_equal(exported["head.weight_v"], np.asarray(model.head.kernel.get_value()).T)
    assert not np.array_equal(exported["head.weight_g"], original["head.weight_g"])


def test_weight_norm_shapes_are_checked_naming_the_keys():
    f32 = np.dtype("float32")
    rules = Rules(weight_norm(r"head", "head/w"))
    rule = 'compute((r"head\\.weight_g", r"head\\.weight_v"), r"head/w", weight_norm(dim=0), inverse=weight_norm_inverse(dim=0))'
    with pytest.raises(
        RuleError,
        match=re.escape(f"`head/w`: {rule} cannot make a tensor from `head.weight_g` (3, 1), `head.weight_v` (4, 2)"),
    ):
        rules.mapping({"head.weight_g": ((3, 1), f32), "head.weight_v": ((4, 2), f32)})


def _scale(w):
    return w * np.asarray(2, w.dtype)


def _half_wrong(w):
    return w / np.asarray(2, w.dtype) + np.asarray(1e-3, w.dtype)


def test_an_inverse_that_does_not_round_trip_is_refused_and_nothing_is_written(tmp_path):
    rules = Rules(compute(r"fc\.w", "kernel", _scale, inverse=_half_wrong))
    model = nnx.Linear(2, 3, use_bias=False, rngs=nnx.Rngs(0))
    out = tmp_path / "out.safetensors"
    with pytest.raises(nnx_save.NnxSaveError, match=re.escape("`kernel`: _half_wrong does not invert _scale")) as info:
        nnx_save.save_model(model, out, rules=rules.inverse())
    error = info.value if isinstance(info.value, RuleError) else info.value.__cause__
    assert isinstance(error, RuleError) and error.kind == "round_trip"
    assert not out.exists()


def _cast(w):
    return w.astype(np.float64)


def test_a_function_that_changes_the_dtype_is_refused_naming_the_target(tmp_path):
    path = tmp_path / "f.safetensors"
    nnx_save.save_file({"fc.w": np.ones((2, 3), np.float32)}, path)
    rules = Rules(compute(r"fc\.w", "kernel", _cast, inverse=_cast))
    with pytest.raises(
        nnx_save.NnxSaveError, match=re.escape("`kernel`: _cast made (2, 3) float64, the plan expects (2, 3) float32")
    ):
        nnx_save.load_model(nnx.Linear(2, 3, use_bias=False, rngs=nnx.Rngs(0)), path, rules=rules)


@settings(max_examples=20)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    dim=st.one_of(st.none(), st.integers(0, 2)),
    seed=st.integers(0, 2**16),
)
def test_weight_norm_matches_torch_and_its_inverse_round_trips_exactly(shape, dim, seed):
    """Over shapes and dims: the rule's w is torch's _weight_norm (to fp32 noise), and
    g = ||w||, v = w gives w back bit for bit."""
    if dim is not None and dim >= len(shape):
        dim = len(shape) - 1
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(shape).astype(np.float32) + 0.1
    g_shape = () if dim is None else tuple(d if a == dim else 1 for a, d in enumerate(shape))
    g = rng.standard_normal(g_shape).astype(np.float32)
    rules = Rules(weight_norm(r"m", "m/w", dim=dim))
    arrays = {"m.weight_g": g, "m.weight_v": v}
    w = rules.mapping(arrays).apply(arrays)["m/w"]
    theirs = torch._weight_norm(torch.from_numpy(v), torch.from_numpy(g), -1 if dim is None else dim).numpy()
    assert np.max(np.abs(w - theirs)) <= TOLERANCE * max(1.0, float(np.max(np.abs(theirs))))
    back = rules.inverse().mapping({"m/w": (shape, np.dtype("float32"))}).apply({"m/w": w})
    again = rules.mapping(back).apply(back)["m/w"]
    assert again.tobytes() == w.tobytes()


def _identity(x):
    return x


def _nudged(ulps):
    def nudge(x):
        return np.nextafter(x, np.asarray(np.inf, x.dtype)) if ulps else x

    nudge.__name__ = f"nudge{ulps}"
    return nudge


@settings(max_examples=40)
@given(
    dtype=st.sampled_from(["float16", "float32", "float64", "bfloat16", "int8", "int32"]),
    size=st.integers(1, 6),
    nudge=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_export_round_trip_accepts_exact_inverses_and_refuses_others(dtype, size, nudge, seed):
    """Over dtypes: an exact inverse exports; one ulp off (tolerance 0) is refused, naming
    the target; an integer off by one is refused at any tolerance (exact types)."""
    import ml_dtypes

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    value = (rng.standard_normal(size) * 10).astype(np_dtype)
    if np_dtype.kind == "i":
        inverse = _nudged(0) if not nudge else (lambda x: x + np.ones((), x.dtype))
        tolerance = 1e6
    else:
        inverse, tolerance = _nudged(int(nudge)), 0.0
    back = Rules(compute(r"w", "m/w", _identity, inverse=inverse, tolerance=tolerance)).inverse()
    mapping = back.mapping({"m/w": ((size,), np_dtype)})
    if not nudge:
        assert mapping.apply({"m/w": value})["w"].tobytes() == value.tobytes()
        return
    with pytest.raises(RuleError, match=re.escape("`m/w`: ")) as info:
        mapping.apply({"m/w": value})
    assert info.value.kind == "round_trip"


def test_weight_norm_of_a_zero_row_is_refused_on_export():
    """g = ||w|| = 0 there, and torch would load v * 0 / 0: NaN. Refused, typed."""
    back = Rules(weight_norm(r"m", "m/w")).inverse()
    w = np.array([[1, 2], [0, 0]], np.float32)
    with pytest.raises(
        RuleError, match=re.escape("weight_norm_inverse(dim=0) does not invert weight_norm(dim=0)")
    ) as info:
        back.mapping({"m/w": ((2, 2), np.dtype("float32"))}).apply({"m/w": w})
    assert info.value.kind == "round_trip"
