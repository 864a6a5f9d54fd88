"""The training store (OrbaxCheckpointStore) driven from every process.

args: {"scenario": name, "dir": a fresh directory, "mesh": [a, b], ...}; each
scenario returns what this process saw, for the test to compare across processes.

- ``open_save_restore``: ``repeat`` times, on a fresh directory each, one process
  arriving up to 50 ms late (as after an uneven start-up): open the store, save three steps of the cross-process sharded "mixed" tree, restore the latest
  onto the mesh and check every local shard (the start-up race: processes that
  decide about the directory apart reach different barriers).
- ``retention``: the losses under latest-2 + best-1 by loss; restore the
  best step onto the mesh and onto another mesh (``other_mesh``).
- ``preemption``: a loop asking ``should_save`` at every step (interval 1000); the
  last process sends itself SIGTERM at step 5; every process must save one same
  step and stop; a reopened store restores it onto the mesh.
- ``damaged``: process 0 damages saved steps between two barriers; a reopened
  store lists, reports and refuses them the same way on every process.
- ``interval_keys``: ``steps`` calls of ``should_save`` under a seconds interval
  (each one a decision of process 0, shared through the key-value store); then the
  store's keys left in the coordination service, as process 0 lists them.
- ``foreign``: process 0 puts an HF index in the directory (between two barriers);
  every process's store refuses to write there, twice, then the processes meet.
"""

import os
import re
import signal
import time

import mp_boot

ctx = mp_boot.init()

import mp_common as c  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from nnx_save.checkpoint import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointDamageWarning,
    CheckpointUsageError,
    OrbaxCheckpointStore,
    Retention,
)

MESH = c.mesh(ctx.args["mesh"])


def state(step: int) -> dict:
    return {"model": c.nest(c.make_tree("mixed", MESH)), "data_iterator": {"position": step}}


def restore_checked(store: OrbaxCheckpointStore, step: int, mesh) -> int:
    templates = {"model": c.nest(c.abstract_tree("mixed", mesh)), "data_iterator": {"position": 0}}
    ckpt = store.restore(step, templates=templates)
    assert ckpt.items["data_iterator"]["position"] == step, ckpt.items["data_iterator"]
    return c.check_tree("mixed", c.flat(ckpt.items["model"]))


def open_save_restore() -> dict:
    checked, times = [], []
    for i in range(ctx.args["repeat"]):
        start = time.perf_counter()
        if ctx.process_id == i % ctx.num_processes:  # processes reach a store at different times
            time.sleep((i * 37 % 50) / 1000)
        with OrbaxCheckpointStore(os.path.join(ctx.args["dir"], f"run{i}"), max_to_keep=2) as store:
            for step in (1, 2, 3):
                store.save(step, state(step), metrics={"loss": 1.0 / step})
            checked.append(restore_checked(store, store.latest_step(), MESH))
            steps = store.list_steps()
        assert steps == [2, 3], steps
        times.append(time.perf_counter() - start)
    return {"checked": checked, "seconds": times}


LOSSES = {10: 0.9, 20: 0.1, 30: 0.5, 40: 0.4, 50: 0.45}


def retention() -> dict:
    policy = Retention(latest=2, best=1, metric="loss")
    with OrbaxCheckpointStore(ctx.args["dir"], retention=policy) as store:
        for step, loss in LOSSES.items():
            store.save(step, state(step), metrics={"loss": loss}, blocking=step % 20 != 0)
        store.wait_until_finished()
        kept, best = store.list_steps(), store.best_step("loss")
    with OrbaxCheckpointStore(ctx.args["dir"]) as store:  # reopened: the recorded policies
        same = store.retention == policy
        on_mesh = restore_checked(store, best, MESH)
        on_other = restore_checked(store, best, c.mesh(ctx.args["other_mesh"]))
    return {"kept": kept, "best": best, "same_policy": same, "on_mesh": on_mesh, "on_other": on_other}


