"""What a training checkpoint holds beside the state dict ``--key`` picks: entries that are
JSON (a config dict, the step) are kept in the output's metadata, one key each, the value
its JSON text; the rest (optimizer state, Python objects) is dropped and named.

The kept names are the entries' dotted paths (``config_dict``, ``model.step`` for
``--key model.ema``); a name the format reserves (``format``, ``nnx_save.*``) or a JSON text
over :data:`MAX_JSON_BYTES` is dropped, with the reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_JSON_BYTES", "Extras"]

MAX_JSON_BYTES = 1 << 20  # one kept entry's JSON text: metadata lives in the header, read whole
_RESERVED = ("format", "nnx_save.")


@dataclass
class Extras:
    """The entries beside the picked state dict: ``kept`` (name -> JSON text, for the
    metadata) and ``dropped`` (one ``"name: why"`` line each)."""

    kept: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    def collect(self, state: Any, key: str) -> None:
        """Every entry along the path ``key`` names in ``state`` but off it."""
        node, where = state, ""
        for part in key.split("."):
            if not isinstance(node, dict):
                return
            for name, value in node.items():
                if str(name) != part:
                    self._add(f"{where}{name}", value)
            node, where = node.get(part), f"{where}{part}."

    def _add(self, name: str, value: Any) -> None:
        why = _unkept(name, value)
        if why is None:
            self.kept[name] = json.dumps(value, sort_keys=True, allow_nan=False)
            why = _too_long(self.kept[name])
            if why is not None:
                del self.kept[name]
        if why is not None:
            self.dropped.append(f"{name}: {why}")


def _unkept(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be kept as metadata (``None``: it can)."""
    if name == _RESERVED[0] or name.startswith(_RESERVED[1]):
        return f"the metadata name {name!r} is reserved"
    held = _not_json(value, 0)
    return None if held is None else f"holds {held}, not JSON"


def _too_long(text: str) -> str | None:
    size = len(text.encode("utf-8"))
    return f"its JSON is {size} bytes, over {MAX_JSON_BYTES}" if size > MAX_JSON_BYTES else None


def _not_json(value: Any, depth: int) -> str | None:
    """What in ``value`` is not plain JSON (a tensor, an object, NaN, a non-str key), or ``None``."""
    if depth > 64:
        return "nesting deeper than 64"
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"the float {value}"
    if isinstance(value, (list, tuple)):
        return next((w for v in value if (w := _not_json(v, depth + 1)) is not None), None)
    if isinstance(value, dict):  # what the values hold names it best (a tensor), then the keys
        held = next((w for v in value.values() if (w := _not_json(v, depth + 1)) is not None), None)
        return held or (None if all(isinstance(k, str) for k in value) else "a dict with keys that are not str")
    return f"a {type(value).__name__}"
