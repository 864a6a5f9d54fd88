"""Run in a fresh process by tests/load/test_cast_budget.py: load checkpoints into
targets of another dtype under ``max_inflight_bytes`` and print, per case, as JSON, how
much the peak resident memory of the load grew (``VmHWM``, reset through
``/proc/self/clear_refs``), the result's bytes, the in-flight peak the load report gives,
and how much the same load into float32 targets (no cast) grew beyond its arrays (what
many arrays cost in bookkeeping, cast or not). Each load runs twice: the first warms jax
up, its result dropped; then the heap gives its free pages back (``malloc_trim``), so
that what an earlier load left to the allocator cannot hide this one's peak, and the
second load is measured.

argv: a JSON list of cases, each ``{"path", "dtype", "layout", "budget"}``: layout
``"host"`` (numpy arrays), ``"one"`` (one CPU device) or ``"dim0"`` / ``"last"`` (the
8 simulated devices, split on that dimension).
"""

import ctypes
import gc
import json
import os
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import ml_dtypes
import numpy as np
from _rss import reset_peak, status

import nnx_save


def _abstract(header, dtype: str, layout: str) -> dict:
    """Targets of ``dtype`` for every tensor of ``header``, laid out as ``layout`` says."""
    dt = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    if layout == "host":  # numpy templates (their values are not read): one element, broadcast
        return {k: np.broadcast_to(np.zeros((), dt), t.shape) for k, t in header.tensors.items()}
    if layout == "one":
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return {k: jax.ShapeDtypeStruct(t.shape, dt, sharding=one) for k, t in header.tensors.items()}
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))

    def sharding(shape):
        axis = 0 if layout == "dim0" else len(shape) - 1
        spec = jax.sharding.PartitionSpec(*[("x" if d == axis else None) for d in range(len(shape))])
        return jax.sharding.NamedSharding(mesh, spec)

    return {k: jax.ShapeDtypeStruct(t.shape, dt, sharding=sharding(t.shape)) for k, t in header.tensors.items()}


def _bytes(value) -> int:
    if isinstance(value, jax.Array):
        return sum(s.data.nbytes for s in value.addressable_shards)
    return np.asarray(value).nbytes


def measure(path: str, dtype: str, layout: str, budget: int) -> dict:
    header = nnx_save.read_header(path)
    abstract = _abstract(header, dtype, layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lossy cast's warning: asked for
        jax.block_until_ready(nnx_save.load_file(header, abstract, max_inflight_bytes=budget))  # warms up; dropped
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(
            0
        )  # the heap's free pages back to the system: the next peak is this load's
        before = reset_peak()
        tree, report = nnx_save.load_file(header, abstract, max_inflight_bytes=budget, return_report=True)
        jax.block_until_ready(tree)
    peak = status("VmHWM")
    results = sum(_bytes(v) for v in tree.values())
    return {"growth": peak - before, "results": results, "reported": report.io.max_inflight_bytes}


def main() -> None:
    out = []
    for c in json.loads(sys.argv[1]):
        got = measure(c["path"], c["dtype"], c["layout"], c["budget"])
        same = measure(c["path"], "float32", c["layout"], c["budget"])  # no cast: what the arrays themselves cost
        out.append(got | {"uncast_beyond": same["growth"] - same["results"]})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
