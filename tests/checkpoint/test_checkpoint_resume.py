"""Resuming NNX training from a checkpoint is exact; restore_into maps state back exactly."""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_save.checkpoint import OrbaxCheckpointStore, restore_into
from nnx_save.errors import DtypeMismatchError, KeyMismatchError, ShapeMismatchError

CONFIG = {"features": [4, 16, 1], "learning_rate": 0.1, "batch_size": 32, "init_seed": 0, "data_seed": 42}
TRAINED_STEPS = 100
RESUMED_STEPS = 5

# One transformation object shared by every optimizer, so the jitted step compiles once.
TX = optax.adam(CONFIG["learning_rate"])
TRUE_WEIGHTS = jnp.array([0.5, -1.0, 0.25, 2.0])


class Regressor(nnx.Module):
    def __init__(self, features, rngs: nnx.Rngs, param_dtype=jnp.float32):
        pairs = itertools.pairwise(features)
        self.layers = nnx.List([nnx.Linear(i, o, rngs=rngs, param_dtype=param_dtype) for i, o in pairs])

    def __call__(self, x):
        return self.layers[1](jnp.tanh(self.layers[0](x)))[:, 0]


def build(seed: int, features=None, **kwargs) -> tuple[Regressor, nnx.Optimizer]:
    model = Regressor(features or CONFIG["features"], nnx.Rngs(seed), **kwargs)
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@functools.partial(jax.jit, static_argnums=0)
def _train_step(graphdef, state, key):
    model, optimizer = nnx.merge(graphdef, state)
    key, batch_key = jax.random.split(key)
    x = jax.random.normal(batch_key, (CONFIG["batch_size"], 4))  # the batch depends on the rng key
    loss, grads = nnx.value_and_grad(_loss)(model, x, x @ TRUE_WEIGHTS)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer)), key


def train(model, optimizer, key, steps: int) -> tuple[np.ndarray, jax.Array]:
    """Run ``steps`` Adam steps in place; return the losses and the advanced key."""
    graphdef, state = nnx.split((model, optimizer))
    losses = []
    for _ in range(steps):
        loss, state, key = _train_step(graphdef, state, key)
        losses.append(loss)
    nnx.update((model, optimizer), state)
    return np.asarray(jnp.stack(losses)), key


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train 100 steps, checkpoint everything, then continue 5 steps (run A)."""
    model, optimizer = build(CONFIG["init_seed"])
    trained_losses, key = train(model, optimizer, jax.random.key(CONFIG["data_seed"]), TRAINED_STEPS)
    directory = tmp_path_factory.mktemp("resume") / "checkpoints"
    with OrbaxCheckpointStore(directory) as store:
        store.save(
            TRAINED_STEPS,
            {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "rng": key},
            metrics={"loss": float(trained_losses[-1])},
            extra={"config": CONFIG},
        )
    losses_a, _ = train(model, optimizer, key, RESUMED_STEPS)
    return {"directory": directory, "trained": trained_losses, "a": losses_a, "params_a": nnx.state(model, nnx.Param)}


def _poisoned_build():
    """Fresh objects whose every value differs from the checkpoint's."""
    model, optimizer = build(seed=123)
    nnx.update(optimizer, jax.tree.map(lambda a: jnp.full_like(a, 7), nnx.state(optimizer, nnx.OptState)))
    return model, optimizer


def test_training_learned_something(run):
    assert run["trained"][-1] < run["trained"][0] / 50


def test_resume_onto_templates_is_bit_exact(run):
    model, optimizer = _poisoned_build()
    with OrbaxCheckpointStore(run["directory"]) as store:
        step = store.latest_step()
        checkpoint = store.restore(
            step,
            templates={
                "model": nnx.state(model),
                "optimizer": nnx.state(optimizer),
                "rng": jax.random.key(0),
            },
        )
    assert step == TRAINED_STEPS and checkpoint.metadata.extra == {"config": CONFIG}
    restore_into(model, checkpoint.items["model"])
    restore_into(optimizer, checkpoint.items["optimizer"])
    assert int(optimizer.step[...]) == TRAINED_STEPS
    losses_b, _ = train(model, optimizer, checkpoint.items["rng"], RESUMED_STEPS)
    np.testing.assert_array_equal(losses_b, run["a"])  # bit-identical, not merely close
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), run["params_a"])


def test_resume_without_templates_maps_list_indices_back_to_ints(run):
    with OrbaxCheckpointStore(run["directory"]) as store:
        checkpoint = store.restore(TRAINED_STEPS)
    restored = checkpoint.items["model"]
    assert list(restored["layers"]) == ["0", "1"]  # Orbax stored the nnx.List indices as strings
    model, optimizer = _poisoned_build()
    with pytest.raises(KeyError, match="Invalid key: 0"):
        nnx.update(model, restored)  # why the glue exists
    restore_into(model, restored)
    restore_into(optimizer, checkpoint.items["optimizer"])
    assert list(nnx.state(model)["layers"]) == [0, 1]
    assert list(nnx.state(optimizer)["opt_state"]) == [0]
    losses_b, _ = train(model, optimizer, checkpoint.items["rng"], RESUMED_STEPS)
    np.testing.assert_array_equal(losses_b, run["a"])


