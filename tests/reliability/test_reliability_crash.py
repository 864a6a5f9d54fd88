"""Crash safety: savers killed with SIGKILL at random moments of a save.

For each way of saving (``save_file``, ``save_model``, an HF multi-file ``save_file``,
a 2-process x 2-device ``save_file`` of cross-process arrays, ``OrbaxCheckpointStore.save`` of a new step
and with ``overwrite=True``), a saver process saves version 1, 2, 3 ... in a loop,
reporting when each save starts and ends. The test measures how long a save takes,
then kills the saver (every process of the job, for the multi-process save) at a
time drawn uniformly over the next save's duration (seeded), and checks that

- the target holds exactly the last completed version or the one being saved
  (loaded through the public API and compared value by value);
- the next save succeeds, loads back, and leaves no temporary file behind: the
  killed process's stale temporary file is removed by the library.

Savers are forked from one process that imported jax once (tests/_reliability_zygote.py),
so 28 kills cost seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _reliability_zygote import model, tree_values
from flax import nnx
from test_reliability_edges import temporary_name

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore

ZYGOTE = Path(__file__).parents[1] / "_reliability_zygote.py"
SEED = 20261129
TMP_MARKER = ".nnx_save-tmp-"  # in every temporary file's name (docs/reliability.md)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Zygote:
    """The fork server, its event stream, and a bounded wait on it."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ZYGOTE.parent,
        )
        self.events: queue.Queue = queue.Queue()
        self.noise: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.wait("ready", timeout=120)

    def _read(self) -> None:
        for line in self.proc.stdout:
            text = line.decode("utf-8", "replace")
            try:
                self.events.put(json.loads(text))
            except ValueError:
                self.noise.append(text)  # a library's own output on the shared stdout
        self.events.put({"ev": "eof"})

    def send(self, **cmd) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def wait(self, ev: str, *, timeout: float = 120, where=None) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                e = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"no {ev!r} event within {timeout} s; output: {''.join(self.noise)[-3000:]}"
                ) from None
            if where is not None:
                where(e)
            if e["ev"] == "error":
                raise AssertionError(f"saver failed:\n{e['text']}")
            if e["ev"] == "eof":
                raise AssertionError(f"fork server died: {''.join(self.noise)[-3000:]}")
            if e["ev"] == ev:
                return e

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(op="quit")
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def temporaries(directory: Path) -> list[str]:
    return sorted(
        n
        for n in os.listdir(directory)
        if TMP_MARKER in n or "orbax-checkpoint-tmp" in n or n.startswith(".nnx_save-overwriting-")
    )


def kill_mid_save(z: Zygote, rng: random.Random, kind: str, directory: Path, n: int = 1) -> tuple[int, dict]:
    """Run a saver, measure a save, kill it at a random moment of the next one.
    Returns the last version it reported complete and what the kill looked like."""
    z.send(op="run", kind=kind, dir=str(directory), n=n, port=free_port(), devices=2 if n > 1 else 1)
    pids = z.wait("pids")["pids"]
    done, starts = [], {}

    def note(e):
        if e.get("ev") == "done":
            done.append(e)
        elif e.get("ev") == "start":
            starts[e["v"]] = e["t"]

    try:
        for _ in range(2):  # the first save also starts jax; the second is a plain one
            z.wait("done", timeout=180, where=note)
        duration = done[-1]["t"] - starts[done[-1]["v"]]
        delay = rng.uniform(0, duration)
        target_v = max(starts) + 1
        while target_v not in starts:
            z.wait("start", where=note)
        time.sleep(max(starts[target_v] + delay - time.monotonic(), 0))
    finally:
        z.send(op="kill", pids=pids)  # on a failure too: no saver outlives the test
    status = z.wait("killed", where=note)["status"]
    assert all(os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9 for s in status), status
    last = max((e["v"] for e in done), default=0)
    return last, {
        "kind": kind,
        "duration": duration,
        "delay": delay,
        "killed_in": target_v,
        "last_done": last,
        "stale": temporaries(directory / "ckpt" if kind.startswith("store") else directory),
    }


def params_of(m) -> list[np.ndarray]:
    return [
        np.asarray(v.get_value()) for _, v in sorted(nnx.to_flat_state(nnx.state(m, nnx.Param)), key=lambda kv: kv[0])
    ]


def which_tree(path: Path, last: int) -> int:
    loaded = nnx_save.load_file(path)
    for v in (last, last + 1):
        want = {"a": tree_values(v)["a"], "b": tree_values(v)["b"], "c/d": tree_values(v)["c"]["d"]}
        if set(loaded) == set(want) and all(np.array_equal(loaded[k], want[k]) for k in want):
            return v
    raise AssertionError(
        f"{path} holds neither version {last} nor {last + 1}: "
        f"{ {k: np.asarray(x).ravel()[:3] for k, x in loaded.items()} }"
    )


def which_model(path: Path, last: int) -> int:
    loaded, _ = nnx_save.load_model(lambda: model(0), path, strict=True)
    got = params_of(loaded)
    for v in (last, last + 1):
        if all(np.array_equal(g, np.full(g.shape, v * 10 + i, np.float32)) for i, g in enumerate(got)):
            return v
    raise AssertionError(f"{path} holds neither version {last} nor {last + 1}: {[g.ravel()[:2] for g in got]}")


