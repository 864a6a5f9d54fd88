"""The training store on 2 and 4 real JAX processes (gloo on 127.0.0.1): every
decision about the directory is made on process 0 and shared, so all processes
reach Orbax's barriers in the same order."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess

LAYOUTS = [(2, 4, [2, 4], [8]), (4, 2, [4, 2], [8])]
IDS = ["2x4", "4x2"]


def _same_on_every_process(workers, key):
    values = [w.result[key] for w in workers]
    assert all(v == values[0] for v in values), values
    return values[0]


@pytest.mark.slow
def test_open_save_restore_twenty_times_on_two_processes(run_workers, tmp_path):
    """Processes that decide about the directory apart reach different barriers
    (`sync_global_devices name mismatch`: one process in Orbax's create_directory
    barrier, another in nnx_save:recover_overwrites) in about 1 run in 5. Twenty fresh
    stores in one launch."""
    args = {"scenario": "open_save_restore", "dir": str(tmp_path / "race"), "mesh": [2, 4], "repeat": 20}
    workers = run_workers("store_ops.py", 2, 4, args, timeout=600)
    for w in workers:
        assert w.result["checked"] == [7 * 4] * 20


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_open_save_restore(run_workers, tmp_path, layout):
    n, devices, mesh, _ = layout
    args = {"scenario": "open_save_restore", "dir": str(tmp_path / "s"), "mesh": mesh, "repeat": 2}
    workers = run_workers("store_ops.py", n, devices, args, timeout=300)
    for w in workers:
        assert w.result["checked"] == [7 * devices] * 2


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_retention_keeps_the_best_and_restores_onto_two_meshes(run_workers, tmp_path, layout):
    n, devices, mesh, other = layout
    args = {"scenario": "retention", "dir": str(tmp_path / "r"), "mesh": mesh, "other_mesh": other}
    workers = run_workers("store_ops.py", n, devices, args, timeout=300)
    assert _same_on_every_process(workers, "kept") == [20, 40, 50]
    assert _same_on_every_process(workers, "best") == 20
    for w in workers:
        assert w.result["same_policy"] and w.result["on_mesh"] == w.result["on_other"] == 7 * devices
    assert sorted(p.name for p in (tmp_path / "r").iterdir() if not p.name.startswith("_")) == ["20", "40", "50"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_damaged_steps_are_reported_alike_on_every_process(run_workers, tmp_path, layout):
    n, devices, mesh, _ = layout
    directory = tmp_path / "d"
    args = {"scenario": "damaged", "dir": str(directory), "mesh": mesh}
    workers = run_workers("store_ops.py", n, devices, args, timeout=300)
    assert _same_on_every_process(workers, "steps") == [1, 4, 5]  # 4's truncation shows only on read
    assert _same_on_every_process(workers, "latest") == 5
    assert _same_on_every_process(workers, "after") == [1, 4, 5, 6]
    damaged = _same_on_every_process(workers, "damaged")
    assert sorted(damaged) == ["2", "3"]
    for w in workers:  # a truncated file: each process reads other shards, so the byte ranges differ
        errors = w.result["errors"]
        assert errors["2"].startswith(f"2|{directory}/2/nnx_save_metadata/metadata|not valid JSON")
        assert errors["3"] == f"3|{directory}/3/model/_METADATA|Orbax's metadata file of item 'model' is missing"
        assert errors["4"].startswith(f"4|{directory}/4/model/|an array file is truncated or unreadable (array 'item.")
    for w in workers:
        assert w.result["good"] == 7 * devices
        assert len(w.result["warned"]) == 1 and "2 damaged steps are left out of list_steps()" in w.result["warned"][0]


def test_a_decision_every_step_leaves_no_keys_behind(run_workers, tmp_path):
    """should_save(every_seconds=...) asks process 0 at every step; the last process
    to read each decision deletes its keys, so the coordination service's store does
    not grow with the steps."""
    args = {"scenario": "interval_keys", "dir": str(tmp_path / "k"), "mesh": [4, 2], "steps": 40}
    workers = run_workers("store_ops.py", 4, 2, args, timeout=300)
    assert _same_on_every_process(workers, "due") == [False] * 40  # the interval (an hour) never passed
    for w in workers:
        assert w.result["keys"] == [], w.result["keys"][:5]


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_preemption_saves_one_step_on_every_process(run_workers, tmp_path, layout):
    n, devices, mesh, _ = layout
    workers = run_workers(
        "store_ops.py", n, devices, {"scenario": "preemption", "dir": str(tmp_path / "p"), "mesh": mesh}
    )
    saved = _same_on_every_process(workers, "saved")
    assert saved is not None and saved > 5, saved  # after the signal, never refused by the 1000-step interval
    assert _same_on_every_process(workers, "steps") == [saved]
    for w in workers:
        assert w.result["checked"] == 7 * devices


def test_a_store_over_an_hf_checkpoint_is_refused_alike_on_every_process(run_workers, tmp_path):
    """The store wrote its steps beside an HF index; process 0 decides, every process raises."""
    directory = tmp_path / "hf"
    workers = run_workers("store_ops.py", 2, 4, {"scenario": "foreign", "dir": str(directory), "mesh": [2, 4]})
    refused = _same_on_every_process(workers, "refused")
    message = f"checkpoint directory {directory}: holds model.safetensors.index.json, a checkpoint of another layout"
    assert [r[:2] for r in refused] == [["directory", "model.safetensors.index.json"]] * 2
    assert all(r[2].startswith(message) for r in refused), refused
    assert sorted(p.name for p in directory.iterdir()) == ["model.safetensors.index.json"]
