"""Launch N JAX processes on 127.0.0.1 and collect what each one reports.

Each worker is a small script in ``workers/`` run as
``python <script> <process_id> <num_processes> <port> <out_dir> <json args>``; it
starts multi-process JAX (gloo collectives, :mod:`mp_boot`) and writes
``result_<i>.json``. Every wait is bounded: the coordinator's connection timeout in
the worker, and a wall-clock limit here after which every worker is killed. A
failing worker's exit status and output are put into the test failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import nnx_save

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))  # the tests share mp_common with the workers

import mp_common as c  # noqa: E402


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Worker:
    process_id: int
    returncode: int | None
    output: str
    result: dict[str, Any] | None

    def describe(self) -> str:
        return f"--- process {self.process_id}: exit status {self.returncode} ---\n{self.output[-6000:]}"


class WorkerFailure(AssertionError):
    pass


def _child_env(devices: int, env: dict[str, str] | None) -> dict[str, str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JAX_COORDINATOR"))}
    child.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                 PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    child.update(env or {})
    return child


def launch(script: str, n: int, devices: int, out: Path, args: dict[str, Any] | None = None, *,
           timeout: float = 90, env: dict[str, str] | None = None, expect_ok: bool = True) -> list[Worker]:
    """Run ``workers/<script>`` as ``n`` processes with ``devices`` CPU devices each.

    Returns one :class:`Worker` per process. With ``expect_ok`` (the default), any
    worker that exits non-zero or reports nothing fails the test with every
    worker's output.
    """
    out.mkdir(parents=True, exist_ok=True)
    port, logs, procs = free_port(), [], []
    child_env = _child_env(devices, env)
    for i in range(n):
        log = open(out / f"worker_{i}.log", "w+b")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKERS / script), str(i), str(n), str(port), str(out), json.dumps(args or {})],
            stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True))
    deadline = time.monotonic() + timeout
    timed_out = False
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p in procs:  # never leave a worker behind
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    workers = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
        log.close()
        path = out / f"result_{i}.json"
        workers.append(Worker(i, p.returncode, text, json.loads(path.read_text()) if path.exists() else None))
    if timed_out:
        raise WorkerFailure(f"{script}: workers still running after {timeout} s, killed\n"
                            + "\n".join(w.describe() for w in workers))
    if expect_ok and any(w.returncode != 0 or w.result is None for w in workers):
        raise WorkerFailure(f"{script}: {n} processes x {devices} devices failed\n"
                            + "\n".join(w.describe() for w in workers))
    return workers


# ---------------------------------------------------------------- launches shared by the tests
# Starting JAX dominates each launch, so one 2 x 4 run and one 4 x 2 run serve every
# test of test_tree.py and test_pod.py.

def _byte_jobs(files, n, devices):
    return [{"path": files["rows"], "suite": "rows", "mesh": [n, devices]},
            {"path": files["wide"], "suite": "wide", "mesh": [n, devices], "ratio": 1.0},
            {"path": files["wide"], "suite": "wide", "mesh": [n, devices], "ratio": 1.5}]


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """Row-split and column-split files (4 MiB of data each), written by this process."""
    d = tmp_path_factory.mktemp("files")
    paths = {}
    for suite in ("rows", "wide"):
        paths[suite] = str(d / f"{suite}.safetensors")
        nnx_save.save_file(c.nest({k: c.value(k, e[0], e[1]) for k, e in c.SUITES[suite].items()}), paths[suite])
    paths["mixed"] = str(d / "mixed.safetensors")  # written by the 2-process run
    paths["single"] = str(d / "single.safetensors")
    tree = c.nest({**c.make_tree("mixed", c.mesh([2, 4])), **c.host_values()})
    nnx_save.save_file(tree, paths["single"], metadata={"made_by": "save_tree"})
    (d / "scratch").mkdir()
    paths["scratch"] = str(d / "scratch")
    paths["pod"] = str(d / "pod")  # save_sharded by the 2-process run
    return paths


@pytest.fixture(scope="session")
def two(files, tmp_path_factory):
    """2 processes x 4 devices: save the mixed tree, load it back, refusals, byte counts."""
    jobs = _byte_jobs(files, 2, 4) + [{"path": files["pod"], "suite": "mixed", "mesh": [2, 4], "host": True}]
    args = {"path": files["mixed"], "mesh": [2, 4], "dir": files["scratch"], "jobs": jobs, "pod": files["pod"]}
    return launch("save_tree.py", 2, 4, tmp_path_factory.mktemp("two"), args)


@pytest.fixture(scope="session")
def four(files, two, tmp_path_factory):
    """4 processes x 2 devices: byte counts, and the 2-process file on two meshes."""
    jobs = _byte_jobs(files, 4, 2) + [
        {"path": files["mixed"], "suite": "mixed", "mesh": [4, 2], "ratio": 4.0, "host": True},
        {"path": files["mixed"], "suite": "mixed", "mesh": [8], "ratio": 4.0, "host": True},
        {"path": files["pod"], "suite": "mixed", "mesh": [4, 2], "host": True},
        {"path": files["pod"], "suite": "mixed", "mesh": [8], "host": True}]
    return launch("load_tree.py", 4, 2, tmp_path_factory.mktemp("four"), {"jobs": jobs})



@pytest.fixture
def run_workers(tmp_path):
    """``run_workers(script, n, devices, args, ...)``: results of every process."""
    counter = iter(range(1000))

    def run(script: str, n: int, devices: int, args: dict[str, Any] | None = None, **kw) -> list[Worker]:
        return launch(script, n, devices, tmp_path / f"run{next(counter)}_{Path(script).stem}", args, **kw)

    return run
