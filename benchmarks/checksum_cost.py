"""Cost of nnx_save's per-tensor xxh3_64 checksums on save and load.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/checksum_cost.py [--gb 1.5] [--repeat 3]

Writes a checkpoint of float32/bfloat16 tensors (~``--gb`` GB) to a temporary
directory and times, in this one process with the page cache warm (the cost of
hashing is then the largest share it can be):

- save with checksums (the writer's default) vs with hashing stubbed out;
- load_file(verify=True) vs load_file(verify=False), into host numpy arrays.

Prints the median of ``--repeat`` runs of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from unittest import mock

import ml_dtypes
import numpy as np

import nnx_save
from nnx_save import _checksum


def _tree(gb: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = max(int(gb * 1e9) // (64 << 20), 1)
    tree = {}
    for i in range(n):  # 64 MiB tensors, alternating f32 and bf16
        if i % 2:
            tree[f"layers.{i}.w"] = rng.standard_normal((4096, 8192), np.float32).astype(ml_dtypes.bfloat16)
        else:
            tree[f"layers.{i}.w"] = rng.standard_normal((4096, 4096), np.float32)
    return tree


def _time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    tree = _tree(args.gb)
    nbytes = sum(a.nbytes for a in tree.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_on = _time(lambda: nnx_save.save_file(tree, path, progress=False), args.repeat)
        with mock.patch.object(_checksum.Digests, "update", lambda self, key, data: None):
            save_off = _time(lambda: nnx_save.save_file(tree, path, progress=False), args.repeat)
        nnx_save.save_file(tree, path, progress=False)
        load_on = _time(lambda: nnx_save.load_file(path, verify=True, progress=False), args.repeat)
        load_off = _time(lambda: nnx_save.load_file(path, verify=False, progress=False), args.repeat)
    gb = nbytes / 1e9
    print(f"checkpoint: {len(tree)} tensors, {gb:.2f} GB, cpus={os.cpu_count()}")
    for what, on, off in (("save", save_on, save_off), ("load", load_on, load_off)):
        print(f"{what}: with checksums {on:.3f} s ({gb / on:.2f} GB/s), without {off:.3f} s "
              f"({gb / off:.2f} GB/s), cost {100 * (on - off) / off:+.1f}%")


if __name__ == "__main__":
    main()
