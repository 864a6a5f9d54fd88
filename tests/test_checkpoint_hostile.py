"""The store against a hostile directory and careless calls: a refused retention
change stays refused, the store's record is never written through a planted link,
symlinked entries are refused (typed, naming the entry) before anything changes,
Python leaves keep their type unless a cast is asked for, and a wrong-kind template
is a template error, not a damaged step."""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from nnx_save.checkpoint import (
    CheckpointLinkError,
    CheckpointRetentionError,
    OrbaxCheckpointStore,
)
from nnx_save.checkpoint._disk import ASIDE_PREFIX
from nnx_save.checkpoint._retention import STORE_RECORD


def state(step: int) -> dict:
    return {"model": {"w": jnp.full((3,), step, jnp.float32)}}


def steps_on_disk(directory) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_a_refused_retention_change_is_refused_on_every_call(tmp_path):
    with OrbaxCheckpointStore(tmp_path, max_to_keep=None) as store:
        for step in (1, 2, 3):
            store.save(step, state(step))
    store = OrbaxCheckpointStore(tmp_path, max_to_keep=1)
    for _ in range(3):
        with pytest.raises(CheckpointRetentionError, match=re.escape("keeps steps by every step")):
            store.save(4, state(4))
    with pytest.raises(CheckpointRetentionError):
        store.list_steps()
    store.close()
    assert steps_on_disk(tmp_path) == [1, 2, 3]


def test_the_store_record_is_never_written_through_a_planted_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    store_dir = tmp_path / "ckpt"
    store_dir.mkdir()
    (store_dir / f".{STORE_RECORD}.tmp").symlink_to(outside)
    with OrbaxCheckpointStore(store_dir, max_to_keep=2) as store:
        store.save(1, state(1))
    assert outside.read_text() == "precious"
    assert OrbaxCheckpointStore(store_dir).max_to_keep == 2  # the record was written, in the store


def _stored(tmp_path, name: str):
    """A store holding steps 1 and 2, and a valid step 5 elsewhere."""
    store_dir, elsewhere = tmp_path / name, tmp_path / f"{name}-elsewhere"
    with OrbaxCheckpointStore(store_dir, max_to_keep=None) as store:
        store.save(1, state(1))
        store.save(2, state(2))
    with OrbaxCheckpointStore(elsewhere) as other:
        other.save(5, state(5))
    return store_dir, elsewhere / "5"


@pytest.mark.parametrize("entry", ["5", f"{ASIDE_PREFIX}2", "3.orbax-checkpoint-tmp"])
def test_a_symlinked_store_entry_is_refused_before_anything_changes(tmp_path, entry):
    store_dir, target = _stored(tmp_path, "ckpt")
    (store_dir / entry).symlink_to(target)
    before = sorted(os.listdir(store_dir))
    store = OrbaxCheckpointStore(store_dir, max_to_keep=1, change_retention=True)  # retention would delete
    message = (
        f"{store_dir / entry}: this entry of the checkpoint store {store_dir} is a symbolic link (to {str(target)!r})"
    )
    with pytest.raises(CheckpointLinkError, match=re.escape(message)):
        store.save(6, state(6))
    with pytest.raises(CheckpointLinkError, match=re.escape(message)):
        store.delete(1)
    store.close()
    assert sorted(os.listdir(store_dir)) == before
    np.testing.assert_array_equal(OrbaxCheckpointStore(target.parent).restore(5).items["model"]["w"], np.full(3, 5))


def test_a_store_without_links_still_saves_after_one_is_removed(tmp_path):
    store_dir, target = _stored(tmp_path, "ckpt")
    (store_dir / "7").symlink_to(target)
    store = OrbaxCheckpointStore(store_dir)
    with pytest.raises(CheckpointLinkError):
        store.save(8, state(8))
    (store_dir / "7").unlink()
    store.save(8, state(8))
    store.close()
    np.testing.assert_array_equal(OrbaxCheckpointStore(store_dir).restore(8).items["model"]["w"], np.full(3, 8))
