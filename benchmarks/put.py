"""Per-tensor cost of placing host shards on devices: jax's internal
``pxla.batched_device_put`` (what nnx_save uses when present) against the public
fallbacks, the figures in docs/performance.md (``nnx_save.load._assemble.batched_put``).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=src python benchmarks/put.py

Each round times every strategy once over the same host shards (interleaved); the
table gives the median and spread of the per-tensor cost over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_save.load._assemble import batched_put


def _public_each(shape, sharding, hosts, devices):
    arrays = [jax.device_put(h, d) for h, d in zip(hosts, devices, strict=True)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _public_lists(shape, sharding, hosts, devices):
    return jax.make_array_from_single_device_arrays(shape, sharding, jax.device_put(hosts, devices))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=700)
    parser.add_argument("--kib", type=int, default=256, help="size of one tensor")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    devices = jax.devices()
    sharding = NamedSharding(jax.make_mesh((len(devices),), ("x",), devices=devices), P("x"))
    rows = args.kib * 1024 // 4 // 64
    shape = (rows - rows % len(devices), 64)
    order = list(sharding.addressable_devices_indices_map(shape))
    index = sharding.addressable_devices_indices_map(shape)
    tensors = [np.full(shape, i, np.float32) for i in range(args.tensors)]
    shards = [[np.ascontiguousarray(t[index[d]]) for d in order] for t in tensors]
    put = batched_put()
    strategies = {"public device_put per device": _public_each, "public device_put of lists": _public_lists}
    if put is not None:
        strategies = {"pxla.batched_device_put": put, **strategies}
    times: dict[str, list[float]] = {name: [] for name in strategies}
    for _ in range(args.rounds):
        for name, fn in strategies.items():
            t0 = time.perf_counter()
            out = [fn(shape, sharding, hosts, order) for hosts in shards]
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.tensors * 1e3)
            assert all(int(np.asarray(a.addressable_shards[0].data)[0, 0]) == i for i, a in enumerate(out))
            del out
    print(f"{args.tensors} tensors {shape} float32 over {len(devices)} devices, {args.rounds} interleaved rounds")
    print(f"{'strategy':32} {'median ms/tensor':>17} {'min-max':>14}")
    for name, ts in times.items():
        print(f"{name:32} {statistics.median(ts):17.3f} {min(ts):6.3f}-{max(ts):.3f}")


if __name__ == "__main__":
    main()
