"""What a new user reaches for: restoring a step onto another mesh from
templates made by ``nnx.eval_shape`` under ``jax.set_mesh``, with a report that counts
what was read; and Orbax ``CheckpointManager`` habits (``restore()`` for the latest step,
``all_steps()``, ``best_step()`` by the retention's metric, a way for other items)."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from nnx_save.checkpoint import (
    CheckpointNotFoundError,
    OrbaxCheckpointStore,
    Retention,
    restore_into,
)
from nnx_save.errors import OptionError, ShardingError

AXES = ("data", "model")


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), AXES)
        self.dense = nnx.Linear(256, 512, kernel_init=init, rngs=rngs)
        self.head = nnx.Linear(
            512, 8, kernel_init=nnx.with_partitioning(nnx.initializers.ones, (None, "model")), rngs=rngs
        )


def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, AXES, devices=jax.devices()[: shape[0] * shape[1]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A step saved on a 4x2 mesh, and its values on the host."""
    directory = tmp_path_factory.mktemp("mesh")
    with jax.set_mesh(mesh_of((4, 2))):
        net = Net(nnx.Rngs(0))
        net.dense.bias[...] = jnp.arange(512, dtype=jnp.float32)  # not zeros: a restore that skipped it would show
    with OrbaxCheckpointStore(directory) as store:
        store.save(7, {"model": nnx.state(net)})
    host = {path: np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(nnx.state(net))}
    return directory, host


def abstract_on(mesh: jax.sharding.Mesh) -> Net:
    with jax.set_mesh(mesh):
        return nnx.eval_shape(lambda: Net(nnx.Rngs(1)))


@pytest.mark.parametrize("shape", [(2, 4), (1, 1), (8, 1)], ids=["2x4", "one device", "8x1"])
@pytest.mark.parametrize("how", ["mesh=", "jax.set_mesh"])
def test_a_step_saved_on_4x2_restores_onto_another_mesh_exactly(saved, shape, how):
    directory, host = saved
    mesh = mesh_of(shape)
    target = abstract_on(mesh)
    given = {"mesh": mesh} if how == "mesh=" else {}
    scope = jax.set_mesh(mesh) if how == "jax.set_mesh" else contextlib.nullcontext()
    with scope, OrbaxCheckpointStore(directory) as store:
        checkpoint = store.restore(7, templates={"model": nnx.state(target)}, **given)
        restore_into(target, checkpoint.items["model"], **given)
    got = dict(jax.tree_util.tree_leaves_with_path(nnx.state(target)))
    assert got.keys() == host.keys()
    for path, value in got.items():
        assert isinstance(value, jax.Array) and value.sharding.mesh.devices.shape == shape, path
        assert np.array_equal(np.asarray(value), host[path]), path
    assert target.dense.kernel[...].sharding.spec == P(*AXES)
    io = checkpoint.report.io
    assert io.bytes_needed == sum(v.nbytes for v in host.values()) == 256 * 512 * 4 + 512 * 4 + 512 * 8 * 4 + 8 * 4
    assert io.bytes_read > 0 and io.requests > 0 and io.files > 0 and io.read_seconds > 0
    assert "read 0.0 MB" not in str(io)


def test_an_abstract_template_without_a_mesh_is_a_typed_error(saved):
    directory, _ = saved
    target = abstract_on(mesh_of((2, 4)))
    with OrbaxCheckpointStore(directory) as store:
        with pytest.raises(
            ShardingError,
            match=re.escape(
                "templates['model']: dense/bias/value: the sharding P(None,) is on an abstract mesh {'data': 2, 'model': 4}"
            ),
        ):
            store.restore(7, templates={"model": nnx.state(target)})
        with pytest.raises(
            ShardingError, match=re.escape("and the mesh to place it on has axes {'data': 4, 'model': 2}")
        ):
            store.restore(7, templates={"model": nnx.state(target)}, mesh=mesh_of((4, 2)))
        state = store.restore(7, templates={"model": nnx.state(target)}, mesh=mesh_of((2, 4))).items["model"]
    with pytest.raises(ShardingError, match=re.escape("restore_into(Net): dense/bias/value: the sharding")):
        restore_into(target, state)


