"""Retention as combinable policies: latest N, best K by a metric, every
Nth step, newer than a duration; a step is kept when any policy keeps it, and the
choice is recorded in the store so that changing it is explicit."""

from __future__ import annotations

import datetime
import json
import math
import os
import re

import jax.numpy as jnp
import pytest
from _errors import raises_usage
from hypothesis import given
from hypothesis import strategies as st

from nnx_save.checkpoint import OrbaxCheckpointStore, Retention, UnsupportedCheckpointError, _disk
from nnx_save.checkpoint._retention import StepInfo, doomed, ranked

LOSSES = {10: 0.9, 20: 0.1, 30: 0.5, 40: 0.4, 50: 0.45}


def run(directory, losses=LOSSES, **store_args) -> OrbaxCheckpointStore:
    store = OrbaxCheckpointStore(directory, **store_args)
    for step, loss in losses.items():
        store.save(step, {"model": {"w": jnp.full((3,), step, jnp.float32)}}, metrics={"loss": loss})
    return store


def on_disk(directory) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_the_issue_example_latest_alone_loses_the_best_step(tmp_path):
    with run(tmp_path, max_to_keep=2) as store:
        assert (store.list_steps(), store.best_step("loss")) == ([40, 50], 40)


def test_the_issue_example_keep_best_keeps_step_20(tmp_path):
    with run(tmp_path, retention=Retention(latest=2, best=1, metric="loss")) as store:
        assert store.list_steps() == [20, 40, 50]
        assert store.best_step("loss") == 20
        assert float(store.restore(20).items["model"]["w"][0]) == 20.0
    assert on_disk(tmp_path) == [20, 40, 50]


def test_best_by_max_and_best_k_ranks_every_kept_step(tmp_path):
    accuracy = {1: 0.5, 2: 0.9, 3: 0.7, 4: 0.2, 5: 0.1, 6: 0.3}
    with run(tmp_path, accuracy, retention=Retention(latest=1, best=2, metric="loss", mode="max")) as store:
        assert store.list_steps() == [2, 3, 6]  # the best two by max, and the latest
        assert store.best_step("loss", mode="max") == 2
        assert store.best_step("loss") == 6  # best_step ranks every kept step, whichever policy kept it


def test_a_best_step_is_never_deleted_by_another_policy(tmp_path):
    losses = {s: (0.01 if s == 1 else 1.0 + s) for s in range(1, 9)}
    with run(tmp_path, losses, retention=Retention(latest=1, best=1, metric="loss", every=4)) as store:
        assert store.list_steps() == [1, 4, 8]


def test_steps_without_the_metric_never_rank(tmp_path):
    with OrbaxCheckpointStore(tmp_path, retention=Retention(latest=1, best=1, metric="loss")) as store:
        store.save(1, {"model": {"w": jnp.ones(2)}}, metrics={"loss": float("nan")})
        store.save(2, {"model": {"w": jnp.ones(2)}})
        store.save(3, {"model": {"w": jnp.ones(2)}}, metrics={"loss": 5.0})
        store.save(4, {"model": {"w": jnp.ones(2)}}, metrics={"acc": 0.1})
        assert store.list_steps() == [3, 4]


def test_keep_every_nth_step(tmp_path):
    with run(tmp_path, retention=Retention(latest=1, every=20)) as store:
        assert store.list_steps() == [20, 40, 50]


def test_keep_steps_newer_than_a_duration(tmp_path):
    with run(tmp_path, {1: 1.0, 2: 1.0}, max_to_keep=None):
        pass
    old = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=2)).isoformat()
    record = tmp_path / "1" / "nnx_save_metadata" / "metadata"  # step 1 was saved two hours ago
    record.write_text(json.dumps({**json.loads(record.read_text()), "created_at": old}))
    with run(tmp_path, {3: 1.0}, retention=Retention(latest=1, newer_than=3600), change_retention=True) as store:
        assert store.list_steps() == [2, 3]


