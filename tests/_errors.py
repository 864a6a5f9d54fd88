"""``raises_check``: ``pytest.raises`` for an error class, or for a :class:`nnx_save.HeaderError`
whose ``check`` is the one named (a string), so parametrized cases can mix both."""

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

import nnx_save
import nnx_save.porting


@contextlib.contextmanager
def raises_check(expected: str | type[BaseException], match: str | None = None) -> Iterator[Any]:
    """``pytest.raises(expected)``; for a string, a :class:`nnx_save.HeaderError` whose ``check`` it is."""
    with pytest.raises(nnx_save.HeaderError if isinstance(expected, str) else expected, match=match) as info:
        yield info
    if isinstance(expected, str):
        assert info.value.check == expected, f"check {info.value.check!r}, expected {expected!r}: {info.value}"


@contextlib.contextmanager
def raises_rule(kind: str, match: str | None = None) -> Iterator[Any]:
    """A :class:`nnx_save.porting.RuleError` whose message matches ``match`` and whose ``kind`` is ``kind``."""
    with pytest.raises(nnx_save.porting.RuleError, match=match) as info:
        yield info
    assert info.value.kind == kind, f"kind {info.value.kind!r}, expected {kind!r}: {info.value}"


@contextlib.contextmanager
def raises_usage(reason: str, match: str | None = None) -> Iterator[Any]:
    """A :class:`nnx_save.checkpoint.CheckpointUsageError` whose message matches ``match`` and
    whose ``reason`` is ``reason``."""
    with pytest.raises(nnx_save.checkpoint.CheckpointUsageError, match=match) as info:
        yield info
    assert info.value.reason == reason, f"reason {info.value.reason!r}, expected {reason!r}: {info.value}"
