"""The ``nnx-save`` command line: ``inspect``, ``verify``, ``diff`` and ``convert``."""

from ._main import main

__all__ = ["main"]
