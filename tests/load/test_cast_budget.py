"""A cast counts in the load report's in-flight bytes like a read: a float32 tensor cast
into a bfloat16 target is read whole into a buffer of the file's dtype, alive beside the
result until it is cast, and ``report.io.max_inflight_bytes`` says so (it said the
budget, 4 MiB, while the peak memory grew by the whole float32 tensor). Measured in a
fresh process (tests/_cast_rss.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import nnx_save

HERE = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def test_the_report_counts_a_casts_buffer(tmp_path):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(16 * MIB, dtype=np.float32)}, path)  # 64 MiB, 32 MiB as bfloat16
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(HERE / "_cast_rss.py"), str(path), str(4 * MIB)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    beyond = got["growth"] - got["results"]  # what the load held besides its result
    assert got["reported"] >= 64 * MIB, got  # the float32 buffer was in flight, not just 4 MiB of reads
    assert beyond <= 1.25 * got["reported"] + 24 * MIB, got  # the report is the truth, within the allocator's noise