def test_keep_all_never_deletes(tmp_path):
    with run(tmp_path, retention=Retention.keep_all()) as store:
        assert store.list_steps() == [10, 20, 30, 40, 50] and store.max_to_keep is None


def test_retention_applies_once_an_async_save_is_committed(tmp_path):
    with OrbaxCheckpointStore(tmp_path, max_to_keep=1) as store:
        for step in (1, 2, 3):
            store.save(step, {"model": {"w": jnp.ones(2)}}, blocking=False)
        store.wait_until_finished()
        assert store.list_steps() == [3]
    assert on_disk(tmp_path) == [3]


def test_the_choice_is_recorded_and_reopening_adopts_it(tmp_path):
    policy = Retention(latest=2, best=1, metric="loss")
    run(tmp_path, retention=policy).close()
    assert json.loads((tmp_path / "_nnx_save_store.json").read_text())["retention"] == {
        "latest": 2,
        "best": 1,
        "metric": "loss",
        "mode": "min",
        "every": None,
        "newer_than": None,
    }
    with run(tmp_path, {60: 0.7, 70: 0.8}) as store:  # no arguments: the recorded policies
        assert store.retention == policy
        assert store.list_steps() == [20, 60, 70]


def test_reopening_with_other_policies_must_be_asked_for(tmp_path):
    run(tmp_path, retention=Retention(latest=2, best=1, metric="loss")).close()
    message = (
        f"{tmp_path} keeps steps by the latest 2 steps + the best 1 by min loss, not the latest 1 steps: changing "
        "retention can delete steps at the next save, so it must be asked for: pass change_retention=True"
    )
    store = OrbaxCheckpointStore(tmp_path, max_to_keep=1)
    with raises_usage("retention", match=re.escape(message)):
        store.list_steps()
    assert on_disk(tmp_path) == [20, 40, 50]
    with run(tmp_path, {60: 0.9}, max_to_keep=1, change_retention=True) as store:
        assert store.list_steps() == [60]
    assert OrbaxCheckpointStore(tmp_path).retention == Retention(latest=1)


def test_the_default_is_the_latest_five(tmp_path):
    with run(tmp_path, dict.fromkeys(range(1, 8), 1.0)) as store:
        assert store.retention == Retention() == Retention(latest=5)
        assert store.list_steps() == [3, 4, 5, 6, 7]


def test_retention_by_step_alone_reads_no_step_record(tmp_path, monkeypatch):
    """Latest-N retention needs the step numbers only: a save reads no kept step's record."""
    read = []
    real = _disk.read_json
    monkeypatch.setattr(_disk, "read_json", lambda path: read.append(path.parent.parent.name) or real(path))
    with run(tmp_path / "latest", max_to_keep=2) as store:
        assert store.list_steps() == [40, 50]
    assert read == []
    with run(tmp_path / "best", retention=Retention(latest=2, best=1, metric="loss")) as store:
        assert store.list_steps() == [20, 40, 50]
    assert {"10", "20", "30", "40", "50"} <= set(read)  # ranking by a metric reads the records


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"latest": 0}, "Retention.latest must be an int >= 1 or None, got 0"),
        ({"every": 2.5}, "Retention.every must be an int >= 1 or None, got 2.5"),
        ({"best": 2}, "Retention.best and Retention.metric go together, got best=2, metric=None"),
        ({"best": 1, "metric": "loss", "mode": "low"}, "Retention.mode must be 'min' or 'max', got 'low'"),
        ({"newer_than": -1}, "Retention.newer_than must be a positive number of seconds or None, got -1"),
    ],
)
def test_bad_policies_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Retention(**kwargs)


def test_max_to_keep_and_retention_are_exclusive(tmp_path):
    with pytest.raises(ValueError, match=re.escape("pass max_to_keep or retention, not both")):
        OrbaxCheckpointStore(tmp_path, max_to_keep=2, retention=Retention())


def test_doomed_is_pure():
    infos = [StepInfo(s, {"loss": v}, age_s=100.0 * s) for s, v in LOSSES.items()]
    assert doomed(Retention(latest=2), infos) == [10, 20, 30]
    assert doomed(Retention(latest=None, newer_than=2500), infos) == [30, 40]  # the latest step always stays
    assert doomed(Retention.keep_all(), infos) == []


