"""Damaged steps fail typed: each kind of damage raises CheckpointCorruptError
naming the step and the file, and listing keeps working, saying which steps are damaged."""

from __future__ import annotations

import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from nnx_save import NnxSaveError
from nnx_save.checkpoint import (
    CheckpointCorruptError,
    CheckpointDamageWarning,
    CheckpointError,
    OrbaxCheckpointStore,
    UnsupportedCheckpointError,
)


def state(step: int) -> dict:
    return {
        "model": {"w": jnp.arange(256.0) + step, "b": jnp.full((4,), step, jnp.int32)},
        "data_iterator": {"at": step},
    }


@pytest.fixture
def saved(tmp_path):
    """A store of steps 1, 2, 3 (written by one store object, read by fresh ones)."""
    with OrbaxCheckpointStore(tmp_path / "ckpt", max_to_keep=None) as store:
        for step in (1, 2, 3):
            store.save(step, state(step))
    return tmp_path / "ckpt"


def _damaged_listing(directory):
    """A fresh store's listing, which must warn once about the damaged steps."""
    store = OrbaxCheckpointStore(directory)
    with pytest.warns(CheckpointDamageWarning) as caught:
        steps, latest = store.list_steps(), store.latest_step()
    assert len(caught) == 1
    return store, steps, latest, str(caught[0].message)


# When one read fails, Orbax closes its asyncio loop while tensorstore's other reads are in
# flight; their completion callbacks then hit the closed loop ("Event loop is closed"),
# which Python reports as unraisable. That is Orbax's failure path, not nnx_save's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_truncated_array_file_raises_on_restore(saved):
    for root, _, names in os.walk(saved / "2" / "model"):
        for name in names if os.path.basename(root) == "d" else ():  # Orbax's array data files
            os.truncate(os.path.join(root, name), 10)
    store = OrbaxCheckpointStore(saved)
    assert store.list_steps() == [1, 2, 3]  # found only when read: a listing does not read arrays
    with pytest.raises(CheckpointCorruptError) as info:
        store.restore(2)
    error = info.value
    assert (error.step, error.path) == (2, f"{saved}/2/model/")
    assert re.fullmatch(
        r"an array file is truncated or unreadable \(array 'item\.[wb]/[^']+'\): (OUT_OF_RANGE|DATA_LOSS): .+",
        error.problem,
    )
    assert str(error).startswith(f"step 2 is damaged: {saved}/2/model/: an array file is truncated")
    assert isinstance(error, CheckpointError) and isinstance(error, NnxSaveError) and isinstance(error, ValueError)
    np.testing.assert_array_equal(store.restore(3).items["model"]["w"], np.arange(256.0) + 3)  # others unaffected


def test_a_missing_item_metadata_file(saved):
    os.remove(saved / "2" / "model" / "_METADATA")
    store, steps, latest, warning = _damaged_listing(saved)
    assert (steps, latest) == ([1, 3], 3)
    path = f"{saved}/2/model/_METADATA"
    assert (
        warning
        == f"{saved}: 1 damaged steps are left out of list_steps(): step 2: {path}: Orbax's metadata file of item 'model' is missing"
    )
    message = f"step 2 is damaged: {path}: Orbax's metadata file of item 'model' is missing"
    for call in (store.restore, store.read_metadata):
        with pytest.raises(CheckpointCorruptError, match=re.escape(message)):
            call(2)
    assert {s: str(e) for s, e in store.damaged_steps().items()} == {2: message}


def test_a_malformed_record(saved):
    (saved / "3" / "nnx_save_metadata" / "metadata").write_text('{"format": "nnx_save.checkpoint", ')
    store, steps, latest, _ = _damaged_listing(saved)
    assert (steps, latest) == ([1, 2], 2)  # the latest intact step: a resume would not crash
    path = f"{saved}/3/nnx_save_metadata/metadata"
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"step 3 is damaged: {path}: not valid JSON (")) as info:
        store.restore(3)
    assert (info.value.step, info.value.path) == (3, path)


def test_a_record_that_is_json_but_not_ours_is_unsupported_not_damaged(saved):
    path = saved / "3" / "nnx_save_metadata" / "metadata"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 99}))
    store = OrbaxCheckpointStore(saved)
    assert store.list_steps() == [1, 2, 3] and store.damaged_steps() == {}
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("format version 99, newer than this nnx_save")):
        store.restore(3)


def test_a_missing_item(saved):
    shutil.rmtree(saved / "1" / "data_iterator")
    store, steps, _, _ = _damaged_listing(saved)
    assert steps == [2, 3]
    message = f"step 1 is damaged: {saved}/1/data_iterator: the directory of item 'data_iterator', named in the step's record, is missing"
    with pytest.raises(CheckpointCorruptError, match=re.escape(message)):
        store.restore(1, items=["model"])  # the step as a whole is damaged


def test_a_missing_record_file(saved):
    os.remove(saved / "2" / "nnx_save_metadata" / "metadata")
    store, steps, _, _ = _damaged_listing(saved)
    assert steps == [1, 3]
    message = f"step 2 is damaged: {saved}/2/nnx_save_metadata/metadata: the file is missing"
    with pytest.raises(CheckpointCorruptError, match=re.escape(message)):
        store.read_metadata(2)


def test_a_malformed_dtype_record(saved):
    (saved / "2" / "nnx_save_dtypes" / "metadata").write_text("[")
    store, steps, _, _ = _damaged_listing(saved)
    assert steps == [1, 3]
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"{saved}/2/nnx_save_dtypes/metadata: not valid JSON")):
        store.restore(2)


def test_a_damaged_store_keeps_saving_and_a_damaged_step_can_be_overwritten_or_deleted(saved):
    os.remove(saved / "2" / "model" / "_METADATA")
    os.remove(saved / "3" / "model" / "_METADATA")
    store = OrbaxCheckpointStore(saved)
    with pytest.warns(CheckpointDamageWarning, match=re.escape("2 damaged steps are left out")), store:
        store.save(4, state(4))
        store.save(2, state(20), overwrite=True)
        store.delete(3)
        assert store.list_steps() == [1, 2, 4] and store.damaged_steps() == {}
        np.testing.assert_array_equal(store.restore(2).items["model"]["w"], np.arange(256.0) + 20)
    assert sorted(p.name for p in saved.iterdir() if not p.name.startswith("_")) == ["1", "2", "4"]


def test_retention_leaves_damaged_steps_alone(saved):
    os.remove(saved / "1" / "model" / "_METADATA")
    store = OrbaxCheckpointStore(saved, max_to_keep=1, change_retention=True)
    with pytest.warns(CheckpointDamageWarning), store:
        store.save(4, state(4))
        assert store.list_steps() == [4]
    assert sorted(p.name for p in saved.iterdir() if not p.name.startswith("_")) == ["1", "4"]
