"""The Orbax store's asynchronous saves: ``save(..., blocking=False)`` returns before
the step is written; training may donate the saved buffers; reads, the next save,
``wait_until_finished``, ``close`` and the ``with`` block wait; refusals still raise
at the call."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_save.checkpoint import CheckpointNotWrittenError, OrbaxCheckpointStore

_step = jax.jit(lambda tree: jax.tree.map(lambda a: a * 0.5 - 1.0, tree), donate_argnums=0)


def _state(seed: float) -> dict:
    return {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) + seed, "b": jnp.full((64,), seed, jnp.float32)}


def _expected(seed: float, steps: int) -> dict:
    """The state after ``steps`` updates, replayed without donation or saving."""
    tree = {k: np.asarray(v) for k, v in _state(seed).items()}
    for _ in range(steps):
        tree = {k: v * np.float32(0.5) - np.float32(1.0) for k, v in tree.items()}
    return tree


def test_async_saves_hold_the_state_of_their_step_despite_donation(tmp_path):
    directory = tmp_path / "ckpt"
    with OrbaxCheckpointStore(directory, max_to_keep=None) as store:
        state, donated = _state(1.0), []
        for i in range(6):
            if i % 2 == 0:
                store.save(i, {"model": state}, blocking=False)
            else:
                donated.append(state["w"])
            state = _step(state)
        assert all(a.is_deleted() for a in donated)  # the loop really donates
        store.wait_until_finished()
        assert store.list_steps() == [0, 2, 4]
    with OrbaxCheckpointStore(directory) as store:
        for i in (0, 2, 4):
            got = store.restore(i).items["model"]
            want = _expected(1.0, i)
            assert {k: np.asarray(v).tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}


def test_a_pending_step_is_listed_and_readable_and_close_waits(tmp_path):
    directory = tmp_path / "ckpt"
    store = OrbaxCheckpointStore(directory)
    path = store.save(3, {"model": _state(2.0)}, metrics={"loss": 0.25}, blocking=False)
    assert store.list_steps() == [3] and path == directory / "3"
    assert store.read_metadata(3).metrics == {"loss": 0.25}  # waits for the commit
    store.save(4, {"model": _state(3.0)}, blocking=False)
    store.close()
    assert (directory / "4").is_dir()
    with OrbaxCheckpointStore(directory) as again:
        np.testing.assert_array_equal(np.asarray(again.restore(4).items["model"]["b"]), np.full(64, 3.0, np.float32))
    with pytest.raises(ValueError, match="is closed"):
        store.list_steps()


def test_refusals_raise_at_the_call_while_a_save_is_pending(tmp_path):
    with OrbaxCheckpointStore(tmp_path / "ckpt") as store:
        store.save(5, {"model": _state(0.0)}, blocking=False)
        with pytest.raises(CheckpointNotWrittenError, match=re.escape("step 5")):
            store.save(5, {"model": _state(1.0)}, blocking=False)
        with pytest.raises(CheckpointNotWrittenError, match=re.escape("step 4")):
            store.save(4, {"model": _state(1.0)}, blocking=False)
        store.wait_until_finished()
        assert store.list_steps() == [5]
        np.testing.assert_array_equal(np.asarray(store.restore(5).items["model"]["b"]), np.zeros(64, np.float32))


def test_an_overwrite_waits_for_its_replacement(tmp_path):
    with OrbaxCheckpointStore(tmp_path / "ckpt") as store:
        store.save(1, {"model": _state(0.0)}, blocking=False)
        store.save(1, {"model": _state(9.0)}, overwrite=True, blocking=False)
        assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".nnx_save-overwriting-")]
        np.testing.assert_array_equal(np.asarray(store.restore(1).items["model"]["b"]), np.full(64, 9.0, np.float32))
