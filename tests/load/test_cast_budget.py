"""A dtype cast is bounded by the load's in-flight budget like a read: a float32 tensor
loaded into a bfloat16 target grows the peak memory by its result and about the budget,
not by the whole float32 tensor as well (each slab is read into reused scratch and cast
into its place in the result as it lands), and ``report.io.max_inflight_bytes`` tells
the truth about what was held. Measured in one fresh process for every case
(tests/_cast_rss.py): each kind of checkpoint (one big tensor, one whose rows are each
wider than the budget, many small tensors, two files) into each kind of target (numpy,
one device, the 8 simulated devices split on the first or the last dimension)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnx_save

HERE = Path(__file__).resolve().parents[1]
MIB = 1 << 20
BUDGET = 4 * MIB
# What the allocator and jax keep beside a load's arrays, run to run (a few MiB measured):
# far under the float32 tensors (64 MiB) that a cast read whole would hold
NOISE = 8 * MIB

KINDS = {  # each 64 MiB of float32, 32 MiB as bfloat16
    "big": lambda: {"w": np.arange(16 * MIB, dtype=np.float32).reshape(4096, 4096)},
    "wide": lambda: {"w": np.arange(16 * MIB, dtype=np.float32).reshape(8, 2 * MIB)},  # a row: 8 MiB
    "small": lambda: {f"b{i:04d}": np.full(16384, i, np.float32) for i in range(1024)},  # 64 KiB each
    "files": lambda: {f"w{i}": np.full((2048, 4096), i, np.float32) for i in range(2)},  # one per file
}
LAYOUTS = ("host", "one", "dim0", "last")
CASES = [(k, layout) for k, layout in itertools.product(KINDS, LAYOUTS) if k != "files" or layout in ("one", "dim0")]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """Every case's figures, from one fresh process."""
    where = tmp_path_factory.mktemp("cast")
    paths = {}
    for kind, make in KINDS.items():
        paths[kind] = where / (kind if kind == "files" else f"{kind}.safetensors")
        nnx_save.save_file(make(), paths[kind], **({"max_shard_size": 40 * MIB} if kind == "files" else {}))
    cases = [{"path": str(paths[k]), "dtype": "bfloat16", "layout": layout, "budget": BUDGET} for k, layout in CASES]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        # a fixed mmap threshold: blocks of 1 MiB and more go back to the system when freed,
        # so a later case's peak is not hidden in what an earlier one left to the allocator
        "MALLOC_MMAP_THRESHOLD_": str(MIB),
    }
    done = subprocess.run(
        [sys.executable, str(HERE / "_cast_rss.py"), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(CASES, json.loads(done.stdout.splitlines()[-1]), strict=True))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_a_cast_grows_memory_by_its_result_and_the_budget(measured, case):
    got = measured[case]
    assert got["results"] == 32 * MIB, got
    beyond = got["growth"] - got["results"]  # what the load held besides its result
    arrays = max(got["uncast_beyond"], 0)  # 8192 device arrays of 8 KiB cost ~15 MiB of bookkeeping, cast or not
    assert beyond <= arrays + 2 * BUDGET + NOISE, got  # not the 64 MiB of float32 a whole read would hold
    assert got["reported"] <= BUDGET, got  # the slabs in flight, within the budget
    assert beyond - arrays <= 1.25 * got["reported"] + 24 * MIB, got  # the report is the truth, within the noise
