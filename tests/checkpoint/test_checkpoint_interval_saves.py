"""Orbax's habit: with a save interval, ``save()`` called at every step writes only
the steps that are due; ``force=True`` (and ``overwrite=True``) writes anyway."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnx_save.checkpoint import OrbaxCheckpointStore


def _items(step: int) -> dict:
    return {"model": {"w": jnp.full(3, float(step))}}


def test_save_every_step_writes_the_due_steps(tmp_path):
    with OrbaxCheckpointStore(tmp_path, max_to_keep=None, save_interval_steps=5) as store:
        written = {step: store.save(step, _items(step)) for step in range(1, 13)}
        assert store.list_steps() == [5, 10]
        assert {s for s, path in written.items() if path is not None} == {5, 10}
        assert written[10] == tmp_path / "10"
        assert store.save(13, _items(13), force=True) == tmp_path / "13"  # not due: forced
        assert store.list_steps() == [5, 10, 13]
        assert store.save(13, _items(130), overwrite=True) == tmp_path / "13"  # an explicit replacement
        assert float(store.restore(13).items["model"]["w"][0]) == 130.0


def test_should_save_and_save_agree(tmp_path):
    with OrbaxCheckpointStore(tmp_path, max_to_keep=None, save_interval_steps=3) as store:
        for step in range(1, 10):
            asked = store.should_save(step)
            assert (store.save(step, _items(step)) is not None) == asked
        assert store.list_steps() == [3, 6, 9]


def test_a_seconds_interval_skips_too(tmp_path):
    with OrbaxCheckpointStore(tmp_path, max_to_keep=None, save_interval_seconds=3600) as store:
        assert [store.save(step, _items(step)) for step in (1, 2, 3)] == [None, None, None]
        assert store.list_steps() == []


def test_without_an_interval_every_call_saves(tmp_path):
    with OrbaxCheckpointStore(tmp_path, max_to_keep=None) as store:
        assert [store.save(step, _items(step)).name for step in (1, 2, 3)] == ["1", "2", "3"]


def test_a_skipped_step_is_not_checked(tmp_path):
    """Nothing of a skipped step is looked at (as Orbax's manager returns before
    serialising): a loop pays nothing for the steps that are not due."""
    with OrbaxCheckpointStore(tmp_path, save_interval_steps=5) as store:
        assert store.save(1, {"model": {"w": object()}}) is None
        with pytest.raises(TypeError):
            store.save(5, {"model": {"w": object()}})


@settings(max_examples=20)
@given(st.integers(1, 7), st.lists(st.integers(1, 40), min_size=1, max_size=12, unique=True))
def test_the_steps_written_are_the_due_ones(tmp_path_factory, every, steps):
    steps = sorted(steps)
    with OrbaxCheckpointStore(tmp_path_factory.mktemp("due"), max_to_keep=None, save_interval_steps=every) as store:
        for step in steps:
            store.save(step, _items(step))
        assert store.list_steps() == [s for s in steps if s % every == 0]