def test_an_unreadable_store_record_is_refused_typed(tmp_path):
    run(tmp_path, {1: 1.0}, max_to_keep=2).close()
    (tmp_path / "_nnx_save_store.json").write_text("{broken")
    message = "holds a store record _nnx_save_store.json that cannot be read (Expecting property name"
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(message)):
        OrbaxCheckpointStore(tmp_path).list_steps()


def test_a_crash_while_retention_deletes_a_step_leaves_no_damaged_step(tmp_path, monkeypatch):
    """Retention renames a step away before deleting it: a crash mid-delete (here, the
    removal fails after its first file) leaves a hidden leftover, never a half-deleted
    step that lists as damaged; the next store opened for writing removes the leftover."""
    from etils import epath

    directory = tmp_path / "ckpt"
    with OrbaxCheckpointStore(directory, max_to_keep=2) as store:
        store.save(1, {"model": {"w": jnp.ones(4)}})
        store.save(2, {"model": {"w": jnp.full(4, 2.0)}})
    kind = type(epath.Path(directory))  # the concrete path class the store uses

    def crash_after_one_file(self, *args, **kwargs):
        top, _, files = next(w for w in os.walk(str(self)) if w[2])
        os.unlink(os.path.join(top, files[0]))  # part of the step is gone
        raise OSError("killed mid-delete")

    monkeypatch.setattr(kind, "rmtree", crash_after_one_file)
    with pytest.raises(OSError, match="killed mid-delete"), OrbaxCheckpointStore(directory, max_to_keep=2) as store:
        store.save(3, {"model": {"w": jnp.full(4, 3.0)}})
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".nnx_save-deleting-")) == [
        ".nnx_save-deleting-1"
    ]
    with OrbaxCheckpointStore(directory, max_to_keep=2) as store:  # warnings are errors: no damaged step
        assert store.list_steps() == [2, 3] and store.damaged_steps() == {}
        store.save(4, {"model": {"w": jnp.full(4, 4.0)}})
        assert store.list_steps() == [3, 4]
        assert float(store.restore(4).items["model"]["w"][0]) == 4.0
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".nnx")) == []


_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e308, -1e308, 5e-324]),
)


@given(
    values=st.lists(st.one_of(st.none(), _VALUES), min_size=1, max_size=9),
    best=st.integers(1, 4),
    mode=st.sampled_from(["min", "max"]),
)
def test_keep_best_ranks_finite_metrics_alone(values, best, mode):
    """Over any metric values: the best ``K`` kept are the ``K`` best finite ones (ties to the
    later step); a NaN or infinite value never outranks a finite one, whichever mode."""
    infos = [StepInfo(s, {} if v is None else {"loss": v}, 0.0) for s, v in enumerate(values, 1)]
    finite = [(v, s) for s, v in enumerate(values, 1) if v is not None and math.isfinite(v)]
    sign = 1 if mode == "min" else -1
    expected = [s for _, s in sorted(finite, key=lambda vs: (sign * vs[0], -vs[1]))]
    assert ranked(infos, "loss", mode) == expected
    kept = {i.step for i in infos} - set(doomed(Retention(latest=1, best=best, metric="loss", mode=mode), infos))
    assert kept == set(expected[:best]) | {len(values)}


@pytest.mark.parametrize(("mode", "poison"), [("max", math.inf), ("min", -math.inf), ("max", math.nan)])
def test_a_non_finite_metric_never_costs_the_real_best_step_its_place(tmp_path, mode, poison):
    metrics = {1: 0.5, 2: 0.9 if mode == "max" else 0.1, 3: poison, 4: 0.3}
    with run(tmp_path, metrics, retention=Retention(latest=1, best=1, metric="loss", mode=mode)) as store:
        assert store.list_steps() == [2, 4]
        assert store.best_step("loss", mode=mode) == 2
