"""docs/porting.md stays true: its rule table is the one the GPT-2 example uses."""

from __future__ import annotations

import re
from pathlib import Path

from examples.models import gpt2

DOC = Path(__file__).resolve().parents[2] / "docs" / "porting.md"


def test_the_guide_shows_the_gpt2_rule_table_verbatim() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    table = next(b for b in blocks if "RULES = Rules(" in b)
    namespace: dict = {}
    exec(compile(table, str(DOC), "exec"), namespace)
    assert namespace["RULES"] == gpt2.RULES
