"""OrbaxCheckpointStore: strict writes, guarded reads, retention, metadata, topology, crashes."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _errors import raises_usage
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import nnx_save
from nnx_save.checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Checkpoint,
    CheckpointDtypeMismatchError,
    CheckpointError,
    CheckpointMetadata,
    CheckpointNotFoundError,
    CheckpointNotWrittenError,
    CheckpointStore,
    DtypeMismatch,
    OrbaxCheckpointStore,
    Producer,
    UnsupportedCheckpointError,
    resolve_checkpoint_dir,
)
from nnx_save.errors import DtypeMismatchError, KeyPathError, NnxSaveError, UnsupportedValueError


def model_tree(seed: int = 0) -> dict:
    """A small model-like tree whose every value depends on ``seed``."""
    return {
        "dense": {
            "kernel": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + seed,
            "bias": jnp.full((3,), seed + 0.5, jnp.bfloat16),
        },
        "count": jnp.array(seed + 7, jnp.int32),
    }


def poison(tree):
    """Constant-filled copies: a restore that reads nothing returns these."""
    return jax.tree.map(lambda a: jnp.full_like(a, 3), tree)


def assert_same(restored, expected) -> None:
    """Same structure, and every leaf equal with the same dtype (and Python type)."""
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=False):
        if isinstance(want, (jax.Array, np.ndarray)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        else:
            assert type(got) is type(want) and got == want


def tmp_dirs(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "orbax-checkpoint-tmp" in p.name)


@pytest.fixture
def store(tmp_path):
    with OrbaxCheckpointStore(tmp_path / "ckpt") as s:
        yield s


# -- resolve_checkpoint_dir ------------------------------------------------------


def test_resolve_prefers_the_explicit_directory(tmp_path):
    assert resolve_checkpoint_dir(tmp_path / "mine", tmp_path / "run") == tmp_path / "mine"


def test_resolve_falls_back_to_run_dir_checkpoints_without_creating_it(tmp_path):
    assert resolve_checkpoint_dir(None, tmp_path / "run") == tmp_path / "run" / "checkpoints"
    assert not (tmp_path / "run").exists()


def test_resolve_takes_relative_paths_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint_dir("ck", None) == tmp_path / "ck"
    assert resolve_checkpoint_dir(None, "runs/a") == tmp_path / "runs" / "a" / "checkpoints"


@pytest.mark.parametrize(
    ("checkpoint_dir", "run_dir", "message"),
    [
        (None, None, "no checkpoint directory: pass checkpoint_dir, or run_dir to use run_dir/checkpoints"),
        ("", "/runs/a", "checkpoint_dir is empty (''); give a directory path"),
        ("  ", None, "checkpoint_dir is empty ('  '); give a directory path"),
        (None, " \t", "run_dir is empty (' \\t'); give a directory path"),
    ],
)
def test_resolve_refuses_missing_or_blank_directories(checkpoint_dir, run_dir, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_checkpoint_dir(checkpoint_dir, run_dir)


# -- construction, lifecycle -------------------------------------------------------


def test_nothing_is_created_before_the_first_save(tmp_path):
    directory = tmp_path / "a" / "b"
    store = OrbaxCheckpointStore(directory)
    assert (store.list_steps(), store.latest_step(), store.best_step("loss")) == ([], None, None)
    with pytest.raises(ValueError, match=re.escape("unknown item name 'weights'")):
        store.save(0, {"weights": jnp.ones(2)})
    with pytest.raises(CheckpointNotFoundError):
        store.restore(0)
    assert not directory.exists()
    assert store.save(0, {"model": model_tree()}) == directory / "0"
    assert store.list_steps() == [0]
    store.close()


@pytest.mark.parametrize("max_to_keep", [0, -1, True, 2.0])
def test_store_refuses_a_bad_max_to_keep(tmp_path, max_to_keep):
    message = f"max_to_keep must be an int >= 1 or None (keep every step), got {max_to_keep!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        OrbaxCheckpointStore(tmp_path, max_to_keep=max_to_keep)


def test_store_refuses_a_file_or_an_empty_path(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(
        ValueError, match=re.escape(f"checkpoint directory {tmp_path / 'f'} exists and is not a directory")
    ):
        OrbaxCheckpointStore(tmp_path / "f")
    with pytest.raises(ValueError, match=re.escape("directory is empty (''); give a directory path")):
        OrbaxCheckpointStore("")


def test_store_is_a_checkpoint_store_and_a_context_manager(tmp_path):
    with OrbaxCheckpointStore(tmp_path / "c", max_to_keep=None) as store:
        assert isinstance(store, CheckpointStore)
        assert (store.directory, store.max_to_keep) == (tmp_path / "c", None)
        store.save(1, {"rng": jax.random.key(0)})
    store.close()  # idempotent
    for call in (store.list_steps, lambda: store.save(2, {"rng": jax.random.key(0)}), lambda: store.restore(1)):
        with pytest.raises(
            ValueError, match=re.escape(f"OrbaxCheckpointStore('{tmp_path / 'c'}', max_to_keep=None) is closed")
        ):
            call()


# -- round trips -----------------------------------------------------------------------


def full_items(seed: int = 0) -> dict:
    return {
        "model": model_tree(seed),
        "optimizer": {"mu": model_tree(seed + 10), "step": jnp.array(seed, jnp.uint32)},
        "rng": jax.random.key(seed + 1),
        "data_iterator": {
            "epoch": 2,
            "position": 40 + seed,
            "name": "shard-3",
            "shuffle": True,
            "order": [3, 1, 2],
            "ratio": 0.25,
        },
        "extensions": jnp.arange(4, dtype=jnp.int8),
    }


def test_save_returns_the_committed_step_directory(store):
    path = store.save(7, full_items())
    assert path == store.directory / "7" and path.is_dir()
    assert (store.list_steps(), store.latest_step()) == ([7], 7)
    assert tmp_dirs(store.directory) == []


def test_round_trip_without_templates_returns_items_as_stored(store):
    items = full_items(seed=4)
    store.save(3, items)
    checkpoint = store.restore(3)
    assert isinstance(checkpoint, Checkpoint) and checkpoint.step == 3 and checkpoint.path == store.directory / "3"
    assert list(checkpoint.items) == ["model", "optimizer", "rng", "data_iterator", "extensions"]
    for name in ("model", "optimizer", "data_iterator", "extensions"):
        assert_same(checkpoint.items[name], items[name])
    rng = checkpoint.items["rng"]
    assert rng.dtype == items["rng"].dtype
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(items["rng"]))


def test_round_trip_onto_poisoned_templates(store):
    items = full_items(seed=1)
    store.save(1, items)
    templates = {name: poison(items[name]) for name in ("model", "optimizer", "extensions")}
    templates["rng"] = jax.random.key(99)
    templates["data_iterator"] = {
        "epoch": 0,
        "position": 0,
        "name": "",
        "shuffle": False,
        "order": [0, 0, 0],
        "ratio": 0.0,
    }
    checkpoint = store.restore(1, templates=templates)
    for name in ("model", "optimizer", "data_iterator", "extensions"):
        assert_same(checkpoint.items[name], items[name])
    np.testing.assert_array_equal(jax.random.key_data(checkpoint.items["rng"]), jax.random.key_data(items["rng"]))


def test_save_does_not_modify_the_callers_items(store):
    items = full_items()
    store.save(1, items)
    unchanged = full_items()
    assert_same({k: v for k, v in items.items() if k != "rng"}, {k: v for k, v in unchanged.items() if k != "rng"})
    np.testing.assert_array_equal(jax.random.key_data(items["rng"]), jax.random.key_data(unchanged["rng"]))


def test_restore_items_reads_a_subset(store):
    store.save(2, full_items(seed=2))
    checkpoint = store.restore(2, items=["extensions", "model"], templates={"model": poison(model_tree())})
    assert list(checkpoint.items) == ["model", "extensions"]
    assert_same(checkpoint.items["model"], model_tree(seed=2))


def test_restore_refuses_unknown_absent_or_unused_item_names(store):
    store.save(2, {"model": model_tree(), "rng": jax.random.key(0)})
    with pytest.raises(
        ValueError,
        match=re.escape("unknown item name 'params'; expected one of model, optimizer, rng, data_iterator, extensions"),
    ):
        store.restore(2, templates={"params": model_tree()})
    with raises_usage("item", match=re.escape("step 2 holds no item 'optimizer'; it holds model, rng")) as info:
        store.restore(2, items=["optimizer"])
    assert (info.value.step, info.value.missing, info.value.held) == (2, ("optimizer",), ("model", "rng"))
    with pytest.raises(
        ValueError, match=re.escape("templates given for ['model'], which items=['rng'] does not restore")
    ):
        store.restore(2, items=["rng"], templates={"model": model_tree()})


# -- metadata ----------------------------------------------------------------------------


def test_metadata_records_everything_given(store):
    before = datetime.datetime.now(datetime.UTC)
    store.save(
        12,
        {"rng": jax.random.key(1), "model": model_tree()},  # out of canonical order
        epoch=3,
        metrics={"loss": jnp.float32(0.25), "accuracy": 1},
        producer=Producer("trainer", "2.0"),
        extra={"config": {"lr": 0.001, "layers": [16, 16]}, "git": "abc123"},
    )
    meta = OrbaxCheckpointStore(store.directory).read_metadata(12)  # a fresh store reads it from disk
    assert (meta.format, meta.format_version, meta.step, meta.epoch) == (FORMAT_NAME, FORMAT_VERSION, 12, 3)
    assert meta.items == ("model", "rng")
    assert meta.metrics == {"loss": 0.25, "accuracy": 1.0}
    assert meta.producer == Producer("trainer", "2.0")
    assert meta.extra == {"config": {"lr": 0.001, "layers": [16, 16]}, "git": "abc123"}
    expected_versions = {"nnx_save": nnx_save.__version__, "jax": jax.__version__}
    for dist in ("flax", "orbax-checkpoint", "optax", "numpy", "jaxlib"):
        expected_versions[dist] = importlib.metadata.version(dist)
    assert meta.library_versions == expected_versions
    created = datetime.datetime.fromisoformat(meta.created_at)
    assert created.utcoffset() == datetime.timedelta(0)
    assert before <= created <= datetime.datetime.now(datetime.UTC)
    assert store.restore(12).metadata == meta


def test_metadata_dict_round_trip_is_json():
    meta = CheckpointMetadata(
        step=4,
        items=("model", "rng"),
        epoch=1,
        metrics={"loss": 0.5},
        extra={"a": [1, 2]},
        producer=Producer("p", "1"),
        library_versions={"jax": "0.1"},
        created_at="2025-01-02T03:04:05+00:00",
    )
    data = json.loads(json.dumps(meta.to_dict()))
    assert data == {
        "format": "nnx_save.checkpoint",
        "format_version": 1,
        "step": 4,
        "epoch": 1,
        "items": ["model", "rng"],
        "library_versions": {"jax": "0.1"},
        "producer": {"name": "p", "version": "1"},
        "metrics": {"loss": 0.5},
        "extra": {"a": [1, 2]},
        "created_at": "2025-01-02T03:04:05+00:00",
    }
    assert CheckpointMetadata.from_dict(data) == meta


def _record(**changes) -> dict:
    data = CheckpointMetadata(step=1, items=("model",), created_at="2025-01-01T00:00:00+00:00").to_dict()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("data", "found"),
    [
        (_record(format="orbax.standard"), "format 'orbax.standard'"),
        (_record(format_version=2), "format version 2, newer than this nnx_save; upgrade nnx_save"),
        (_record(format_version=True), "format version True"),
        (_record(producer={"name": "p"}), "a producer record {'name': 'p'} (expected name and version)"),
        (
            _record(producer={"name": "p", "version": ""}),
            "a producer record {'name': 'p', 'version': ''} (expected two non-empty strings)",
        ),
        (_record(step=-1), "step -1 (expected an int >= 0)"),
        (
            _record(items=["weights"]),
            "items ['weights'] (expected a non-empty list of model, optimizer, rng, data_iterator, extensions)",
        ),
        (_record(metrics={"loss": "low"}), "metrics {'loss': 'low'} (expected numbers)"),
        (_record(created_at=5), "created_at 5 (expected a str)"),
        (
            {k: v for k, v in _record(color="red").items() if k != "epoch"},
            "a metadata record with missing fields ['epoch'] and unknown fields ['color']",
        ),
        ([1, 2], "a metadata record of type list, not a JSON object"),
    ],
)
def test_metadata_from_dict_refuses_what_it_cannot_read(data, found):
    message = f"the checkpoint record holds {found}; this nnx_save reads format 'nnx_save.checkpoint' up to version 1"
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(message)) as info:
        CheckpointMetadata.from_dict(data)
    assert (info.value.found, info.value.step, info.value.directory) == (found, None, None)


def test_producer_needs_a_name_and_a_version():
    with pytest.raises(ValueError, match=re.escape("Producer.version must be a non-empty str, got ' '")):
        Producer("trainer", " ")
    assert Producer.from_dict(Producer("a", "1").to_dict()) == Producer("a", "1")


def _rewrite_record(store, step, **changes) -> None:
    path = store.directory / str(step) / "nnx_save_metadata" / "metadata"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_restore_refuses_a_newer_format_version_before_reading(store, monkeypatch):
    store.save(5, {"model": model_tree()})
    _rewrite_record(store, 5, format_version=FORMAT_VERSION + 1)
    monkeypatch.setattr(ocp.CheckpointManager, "restore", _fail_if_called)
    fresh = OrbaxCheckpointStore(store.directory)
    message = (
        f"step 5 in {store.directory} holds format version 2, newer than this nnx_save; upgrade nnx_save; "
        "this nnx_save reads format 'nnx_save.checkpoint' up to version 1"
    )
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(message)) as info:
        fresh.restore(5)
    assert (info.value.step, info.value.directory) == (5, str(store.directory))


def test_restore_refuses_another_format_and_another_producer_format(store):
    store.save(1, {"model": model_tree()})
    store.save(2, {"model": model_tree()})
    _rewrite_record(store, 1, format="someone.else")
    _rewrite_record(store, 2, producer="trainer-1.0")
    fresh = OrbaxCheckpointStore(store.directory)
    with pytest.raises(
        UnsupportedCheckpointError, match=re.escape(f"step 1 in {store.directory} holds format 'someone.else';")
    ):
        fresh.read_metadata(1)
    with pytest.raises(
        UnsupportedCheckpointError, match=re.escape("holds a producer record 'trainer-1.0' (expected name and version)")
    ):
        fresh.restore(2)


@pytest.mark.parametrize(
    ("record", "found"),
    [
        (
            {"format": "nnx_save.checkpoint.dtypes", "items": {"model": [["dense/kernel", "float32"]]}},
            "a malformed dtype record \"{'format': 'nnx_save.checkpoint.dtypes', 'items': {'model': [['dense/kernel', 'float32']]}}\"",
        ),
        ({"format": "nnx_save.checkpoint.dtypes", "items": {}}, "a dtype record without items ['model']"),
        ({"format": "other", "items": {}}, "a malformed dtype record \"{'format': 'other', 'items': {}}\""),
    ],
)
def test_restore_refuses_a_malformed_dtype_record(store, record, found):
    store.save(1, {"model": model_tree()})
    (store.directory / "1" / "nnx_save_dtypes" / "metadata").write_text(json.dumps(record))
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(f"step 1 in {store.directory} holds {found};")):
        OrbaxCheckpointStore(store.directory).restore(1)


def test_a_plain_orbax_checkpoint_is_another_format(tmp_path):
    with ocp.CheckpointManager(
        tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    ) as manager:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"w": jnp.ones(2)})))
    store = OrbaxCheckpointStore(tmp_path)
    assert store.list_steps() == [1]
    message = f"step 1 in {tmp_path} holds no nnx_save metadata record (Orbax items: state)"
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(message)):
        store.restore(1)


# -- strict writes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "items", "kwargs", "message"),
    [
        (-1, {"model": {}}, {}, "step must be a non-negative int, got -1"),
        (True, {"model": {}}, {}, "step must be a non-negative int, got True"),
        (1.0, {"model": {}}, {}, "step must be a non-negative int, got 1.0"),
        (1, {}, {}, "items must be a non-empty mapping of model, optimizer, rng, data_iterator, extensions, got {}"),
        (1, [("model", {})], {}, "items must be a non-empty mapping of"),
        (
            1,
            {"model": {}, "ema": {}},
            {},
            "unknown item name 'ema'; expected one of model, optimizer, rng, data_iterator, extensions",
        ),
        (
            1,
            {"model": {}},
            {"extra": {"step": 3, "metrics": {}}},
            (
                "extra keys ['metrics', 'step'] shadow metadata fields; reserved: created_at, epoch, extra, format, "
                "format_version, items, library_versions, metrics, producer, step. Pass step, epoch, metrics and producer "
                "as save() arguments, or rename the key"
            ),
        ),
        (1, {"model": {}}, {"extra": {"sizes": {1: 16}}}, "extra/sizes: key 1 is a int; JSON keys must be str"),
        (
            1,
            {"model": {}},
            {"extra": {"lr": float("nan")}},
            "extra/lr: nan is not a finite float; JSON cannot store it",
        ),
        (1, {"model": {}}, {"extra": {"fn": print}}, "extra/fn: a builtin_function_or_method is not JSON data"),
        (1, {"model": {}}, {"metrics": {"loss": "low"}}, "metrics['loss'] must be a real scalar, got 'low'"),
        (1, {"model": {}}, {"metrics": {"loss": jnp.ones(2)}}, "metrics['loss'] must be a real scalar"),
        (1, {"model": {}}, {"epoch": -2}, "epoch must be a non-negative int or None, got -2"),
        (
            1,
            {"model": {}},
            {"producer": ("t", "1")},
            "producer must be a Producer(name, version) or None, got ('t', '1')",
        ),
    ],
)
def test_save_refuses_bad_arguments_and_writes_nothing(store, step, items, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        store.save(step, items, **kwargs)
    assert not store.directory.exists()


@pytest.mark.parametrize(
    ("items", "error", "message"),
    [
        (
            {"model": {"w": object()}},
            UnsupportedValueError,
            "model/w: a object cannot be stored; leaves must be arrays, typed PRNG keys, ints, floats, bools or strings",
        ),
        (
            {"data_iterator": {"seed": np.int64(3)}},
            UnsupportedValueError,
            "data_iterator/seed: a numpy scalar int64 would come back as a Python value; store leaf.item() or np.asarray(leaf)",
        ),
        (
            {"data_iterator": {"n": 2**70}},
            UnsupportedValueError,
            "data_iterator/n: the int 1180591620717411303424 does not fit in int64",
        ),
        (
            {"model": {"w": jnp.zeros((0, 3))}},
            UnsupportedValueError,
            "model/w: Orbax cannot store the empty array of shape (0, 3)",
        ),
        (
            {"model": {"a.b": jnp.ones(1), "a": {"b": jnp.zeros(1)}}},
            KeyPathError,
            "model/a.b and model/a/b are both stored by Orbax as 'a.b', so one would overwrite the other; rename one of the keys",
        ),
    ],
)
def test_save_refuses_leaves_orbax_cannot_store_exactly(store, items, error, message):
    with pytest.raises(error, match=re.escape(message)):
        store.save(1, items)
    assert not store.directory.exists()


def test_save_refuses_an_existing_step_and_keeps_it(store):
    store.save(3, {"model": model_tree(seed=1)})
    with pytest.raises(
        CheckpointNotWrittenError,
        match=re.escape(f"step 3 already exists in {store.directory}; pass overwrite=True to replace it"),
    ) as info:
        store.save(3, {"model": model_tree(seed=2)})
    error = info.value
    assert (error.step, error.latest_step, error.reason, error.directory) == (3, 3, "exists", str(store.directory))
    assert isinstance(error, (CheckpointError, NnxSaveError, ValueError))
    assert store.list_steps() == [3]
    assert_same(store.restore(3).items["model"], model_tree(seed=1))


def test_save_refuses_a_step_below_the_latest(store):
    store.save(2, {"model": model_tree()})
    store.save(5, {"model": model_tree()})
    with pytest.raises(
        CheckpointNotWrittenError,
        match=re.escape(
            f"step 4 is below the latest step 5 in {store.directory}; steps only move forward: "
            "save at a step above 5, or delete the later steps first"
        ),
    ) as info:
        store.save(4, {"model": model_tree()})
    assert (info.value.step, info.value.latest_step, info.value.reason) == (4, 5, "below_latest")
    assert store.list_steps() == [2, 5]


def test_save_reports_a_step_orbax_declines(store, monkeypatch):
    store.save(1, {"model": model_tree(seed=1)})
    monkeypatch.setattr(ocp.CheckpointManager, "should_save", lambda self, step: False)
    with pytest.raises(
        CheckpointNotWrittenError,
        match=re.escape(f"Orbax declined to save step 2 in {store.directory} (latest step 1); nothing was written"),
    ) as info:
        store.save(2, {"model": model_tree(seed=2)})
    assert (info.value.step, info.value.latest_step, info.value.reason) == (2, 1, "rejected")
    assert store.list_steps() == [1] and not (store.directory / "2").exists()


def test_overwrite_replaces_a_step(store):
    store.save(1, {"model": model_tree(seed=1)}, metrics={"loss": 1.0})
    store.save(3, {"model": model_tree(seed=3)}, metrics={"loss": 3.0})
    store.save(3, {"model": model_tree(seed=30)}, metrics={"loss": 0.3}, overwrite=True)
    store.save(1, {"model": model_tree(seed=10), "rng": jax.random.key(0)}, overwrite=True)
    assert (store.list_steps(), store.latest_step()) == ([1, 3], 3)
    fresh = OrbaxCheckpointStore(store.directory)
    assert_same(fresh.restore(3).items["model"], model_tree(seed=30))
    assert fresh.read_metadata(3).metrics == {"loss": 0.3}
    assert fresh.read_metadata(1).items == ("model", "rng")
    assert sorted(p.name for p in store.directory.iterdir() if not p.name.startswith("_")) == ["1", "3"]


def test_a_crash_during_overwrite_keeps_the_old_step(tmp_path):
    directory = tmp_path / "ckpt"
    with OrbaxCheckpointStore(directory) as store:
        store.save(2, {"model": model_tree(seed=2)})
        store.save(4, {"model": model_tree(seed=40)})
    with OrbaxCheckpointStore(tmp_path / "old") as store:
        store.save(4, {"model": model_tree(seed=4)})
    # A crash after setting step 2 aside, before its replacement was committed ...
    (directory / "2").rename(directory / ".nnx_save-overwriting-2")
    # ... and one after committing step 4's replacement, before removing the old copy.
    shutil.copytree(tmp_path / "old" / "4", directory / ".nnx_save-overwriting-4")
    with OrbaxCheckpointStore(directory) as store:
        store.save(5, {"model": model_tree(seed=5)})
        assert store.list_steps() == [2, 4, 5]
        assert_same(store.restore(2).items["model"], model_tree(seed=2))
        assert_same(store.restore(4).items["model"], model_tree(seed=40))
    assert not list(directory.glob(".nnx_save-overwriting-*"))


def test_a_failed_overwrite_keeps_the_old_step(store, monkeypatch):
    store.save(3, {"model": model_tree(seed=3)})

    def full_disk(self, step, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(OSError, match=re.escape("No space left on device")):
        store.save(3, {"model": model_tree(seed=30)}, overwrite=True)
    monkeypatch.undo()
    assert store.list_steps() == [3] and not list(store.directory.glob(".nnx_save-overwriting-*"))
    assert_same(OrbaxCheckpointStore(store.directory).restore(3).items["model"], model_tree(seed=3))


# -- missing steps, delete, retention, best step --------------------------------------------


def test_missing_steps_raise_not_found(store):
    for call in (store.restore, store.read_metadata, store.delete):
        with pytest.raises(
            CheckpointNotFoundError, match=re.escape(f"no checkpoint at step 9 in {store.directory} (steps held: none)")
        ):
            call(9)
    store.save(1, {"model": model_tree()})
    store.save(4, {"model": model_tree()})
    with pytest.raises(
        CheckpointNotFoundError, match=re.escape(f"no checkpoint at step 2 in {store.directory} (steps held: 1, 4)")
    ) as info:
        store.restore(2)
    assert (info.value.step, info.value.directory, info.value.available) == (2, str(store.directory), (1, 4))
    assert isinstance(info.value, FileNotFoundError)


def test_delete_removes_a_step(store):
    for step in (1, 2, 3):
        store.save(step, {"model": model_tree(seed=step)})
    store.delete(3)
    assert (store.list_steps(), store.latest_step()) == ([1, 2], 2)
    assert not (store.directory / "3").exists()
    store.save(3, {"model": model_tree(seed=33)})  # the step number is free again
    assert_same(store.restore(3).items["model"], model_tree(seed=33))


def test_retention_keeps_the_latest_steps(tmp_path):
    with OrbaxCheckpointStore(tmp_path / "two", max_to_keep=2) as store:
        for step in range(1, 5):
            store.save(step, {"rng": jax.random.key(step)})
        assert store.list_steps() == [3, 4]
        assert not (tmp_path / "two" / "1").exists() and not (tmp_path / "two" / "2").exists()
    with OrbaxCheckpointStore(tmp_path / "all", max_to_keep=None) as store:
        for step in range(1, 8):
            store.save(step, {"rng": jax.random.key(step)})
        assert store.list_steps() == [1, 2, 3, 4, 5, 6, 7]
    assert OrbaxCheckpointStore(tmp_path / "two").list_steps() == [3, 4]


def test_best_step_ranks_kept_steps_by_a_metric(tmp_path):
    with OrbaxCheckpointStore(tmp_path, max_to_keep=5) as store:
        losses = {1: 0.1, 2: 0.5, 3: 0.2, 4: float("nan"), 5: 0.2, 6: None, 7: 0.9}
        for step, loss in losses.items():
            store.save(step, {"rng": jax.random.key(0)}, metrics=None if loss is None else {"loss": loss, "acc": -step})
        assert store.list_steps() == [3, 4, 5, 6, 7]  # step 1 (the lowest loss) is no longer kept
        assert store.best_step("loss") == 5  # ties go to the latest step, NaN is skipped
        assert store.best_step("loss", mode="max") == 7
        assert store.best_step("acc", mode="max") == 3
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"no checkpoint in {tmp_path} records a value for metric 'val_loss'; recorded metrics: acc, loss"
            ),
        ):
            store.best_step("val_loss")
        with pytest.raises(ValueError, match=re.escape("mode must be 'min' or 'max', got 'lowest'")):
            store.best_step("loss", mode="lowest")


# -- dtype guard ----------------------------------------------------------------------------


def _fail_if_called(*args, **kwargs):
    raise AssertionError("arrays were read")


def test_template_dtype_mismatch_is_refused_before_reading(store, monkeypatch):
    store.save(6, {"model": model_tree(), "rng": jax.random.key(0)})
    template = {
        "dense": {"kernel": jnp.zeros((2, 3), jnp.float16), "bias": jnp.zeros(3, jnp.float32)},
        "count": jax.ShapeDtypeStruct((), jnp.int32),
    }
    monkeypatch.setattr(ocp.CheckpointManager, "restore", _fail_if_called)
    message = (
        "step 6: 2 arrays change dtype on restore:\n"
        "  model/dense/bias: bfloat16 saved, float32 in the template\n"
        "  model/dense/kernel: float32 saved, float16 in the template\n"
        "Pass allow_casts=['model/dense/kernel'] to accept them (LOSSY casts: the restored values can differ from "
        "the saved)"
    )
    with pytest.raises(CheckpointDtypeMismatchError, match=re.escape(message)) as info:
        store.restore(6, templates={"model": template})
    assert info.value.mismatches == (
        DtypeMismatch("model", "dense/bias", "bfloat16", "float32"),
        DtypeMismatch("model", "dense/kernel", "float32", "float16"),
    )
    assert (info.value.step, info.value.before_read, info.value.x64_off) == (6, True, False)
    assert isinstance(info.value, (DtypeMismatchError, TypeError))


def test_cast_dtypes_accepts_the_casts(store):
    store.save(6, {"model": model_tree(seed=2)})
    template = {
        "dense": {"kernel": jnp.zeros((2, 3), jnp.float16), "bias": jnp.zeros(3, jnp.float32)},
        "count": jnp.zeros((), jnp.int32),
    }
    restored = store.restore(6, templates={"model": template}, cast_dtypes=True).items["model"]
    expected = model_tree(seed=2)
    assert_same(
        restored,
        {
            "dense": {
                "kernel": expected["dense"]["kernel"].astype(jnp.float16),
                "bias": expected["dense"]["bias"].astype(jnp.float32),
            },
            "count": expected["count"],
        },
    )


def test_shape_dtype_struct_templates_and_python_leaves(store):
    items = {"model": model_tree(seed=5), "data_iterator": {"position": 17, "name": "a", "ratio": 0.5}}
    store.save(1, items)
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model_tree())
    # Python leaves are restored by type and never compared: their values come from disk.
    checkpoint = store.restore(
        1, templates={"model": template, "data_iterator": {"position": 0, "name": "", "ratio": 0.0}}
    )
    assert_same(checkpoint.items["model"], items["model"])
    assert checkpoint.items["data_iterator"] == items["data_iterator"]


def test_typed_keys_compare_by_key_data(store):
    store.save(1, {"rng": jax.random.key(3)})
    restored = store.restore(1, templates={"rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype)}).items["rng"]
    np.testing.assert_array_equal(jax.random.key_data(restored), jax.random.key_data(jax.random.key(3)))
    rbg = jax.random.key(0, impl="rbg")  # key data uint32[4], not threefry's uint32[2]
    with raises_usage(
        "template",
        match=re.escape(
            "step 1: 1 template leaves disagree with the checkpoint:\n  rng/<root>: shape (4,) in the template, (2,) in the checkpoint"
        ),
    ):
        store.restore(1, templates={"rng": rbg})


def test_without_a_template_64_bit_arrays_need_x64(store):
    with jax.enable_x64(True):
        wide = {
            "w": jnp.arange(3, dtype=jnp.float64) / 3,
            "n": jnp.arange(2, dtype=jnp.int64),
            "h": np.ones(2, np.float64),
        }
        store.save(1, {"extensions": wide})
        expected = jax.tree.map(np.asarray, wide)
        assert_same(store.restore(1).items["extensions"], expected)
    assert not jax.config.jax_enable_x64
    message = (
        "step 1: 2 arrays change dtype on restore:\n"
        "  extensions/n: int64 saved, int32 restored\n"
        "  extensions/w: float64 saved, float32 restored\n"
        "jax's x64 mode is off, so 64-bit arrays come back as 32-bit: enable it with "
        "jax.config.update('jax_enable_x64', True) before restoring, or pass allow_casts=['extensions/n', "
        "'extensions/w'] to accept them (LOSSY casts: the restored values can differ from the saved)"
    )
    with pytest.raises(CheckpointDtypeMismatchError, match=re.escape(message)) as info:
        store.restore(1)
    assert (info.value.before_read, info.value.x64_off) == (False, True)
    narrowed = store.restore(1, cast_dtypes=True).items["extensions"]
    assert narrowed["w"].dtype == jnp.float32 and narrowed["h"].dtype == np.float64  # numpy keeps 64 bits
    np.testing.assert_array_equal(narrowed["w"], expected["w"].astype(np.float32))


def test_checkpoints_without_a_dtype_record_use_orbax_metadata(store):
    store.save(1, {"model": model_tree(seed=1), "rng": jax.random.key(4)})
    shutil.rmtree(store.directory / "1" / "nnx_save_dtypes")  # as an older writer left it: no dtype record
    template = {
        "dense": {"kernel": jnp.zeros((2, 3), jnp.float32), "bias": jnp.zeros(3, jnp.float16)},
        "count": jnp.zeros((), jnp.int32),
    }
    with pytest.raises(
        CheckpointDtypeMismatchError, match=re.escape("model/dense/bias: bfloat16 saved, float16 in the template")
    ):
        store.restore(1, templates={"model": template, "rng": jax.random.key(0)})
    checkpoint = store.restore(1, templates={"model": poison(model_tree()), "rng": jax.random.key(0)})
    assert_same(checkpoint.items["model"], model_tree(seed=1))


def test_template_paths_shapes_and_kinds_are_checked_before_reading(store, monkeypatch):
    store.save(2, {"model": model_tree(), "data_iterator": {"position": 3}})
    template = {"dense": {"kernel": jnp.zeros((3, 2)), "extra": jnp.zeros(1)}, "count": 0}
    monkeypatch.setattr(ocp.CheckpointManager, "restore", _fail_if_called)
    message = (
        "step 2: 5 template leaves disagree with the checkpoint:\n"
        "  data_iterator/position: an array in the template, a Python value in the checkpoint\n"
        "  model/count: a Python value in the template, an array in the checkpoint\n"
        "  model/dense/bias: stored in the checkpoint, absent from the template\n"
        "  model/dense/extra: in the template, not stored in the checkpoint\n"
        "  model/dense/kernel: shape (3, 2) in the template, (2, 3) in the checkpoint"
    )
    with raises_usage("template", match=re.escape(message)) as info:
        store.restore(2, templates={"model": template, "data_iterator": {"position": jnp.zeros(())}})
    assert len(info.value.problems) == 5 and info.value.step == 2


def test_template_leaves_must_be_arrays_or_python_values(store):
    store.save(1, {"model": {"w": jnp.ones(2)}})
    with pytest.raises(
        TypeError,
        match=re.escape(
            "templates['model']: leaf w is a object; template leaves must be arrays, jax.ShapeDtypeStruct, or ints, floats, bools and strings"
        ),
    ):
        store.restore(1, templates={"model": {"w": object()}})


# -- topology ---------------------------------------------------------------------------------


def _mesh():
    assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated CPU devices"
    return jax.make_mesh((4, 2), ("data", "model"))


def test_a_single_device_checkpoint_restores_onto_eight_devices(store):
    kernel = jnp.arange(32, dtype=jnp.float32).reshape(8, 4)
    store.save(1, {"model": {"kernel": jax.device_put(kernel, jax.devices()[0])}, "rng": jax.random.key(2)})
    mesh = _mesh()
    sharded = NamedSharding(mesh, PartitionSpec("data", "model"))
    replicated = NamedSharding(mesh, PartitionSpec())
    template = {
        "model": {"kernel": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharded)},
        "rng": jax.device_put(jax.random.key(0), replicated),
    }
    items = store.restore(1, templates=template).items
    assert items["model"]["kernel"].sharding == sharded and len(items["model"]["kernel"].addressable_shards) == 8
    assert items["rng"].sharding == replicated
    np.testing.assert_array_equal(items["model"]["kernel"], kernel)
    np.testing.assert_array_equal(jax.random.key_data(items["rng"]), jax.random.key_data(jax.random.key(2)))


def test_an_eight_device_checkpoint_restores_onto_one_device_or_as_stored(store):
    mesh = _mesh()
    sharded = NamedSharding(mesh, PartitionSpec("data", "model"))
    kernel = jnp.arange(32, dtype=jnp.float32).reshape(8, 4)
    store.save(1, {"model": {"kernel": jax.device_put(kernel, sharded)}})
    one = SingleDeviceSharding(jax.devices()[3])
    restored = store.restore(
        1, templates={"model": {"kernel": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=one)}}
    )
    assert restored.items["model"]["kernel"].sharding == one
    np.testing.assert_array_equal(restored.items["model"]["kernel"], kernel)
    as_stored = store.restore(1).items["model"]["kernel"]
    assert as_stored.sharding.is_equivalent_to(sharded, 2)
    np.testing.assert_array_equal(as_stored, kernel)


def test_a_template_without_a_sharding_lands_on_the_default_device(store):
    store.save(1, {"model": {"w": jnp.arange(4.0)}})
    restored = store.restore(1, templates={"model": {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}}).items["model"]["w"]
    assert restored.sharding == SingleDeviceSharding(jax.devices()[0])
    np.testing.assert_array_equal(restored, np.arange(4.0))


# -- crash safety --------------------------------------------------------------------------------

_SAVER = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from nnx_save.checkpoint import OrbaxCheckpointStore
    store = OrbaxCheckpointStore(sys.argv[1], max_to_keep=None)
    for step in (1, 2):
        store.save(step, {"model": {"w": jnp.full((4,), float(step))}})
    print("saved", flush=True)
    big = jnp.ones((4096, 2048), jnp.float32)  # 32 MiB per save: long enough to be caught midway
    for step in range(3, 1000):
        store.save(step, {"model": {"w": big * step}})
    """
)


def test_a_save_killed_midway_leaves_previous_steps_intact(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    with subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, env=env) as child:
        try:
            assert child.stdout.readline() == b"saved\n"
            deadline = time.monotonic() + 60
            while not tmp_dirs(tmp_path) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert tmp_dirs(tmp_path), "the child never started a third save"
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert tmp_dirs(tmp_path)  # the killed save left its temporary directory behind
    with OrbaxCheckpointStore(tmp_path, max_to_keep=None) as store:
        steps = store.list_steps()
        assert steps[:2] == [1, 2]
        for step in (1, 2):
            np.testing.assert_array_equal(store.restore(step).items["model"]["w"], np.full(4, float(step)))
        for step in steps[2:]:  # any save committed before the kill is complete
            np.testing.assert_array_equal(store.restore(step).items["model"]["w"], np.full((4096, 2048), float(step)))
        store.save(steps[-1] + 1, {"model": {"w": jnp.zeros(4)}})
        assert tmp_dirs(tmp_path) == []  # the next writer cleans up
