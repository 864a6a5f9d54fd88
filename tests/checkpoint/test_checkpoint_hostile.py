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
from _errors import raises_usage

import nnx_save
from nnx_save import LossyCastWarning
from nnx_save.checkpoint import (
    CheckpointDtypeMismatchError,
    OrbaxCheckpointStore,
)

STORE_RECORD = "_nnx_save_store.json"  # the store's policies (docs/checkpoints.md)
ASIDE_PREFIX = ".nnx_save-overwriting-"  # a step set aside while it is overwritten (docs/reliability.md)


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
        with raises_usage("retention", match=re.escape("keeps steps by every step")):
            store.save(4, state(4))
    with raises_usage("retention"):
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
    with raises_usage("link", match=re.escape(message)):
        store.save(6, state(6))
    with raises_usage("link", match=re.escape(message)):
        store.delete(1)
    store.close()
    assert sorted(os.listdir(store_dir)) == before
    np.testing.assert_array_equal(OrbaxCheckpointStore(target.parent).restore(5).items["model"]["w"], np.full(3, 5))


def test_a_store_without_links_still_saves_after_one_is_removed(tmp_path):
    store_dir, target = _stored(tmp_path, "ckpt")
    (store_dir / "7").symlink_to(target)
    store = OrbaxCheckpointStore(store_dir)
    with raises_usage("link"):
        store.save(8, state(8))
    (store_dir / "7").unlink()
    store.save(8, state(8))
    store.close()
    np.testing.assert_array_equal(OrbaxCheckpointStore(store_dir).restore(8).items["model"]["w"], np.full(3, 8))


PYTHON_LEAVES = {"lr": 2.5, "n": 7, "big": 2**53 + 1, "neg": -0.75, "flag": True, "name": "run-1"}
OTHER_TYPES = {"lr": 1, "n": True, "big": 1.0, "neg": 0, "flag": True, "name": "x"}


def _python_store(tmp_path) -> OrbaxCheckpointStore:
    store = OrbaxCheckpointStore(tmp_path)
    store.save(1, {"extensions": PYTHON_LEAVES})
    return store


def test_python_leaves_through_templates_of_another_type_are_refused(tmp_path):
    with _python_store(tmp_path) as store:
        message = (
            "step 1: 4 leaves change type on restore:\n"
            "  extensions/big: int (Python) saved, float (Python) in the template\n"
            "  extensions/lr: float (Python) saved, int (Python) in the template\n"
            "  extensions/n: int (Python) saved, bool (Python) in the template\n"
            "  extensions/neg: float (Python) saved, int (Python) in the template\n"
            "Pass allow_casts=['extensions/big', 'extensions/lr', 'extensions/n', 'extensions/neg'] to accept them "
            "(LOSSY casts: the restored values can differ from the saved)"
        )
        with pytest.raises(CheckpointDtypeMismatchError, match=re.escape(message)):
            store.restore(1, templates={"extensions": OTHER_TYPES})
        same = store.restore(1, templates={"extensions": {k: type(v)(v) for k, v in PYTHON_LEAVES.items()}})
        assert same.items["extensions"] == PYTHON_LEAVES
        assert all(type(same.items["extensions"][k]) is type(v) for k, v in PYTHON_LEAVES.items())


def test_python_leaves_cast_only_when_asked_and_lossy_casts_are_reported(tmp_path):
    with _python_store(tmp_path) as store, pytest.warns(LossyCastWarning) as caught:
        ckpt = store.restore(1, templates={"extensions": OTHER_TYPES}, cast_dtypes=True)
    assert ckpt.items["extensions"] == {**OTHER_TYPES, "lr": 2, "n": True, "big": 2.0**53, "neg": 0, "name": "run-1"}
    assert sorted(str(w.message).split(":")[0] for w in caught) == [
        "extensions/big",
        "extensions/lr",
        "extensions/n",
        "extensions/neg",
    ]
    assert any("extensions/lr: the stored float (Python) 2.5 is restored as 2 (int" in str(w.message) for w in caught)
    casts = sorted(ckpt.report.dtype_casts, key=lambda c: c.path)
    assert [str(c) for c in casts] == [
        "extensions/big: int (Python) in the file -> float (Python) in the model",
        "extensions/lr: float (Python) in the file -> int (Python) in the model",
        "extensions/n: int (Python) in the file -> bool (Python) in the model",
        "extensions/neg: float (Python) in the file -> int (Python) in the model",
    ]
    # The report judges the types (numpy calls int64 -> float64 safe); the warning judged each value.
    assert [c.path for c in casts if c.lossy] == ["extensions/lr", "extensions/n", "extensions/neg"]


def test_an_exact_cast_of_a_python_leaf_warns_nothing(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"extensions": {"epochs": 3.0, "seen": 1}})
        ckpt = store.restore(1, templates={"extensions": {"epochs": 0, "seen": False}}, cast_dtypes=True)
    assert ckpt.items["extensions"] == {"epochs": 3, "seen": True}
    assert type(ckpt.items["extensions"]["epochs"]) is int and type(ckpt.items["extensions"]["seen"]) is bool


def test_nan_onto_an_int_template_is_a_template_error(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"extensions": {"loss": float("nan")}})
        message = "extensions/loss: the stored float (Python) nan cannot be restored as int (Python)"
        with raises_usage("template", match=re.escape(message)):
            store.restore(1, templates={"extensions": {"loss": 0}}, cast_dtypes=True)


@pytest.mark.parametrize("cast_dtypes", [False, True])
def test_a_template_of_the_wrong_kind_is_a_template_error_not_a_damaged_step(tmp_path, cast_dtypes):
    with _python_store(tmp_path) as store:
        message = (
            "step 1: 2 template leaves disagree with the checkpoint:\n"
            "  extensions/lr: a str in the template, a float in the checkpoint\n"
            "  extensions/name: an int in the template, a str in the checkpoint"
        )
        with raises_usage("template", match=re.escape(message)):
            store.restore(1, templates={"extensions": {**PYTHON_LEAVES, "lr": "x", "name": 0}}, cast_dtypes=cast_dtypes)
        assert store.damaged_steps() == {}
        assert store.restore(1).items["extensions"] == PYTHON_LEAVES


def _hf(d) -> None:
    nnx_save.save_file({f"t{i}": np.full((64,), 1.0, np.float32) for i in range(3)}, d, max_shard_size=512)


def _pod(d) -> None:
    nnx_save.save_pod({"t": np.full((64,), 1.0, np.float32)}, d)


def _single(d) -> None:
    nnx_save.save_file({"t": np.full((64,), 1.0, np.float32)}, d / "weights.safetensors")


@pytest.mark.parametrize(
    ("make", "entry"),
    [(_hf, "model.safetensors.index.json"), (_pod, "manifest.json"), (_single, "1 .safetensors files")],
)
def test_a_store_over_another_layouts_checkpoint_is_refused_before_anything_changes(tmp_path, make, entry):
    """A store opened over an HF, pod or single-file checkpoint wrote its steps beside it."""
    make(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    loaded = nnx_save.load_file(tmp_path if make is not _single else tmp_path / "weights.safetensors")
    message = f"checkpoint directory {tmp_path}: holds {entry}"
    with OrbaxCheckpointStore(tmp_path) as store:
        with raises_usage("directory", match=re.escape(message)):
            store.save(1, state(1))
        with raises_usage("directory", match=re.escape(message)):
            store.save(1, state(1))  # and on every call
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    again = nnx_save.load_file(tmp_path if make is not _single else tmp_path / "weights.safetensors")
    assert again.keys() == loaded.keys()
