"""The packages' PEP 562 ``__getattr__``: a name bound on first use, any other refused."""

from __future__ import annotations

import doctest
import re
import sys
import types

import pytest

import nnx_save
import nnx_save.checkpoint
from nnx_save import _lazy_import


def test_the_example_runs():
    result = doctest.testmod(_lazy_import)
    assert result.attempted > 0 and result.failed == 0


def test_a_name_is_imported_once_and_bound_in_its_package(monkeypatch):
    package = types.ModuleType("lazy_demo")
    monkeypatch.setitem(sys.modules, "lazy_demo", package)
    package.__getattr__ = _lazy_import.lazy_getattr("lazy_demo", {"sqrt": "math", "loads": "json"})
    assert "sqrt" not in vars(package)
    assert package.sqrt(9.0) == 3.0
    assert vars(package)["sqrt"] is sys.modules["math"].sqrt  # later lookups skip __getattr__
    assert "loads" not in vars(package)  # only the name asked for is bound


@pytest.mark.parametrize("package", [nnx_save, nnx_save.checkpoint], ids=lambda m: m.__name__)
def test_the_packages_refuse_a_name_they_do_not_have(package):
    with pytest.raises(AttributeError, match=re.escape(f"module {package.__name__!r} has no attribute 'nope'")):
        package.nope  # noqa: B018
