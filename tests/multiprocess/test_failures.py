"""A process killed in the middle of a multi-process save: the previous file stays,
the others stop with a clear error in bounded time."""

from __future__ import annotations

import os

import numpy as np
import pytest

import nnx_save

pytestmark = pytest.mark.multiprocess

TIMEOUT_ENV = "NNX_SAVE_COLLECTIVE_TIMEOUT_S"  # docs/configuration.md
TIMEOUT_S = 4  # the library's bound on each step, far below the 10 s heartbeat timeout


@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "primary"])
def test_killed_process_leaves_previous_file_and_stops_the_others(run_workers, tmp_path, victim):
    path = tmp_path / "model.safetensors"
    nnx_save.save_file({"old": np.arange(10, dtype=np.float32)}, path)
    before = path.read_bytes()
    workers = run_workers(
        "save_killed.py",
        4,
        1,
        {"path": str(path), "victim": victim},
        env={TIMEOUT_ENV: str(TIMEOUT_S)},
        timeout=60,
        expect_ok=False,
    )
    assert workers[victim].returncode == -9
    for w in workers:
        if w.process_id == victim:
            continue
        if victim == 0 and w.result is None:  # JAX itself ends a process whose leader died: clearly, at once
            assert w.returncode != 0
            assert "Terminating process because the JAX distributed service detected fatal errors" in w.output
            continue
        assert w.result is not None, w.describe()
        error = w.result["error"] or ""
        if victim == 0:  # the coordination service went down with process 0
            assert "lost the JAX coordination service" in error or "did not reach" in error, w.describe()
        else:
            assert (
                f"process(es) [{victim}] did not reach the 'write' step of the multi-process save within "
                f"{TIMEOUT_S} s ({TIMEOUT_ENV}); did one of them die" in error
            ), w.describe()
        assert "previous file at the path, if any, is intact" in error.lower()
        assert w.result["seconds"] < TIMEOUT_S + 5
    assert path.read_bytes() == before
    temporary = [n for n in os.listdir(tmp_path) if n.startswith(".model.safetensors.nnx_save-tmp-")]
    assert len(temporary) == (1 if victim == 0 else 0)  # a dead primary cannot remove its temporary file