def damage(directory: str) -> None:
    """Process 0 damages steps 2 (a malformed record), 3 (an item's _METADATA gone)
    and 4 (its array files truncated); the others wait at the barriers."""
    multihost_utils.sync_global_devices("damage:before")
    if ctx.process_id == 0:
        with open(os.path.join(directory, "2", "nnx_save_metadata", "metadata"), "w") as f:
            f.write("{not json")
        os.remove(os.path.join(directory, "3", "model", "_METADATA"))
        for root, _, names in os.walk(os.path.join(directory, "4", "model")):
            for name in names if os.path.basename(root) == "d" else ():
                os.truncate(os.path.join(root, name), 10)
    multihost_utils.sync_global_devices("damage:after")


def damaged() -> dict:
    directory = ctx.args["dir"]
    with OrbaxCheckpointStore(directory, max_to_keep=None) as store:
        for step in (1, 2, 3, 4, 5):
            store.save(step, state(step))
    damage(directory)
    with OrbaxCheckpointStore(directory) as store:
        warned = []
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps, latest = store.list_steps(), store.latest_step()
            warned = [str(w.message) for w in caught if issubclass(w.category, CheckpointDamageWarning)]
        report = {s: str(e) for s, e in store.damaged_steps().items()}
        errors = {}
        for step in (2, 3, 4):
            try:
                restore_checked(store, step, MESH)
                errors[step] = "restored"
            except CheckpointCorruptError as error:
                errors[step] = f"{error.step}|{error.path}|{error.problem}"
        good = restore_checked(store, 5, MESH)
        store.save(6, state(6))  # a damaged store still saves
        after = store.list_steps()
    return {
        "steps": steps,
        "latest": latest,
        "warned": warned,
        "damaged": report,
        "errors": {str(k): re.sub(r"\s+", " ", v) for k, v in errors.items()},
        "good": good,
        "after": after,
    }


def preemption() -> dict:
    saved = None
    with OrbaxCheckpointStore(ctx.args["dir"], save_interval_steps=1000) as store:
        for step in range(1, 400):
            if step == 5 and ctx.process_id == ctx.num_processes - 1:
                os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption service turns it into a sync point
            if store.should_save(step):
                store.save(step, state(step))
                if store.preemption_requested:
                    saved = step
                    break
            time.sleep(0.01)
    with OrbaxCheckpointStore(ctx.args["dir"]) as store:
        steps = store.list_steps()
        checked = restore_checked(store, saved, MESH) if saved is not None else 0
    return {"saved": saved, "steps": steps, "checked": checked}


def interval_keys() -> dict:
    from jax._src import distributed

    with OrbaxCheckpointStore(ctx.args["dir"], save_interval_seconds=3600) as store:
        due = [store.should_save(step) for step in range(1, ctx.args["steps"] + 1)]
    multihost_utils.sync_global_devices("interval_keys")  # every process has read every decision
    keys = distributed.global_state.client.key_value_dir_get("nnx_save/checkpoint/")
    return {"due": due, "keys": sorted(k for k, _ in keys)}


def foreign() -> dict:
    directory = ctx.args["dir"]
    multihost_utils.sync_global_devices("foreign:before")
    if ctx.process_id == 0:  # as on a filesystem only process 0 sees (a node-local directory)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            f.write('{"weight_map": {}}')
    multihost_utils.sync_global_devices("foreign:after")
    refused = []
    with OrbaxCheckpointStore(directory) as store:
        for step in (1, 2):
            try:
                store.save(step, state(step))
            except CheckpointUsageError as e:
                refused.append([e.reason, e.entry, str(e)])
    multihost_utils.sync_global_devices("foreign:done")  # no process was left waiting in a barrier
    return {"refused": refused, "listing": sorted(os.listdir(directory)) if os.path.isdir(directory) else None}


ctx.write(globals()[ctx.args["scenario"]]())
