"""Worker bootstrap: read the launch arguments, start multi-process JAX, write results.

The parent (:mod:`tests.multiprocess.harness`) starts each worker as
``python <script> <process_id> <num_processes> <port> <out_dir> [json args]`` with
``XLA_FLAGS`` already set to this worker's device count, so jax sees it at import.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INIT_TIMEOUT_S = 60
HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 15


@dataclass(frozen=True)
class Ctx:
    process_id: int
    num_processes: int
    out: Path
    args: dict[str, Any]

    def write(self, result: dict[str, Any]) -> None:
        """Report this process's findings to the parent as JSON."""
        tmp = self.out / f".result_{self.process_id}.json"
        tmp.write_text(json.dumps(result, sort_keys=True))
        tmp.replace(self.out / f"result_{self.process_id}.json")


def init() -> Ctx:
    pid, n, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    args = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=n,
        process_id=pid,
        initialization_timeout=INIT_TIMEOUT_S,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
    assert jax.process_count() == n and jax.process_index() == pid, (jax.process_count(), jax.process_index())
    return Ctx(pid, n, out, args)
