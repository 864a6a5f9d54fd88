"""A fork server for the crash tests (tests/reliability/test_reliability_crash.py).

Starting a Python process that imports jax costs seconds; killing twenty of them
would cost minutes. This process imports jax, flax, orbax and nnx_save once, never
starts a jax backend (so forking it is safe), and on request forks savers that each
start their own backend (and, for a multi-process save, their own
``jax.distributed`` job) and then save in a loop until they are killed.

Protocol: one JSON command per line on stdin, one JSON reply per line on stdout.
Savers write their progress to the same stdout (one ``os.write`` per line, atomic
on a pipe): ``{"pid", "ev": "start" | "done", "v", "t"}``.

- ``{"op": "run", "kind", "dir", "n", "port"}`` forks ``n`` savers; replies ``{"pids"}``.
- ``{"op": "kill", "pids"}`` SIGKILLs them and reaps them (so the pids are dead,
  not zombies, when the reply comes); replies ``{"status"}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore

sys.path.insert(0, str(Path(__file__).parent / "multiprocess" / "workers"))
import mp_boot


def tree_values(v: int) -> dict[str, np.ndarray]:
    """The tree saved as version ``v``: every tensor depends on ``v``."""
    return {
        "a": np.full((128, 256), v, np.float32),
        "b": np.arange(8192, dtype=np.int64) * 3 + v,
        "c": {"d": np.full((7,), -v, np.int16)},
    }


def model(v: int) -> nnx.Module:
    """A small model whose every parameter is a function of ``v``."""
    m = nnx.Sequential(nnx.Linear(64, 256, rngs=nnx.Rngs(0)), nnx.Linear(256, 32, rngs=nnx.Rngs(1)))
    for i, (_, var) in enumerate(sorted(nnx.to_flat_state(nnx.state(m, nnx.Param)), key=lambda kv: kv[0])):
        var.set_value(np.full(var.get_value().shape, v * 10 + i, np.float32))
    return m


def emit(**event) -> None:
    os.write(1, (json.dumps(event) + "\n").encode())


def _loop(save, pid_reports: bool = True) -> None:
    for v in range(1, 1_000_000):
        if pid_reports:
            emit(pid=os.getpid(), ev="start", v=v, t=time.monotonic())
        save(v)
        if pid_reports:
            emit(pid=os.getpid(), ev="done", v=v, t=time.monotonic())


def saver(cmd: dict, rank: int) -> None:
    target = Path(cmd["dir"])
    kind = cmd["kind"]
    if kind == "save_file":
        _loop(lambda v: nnx_save.save_file(tree_values(v), target / "tree.safetensors"))
    elif kind == "multi_file":  # an HF index and three files in the directory itself
        _loop(lambda v: nnx_save.save_file(tree_values(v), target, max_shard_size=40_000))
    elif kind == "save_model":
        m = model(0)
        params = sorted(nnx.to_flat_state(nnx.state(m, nnx.Param)), key=lambda kv: kv[0])

        def save(v):
            for i, (_, var) in enumerate(params):
                var.set_value(jax.numpy.full(var.get_value().shape, v * 10 + i, jax.numpy.float32))
            nnx_save.save_model(m, target / "model.safetensors")

        _loop(save)
    elif kind == "multiprocess":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{cmd['port']}",
            num_processes=cmd["n"],
            process_id=rank,
            initialization_timeout=mp_boot.INIT_TIMEOUT_S,
            heartbeat_timeout_seconds=mp_boot.HEARTBEAT_TIMEOUT_S,
            shutdown_timeout_seconds=mp_boot.SHUTDOWN_TIMEOUT_S,
        )
        mesh = jax.make_mesh((jax.device_count(),), ("x",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))

        def save(v):
            whole = tree_values(v)
            tree = {
                k: jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i])
                for k, x in whole.items()
                if k != "c"
            }
            nnx_save.save_file({**tree, "c": whole["c"]}, target / "tree.safetensors")

        _loop(save, pid_reports=rank == 0)
    elif kind in ("store", "store_overwrite"):
        store = OrbaxCheckpointStore(target / "ckpt", max_to_keep=3)
        if kind == "store":
            _loop(lambda v: store.save(v, {"model": {"w": np.full((64, 256), v, np.float32)}}))
        else:
            _loop(lambda v: store.save(1, {"model": {"w": np.full((64, 256), v, np.float32)}}, overwrite=True))
    else:
        raise ValueError(kind)


def fork_saver(cmd: dict, rank: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cmd.get('devices', 1)}"
        saver(cmd, rank)
    except BaseException:  # reported to the test, which fails on any saver error
        emit(pid=os.getpid(), ev="error", text=traceback.format_exc())
        code = 1
    os._exit(code)


def kill(pids) -> list[int]:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited (a saver that failed) but not reaped yet
            os.kill(pid, signal.SIGKILL)
    return [os.waitpid(pid, 0)[1] for pid in pids]


def main() -> None:
    emit(ev="ready")
    live = set()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "run":
                pids = [fork_saver(cmd, rank) for rank in range(cmd.get("n", 1))]
                live.update(pids)
                emit(ev="pids", pids=pids)
            elif cmd["op"] == "kill":
                live.difference_update(cmd["pids"])
                emit(ev="killed", status=kill(cmd["pids"]))
            elif cmd["op"] == "quit":
                break
    finally:  # never leave a saver behind (the test failed, or its process went away)
        kill(sorted(live))


if __name__ == "__main__":
    main()
