"""tests/porting: make the repository's ``examples`` package and this directory's
``porting_support`` helpers importable, whatever pytest's import mode."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parents[1]), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
