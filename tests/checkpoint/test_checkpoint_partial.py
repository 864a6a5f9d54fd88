"""Partial restore: a subset of items, and within an item a subset of
leaves (params only; everything but a new head), with load_model's LoadReport,
strict or not, onto any mesh."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_usage
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_save import LoadReport, LoadWarning, ShapeMismatch
from nnx_save.checkpoint import OrbaxCheckpointStore, restore_into


class Net(nnx.Module):
    def __init__(self, classes: int, rngs: nnx.Rngs) -> None:
        self.body = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, classes, rngs=rngs)


def poisoned(classes: int) -> Net:
    """A model whose every float is 3.0: a restore that reads nothing leaves 3s."""
    net = Net(classes, nnx.Rngs(1))
    nnx.update(net, jax.tree.map(lambda a: jnp.full_like(a, 3), nnx.state(net)))
    return net


@pytest.fixture
def saved(tmp_path):
    net = Net(3, nnx.Rngs(0))
    net.norm.mean[...] = jnp.arange(8.0)  # batch statistics differ from the init
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": nnx.state(net), "data_iterator": {"position": 64}})
    return tmp_path, net


def test_a_subset_of_items(saved):
    directory, _ = saved
    ckpt = OrbaxCheckpointStore(directory).restore(1, items=["data_iterator"])
    assert list(ckpt.items) == ["data_iterator"] and ckpt.items["data_iterator"] == {"position": 64}


def test_params_only(saved):
    directory, net = saved
    target = poisoned(3)
    store = OrbaxCheckpointStore(directory)
    template = {"model": nnx.state(target, nnx.Param)}
    with raises_usage(
        "template",
        match=re.escape("model/norm/mean/value: stored in the checkpoint, absent from the template"),
    ):
        store.restore(1, templates=template)  # strict by default: a resume must be whole
    ckpt = store.restore(1, templates=template, allow_unexpected=["model/norm/mean/*", "model/norm/var/*"])
    report = ckpt.report
    assert isinstance(report, LoadReport) and report.clean
    assert report.allowed_unexpected == ["model/norm/mean/value", "model/norm/var/value"]
    params = ("body/bias", "body/kernel", "head/bias", "head/kernel", "norm/bias", "norm/scale")
    assert sorted(report.loaded) == sorted(  # Orbax stores Variable.value; data_iterator is restored as stored
        ["data_iterator/position", *(f"model/{p}/value" for p in params)]
    )
    nnx.update(target, ckpt.items["model"])
    np.testing.assert_array_equal(target.body.kernel[...], net.body.kernel[...])
    np.testing.assert_array_equal(target.norm.mean[...], np.full(8, 3.0))  # not read: the model's own value


def test_everything_but_a_new_head(saved):
    directory, net = saved
    target = poisoned(5)  # a new head: 5 classes instead of 3
    head_kernel = np.asarray(target.head.kernel[...])
    store = OrbaxCheckpointStore(directory)
    message = "model/head/kernel/value: shape (8, 5) in the template, (8, 3) in the checkpoint"
    with raises_usage("template", match=re.escape(message)) as info:
        store.restore(1, templates={"model": nnx.state(target)})
    assert info.value.problems == ("model/head/bias/value: shape (5,) in the template, (3,) in the checkpoint", message)
    ckpt = store.restore(1, templates={"model": nnx.state(target)}, allow_shape_mismatch=["model/head/*"])
    assert ckpt.report.clean and ckpt.report.allowed_shape_mismatches == [
        ShapeMismatch("model/head/bias/value", (5,), (3,)),
        ShapeMismatch("model/head/kernel/value", (8, 5), (8, 3)),
    ]
    restore_into(target, ckpt.items["model"])
    np.testing.assert_array_equal(target.body.kernel[...], net.body.kernel[...])
    np.testing.assert_array_equal(target.norm.mean[...], np.arange(8.0))
    np.testing.assert_array_equal(target.head.kernel[...], head_kernel)  # the new head keeps its values


def plain(classes: int, value: float | None = None) -> dict:
    """A model as plain dicts (no nnx.Variable level), every float ``value`` when given."""
    tree = nnx.to_pure_dict(nnx.state(Net(classes, nnx.Rngs(0))))
    return tree if value is None else jax.tree.map(lambda a: jnp.full_like(a, value), tree)


def test_not_strict_warns_once_with_the_report(tmp_path):
    source = plain(3)
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": source})
    template = {"model": {**plain(5, value=3.0), "extra": jnp.zeros(2)}}
    with pytest.warns(LoadWarning, match=r"6 loaded, 1 missing, 0 unexpected, 2 shape mismatches") as caught:
        ckpt = OrbaxCheckpointStore(tmp_path).restore(1, templates=template, strict=False)
    assert len(caught) == 1
    report = ckpt.report
    assert report.missing == ["model/extra"]
    assert sorted(m.path for m in report.shape_mismatches) == ["model/head/bias", "model/head/kernel"]
    assert not report.clean
    restored = ckpt.items["model"]
    np.testing.assert_array_equal(restored["extra"], np.zeros(2))  # kept from the template
    np.testing.assert_array_equal(restored["head"]["kernel"], np.full((8, 5), 3.0))
    np.testing.assert_array_equal(restored["body"]["kernel"], source["body"]["kernel"])


def test_allowed_missing_leaves_keep_the_template_value(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": plain(3)})
    template = {"model": {**plain(3, value=3.0), "adapter": jnp.ones(4)}}
    ckpt = OrbaxCheckpointStore(tmp_path).restore(1, templates=template, allow_missing=["model/adapter"])
    assert ckpt.report.allowed_missing == ["model/adapter"] and ckpt.report.clean
    np.testing.assert_array_equal(ckpt.items["model"]["adapter"], np.ones(4))
    np.testing.assert_array_equal(ckpt.items["model"]["norm"]["scale"], np.ones(8))  # read: the init, not 3


def test_a_leaf_of_another_kind_is_refused_even_when_not_strict(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": plain(3)})
    template = {"model": {**plain(3), "body": {"kernel": 1.0, "bias": jnp.ones(8)}}}
    message = "model/body/kernel: a Python value in the template, an array in the checkpoint"
    with raises_usage("template", match=re.escape(message)):
        OrbaxCheckpointStore(tmp_path).restore(1, templates=template, strict=False)


def test_allowing_a_shape_mismatch_does_not_hide_a_leaf_of_another_kind(tmp_path):
    """A leaf stored as a Python value, an array in the template, whose path an
    allow_shape_mismatch pattern matched, was once neither read nor reported: the template's
    value came back in silence."""
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": {"w": jnp.ones(3), "n": 5}})
    template = {"model": {"w": jnp.zeros(3), "n": jnp.zeros(2)}}
    message = "model/n: an array in the template, a Python value in the checkpoint"
    for options in ({"allow_shape_mismatch": ["model/n"]}, {"allow_shape_mismatch": ["model/*"], "strict": False}):
        with raises_usage("template", match=re.escape(message)):
            OrbaxCheckpointStore(tmp_path).restore(1, templates=template, **options)


def test_an_item_with_nothing_to_read(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": {"w": jnp.ones(2)}, "data_iterator": {"position": 3}})
    ckpt = OrbaxCheckpointStore(tmp_path).restore(
        1, templates={"model": {"v": jnp.zeros(2)}}, allow_missing=["model/v"], allow_unexpected=["model/w"]
    )
    assert list(ckpt.items) == ["model", "data_iterator"]
    np.testing.assert_array_equal(ckpt.items["model"]["v"], np.zeros(2))
    assert ckpt.report.loaded == ["data_iterator/position"]  # nothing of the model; the item restored as stored
    assert ckpt.items["data_iterator"] == {"position": 3}


def test_partial_restore_onto_another_mesh(tmp_path):
    devices = np.array(jax.devices()).reshape(2, 4)
    mesh_a = jax.sharding.Mesh(devices, ("a", "b"))
    mesh_b = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh_a, PartitionSpec("a", "b")))
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": {"w": w, "head": jnp.ones(3)}})
        target = NamedSharding(mesh_b, PartitionSpec(None, "x"))
        template = {"model": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=target)}}
        ckpt = store.restore(1, templates=template, allow_unexpected=["model/head"])
    got = ckpt.items["model"]["w"]
    assert got.sharding == target and len(got.addressable_shards) == 8
    np.testing.assert_array_equal(got, np.arange(64.0).reshape(8, 8))
    assert ckpt.report.loaded == ["model/w"] and ckpt.report.allowed_unexpected == ["model/head"]
