"""The torch habit: ``load_model(model, {"key": array, ...})`` loads a state
dict already in memory with the same matching, porting rules, report and strict
semantics as a file; torch is never imported for it."""

import re
import subprocess
import sys
import warnings

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from _nnx_helpers import assert_differs, assert_same_state, poison, snapshot
from flax import nnx
from hypothesis import given, settings
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_save
from nnx_save.porting import Rules, rename, transpose


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(5, 4, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.rngs = rngs
        self.step = nnx.Variable(9)


@pytest.mark.parametrize("kind", ["numpy", "jax", "nested", "nnx state", "torch"])
def test_a_state_dict_in_memory_loads_strictly_into_a_poisoned_model(kind):
    source = _Net(nnx.Rngs(0))
    flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(source))}
    if kind == "torch":
        torch = pytest.importorskip("torch")
        state = {k: torch.from_numpy(np.array(v)) if k != "rngs/default/key" else v for k, v in flat.items()}
    else:
        state = {
            "numpy": {k: np.asarray(v) if k != "rngs/default/key" else v for k, v in flat.items()},
            "jax": flat,
            "nested": nnx.to_pure_dict(nnx.state(source)),  # {"blocks": {0: {"bias": ...}}, ...}
            "nnx state": nnx.state(source),
        }[kind]
    target = poison(_Net(nnx.Rngs(1)))
    assert_differs(snapshot(source), snapshot(target))
    _, report = nnx_save.load_model(target, state, strict=True)
    assert report.clean and len(report.loaded) == len(flat) and report.source == "<state dict in memory>"
    assert_same_state(snapshot(source), snapshot(target))


_KEYS = ["embed/embedding", "blocks/0/kernel", "blocks/0/bias", "blocks/1/kernel", "norm/scale"]


@settings(max_examples=15)
@given(
    dropped=st.sets(st.sampled_from(_KEYS)),
    extra=st.booleans(),
    reshaped=st.sets(st.sampled_from(_KEYS), max_size=2),
    cast=st.sets(st.sampled_from(_KEYS), max_size=2),
)
def test_the_report_is_a_files_report(tmp_path_factory, dropped, extra, reshaped, cast):
    """Whatever the state dict lacks, adds, reshapes or casts: the report's problems (or
    the error) are those of the same tensors loaded from a file."""
    source = _Net(nnx.Rngs(0))
    state = {
        "/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(source, nnx.Param))
    }
    for k in dropped:
        del state[k]
    for k in reshaped - dropped:
        state[k] = np.zeros((*state[k].shape, 2), np.float32)
    for k in cast - dropped - reshaped:
        state[k] = state[k].astype(np.float16)
    if extra:
        state["head/kernel"] = np.ones((4, 2), np.float32)
    path = tmp_path_factory.mktemp("sd") / "same.safetensors"
    nnx_save.save_file(state, path)

    def outcome(src):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the LoadWarning: its report is compared
            try:
                _, report = nnx_save.load_model(_Net(nnx.Rngs(1)), src, filter=nnx.Param)
            except nnx_save.NnxSaveError as e:
                return type(e).__name__, str(e).replace(str(path), "SRC").replace("<state dict in memory>", "SRC")
        return "ok", report.problems()

    assert outcome(state) == outcome(path)


def test_torch_state_dict_through_porting_rules_matches_torch():
    """An HF-style Linear (weight (out, in)) into nnx.Linear through rules, compared
    with torch's own tensor."""
    torch = pytest.importorskip("torch")
    layer = torch.nn.Linear(4, 3)
    rules = Rules(rename(r"weight", "kernel"), transpose("kernel", (1, 0)))
    target = poison(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    _, report = nnx_save.load_model(target, layer.state_dict(), rules=rules, strict=True)
    assert report.clean and sorted(report.loaded) == ["bias", "kernel"]
    np.testing.assert_array_equal(np.asarray(target.kernel.get_value()), layer.weight.detach().numpy().T)
    np.testing.assert_array_equal(np.asarray(target.bias.get_value()), layer.bias.detach().numpy())
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(np.asarray(target(x)), layer(torch.from_numpy(x)).detach().numpy(), rtol=1e-6)


def test_strict_refusal_leaves_the_model_untouched():
    target = poison(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    before = snapshot(target)
    wanted = "strict load refused, nothing was changed. <state dict in memory>: 0 loaded, 1 missing, 0 unexpected"
    with pytest.raises(nnx_save.LoadError, match=re.escape(wanted)):
        nnx_save.load_model(target, {"kernel": np.ones((2, 3), np.float32)}, strict=True)
    assert_same_state(before, snapshot(target))


def test_a_builder_adopts_its_shardings_from_a_state_dict():
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    col = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    state = {"kernel": np.arange(16 * 8, dtype=np.float32).reshape(16, 8), "bias": np.ones(8, np.float32)}
    model, report = nnx_save.load_model(lambda: nnx.Linear(16, 8, kernel_init=col, rngs=nnx.Rngs(0)), state, mesh=mesh)
    kernel = model.kernel.get_value()
    assert report.clean and kernel.sharding == NamedSharding(mesh, P(None, "model"))
    assert len(kernel.addressable_shards) == 8 and kernel.addressable_shards[0].data.shape == (16, 1)
    np.testing.assert_array_equal(np.asarray(kernel), state["kernel"])


def test_values_that_are_not_arrays_are_refused_by_key():
    with pytest.raises(nnx_save.UnsupportedValueError, match=re.escape("kernel: the state dict holds a str ('x')")):
        nnx_save.load_model(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), {"kernel": "x", "bias": np.ones(3, np.float32)})


def test_an_empty_state_dict_loads_nothing_and_says_so():
    with pytest.raises(nnx_save.LoadError, match=re.escape("the source holds 0: no tensors")):
        nnx_save.load_model(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), {})


def test_torch_is_not_imported_for_a_numpy_state_dict():
    code = (
        "import sys, numpy as np, nnx_save\n"
        "out = nnx_save.load_file({'w': np.arange(3, dtype=np.float32)})\n"
        "assert out['w'].tolist() == [0.0, 1.0, 2.0]\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
