"""One writer per directory across jobs: a job of two JAX processes
saving into a directory another process is writing is refused on every process, naming
that writer, which then commits intact; the job's own saves (process 0 holds the lock for
all, its peers never take it) leave no lock file behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import nnx_save

pytestmark = pytest.mark.multiprocess

# The first writer: a save_pod into argv[1] that stops before its manifest is committed
# until a line arrives on stdin.
_FIRST = """
import sys
import numpy as np
import nnx_save
from nnx_save.layouts import _pod

commit = _pod._commit_manifest
def paused(*args, **kwargs):
    print("holding", flush=True)
    sys.stdin.readline()
    return commit(*args, **kwargs)

_pod._commit_manifest = paused
nnx_save.save_pod({"w": np.arange(16, dtype=np.float32)}, sys.argv[1])
print("saved", flush=True)
"""


@pytest.mark.slow  # two JAX processes beside a third
def test_a_second_job_is_refused_on_every_process_and_its_peers_never_refuse_it(run_workers, tmp_path):
    held = tmp_path / "held"
    first = subprocess.Popen(
        [sys.executable, "-c", _FIRST, str(held)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None and first.stdout.readline() == "holding\n"
        before = sorted(os.listdir(held))
        args = {"held": str(held), "free": str(tmp_path / "free"), "mesh": [2, 4]}
        workers = run_workers("save_locked.py", 2, 4, args, timeout=300)
        assert sorted(os.listdir(held)) == before  # the refused job wrote nothing there
    finally:
        out, _ = first.communicate("\n", timeout=120)
    assert (first.returncode, out) == (0, "saved\n")
    named = f"save_pod in process {first.pid} on host "
    for w in workers:
        for layout in ("pod", "index"):
            refused = w.result["refused"][layout]
            assert refused is not None and refused["type"] == "DirectoryLockedError", (w.process_id, layout, refused)
            assert refused["message"].startswith(f"{held} is being written by {named}")
            assert refused["holder"].startswith(named)
    for w in workers:  # the job's own saves: never refused, no lock file left after either
        assert all("_nnx_save.lock" not in names for saves in w.result["listed"].values() for names in saves)
        assert w.result["listed"] == workers[0].result["listed"]
        assert w.result["checked"] == {"pod": 7 * 4, "index": 7 * 4}
    assert nnx_save.load_file(held)["w"].tolist() == list(range(16))  # the first writer's save, whole
    assert sorted(os.listdir(held)) == ["manifest.json", *[n for n in before if n.endswith(".safetensors")]]
