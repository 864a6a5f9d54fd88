"""Params-only restores for evaluation: the documented template
``nnx.state(model, nnx.Param)``, refusals that end with the option accepting
them (followed, they restore), and ``restore_into``'s ``filter=``."""

from __future__ import annotations

import ast
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_usage
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from nnx_save.checkpoint import CheckpointUsageError, OrbaxCheckpointStore, restore_into
from nnx_save.errors import KeyMismatchError


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.body = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)


def poisoned() -> Net:
    net = Net(nnx.Rngs(5, dropout=6))
    nnx.update(net, jax.tree.map(lambda a: jnp.full_like(a, 3), nnx.state(net, nnx.Param)))
    return net


def suggested(message: str, option: str) -> list[str]:
    """The patterns a refusal suggests for ``option`` (as a Python literal in its text)."""
    found = re.search(rf"{option}=(\[[^\]]*\])", message)
    assert found, message
    return ast.literal_eval(found.group(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("params_only")
    net = Net(nnx.Rngs(0, dropout=1))
    net.norm.mean[...] = jnp.arange(8.0)
    with OrbaxCheckpointStore(directory) as store:
        store.save(1, {"model": nnx.state(net)})
    return directory, net


def test_the_documented_template_is_refused_with_the_option_that_accepts_it(saved):
    directory, net = saved
    target = poisoned()
    store = OrbaxCheckpointStore(directory)
    template = {"model": nnx.state(target, nnx.Param)}
    with raises_usage("template") as info:
        store.restore(1, templates=template)
    message = str(info.value)
    assert message.endswith("or strict=False (take what matches, warn once)"), message
    assert suggested(message, "allow_unexpected") == ["model/*"]  # rngs and batch stats: no shared deeper prefix
    ckpt = store.restore(1, templates=template, allow_unexpected=suggested(message, "allow_unexpected"))
    restore_into(target, ckpt.items["model"], filter=nnx.Param)
    for path, variable in nnx.to_flat_state(nnx.state(target, nnx.Param)):
        want = dict(nnx.to_flat_state(nnx.state(net, nnx.Param)))[path]
        np.testing.assert_array_equal(variable.get_value(), want.get_value())
    np.testing.assert_array_equal(target.norm.mean[...], np.zeros(8))  # batch stats: the target's own
    assert int(target.drop.rngs.count[...]) == 0  # the rng stream: the target's own


def test_restore_into_takes_load_models_filter(saved):
    directory, net = saved
    whole = OrbaxCheckpointStore(directory).restore(1).items["model"]  # as stored: everything
    target = poisoned()
    restore_into(target, whole, filter=nnx.Param)  # the rest of the stored state is not unexpected
    np.testing.assert_array_equal(target.head.kernel[...], net.head.kernel[...])
    np.testing.assert_array_equal(target.norm.mean[...], np.zeros(8))
    with pytest.raises(KeyMismatchError, match=re.escape("1 unexpected (restored, not in the target): extra")):
        restore_into(poisoned(), {**whole, "extra": jnp.zeros(2)}, filter=nnx.Param)  # not the target's at all
    params_only = {k: v for k, v in whole.items() if k != "head"}
    with pytest.raises(KeyMismatchError, match=re.escape("2 missing (in the target, not restored): head/bias/value")):
        restore_into(poisoned(), params_only, filter=nnx.Param)


def test_a_missing_item_names_the_items_to_restore(saved):
    directory, _ = saved
    with raises_usage("item", match=re.escape("pass items=['model'] (and templates for those only)")):
        OrbaxCheckpointStore(directory).restore(1, items=["model", "optimizer"])


def _stored() -> dict:
    return {"a": {"w": np.arange(6.0).reshape(2, 3), "b": np.ones(3)}, "c": {"d": {"e": np.zeros(4)}}, "n": 3}


_PATHS = [("a", "w"), ("a", "b"), ("c", "d", "e")]


def _template(drop: list[bool], reshape: list[bool], extra: bool) -> dict:
    out: dict = {"n": 0}
    for (path, keep), wide in zip(zip(_PATHS, drop, strict=True), reshape, strict=True):
        if not keep:
            continue
        leaf = _stored()
        for key in path:
            leaf = leaf[key]
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.zeros((leaf.shape[0] + 1,) if wide else leaf.shape)
    if extra:
        out.setdefault("c", {}).setdefault("d", {})["new"] = np.zeros(2)
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    directory = tmp_path_factory.mktemp("small")
    with OrbaxCheckpointStore(directory) as store:
        store.save(1, {"extensions": _stored()})
    return OrbaxCheckpointStore(directory)


@settings(max_examples=25)
@given(st.lists(st.booleans(), min_size=3, max_size=3), st.lists(st.booleans(), min_size=3, max_size=3), st.booleans())
def test_every_template_refusal_names_options_that_followed_restore(small, keep, reshape, extra):
    """Any template missing, adding or reshaping leaves is refused with the options
    that accept it; passing exactly those restores, and nothing else is excused."""
    template = {"extensions": _template(keep, reshape, extra)}
    try:
        small.restore(1, templates=template)
        return  # the template matched the step
    except CheckpointUsageError as error:
        message = str(error)
    options = {
        option: suggested(message, option)
        for option in ("allow_unexpected", "allow_missing", "allow_shape_mismatch")
        if f"{option}=" in message
    }
    assert options and message.endswith("or strict=False (take what matches, warn once)"), message
    ckpt = small.restore(1, templates=template, **options)
    assert ckpt.report.missing == ckpt.report.unexpected == ckpt.report.shape_mismatches == []
    for option in options:  # each suggested option is needed
        fewer = {k: v for k, v in options.items() if k != option}
        with pytest.raises(CheckpointUsageError):
            small.restore(1, templates=template, **fewer)