# -- Orbax CheckpointManager habits ----------------------------------------------------


def test_restore_without_a_step_reads_the_latest(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        with pytest.raises(CheckpointNotFoundError, match=re.escape(f"no checkpoint in {tmp_path} (steps held: none)")):
            store.restore()
        for step in (3, 5):
            store.save(step, {"model": {"w": jnp.full((2,), float(step))}})
        assert store.restore().step == store.restore(None).step == 5
        assert store.restore().items["model"]["w"].tolist() == [5.0, 5.0]
        assert store.all_steps() == store.list_steps() == [3, 5]


def test_best_step_ranks_by_the_retention_metric_by_default(tmp_path):
    losses = {1: 0.5, 2: 0.1, 3: 0.9}
    retention = Retention(latest=1, best=2, metric="acc", mode="max")
    with OrbaxCheckpointStore(tmp_path, retention=retention) as store:
        for step, loss in losses.items():
            store.save(step, {"model": {"w": jnp.ones(2)}}, metrics={"loss": loss, "acc": 1 - loss})
        assert store.best_step() == 2  # acc, max: the retention's
        assert store.best_step("loss") == 2 and store.best_step("loss", mode="max") == 3
    with OrbaxCheckpointStore(tmp_path / "plain") as store:
        store.save(1, {"model": {"w": jnp.ones(2)}}, metrics={"loss": 1.0})
        with pytest.raises(OptionError, match=re.escape("best_step() needs a metric: the retention of")):
            store.best_step()


def test_an_item_beyond_the_names_is_refused_naming_extensions(tmp_path):
    way = "put other state in extensions, e.g. items={'extensions': {'ema': ...}}"
    with OrbaxCheckpointStore(tmp_path) as store:
        with pytest.raises(
            OptionError,
            match=re.escape(
                f"unknown item name 'ema'; expected one of model, optimizer, rng, data_iterator, extensions; {way}"
            ),
        ):
            store.save(1, {"model": {"w": jnp.ones(2)}, "ema": {"w": jnp.ones(2)}})
        store.save(1, {"model": {"w": jnp.ones(2)}, "extensions": {"ema": {"w": jnp.full((2,), 3.0)}}})
        with pytest.raises(OptionError, match=re.escape(way)):
            store.restore(1, templates={"ema": {"w": jnp.ones(2)}})
        assert store.restore(1).items["extensions"]["ema"]["w"].tolist() == [3.0, 3.0]


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 9),
    mesh_shape=st.sampled_from([(8,), (4, 2), (2, 4), (2, 2), (1, 8)]),
    spec=st.sampled_from([P("a"), P(None, "a"), P("a", "b"), P("b", "a"), P(("a", "b")), P(None, ("a", "b")), P()]),
)
def test_restore_and_load_file_refuse_the_same_shardings_alike(tmp_path_factory, rows, cols, mesh_shape, spec):
    """Over shapes, meshes and specs: a template sharding that cannot hold the shape (a
    split that does not divide a dimension) is the same ``ShardingError`` from
    ``store.restore`` as from ``load_file``, before any read; one that can restores exactly."""
    import nnx_save

    names = ("a", "b")[: len(mesh_shape)]
    if any(axis not in names for part in spec for axis in ((part,) if isinstance(part, str) else part or ())):
        return  # a spec naming an axis the mesh lacks is another error
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(names))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    value = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    where = tmp_path_factory.mktemp("divide")
    nnx_save.save_file({"w": value}, where / "w.safetensors")
    with OrbaxCheckpointStore(where / "store") as store:
        store.save(1, {"model": {"w": value}})
    template = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    outcomes = []
    for restore in (
        lambda: nnx_save.load_file(where / "w.safetensors", {"w": template})["w"],
        lambda: (
            OrbaxCheckpointStore(where / "store").restore(1, templates={"model": {"w": template}}).items["model"]["w"]
        ),
    ):
        try:
            got = restore()
        except ShardingError as error:
            assert "cannot hold shape" in str(error), error
            outcomes.append("refused")
        else:
            np.testing.assert_array_equal(np.asarray(got), value)
            assert got.sharding == sharding
            outcomes.append("restored")
    assert outcomes[0] == outcomes[1], outcomes
