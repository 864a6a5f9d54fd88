"""Host memory of save_model / load_model, measured in fresh processes by the
benchmark's own worker (peak RSS above the baseline, /proc/self/clear_refs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TENSOR = 4 * 2048 * 2048  # one layer's kernel, the largest tensor of the benchmark model


def phase(name: str, directory: Path, size_gb: float) -> dict:
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]),
    )
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "nnx.py"),
            "--worker",
            f"nnx_save:{name}",
            "--size-gb",
            str(size_gb),
            "--dir",
            str(directory),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_save_adds_one_tensor_and_builder_load_stays_under_1_1x(tmp_path):
    saved = phase("save", tmp_path, 0.5)
    assert saved["peak_above_kb"] * 1024 <= TENSOR + (8 << 20), saved
    loaded = phase("load_builder", tmp_path, 0.5)
    assert loaded["peak_above_kb"] * 1024 <= 1.1 * loaded["bytes"], loaded
