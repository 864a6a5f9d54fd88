"""save_model / load_model: bit-exact round trips into poisoned targets, every failure
mode with its message, filters, scalars, rng streams, optimizers."""

from __future__ import annotations

import gc
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from _nnx_helpers import assert_differs, assert_same_state, poison, snapshot
from flax import nnx

import nnx_save

# ----------------------------------------------------------------------------- models


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, din: int = 4, hidden: int = 8, dout: int = 3) -> None:
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


class Stack(nnx.Module):  # nnx.List of blocks: keys layers/0/..., layers/1/...
    def __init__(self, rngs: nnx.Rngs, n: int = 3) -> None:
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(n)])


class Heads(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.heads = nnx.Dict(cls_head=nnx.Linear(4, 2, rngs=rngs), reg=nnx.Linear(4, 1, rngs=rngs))


class PlainContainers(nnx.Module):  # plain Python list / dict of modules, marked as data
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.data([nnx.Linear(3, 3, rngs=rngs) for _ in range(2)])
        self.named = nnx.data({"a": nnx.Linear(3, 2, rngs=rngs), "b": MLP(rngs, 3, 5, 2)})


class Nested(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.encoder = nnx.Dict(stack=Stack(rngs, 2), mlp=MLP(rngs))
        self.decoder = nnx.Sequential(nnx.Linear(3, 6, rngs=rngs), jax.nn.gelu, nnx.Linear(6, 4, rngs=rngs))


class Tied(nnx.Module):  # the embedding is the output head: one Variable, two places
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(11, 4, rngs=rngs)
        self.body = nnx.Linear(4, 4, rngs=rngs)
        self.head = self.embed


class Net(nnx.Module):  # batch norm statistics, dropout rng state and counters
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(4, 6, rngs=rngs)
        self.bn = nnx.BatchNorm(6, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(6, 2, rngs=rngs)
        self.step = nnx.Variable(0)
        self.lr = nnx.Variable(0.25)
        self.warm = nnx.Variable(False)

    def __call__(self, x):
        return self.l2(self.drop(self.bn(self.l1(x))))


def trained_net(seed: int = 0) -> Net:
    net = Net(nnx.Rngs(seed, dropout=seed + 100))
    net.train()
    for _ in range(2):  # moves batch statistics and the dropout stream
        net(jax.random.normal(jax.random.key(seed), (5, 4)))
    net.step.set_value(2)
    net.lr.set_value(0.125)
    net.warm.set_value(True)
    return net


class TrainState(nnx.Module):  # model + optax optimizer in one graph
    def __init__(self, seed: int) -> None:
        self.model = MLP(nnx.Rngs(seed))
        self.opt = nnx.Optimizer(self.model, optax.adam(1e-2), wrt=nnx.Param)


def _loss(model, x):
    return jnp.sum(model(x) ** 2)


def train_step(ts: TrainState, x) -> None:
    grads = nnx.grad(_loss)(ts.model, x)
    ts.opt.update(ts.model, grads)


def stepped_train_state(seed: int = 0) -> TrainState:
    ts = TrainState(seed)
    train_step(ts, jnp.ones((2, 4)))
    return ts


FACTORIES = {
    "linear": lambda seed: nnx.Linear(4, 3, rngs=nnx.Rngs(seed)),
    "mlp": lambda seed: MLP(nnx.Rngs(seed)),
    "list_stack": lambda seed: Stack(nnx.Rngs(seed)),
    "nnx_dict": lambda seed: Heads(nnx.Rngs(seed)),
    "plain_list_dict": lambda seed: PlainContainers(nnx.Rngs(seed)),
    "sequential": lambda seed: nnx.Sequential(
        nnx.Linear(2, 5, rngs=nnx.Rngs(seed)), jax.nn.relu, nnx.Linear(5, 2, rngs=nnx.Rngs(seed + 1))
    ),
    "nested": lambda seed: Nested(nnx.Rngs(seed)),
    "tied": lambda seed: Tied(nnx.Rngs(seed)),
    "batchnorm_dropout_counters": trained_net,
    "rngs": lambda seed: nnx.Rngs(seed, dropout=jax.random.key(seed + 1, impl="rbg")),
    "optimizer_adam": stepped_train_state,
}


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "model.safetensors")


def load_quiet(target, path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean round trip warns about nothing
        # ... but the 8 simulated devices: builders here declare no shardings on purpose
        warnings.filterwarnings("ignore", category=nnx_save.SingleDeviceWarning)
        return nnx_save.load_model(target, path, **kw)


# ------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_round_trip_into_poisoned_instance(name, path):
    source = FACTORIES[name](0)
    before = snapshot(source)
    nnx_save.save_model(source, path)
    assert_same_state(snapshot(source), before)  # saving did not touch the model

    target = poison(FACTORIES[name](1))
    assert_differs(snapshot(target), before)
    loaded, report = load_quiet(target, path)
    assert loaded is target
    assert_same_state(snapshot(target), before)
    assert report.clean and sorted(report.loaded) == sorted(nnx_save.read_header(path).tensors)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_round_trip_through_poisoned_builder(name, path):
    source = FACTORIES[name](0)
    before = snapshot(source)
    nnx_save.save_model(source, path)
    model, report = load_quiet(lambda: poison(FACTORIES[name](1)), path)
    assert_same_state(snapshot(model), before)
    assert report.clean


def test_tied_parameter_stored_once_and_still_tied(path):
    source = Tied(nnx.Rngs(0))
    nnx_save.save_model(source, path)
    assert sorted(nnx_save.read_header(path).tensors) == ["body/bias", "body/kernel", "embed/embedding"]
    for target in (poison(Tied(nnx.Rngs(1))), lambda: poison(Tied(nnx.Rngs(1)))):
        model, _ = load_quiet(target, path)
        assert model.head is model.embed
        model.embed.embedding[...] = jnp.zeros((11, 4))
        assert float(jnp.abs(model.head.embedding[...]).sum()) == 0.0


@pytest.mark.parametrize("collecting", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_a_builder_is_traced_with_garbage_collection_paused_and_the_callers_setting_kept(collecting, fails, path):
    nnx_save.save_model(MLP(nnx.Rngs(0)), path)
    seen = []

    def builder():
        seen.append(gc.isenabled())
        if fails:
            raise RuntimeError("the builder failed")
        return poison(MLP(nnx.Rngs(1)))

    (gc.enable if collecting else gc.disable)()
    try:
        if fails:
            with pytest.raises(RuntimeError, match="the builder failed"):
                load_quiet(builder, path)
        else:
            model, _ = load_quiet(builder, path, strict=True)
            assert_same_state(snapshot(model), snapshot(MLP(nnx.Rngs(0))))
        assert seen == [False]  # no full collection walks the process during the trace
        assert gc.isenabled() is collecting  # the caller's setting, whatever the builder did
    finally:
        gc.enable()


def test_list_keys_are_decimal(path):
    nnx_save.save_model(Stack(nnx.Rngs(0), 12), path)
    keys = sorted(nnx_save.read_header(path).tensors)
    assert keys[:4] == ["layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/kernel"]
    assert "layers/11/kernel" in keys


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "bool", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("via", ["instance", "builder"])
def test_parameter_dtypes_round_trip(dtype, via, path):
    class P(nnx.Module):
        def __init__(self, seed: int) -> None:
            w = jax.random.normal(jax.random.key(seed), (3, 5)) * 4
            self.w = nnx.Param(w > 0 if dtype == "bool" else w.astype(dtype))

    source = P(0)
    before = snapshot(source)
    nnx_save.save_model(source, path)
    target = poison(P(1)) if via == "instance" else (lambda: poison(P(1)))
    model, report = load_quiet(target, path)
    assert model.w[...].dtype == jnp.dtype(dtype)
    assert_same_state(snapshot(model), before)
    assert report.dtype_casts == []


# ----------------------------------------------------------------- scalars, rng, optax


def test_python_scalars_keep_their_type(path):
    nnx_save.save_model(trained_net(0), path)
    meta = nnx_save.read_header(path).metadata
    assert meta["nnx_save.scalars"] == '{"lr": "float", "step": "int", "warm": "bool"}'
    for target in (poison(Net(nnx.Rngs(1))), lambda: poison(Net(nnx.Rngs(1)))):
        model, _ = load_quiet(target, path)
        values = (model.step.get_value(), model.lr.get_value(), model.warm.get_value())
        assert [(type(v), v) for v in values] == [(int, 2), (float, 0.125), (bool, True)]


def test_builder_keeps_declared_scalars_the_file_lacks(path):
    nnx_save.save_model(trained_net(0), path, filter=nnx.Param)
    model, report = load_quiet(lambda: Net(nnx.Rngs(1)), path, filter=nnx.Param)
    values = (model.step.get_value(), model.lr.get_value(), model.warm.get_value())
    assert [(type(v), v) for v in values] == [(int, 0), (float, 0.25), (bool, False)]
    assert report.clean


def test_scalar_of_another_kind_is_reported_as_a_cast(path):
    safetensors.numpy.save_file({"w": np.ones(2, np.float32), "step": np.array(2.5)}, path)

    class C(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.zeros(2))
            self.step = nnx.Variable(0)

    with pytest.warns(nnx_save.LoadWarning, match=re.escape("dtype: step: float64 in the file -> int64 in the model")):
        model, report = nnx_save.load_model(C(), path)
    assert (type(model.step.get_value()), model.step.get_value()) == (int, 2)
    assert [str(c) for c in report.dtype_casts] == ["step: float64 in the file -> int64 in the model"]


def test_rng_keys_stored_as_key_data_with_impl(path):
    nnx_save.save_model(nnx.Rngs(0, dropout=jax.random.key(1, impl="rbg")), path)
    header = nnx_save.read_header(path)
    assert {k: (t.shape, t.dtype.code) for k, t in header.tensors.items()} == {
        "default/count": ((), "U32"),
        "default/key": ((2,), "U32"),
        "dropout/count": ((), "U32"),
        "dropout/key": ((4,), "U32"),
    }
    assert header.metadata["nnx_save.rng_impl"] == '{"default/key": "threefry2x32", "dropout/key": "rbg"}'


def test_resumed_run_continues_the_same_random_stream(path):
    source = trained_net(0)
    nnx_save.save_model(source, path)
    x = jax.random.normal(jax.random.key(7), (4, 4))
    for target in (poison(trained_net(5)), lambda: poison(trained_net(5))):
        model, _ = load_quiet(target, path)
        model.train()
        resumed = [np.asarray(model(x)) for _ in range(3)]
        fresh = nnx.clone(source)
        expected = [np.asarray(fresh(x)) for _ in range(3)]
        assert all(np.array_equal(a, b) for a, b in zip(resumed, expected, strict=False))
        assert not np.array_equal(resumed[0], resumed[1])  # dropout is live


def test_rngs_object_resumes_its_streams(path):
    rngs = nnx.Rngs(0, dropout=jax.random.key(1, impl="rbg"))
    rngs(), rngs.dropout()
    nnx_save.save_model(rngs, path)
    resumed, _ = load_quiet(lambda: nnx.Rngs(9, dropout=jax.random.key(9, impl="rbg")), path)
    assert jax.random.key_impl(resumed.dropout.key[...]) == jax.random.key_impl(rngs.dropout.key[...])
    for stream in ("default", "dropout"):
        a, b = getattr(rngs, stream)(), getattr(resumed, stream)()
        assert np.array_equal(jax.random.key_data(a), jax.random.key_data(b))


def test_optimizer_resume_matches_uninterrupted_training(path):
    ts = stepped_train_state(0)
    nnx_save.save_model(ts, path)
    assert "opt/opt_state/0/mu/l1/kernel" in nnx_save.read_header(path).tensors
    resumed, _ = load_quiet(lambda: poison(TrainState(3)), path)
    x = jnp.arange(8.0).reshape(2, 4)
    for _ in range(2):
        train_step(ts, x)
        train_step(resumed, x)
    assert_same_state(snapshot(resumed), snapshot(ts))


def test_optimizer_alone_round_trips(path):
    ts = stepped_train_state(0)
    nnx_save.save_model(ts.opt, path)
    target = TrainState(1)
    poison(target.opt)
    load_quiet(target.opt, path)
    assert_same_state(snapshot(target.opt), snapshot(ts.opt))


# ------------------------------------------------------------------------- filters


def test_params_only_save_and_load(path):
    source = trained_net(0)
    nnx_save.save_model(source, path, filter=nnx.Param)
    assert sorted(nnx_save.read_header(path).tensors) == [
        "bn/bias",
        "bn/scale",
        "l1/bias",
        "l1/kernel",
        "l2/bias",
        "l2/kernel",
    ]
    target = poison(trained_net(1))
    rest = snapshot(target, nnx.Not(nnx.Param))
    _, report = load_quiet(target, path, filter=nnx.Param)  # batch stats, rng state, counters not "missing"
    assert report.clean and report.missing == []
    assert_same_state(snapshot(target, nnx.Param), snapshot(source, nnx.Param))
    assert_same_state(snapshot(target, nnx.Not(nnx.Param)), rest)  # the filter left the rest alone


def test_params_only_load_from_a_full_file(path):
    source = trained_net(0)
    nnx_save.save_model(source, path)
    target = poison(trained_net(1))
    _, report = load_quiet(target, path, filter=nnx.Param)
    assert report.clean and report.unexpected == []  # the file's other state is not "unexpected"
    assert_same_state(snapshot(target, nnx.Param), snapshot(source, nnx.Param))


def test_params_only_file_into_full_model_reports_the_rest_missing(path):
    nnx_save.save_model(trained_net(0), path, filter=nnx.Param)
    with pytest.warns(nnx_save.LoadWarning):
        _, report = nnx_save.load_model(Net(nnx.Rngs(1)), path)
    assert sorted(report.missing) == ["bn/mean", "bn/var", "drop/rngs/count", "drop/rngs/key", "lr", "step", "warm"]


# -------------------------------------------------------------------- failure modes


class WithHead(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dout: int = 3) -> None:
        self.body = nnx.Linear(4, 4, rngs=rngs)
        self.head = nnx.Linear(4, dout, rngs=rngs)


def _body_only(path):
    class Body(nnx.Module):
        def __init__(self) -> None:
            self.body = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    nnx_save.save_model(Body(), path)


def test_missing_warns_with_the_paths(path):
    _body_only(path)
    target = poison(WithHead(nnx.Rngs(1)))
    head_before = snapshot(target.head)
    expected = (
        f"{path}: 2 loaded, 2 missing, 0 unexpected, 0 shape mismatches, 0 dtype casts:\n"
        "  missing: head/bias\n  missing: head/kernel\n"
        "(see the returned LoadReport; strict=True raises)"
    )
    with pytest.warns(nnx_save.LoadWarning, match=re.escape(expected)) as record:
        _, report = nnx_save.load_model(target, path)
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller
    assert report.missing == ["head/bias", "head/kernel"] and sorted(report.loaded) == ["body/bias", "body/kernel"]
    assert_same_state(snapshot(target.head), head_before)  # nothing invented for them


def test_missing_strict_refuses(path):
    _body_only(path)
    expected = (
        f"strict load refused, nothing was changed. {path}: 0 loaded, 2 missing, 0 unexpected, "
        "0 shape mismatches, 0 dtype casts:\n  missing: head/bias\n  missing: head/kernel"
    )
    with pytest.raises(nnx_save.LoadError, match=re.escape(expected)) as info:
        nnx_save.load_model(WithHead(nnx.Rngs(1)), path, strict=True)
    assert info.value.report.missing == ["head/bias", "head/kernel"]


def test_allow_missing_and_unexpected_patterns(path):
    _body_only(path)
    _, report = load_quiet(WithHead(nnx.Rngs(1)), path, strict=True, allow_missing=["head/*"])
    assert report.clean and report.allowed_missing == ["head/bias", "head/kernel"]
    nnx_save.save_model(WithHead(nnx.Rngs(0)), path)
    _, report = load_quiet(
        lambda: nnx.Dict(body=nnx.Linear(4, 4, rngs=nnx.Rngs(1))),
        path,
        strict=True,
        allow_unexpected=[r"head/(kernel|bias)"],
    )
    assert report.clean and report.allowed_unexpected == ["head/bias", "head/kernel"]


def test_unexpected_strict_refuses(path):
    nnx_save.save_model(WithHead(nnx.Rngs(0)), path)
    expected = (
        f"strict load refused, nothing was changed. {path}: 0 loaded, 0 missing, 2 unexpected, "
        "0 shape mismatches, 0 dtype casts:\n  unexpected: head/bias\n  unexpected: head/kernel"
    )
    with pytest.raises(nnx_save.LoadError, match=re.escape(expected)):
        nnx_save.load_model(nnx.Dict(body=nnx.Linear(4, 4, rngs=nnx.Rngs(1))), path, strict=True)


def test_shape_mismatch_is_reported_and_not_loaded(path):
    nnx_save.save_model(WithHead(nnx.Rngs(0), dout=3), path)
    target = poison(WithHead(nnx.Rngs(1), dout=5))
    head_before = snapshot(target.head)
    line = (
        "  shape: head/bias: shape (5,) in the model, (3,) in the file\n"
        "  shape: head/kernel: shape (4, 5) in the model, (4, 3) in the file"
    )
    with pytest.warns(nnx_save.LoadWarning, match=re.escape(line)):
        _, report = nnx_save.load_model(target, path)
    assert [(m.path, m.model_shape, m.file_shape) for m in report.shape_mismatches] == [
        ("head/bias", (5,), (3,)),
        ("head/kernel", (4, 5), (4, 3)),
    ]
    assert_same_state(snapshot(target.head), head_before)
    with pytest.raises(
        nnx_save.LoadError,
        match=re.escape(f"{path}: 0 loaded, 0 missing, 0 unexpected, 2 shape mismatches, 0 dtype casts:\n{line}"),
    ):
        nnx_save.load_model(target, path, strict=True)
    target, report = nnx_save.load_model(target, path, strict=True, allow_shape_mismatch=["head/*"])
    assert report.clean and report.shape_mismatches == []
    assert [m.path for m in report.allowed_shape_mismatches] == ["head/bias", "head/kernel"]
    assert_same_state(snapshot(target.head), head_before)  # the model's own values, not the file's


def test_dtype_cast_on_the_host(path):
    source = MLP(nnx.Rngs(0))
    nnx_save.save_model(source, path)
    target = nnx.Dict(
        l1=nnx.Linear(4, 8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)),
        l2=nnx.Linear(8, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)),
    )
    lines = [  # float32 -> bfloat16 drops mantissa bits: lossy, warned as such
        f"  LOSSY dtype: {p}: float32 in the file -> bfloat16 in the model"
        for p in ("l1/bias", "l1/kernel", "l2/bias", "l2/kernel")
    ]
    with pytest.warns(nnx_save.LossyCastWarning, match=re.escape("\n".join(lines))):
        _, report = nnx_save.load_model(target, path)
    assert [(c.path, c.file_dtype, c.model_dtype) for c in report.dtype_casts] == [
        (p, "float32", "bfloat16") for p in ("l1/bias", "l1/kernel", "l2/bias", "l2/kernel")
    ]
    expected = np.asarray(source.l1.kernel[...]).astype(jnp.bfloat16)
    assert target["l1"].kernel[...].dtype == jnp.bfloat16
    assert np.asarray(target["l1"].kernel[...]).tobytes() == expected.tobytes()


def test_strict_refusal_leaves_every_value_unchanged(path):
    nnx_save.save_model(trained_net(0), path)

    class Bigger(Net):
        def __init__(self, rngs: nnx.Rngs) -> None:
            super().__init__(rngs)
            self.extra = nnx.Param(jnp.ones(3))

    target = poison(Bigger(nnx.Rngs(1, dropout=2)))
    before = snapshot(target)
    with pytest.raises(nnx_save.LoadError, match=re.escape("missing: extra")):
        nnx_save.load_model(target, path, strict=True)
    assert_same_state(snapshot(target), before)


def test_report_is_readable(path):
    _body_only(path)
    with pytest.warns(nnx_save.LoadWarning):
        _, report = nnx_save.load_model(WithHead(nnx.Rngs(1)), path)
    text = str(report).splitlines()
    assert text[:3] == [
        f"{path}: 2 loaded, 2 missing, 0 unexpected, 0 shape mismatches, 0 dtype casts",
        "  missing: head/bias",
        "  missing: head/kernel",
    ]
    assert text[3].startswith("  I/O: read 0.0 MB for 0.0 MB needed")
    assert report.io.bytes_needed == 4 * 4 * 4 + 4 * 4 and report.io.files == 1


def test_slash_in_a_name_is_refused_at_save(path):
    model = nnx.Dict({"a/b": nnx.Param(jnp.ones(2))})
    with pytest.raises(
        nnx_save.KeyPathError,
        match=re.escape(
            "'a/b': name contains /; file keys join names with '/' so this one could not be read "
            "back to the same place. Rename the attribute or key."
        ),
    ) as info:
        nnx_save.save_model(model, path)
    assert info.value.key_path == "a/b"


class Holds(nnx.Module):
    def __init__(self, value) -> None:
        self.w = nnx.Param(jnp.ones(2))
        self.inner = nnx.Dict(tag=nnx.Variable(value))


def test_string_value_is_refused_at_save_with_its_path(path):
    with pytest.raises(
        nnx_save.UnsupportedValueError,
        match=re.escape(
            "inner/tag: the model holds a str ('bert'); safetensors stores arrays and numbers only. "
            "Keep such values out of nnx.Variable, or pass filter= to skip them"
        ),
    ) as info:
        nnx_save.save_model(Holds("bert"), path)
    assert info.value.key_path == "inner/tag"


def test_none_value_is_refused_at_save_with_its_path(path):
    with pytest.raises(
        nnx_save.UnsupportedValueError,
        match=re.escape(
            "inner/tag: the model holds None; safetensors stores arrays and numbers only. "
            "Keep such values out of nnx.Variable, or pass filter= to skip them"
        ),
    ):
        nnx_save.save_model(Holds(None), path)


@pytest.mark.parametrize("via", ["instance", "builder"])
def test_none_value_is_refused_at_load_unless_filtered(via, path):
    nnx_save.save_model(Holds(1), path, filter=nnx.Param)
    target = Holds(None) if via == "instance" else (lambda: Holds(None))
    with pytest.raises(
        nnx_save.UnsupportedValueError,
        match=re.escape(
            "inner/tag: the model holds None; safetensors stores arrays and numbers only. "
            "Keep such values out of nnx.Variable, or pass filter= to skip them"
        ),
    ):
        nnx_save.load_model(target, path)
    model, report = load_quiet(target, path, filter=nnx.Param)
    assert model.inner["tag"].get_value() is None and report.clean


def test_failed_save_writes_nothing(path):
    with pytest.raises(nnx_save.UnsupportedValueError):
        nnx_save.save_model(Holds("x"), path)
    import os

    assert os.listdir(os.path.dirname(path)) == []


def test_user_metadata_is_kept(path):
    nnx_save.save_model(MLP(nnx.Rngs(0)), path, metadata={"run": "r1"})
    meta = nnx_save.read_header(path).metadata
    assert meta["run"] == "r1" and meta["format"] == "nnx_save"


# ------------------------------------------------------------- files from other tools


def test_string_list_keys_from_other_tools_load_into_nnx_list(path):
    source = Stack(nnx.Rngs(0))
    flat = {"/".join(str(k) for k in p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(source))}
    safetensors.numpy.save_file(flat, path)  # another tool: plain string keys, no metadata
    target = poison(Stack(nnx.Rngs(1)))
    load_quiet(target, path, strict=True)
    assert_same_state(snapshot(target), snapshot(source))


def test_string_keyed_dict_saved_by_save_file_loads_into_nnx_list(path):
    source = Stack(nnx.Rngs(0), 2)
    tree = {
        "layers": {
            str(i): {"kernel": np.asarray(layer.kernel[...]), "bias": np.asarray(layer.bias[...])}
            for i, layer in enumerate(source.layers)
        }
    }
    nnx_save.save_file(tree, path)
    model, _ = load_quiet(lambda: poison(Stack(nnx.Rngs(1), 2)), path, strict=True)
    assert_same_state(snapshot(model), snapshot(source))


def test_metadata_must_be_strings_and_not_reserved(path):
    with pytest.raises(nnx_save.UnsupportedValueError, match=re.escape("metadata must map str to str")):
        nnx_save.save_model(MLP(nnx.Rngs(0)), path, metadata={"epoch": 3})
    with pytest.raises(
        nnx_save.UnsupportedValueError,
        match=re.escape(
            "metadata keys ['nnx_save.scalars'] are reserved: the 'nnx_save.' prefix holds what load_model "
            "needs to rebuild rng keys and scalars; use another name"
        ),
    ):
        nnx_save.save_model(MLP(nnx.Rngs(0)), path, metadata={"nnx_save.scalars": "{}"})


def test_numpy_values_stay_on_the_host(path):
    class HostState(nnx.Module):
        def __init__(self, seed: int) -> None:
            self.table = nnx.Variable(np.arange(seed, seed + 6, dtype=np.int32).reshape(2, 3))
            self.scale = nnx.Variable(np.float32(seed + 0.5))

    nnx_save.save_model(HostState(0), path)
    target = HostState(7)
    load_quiet(target, path, strict=True)
    assert type(target.table.get_value()) is np.ndarray and type(target.scale.get_value()) is np.float32
    assert target.table.get_value().tolist() == [[0, 1, 2], [3, 4, 5]] and target.scale.get_value() == 0.5


def test_builder_never_builds_the_random_model(path):
    nnx_save.save_model(MLP(nnx.Rngs(0)), path)
    seen = []

    def builder():
        model = MLP(nnx.Rngs(1))
        seen.append(isinstance(model.l1.kernel.get_value(), jax.core.Tracer))
        return model

    model, _ = load_quiet(builder, path, strict=True)
    assert seen and all(seen)  # only ever traced: no concrete random weights
    assert not isinstance(model.l1.kernel.get_value(), jax.core.Tracer)


def test_a_builder_without_shardings_on_several_devices_is_warned(path):
    nnx_save.save_model(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), path)
    message = (
        "2 arrays have no sharding (bias, kernel): all of them are loaded onto cpu:0, although this "
        "process has 8 devices. Annotate the builder's parameters with shardings (nnx.with_partitioning) and "
        "pass mesh=, or load into a model instance already placed where you want it"
    )
    with pytest.warns(nnx_save.SingleDeviceWarning, match=re.escape(message)) as caught:
        model, _ = nnx_save.load_model(lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(1)), path)
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller
    assert {d.id for d in model.kernel[...].devices()} == {0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an instance is placed already: nothing to say
        nnx_save.load_model(nnx.Linear(4, 8, rngs=nnx.Rngs(1)), path)