def test_resume_into_abstract_objects_never_builds_real_weights(run):
    model, optimizer = nnx.eval_shape(lambda: build(CONFIG["init_seed"]))
    assert isinstance(model.layers[0].kernel.get_value(), jax.ShapeDtypeStruct)
    with OrbaxCheckpointStore(run["directory"]) as store:
        checkpoint = store.restore(
            TRAINED_STEPS,
            templates={
                "model": nnx.state(model),
                "optimizer": nnx.state(optimizer),
                "rng": jax.random.key(0),
            },
        )
    restore_into(model, checkpoint.items["model"])
    restore_into(optimizer, checkpoint.items["optimizer"])
    assert isinstance(model.layers[0].kernel.get_value(), jax.Array)
    losses_b, _ = train(model, optimizer, checkpoint.items["rng"], RESUMED_STEPS)
    np.testing.assert_array_equal(losses_b, run["a"])


def test_weights_only_with_a_fresh_adam_spikes(run):
    model, _ = _poisoned_build()
    with OrbaxCheckpointStore(run["directory"]) as store:
        checkpoint = store.restore(TRAINED_STEPS, items=["model", "rng"], templates={"model": nnx.state(model)})
    restore_into(model, checkpoint.items["model"])
    fresh_adam = nnx.Optimizer(model, TX, wrt=nnx.Param)
    losses_c, _ = train(model, fresh_adam, checkpoint.items["rng"], RESUMED_STEPS)
    assert losses_c[0] == run["a"][0]  # same weights, same first batch ...
    assert losses_c[1] > 10 * run["a"][1]  # ... but Adam's first step from zero moments overshoots
    assert losses_c.max() > 10 * run["a"].max()


# -- restore_into checks everything before changing anything ---------------------------------------


@pytest.fixture
def saved_small(tmp_path):
    """A restored model state (without a template: string keys) and the state saved."""
    model, _ = build(seed=1)
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": nnx.state(model)})
        return store.restore(1).items["model"], nnx.state(model)


def _kernel(model) -> np.ndarray:
    return np.asarray(model.layers[0].kernel[...])


def test_restore_into_refuses_missing_and_unexpected_leaves(saved_small):
    restored, _ = saved_small
    target = nnx.eval_shape(lambda: Regressor([4, 16, 16, 1], nnx.Rngs(5)))
    message = (
        "restore_into(Regressor): the restored state does not match the target's structure: "
        "2 missing (in the target, not restored): layers/2/bias/value, layers/2/kernel/value; "
        "0 unexpected (restored, not in the target): -"
    )
    with pytest.raises(KeyMismatchError, match=re.escape(message)):
        restore_into(target, restored)
    assert isinstance(target.layers[0].kernel.get_value(), jax.ShapeDtypeStruct)  # untouched
    del restored["layers"]["1"]
    with pytest.raises(
        KeyMismatchError,
        match=re.escape(
            "2 missing (in the target, not restored): layers/1/bias/value, layers/1/kernel/value; 0 unexpected"
        ),
    ):
        restore_into(build(seed=5)[0], restored)


def test_restore_into_refuses_other_shapes(saved_small):
    restored, _ = saved_small
    target, _ = nnx.eval_shape(lambda: build(seed=5, features=[4, 8, 1]))
    with pytest.raises(
        ShapeMismatchError,
        match=re.escape(
            "restore_into(Regressor): 3 leaves differ in shape: layers/0/bias/value: shape (8,) in the target, (16,) restored; "
            "layers/0/kernel/value: shape (4, 8) in the target, (4, 16) restored; "
            "layers/1/kernel/value: shape (8, 1) in the target, (16, 1) restored"
        ),
    ):
        restore_into(target, restored)


def test_restore_into_refuses_or_casts_other_dtypes(saved_small):
    restored, expected = saved_small
    target, _ = nnx.eval_shape(lambda: build(seed=5, param_dtype=jnp.bfloat16))
    with pytest.raises(
        DtypeMismatchError,
        match=re.escape(
            "restore_into(Regressor): 4 leaves differ in dtype: layers/0/bias/value: bfloat16 in the target, float32 restored; "
        ),
    ) as info:
        restore_into(target, restored)
    assert str(info.value).endswith("pass cast_dtypes=True to cast them to the target's dtypes")
    assert isinstance(target.layers[0].kernel.get_value(), jax.ShapeDtypeStruct)  # untouched
    restore_into(target, restored, cast_dtypes=True)
    assert target.layers[0].kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        _kernel(target), np.asarray(expected["layers"][0]["kernel"][...].astype(jnp.bfloat16))
    )


def test_restore_into_places_arrays_on_the_targets_shardings(saved_small):
    restored, expected = saved_small
    target, _ = build(seed=5)
    mesh = jax.make_mesh((8,), ("model",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    target.layers[0].kernel.set_value(jax.device_put(target.layers[0].kernel[...], sharding))
    restore_into(target, restored)
    assert target.layers[0].kernel[...].sharding == sharding
    np.testing.assert_array_equal(_kernel(target), np.asarray(expected["layers"][0]["kernel"][...]))
