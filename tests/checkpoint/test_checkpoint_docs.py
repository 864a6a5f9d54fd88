"""The checkpoint guide, docstring examples and example script run as written."""

from __future__ import annotations

import doctest
import os
import pathlib
import re
import subprocess
import sys

import pytest

from nnx_save.checkpoint import (
    _agree,
    _metadata,
    _nnx,
    _partial,
    _retention,
    _schedule,
    _store,
    _store_location,
    _tree,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    [_agree, _metadata, _nnx, _partial, _retention, _schedule, _store, _store_location, _tree],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.multiprocess  # its two-process fine-tune starts two JAX processes
def test_the_guide_example_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the page writes its worker script to the working directory
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 5
    namespace = {"__name__": "guide"}
    for block in blocks:  # one namespace, in order, as a reader would run them
        exec(compile(block, "docs/checkpoints.md", "exec"), namespace)
    assert capsys.readouterr().out == (
        "100 {'epoch': 1, 'position': 640} {'lr': 0.001, 'hidden': 8}\n(2, 4) 8320\n(1, 1) 8320\n[150, 200]\n[5, 10, 12]\n"
        "process 0: steps [10, 12], evaluation weights as trained: True\n"
        "process 1: steps [10, 12], evaluation weights as trained: True\n"
    )


@pytest.mark.slow
def test_train_resume_example_reproduces_the_run(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / "train_resume.py"), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== resumed run bit-identical: True" in result.stdout
    assert "refused as expected (below_latest)" in result.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["100", "75"]
