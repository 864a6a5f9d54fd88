"""Run in a fresh process by tests/load/test_stream.py: load a checkpoint onto one device
(streamed or on the host path) and print host memory figures as JSON.

argv: path, "stream" | "host" | "verify" (the host path checking checksums) | "after"
(loaded in the file's dtypes, then cast whole), max_inflight_bytes, "warm" | "cold". Warm: the load runs twice, the first warming jax
up (compiling the on-device copy and update), its results dropped; the peak RSS of the
second (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) is measured.
Cold: one load, in a process that has allocated nothing before it.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from _rss import reset_peak, status

import nnx_save


def main() -> None:
    path, mode, budget, warm = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "warm"
    device = jax.devices()[0]
    header = nnx_save.read_header(path)
    one = jax.sharding.SingleDeviceSharding(device)
    abstract = {k: jax.ShapeDtypeStruct(t.shape, np.float32, sharding=one) for k, t in header.tensors.items()}

    def load():
        if mode == "after":  # the file's dtypes loaded, then each cast whole on its device: both held at the end
            same = {k: jax.ShapeDtypeStruct(t.shape, t.dtype.numpy, sharding=one) for k, t in header.tensors.items()}
            loaded = nnx_save.load_file(header, same, max_inflight_bytes=budget)
            return {k: v.astype(np.float32) for k, v in loaded.items()}, loaded
        return nnx_save.load_file(
            header,
            abstract,
            stream=mode == "stream",
            verify=mode == "verify",
            max_inflight_bytes=budget,
            allow_unexpected=["*"],
        )

    import warnings

    warnings.simplefilter("ignore", nnx_save.LoadWarning)  # the bf16 -> f32 casts are the point
    if warm:
        jax.block_until_ready(load())
    before = reset_peak()  # the peak RSS (VmHWM) from the current RSS
    tree = jax.block_until_ready(load())
    peak = status("VmHWM")
    results = sum(a.nbytes for a in (tree[0] if mode == "after" else tree).values())
    print(json.dumps({"before": before, "peak": peak, "results": results}))


if __name__ == "__main__":
    main()
