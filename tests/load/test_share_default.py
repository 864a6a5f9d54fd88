"""The automatic ``share_reads`` decision (``None``, the default): on for several
processes that hold the same elements, reading a remote source or spread over
several hosts, off otherwise; ``True`` / ``False`` honoured, nothing shared on one
process."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nnx_save import LoadOptions
from nnx_save.errors import OptionError
from nnx_save.load._share import decide, enabled


def _no_hosts() -> int:
    raise AssertionError("the host count was asked for where the decision needs none")


@pytest.mark.parametrize(
    ("setting", "processes", "shared", "remote", "hosts", "expected"),
    [
        (None, 2, True, True, None, True),  # a URL: read once per pod
        (None, 4, True, False, 1, False),  # local files on one host: one page cache
        (None, 2, True, False, 2, True),  # local paths on several hosts: a network filesystem
        (None, 2, False, True, None, False),  # nothing held by several processes (or a load on some only)
        (None, 1, True, True, None, False),  # one process: no peers to share with
        (True, 2, False, False, None, True),
        (False, 2, True, True, None, False),
        (True, 1, True, False, None, False),
    ],
)
def test_the_decision(setting, processes, shared, remote, hosts, expected):
    count = _no_hosts if hosts is None else (lambda: hosts)
    assert decide(setting, processes, shared, remote, count) is expected


def test_the_default_is_automatic_and_a_bad_value_is_refused():
    assert LoadOptions().share_reads is None
    with pytest.raises(OptionError, match=re.escape("share_reads must be None, True or False, got 1")):
        LoadOptions(share_reads=1)


def test_one_process_never_shares():
    import jax

    from nnx_save.load._target import Target

    sharding = jax.sharding.NamedSharding(jax.make_mesh((8,), ("x",)), jax.sharding.PartitionSpec())
    t = Target("w", (8,), np.dtype(np.float32), sharding, sources=("w",))
    assert enabled(None, [t], True, "x.safetensors") is False
    assert enabled(True, [t], False, "x.safetensors") is False


def test_a_load_on_some_processes_only_is_not_shared():
    import jax

    from nnx_save.load._share import _every_process
    from nnx_save.load._target import Target

    sharding = jax.sharding.NamedSharding(jax.make_mesh((8,), ("x",)), jax.sharding.PartitionSpec())
    t = Target("w", (8,), np.dtype(np.float32), sharding, sources=("w",))
    assert _every_process([t], 1) and not _every_process([t], 2)  # these devices are all process 0's
