"""A process killed during a shared read: the other stops with a typed error naming
it within the library's bound, instead of blocking in a collective."""

from __future__ import annotations

import numpy as np
import pytest

import nnx_save

pytestmark = pytest.mark.multiprocess

TIMEOUT_ENV = "NNX_SAVE_COLLECTIVE_TIMEOUT_S"  # docs/configuration.md
TIMEOUT_S = 4  # the library's bound on each step, far below the 10 s heartbeat timeout


def test_a_process_killed_during_a_shared_read_stops_its_peer_in_bounded_time(run_workers, tmp_path):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(64 * 48, dtype=np.float32).reshape(64, 48)}, path)
    workers = run_workers(
        "load_killed.py",
        2,
        4,
        {"path": str(path), "victim": 1},
        env={TIMEOUT_ENV: str(TIMEOUT_S)},
        timeout=60,
        expect_ok=False,
    )
    assert workers[1].returncode == -9 and workers[1].result is None
    survivor = workers[0]
    assert survivor.result is not None, survivor.describe()
    error = survivor.result["error"]
    assert error is not None and error["type"] == "SourceError", survivor.describe()
    assert (
        f"process(es) [1] did not reach the 'read' step of the shared-read load within {TIMEOUT_S} s"
        in error["message"]
    ), error
    assert error["message"].endswith("Nothing was loaded"), error
    assert survivor.result["seconds"] < TIMEOUT_S + 5
