"""Names a package binds on first use (PEP 562): its ``__getattr__`` imports the module
that defines a name when the name is first asked for, so importing the package stays light."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, lazy: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: a name of ``lazy`` imports the
    (relative) module it maps to and binds its value in ``package``, so later lookups
    skip this function; any other name raises ``AttributeError``.

    Examples:
        >>> import types, sys
        >>> sys.modules["demo"] = demo = types.ModuleType("demo")
        >>> demo.__getattr__ = lazy_getattr("demo", {"dumps": "json"})
        >>> demo.dumps is sys.modules["json"].dumps, "dumps" in vars(demo)
        (True, True)
        >>> del sys.modules["demo"]
    """

    def __getattr__(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(lazy[name], package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__
