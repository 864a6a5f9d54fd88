"""Fixtures for the multi-process tests: the files they load and the launches
(2 x 4 and 4 x 2) shared by the tests. The launcher is :mod:`mp_harness`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import nnx_save

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))  # the tests share mp_common with the workers
sys.path.insert(0, str(Path(__file__).parent))

import mp_common as c  # noqa: E402
from mp_harness import Worker, launch  # noqa: E402

# ---------------------------------------------------------------- launches shared by the tests
# Starting JAX dominates each launch, so one 2 x 4 run and one 4 x 2 run serve every
# test of test_tree.py and test_pod.py.


def _byte_jobs(files, n, devices):
    return [
        {"path": files["rows"], "suite": "rows", "mesh": [n, devices]},
        {"path": files["wide"], "suite": "wide", "mesh": [n, devices], "ratio": 1.0},
        {"path": files["wide"], "suite": "wide", "mesh": [n, devices], "ratio": 1.5},
    ]


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
    paths["pod"] = str(d / "pod")  # save_pod by the 2-process run
    return paths


@pytest.fixture(scope="session")
def two(files, tmp_path_factory):
    """2 processes x 4 devices: save the mixed tree, load it back, refusals, byte counts."""
    jobs = [*_byte_jobs(files, 2, 4), {"path": files["pod"], "suite": "mixed", "mesh": [2, 4], "host": True}]
    args = {"path": files["mixed"], "mesh": [2, 4], "dir": files["scratch"], "jobs": jobs, "pod": files["pod"]}
    return launch("save_tree.py", 2, 4, tmp_path_factory.mktemp("two"), args)


@pytest.fixture(scope="session")
def four(files, two, tmp_path_factory):
    """4 processes x 2 devices: byte counts, and the 2-process file on two meshes."""
    jobs = [
        *_byte_jobs(files, 4, 2),
        {"path": files["mixed"], "suite": "mixed", "mesh": [4, 2], "ratio": 4.0, "host": True},
        {"path": files["mixed"], "suite": "mixed", "mesh": [8], "ratio": 4.0, "host": True},
        {"path": files["pod"], "suite": "mixed", "mesh": [4, 2], "host": True},
        {"path": files["pod"], "suite": "mixed", "mesh": [8], "host": True},
    ]
    return launch("load_tree.py", 4, 2, tmp_path_factory.mktemp("four"), {"jobs": jobs})


@pytest.fixture
def run_workers(tmp_path):
    """``run_workers(script, n, devices, args, ...)``: results of every process."""
    counter = iter(range(1000))

    def run(script: str, n: int, devices: int, args: dict[str, Any] | None = None, **kw) -> list[Worker]:
        return launch(script, n, devices, tmp_path / f"run{next(counter)}_{Path(script).stem}", args, **kw)

    return run
