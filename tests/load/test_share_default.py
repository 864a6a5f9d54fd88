"""The automatic ``share_reads`` decision (``None``, the default): on for several
processes that hold the same elements, reading a remote source or spread over
several hosts, off otherwise; ``True`` / ``False`` honoured, nothing shared on one
process. And what a shared load hands back on the CPU backend: one host buffer per
box however many local devices hold it."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


SPECS = [(), ("x",), ("x", None), (None, "y"), ("y", None), (("x", "y"),)]


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(SPECS), st.sampled_from([np.float32, np.int8, np.float16]))
def test_a_reshard_result_keeps_one_host_buffer_per_box(spec, dtype):
    """The reshard leaves one buffer per device; :func:`one_host_buffer` keeps one per
    distinct box, the same bytes, and a donated result never writes into it."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from nnx_save.load._share import one_host_buffer
    from nnx_save.load._target import Target

    mesh = jax.make_mesh((2, 4), ("x", "y"))
    shape = (8, 16)[: max(1, len(spec))]
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    source = np.arange(np.prod(shape)).astype(dtype).reshape(shape)
    resharded = jax.jit(lambda a: a, out_shardings=sharding)(
        jax.device_put(source, NamedSharding(mesh, PartitionSpec()))
    )
    assert len({s.data.unsafe_buffer_pointer() for s in resharded.addressable_shards}) == 8  # one per device
    value = one_host_buffer(resharded, Target("w", shape, np.dtype(dtype), sharding, sources=("w",)))
    del resharded
    boxes = {str(s.index) for s in value.addressable_shards}
    assert len({s.data.unsafe_buffer_pointer() for s in value.addressable_shards}) == len(boxes)
    assert value.sharding == sharding and value.dtype == dtype
    np.testing.assert_array_equal(np.asarray(value), source)
    first = value.addressable_shards[0]
    kept, index = np.asarray(first.data), first.index  # a view of a shared buffer
    doubled = jax.jit(lambda a: a * 2, donate_argnums=0)(value)
    np.testing.assert_array_equal(kept, source[index])
    np.testing.assert_array_equal(np.asarray(doubled), source * 2)
