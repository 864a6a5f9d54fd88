"""save_model / load_model on a model sharded over 8 simulated devices (tests/conftest.py):
the loaded model keeps its sharding, and each shard holds the right slice."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from _nnx_helpers import assert_same_state, poison, snapshot
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_save

COL = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
ROW = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None))
VEC = nnx.with_partitioning(nnx.initializers.normal(1.0), ("model",))


class ShardedMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(16, 64, kernel_init=COL, bias_init=VEC, rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=ROW, rngs=rngs)
        self.step = nnx.Variable(0)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8
    return jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture
def saved(mesh, tmp_path):
    with jax.set_mesh(mesh):
        model = ShardedMLP(nnx.Rngs(0))
    model.step.set_value(41)
    path = str(tmp_path / "sharded.safetensors")
    nnx_save.save_model(model, path)
    return model, path


SPECS = {"up/kernel": P(None, "model"), "up/bias": P("model"), "down/kernel": P("model", None)}


def assert_sharded_like(model, source) -> None:
    """Every annotated param spread over 8 devices with its spec, each shard exact."""
    expected = {
        "/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(source, nnx.Param))
    }
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = "/".join(map(str, path))
        array = variable.get_value()
        if key in SPECS:
            assert isinstance(array.sharding, NamedSharding) and array.sharding.spec == SPECS[key]
            assert len(array.sharding.device_set) == 8
            assert len({tuple((s.start, s.stop) for s in shard.index) for shard in array.addressable_shards}) == 8
        for shard in array.addressable_shards:
            assert np.asarray(shard.data).tobytes() == expected[key][shard.index].tobytes(), (key, shard.device)
    assert (type(model.step.get_value()), model.step.get_value()) == (int, 41)


def test_into_a_freshly_sharded_poisoned_model(mesh, saved):
    source, path = saved
    with jax.set_mesh(mesh):
        target = poison(ShardedMLP(nnx.Rngs(1)))
    model, report = nnx_save.load_model(target, path, strict=True)
    assert model is target and report.clean
    assert_sharded_like(model, source)
    assert report.io.over_read == 1.0  # each shard read exactly its bytes


def test_through_a_builder_with_mesh_argument(mesh, saved):
    source, path = saved
    model, _report = nnx_save.load_model(lambda: poison(ShardedMLP(nnx.Rngs(1))), path, mesh=mesh, strict=True)
    assert_sharded_like(model, source)
    assert_same_state(snapshot(model), snapshot(source))


def test_through_a_builder_under_set_mesh(mesh, saved):
    source, path = saved
    with jax.set_mesh(mesh):
        model, _ = nnx_save.load_model(lambda: poison(ShardedMLP(nnx.Rngs(1))), path, strict=True)
    assert_sharded_like(model, source)


def test_builder_initialises_only_missing_leaves_sharded(mesh, saved, tmp_path):
    source, _ = saved
    path = str(tmp_path / "params-up.safetensors")
    nnx_save.save_model(source, path, filter=nnx.Not(nnx.PathContains("down")))  # no second layer

    with pytest.warns(nnx_save.LoadWarning, match=re.escape("missing: down/bias\n  missing: down/kernel\n")):
        model, report = nnx_save.load_model(lambda: ShardedMLP(nnx.Rngs(1)), path, mesh=mesh)
    assert report.missing == ["down/bias", "down/kernel"]
    with jax.set_mesh(mesh):
        fresh = ShardedMLP(nnx.Rngs(1))
    down = model.down.kernel.get_value()  # initialised by the builder, on its mesh
    assert down.sharding.spec == P("model", None) and len(down.sharding.device_set) == 8
    assert np.asarray(down).tobytes() == np.asarray(fresh.down.kernel.get_value()).tobytes()


def test_sharded_model_saves_the_global_array(mesh, saved):
    source, path = saved
    loaded = nnx_save.load_file(path)
    assert loaded["up/kernel"].shape == (16, 64)
    assert loaded["up/kernel"].tobytes() == np.asarray(source.up.kernel.get_value()).tobytes()


def test_sharded_model_into_an_unsharded_one(saved):
    source, path = saved
    target = poison(_unsharded())
    nnx_save.load_model(target, path, strict=True)
    assert_same_state(snapshot(target), snapshot(source))
    assert len(target.up.kernel.get_value().sharding.device_set) == 1


def _unsharded() -> ShardedMLP:
    class Plain(nnx.Module):
        def __init__(self) -> None:
            rngs = nnx.Rngs(3)
            self.up = nnx.Linear(16, 64, rngs=rngs)
            self.down = nnx.Linear(64, 16, rngs=rngs)
            self.step = nnx.Variable(0)

    return Plain()


def test_abstract_mesh_without_a_concrete_one_is_refused(mesh, saved):
    _, path = saved
    with (
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
        pytest.raises(
            nnx_save.ShardingError,
            match=re.escape(
                "down/bias: the builder annotates a sharding (P(None,)) on an abstract mesh {'model': 8}; "
                "pass mesh= to load_model or call it under jax.set_mesh(mesh)"
            ),
        ),
    ):
        nnx_save.load_model(lambda: ShardedMLP(nnx.Rngs(1)), path)


def test_sharded_rng_keys_resume(mesh, tmp_path):
    path = str(tmp_path / "rng.safetensors")
    spread = NamedSharding(mesh, P("model"))
    rngs = nnx.Rngs(jax.device_put(jax.random.split(jax.random.key(0), 8), spread))
    nnx_save.save_model(rngs, path)
    target = poison(nnx.Rngs(jax.device_put(jax.random.split(jax.random.key(5), 8), spread)))
    restored, _ = nnx_save.load_model(target, path, strict=True)
    key = restored.default.key.get_value()
    assert key.sharding == spread and len(key.sharding.device_set) == 8
    assert np.array_equal(
        jax.random.key_data(restored.default.key.get_value()), jax.random.key_data(rngs.default.key.get_value())
    )
    assert_same_state(snapshot(restored), snapshot(rngs))