def check_file_kind(kind: str, directory: Path, last: int) -> int:
    if kind == "multi_file":
        v = which_tree(directory, last)
        nnx_save.save_file(tree_values(last + 2), directory, max_shard_size=40_000)
        assert which_tree(directory, last + 2 - 1) == last + 2
        named = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values()
        assert sorted(os.listdir(directory)) == sorted({"model.safetensors.index.json", *named})  # nothing stale
    elif kind == "save_model":
        path = directory / "model.safetensors"
        v = which_model(path, last)
        nnx_save.save_model(model(last + 2), path)  # the next save
        assert which_model(path, last + 2 - 1) == last + 2
    else:
        path = directory / "tree.safetensors"
        v = which_tree(path, last)
        umask = os.umask(0o022)
        os.umask(umask)
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # as open() makes it, multi-process too
        nnx_save.save_file(tree_values(last + 2), path)
        assert which_tree(path, last + 2 - 1) == last + 2
    return v


def check_store(kind: str, directory: Path, last: int) -> int:
    w = lambda s: np.full((64, 256), s, np.float32)  # noqa: E731
    with OrbaxCheckpointStore(directory / "ckpt", max_to_keep=3) as store:
        if kind == "store":
            steps = store.list_steps()
            assert steps[-1] in (last, last + 1) and last in steps, (steps, last)
            for s in steps:  # every step the store lists is complete
                np.testing.assert_array_equal(store.restore(s).items["model"]["w"], w(s))
            v = steps[-1]
            store.save(v + 1, {"model": {"w": w(v + 1)}})  # the next save
            np.testing.assert_array_equal(store.restore(v + 1).items["model"]["w"], w(v + 1))
        else:
            store.save(2, {"model": {"w": w(-1)}})  # a writer first recovers an interrupted overwrite
            got = np.asarray(store.restore(1).items["model"]["w"])
            v = next((v for v in (last, last + 1) if np.array_equal(got, w(v))), None)
            assert v is not None, (got.ravel()[:3], last)
            store.save(1, {"model": {"w": w(last + 2)}}, overwrite=True)
            np.testing.assert_array_equal(store.restore(1).items["model"]["w"], w(last + 2))
    return v


PLAN = [
    ("save_file", 1, 6),
    ("save_model", 1, 6),
    ("multi_file", 1, 4),
    ("multiprocess", 2, 4),
    ("store", 1, 5),
    ("store_overwrite", 1, 3),
]


@pytest.mark.slow  # ~30 s of CPU (24 forks, each starting jax); longer on busy cores
def test_sigkill_at_random_moments_leaves_old_or_new_and_the_next_save_cleans_up(zygote, tmp_path):
    rng = random.Random(SEED)
    log = []
    t0 = time.monotonic()
    for kind, n, kills in PLAN:
        for i in range(kills):
            directory = tmp_path / f"{kind}{i}"
            directory.mkdir()
            last, record = kill_mid_save(zygote, rng, kind, directory, n)
            assert last >= 2
            if kind.startswith("store"):
                record["holds"] = check_store(kind, directory, last)
                leftovers = temporaries(directory / "ckpt")
            else:
                record["holds"] = check_file_kind(kind, directory, last)
                leftovers = temporaries(directory)
            assert leftovers == [], (record, leftovers)
            log.append(record)
    assert len(log) >= 20
    print(f"\n{len(log)} kills in {time.monotonic() - t0:.1f} s")
    for r in log:
        print(r)
    # The kills must land inside saves, not between them: a file save killed midway
    # leaves its temporary file, which the next save removed (checked above).
    assert sum(bool(r["stale"]) for r in log if not r["kind"].startswith("store")) >= 3, log


# --- the cleanup rules, one by one (fast) --------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # reaped: no process has this id now (until the kernel reuses it)


def temporary_host(path: Path, monkeypatch) -> str:
    """The ``<host>.ns<pidns>`` a save of ``path`` puts in its temporary's name (docs/reliability.md)."""
    name = temporary_name(path, monkeypatch)  # seen in a directory beside path, removed after
    return name.removeprefix(f".{path.name}{TMP_MARKER}").rsplit("-", 2)[0]


def test_the_next_save_removes_only_temporaries_of_dead_processes_of_this_host(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    host, dead, prefix = temporary_host(path, monkeypatch), dead_pid(), f".m.safetensors{TMP_MARKER}"
    names = {
        "dead here": f"{prefix}{host}-{dead}-0badc0de",
        "alive here (the parent)": f"{prefix}{host}-{os.getppid()}-0badc0de",
        "this process": f"{prefix}{host}-{os.getpid()}-0badc0de",
        "another host": f"{prefix}otherhost-{dead}-0badc0de",
        "another PID namespace": f"{prefix}{host.split('.ns')[0]}.ns1-{dead}-0badc0de",
        "an older name without a host": f"{prefix}{dead}-0badc0de",
        "another target": f".n.safetensors{TMP_MARKER}{host}-{dead}-0badc0de",
        "not ours": f"{prefix}{host}-notapid-0badc0de",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    nnx_save.save_file({"w": np.zeros(2, np.float32)}, path)
    left = set(os.listdir(tmp_path))
    assert names["dead here"] not in left
    assert left == {"m.safetensors"} | {n for k, n in names.items() if k != "dead here"}


def test_temporary_names_carry_host_and_pid(tmp_path, monkeypatch):
    name = temporary_name(tmp_path / "m.safetensors", monkeypatch)
    host, pid, token = name.removeprefix(f".m.safetensors{TMP_MARKER}").rsplit("-", 2)
    namespace = re.sub(r"[^0-9]", "", os.readlink("/proc/self/ns/pid"))  # "pid:[4026531836]"
    safe_name = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())[:64] or "localhost"
    assert (host, int(pid), len(token)) == (f"{safe_name}.ns{namespace}", os.getpid(), 8)
    assert "-" not in host and "/" not in host
