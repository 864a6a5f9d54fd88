"""The house rules the code itself can check: no tracker references in code, tests or
docs (a reader has no tracker: the text says what the code does and why, history lives
in git), no dead code, and every module small enough to read (STYLE.md: under 600 lines)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "nnx_save"
ISSUE = re.compile(r"\b[Ii]ssues?\s+#?\d+")
MAX_LINES = 600


def _texts() -> list[Path]:
    """Every Python, Markdown and text file of src/, tests/, docs/ and benchmarks/, and
    the README."""
    files = [ROOT / "README.md"]
    for top in ("src", "tests", "docs", "benchmarks"):
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in {".py", ".md", ".txt"} and p.is_file()]
    return files


def _issue_hits() -> dict[str, list[int]]:
    hits: dict[str, list[int]] = {}
    for path in _texts():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ISSUE.search(line):
                hits.setdefault(str(path.relative_to(ROOT)), []).append(number)
    return hits


def test_the_pattern_finds_tracker_references_and_nothing_else():
    word = "issue"  # spelled apart so that this file holds no reference itself
    samples = (f"({word} 29)", f"{word.title()} 33: ...", f"{word}s 14 and 16", f"{word} #7")
    found = [s for s in samples if ISSUE.search(s)]
    assert len(found) == 4
    assert not any(ISSUE.search(s) for s in ("the issue's case", "an issue with 2 files", "tissue 3"))


def test_no_issue_numbers_in_code_tests_or_docs():
    assert _issue_hits() == {}


def test_no_module_over_600_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in SRC.rglob("*.py")}
    long = {f: n for f, n in sizes.items() if n > MAX_LINES}
    assert long == {}


def _without_all(path: Path) -> str:
    """The source of ``path``; for a private module, without its ``__all__``, which
    vulture counts as a use of every name it lists (a private module's ``__all__`` only
    says what other modules may import, not that any does)."""
    text = path.read_text(encoding="utf-8")
    if not path.name.startswith("_") or path.name == "__init__.py":
        return text
    lines = text.splitlines(keepends=True)
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            lines[node.lineno - 1 : node.end_lineno] = ["\n"] * (node.end_lineno - node.lineno + 1)
    return "".join(lines)


def test_no_dead_code_in_src(tmp_path):
    """vulture over src/ as `make test` runs it, and stricter: a name only a private
    module's ``__all__`` lists is not used (tests and docs do not count as uses)."""
    vulture = pytest.importorskip("vulture")
    for path in SRC.rglob("*.py"):
        copy = tmp_path / path.relative_to(SRC.parent)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(_without_all(path), encoding="utf-8")
    finder = vulture.Vulture()
    finder.scavenge([tmp_path / SRC.name, ROOT / "vulture_allowlist.py"])
    found = [item.get_report().replace(str(tmp_path), "src") for item in finder.get_unused_code(min_confidence=60)]
    assert found == []
