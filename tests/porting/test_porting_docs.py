"""docs/porting.md stays true: its code runs as it is from any directory, its rule
tables are the example models', and its rule-line counts are recounted here."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from examples.models import gpt2

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "porting.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def _table(name: str) -> object:
    block = next(b for b in _blocks() if f"{name} = Rules(" in b)
    block = block[: block.index("\n)\n", block.index(f"{name} = Rules(")) + 3]  # the table, not what uses it
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    return namespace[name]


def test_the_guide_shows_the_gpt2_rule_tables_verbatim() -> None:
    assert _table("RULES") == gpt2.RULES
    assert _table("SCANNED_RULES") == gpt2.SCANNED_RULES


def test_the_guide_runs_from_a_temporary_directory(tmp_path) -> None:
    """Every block, in order, as one script run where ``examples`` cannot be imported."""
    script = "\n\n".join(_blocks())
    assert "examples" not in re.findall(r"^\s*(?:from|import)\s+(\w+)", script, re.M)
    (tmp_path / "guide.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "guide.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "AxisType.Auto forward ok" in done.stdout
    if "device_count=8" in os.environ.get("XLA_FLAGS", ""):  # the suite's simulated devices
        assert "AxisType.Explicit refused: ShardingTypeError" in done.stdout


# --- rule lines per family ------------------------------------------------------------

FAMILY_RULES = {
    "`examples/models/gpt2.py` `RULES`": (ROOT / "examples/models/gpt2.py", "RULES"),
    "`examples/models/gpt2.py` `SCANNED_RULES`": (ROOT / "examples/models/gpt2.py", "SCANNED_RULES"),
    "`examples/models/llama.py` `RULES`": (ROOT / "examples/models/llama.py", "RULES"),
    "`examples/models/llama.py` `SCANNED_RULES`": (ROOT / "examples/models/llama.py", "SCANNED_RULES"),
    "`examples/models/bert.py` `RULES`": (ROOT / "examples/models/bert.py", "RULES"),
    "`examples/models/vit.py` `RULES`": (ROOT / "examples/models/vit.py", "RULES"),
    "`tests/porting/test_porting_lstm.py` `speech_rules`": (
        ROOT / "tests/porting/test_porting_lstm.py",
        "speech_rules",
    ),
}


def _rules_call(tree: ast.Module, name: str) -> ast.Call:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            assert isinstance(node.value, ast.Call)
            return node.value
        if isinstance(node, ast.FunctionDef) and node.name == name:
            returned = next(n for n in ast.walk(node) if isinstance(n, ast.Return))
            assert isinstance(returned.value, ast.Call)
            return returned.value
    raise AssertionError(f"no {name} found")


def _rule_lines(path: Path, name: str) -> int:
    """Non-blank, non-comment source lines between ``Rules(`` and its ``)``."""
    source = path.read_text()
    call = _rules_call(ast.parse(source), name)
    assert call.end_lineno is not None
    lines = source.splitlines()[call.lineno : call.end_lineno - 1]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def test_the_guide_counts_each_familys_rule_lines() -> None:
    rows = dict(re.findall(r"^\| [^|]+ \| (`[^|]+`) \| (\d+) \|$", DOC.read_text(), re.M))
    assert sorted(rows) == sorted(FAMILY_RULES)
    for label, (path, name) in FAMILY_RULES.items():
        assert int(rows[label]) == _rule_lines(path, name) < 25, label
