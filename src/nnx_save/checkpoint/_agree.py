"""Decisions about the disk, made once on process 0 and shared with every process.

Two processes reading the disk a moment apart could decide differently and then wait at
Orbax barriers the other never reaches; so process 0 decides and the others read its
answer from the JAX coordination service's key-value store, in call order. A process that
asks another question than process 0 answered gets a ``CheckpointUsageError`` (``reason="sync"``),
not a hang.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from typing import TypeVar

from .. import _config
from ..io import _kv
from ._errors import CheckpointUsageError

__all__ = ["agree"]

_sync_error = functools.partial(CheckpointUsageError, reason="sync")
_SEQUENCE = itertools.count()  # every process numbers its decisions the same way

T = TypeVar("T")


def agree(name: str, decide: Callable[[], T]) -> T:
    """``decide()`` as computed on process 0, on every process (JSON data: tuples come back
    as lists); ``name`` checks the call order. The last reader deletes the decision's keys.

    Raises:
        CheckpointUsageError: ``reason="sync"``: process 0's decision failed, did not come within the
            timeout, or answered another question (the processes diverged).

    Examples:
        >>> agree("answer", lambda: {"steps": [1, 2]})
        {'steps': [1, 2]}
    """
    kv = _kv.Channel.open("the checkpoint store", _sync_error)
    if kv.n == 1:
        return decide()
    key = f"nnx_save/checkpoint/decision/{next(_SEQUENCE)}"
    if kv.pid == 0:
        try:
            value = decide()
        except BaseException as error:
            _exchange(kv, key, name, {"name": name, "error": f"{type(error).__name__}: {error}"})
            raise
        _exchange(kv, key, name, {"name": name, "value": value})
        return value
    posted = _exchange(kv, key, name, None)
    kv.read_once(key, kv.n - 1)
    if posted["name"] != name:
        raise _sync_error(
            f"the processes diverged: process 0 decided {posted['name']!r} where process {kv.pid} asks {name!r}; "
            "call every store method on every process, in the same order"
        )
    if "error" in posted:
        raise _sync_error(f"process 0 failed to decide {name!r}: {posted['error']}")
    return posted["value"]


def _exchange(kv: _kv.Channel, key: str, name: str, mine: dict | None) -> dict:
    """Post process 0's decision ``mine``, or wait for it (bounded like every wait on another process)."""
    timeout = _config.COLLECTIVE_TIMEOUT_S.get()
    try:
        return json.loads(kv.gather(key, None if mine is None else json.dumps(mine), {0}, timeout)[0])
    except _kv.Unanswered as error:
        raise _sync_error(
            f"process {kv.pid} waited {timeout:g} s ({_config.COLLECTIVE_TIMEOUT_S.name}) for process 0 to "
            f"decide {name!r} and got no answer ({error}); did process 0 die, or stop calling the store?"
        ) from error
