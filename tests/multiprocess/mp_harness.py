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

WORKERS = Path(__file__).parent / "workers"


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
    child.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    child.update(env or {})
    return child


def launch(
    script: str,
    n: int,
    devices: int,
    out: Path,
    args: dict[str, Any] | None = None,
    *,
    timeout: float = 90,
    env: dict[str, str] | None = None,
    expect_ok: bool = True,
) -> list[Worker]:
    """Run ``workers/<script>`` as ``n`` processes with ``devices`` CPU devices each.

    Returns one :class:`Worker` per process. With ``expect_ok`` (the default), any
    worker that exits non-zero or reports nothing fails the test with every
    worker's output.
    """
    out.mkdir(parents=True, exist_ok=True)
    port, logs, procs = free_port(), [], []
    child_env = _child_env(devices, env)
    for i in range(n):
        log = open(out / f"worker_{i}.log", "w+b")  # noqa: SIM115 (closed after the workers exit)
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKERS / script), str(i), str(n), str(port), str(out), json.dumps(args or {})],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
            )
        )
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
    for i, (p, log) in enumerate(zip(procs, logs, strict=False)):
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
        log.close()
        path = out / f"result_{i}.json"
        workers.append(Worker(i, p.returncode, text, json.loads(path.read_text()) if path.exists() else None))
    if timed_out:
        raise WorkerFailure(
            f"{script}: workers still running after {timeout} s, killed\n" + "\n".join(w.describe() for w in workers)
        )
    if expect_ok and any(w.returncode != 0 or w.result is None for w in workers):
        raise WorkerFailure(
            f"{script}: {n} processes x {devices} devices failed\n" + "\n".join(w.describe() for w in workers)
        )
    return workers
