"""Run in a fresh process by tests/load/test_cast_budget.py: load one float32 tensor into
a bfloat16 target under ``max_inflight_bytes`` (twice: the first warms jax up, its
result dropped) and print, as JSON, how much the peak resident memory of the second grew (``VmHWM``, reset through ``/proc/self/clear_refs``), the result's
bytes and the in-flight peak the load report gives.

argv: path, max_inflight_bytes.
"""

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


def main() -> None:
    path, budget = sys.argv[1], int(sys.argv[2])
    header = nnx_save.read_header(path)
    abstract = {k: jax.ShapeDtypeStruct(t.shape, ml_dtypes.bfloat16) for k, t in header.tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lossy cast's warning: asked for
        nnx_save.load_file(header, abstract, max_inflight_bytes=budget)  # warms jax up; dropped
        before = reset_peak()
        tree, report = nnx_save.load_file(header, abstract, max_inflight_bytes=budget, return_report=True)
    peak = status("VmHWM")
    results = sum(np.asarray(v).nbytes for v in tree.values())
    print(json.dumps({"growth": peak - before, "results": results, "reported": report.io.max_inflight_bytes}))


if __name__ == "__main__":
    main()
