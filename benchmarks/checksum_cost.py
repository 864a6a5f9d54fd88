"""Cost of nnx_save's per-tensor xxh3_64 checksums on save and load.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/checksum_cost.py [--gb 1.5] [--repeat 3]

Writes a checkpoint of float32/bfloat16 tensors (~``--gb`` GB) to a temporary
directory and times, in this one process with the page cache warm (the cost of
hashing is then the largest share it can be):

- save with checksums (the writer's default) vs with hashing stubbed out;
- load_file(verify=True) vs load_file(verify=False), into host numpy arrays.

Alternates the variants ``--repeat`` times each and prints min and median (on a
shared machine the min is the better estimate), plus the hash alone.
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
from nnx_save.format import _checksum


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


def _pair(on, off, repeat: int) -> tuple[list[float], list[float]]:
    """Alternate the two variants ``repeat`` times each (a busy machine drifts)."""
    times: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out, out_cpu in ((on, times[0], cpu[0]), (off, times[1], cpu[1])):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            out.append(time.perf_counter() - t0)
            out_cpu.append(time.process_time() - c0)
    _CPU.append(cpu)
    return times


_CPU: list = []  # CPU seconds (all threads) of each pair: independent of other load on the machine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.5)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    tree = _tree(args.gb)
    nbytes = sum(a.nbytes for a in tree.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        stub = mock.patch.object(_checksum.Digests, "update", lambda self, key, data: None)

        def save_off():
            with stub:
                nnx_save.save_file(tree, path, progress=False)

        save = _pair(lambda: nnx_save.save_file(tree, path, progress=False), save_off, args.repeat)
        nnx_save.save_file(tree, path, progress=False)
        load = _pair(
            lambda: nnx_save.load_file(path, verify=True, progress=False),
            lambda: nnx_save.load_file(path, verify=False, progress=False),
            args.repeat,
        )
    t0 = time.perf_counter()
    for a in tree.values():
        _checksum.digest([memoryview(a.reshape(-1).view(np.uint8))])
    hash_s = time.perf_counter() - t0
    gb = nbytes / 1e9
    print(f"checkpoint: {len(tree)} tensors, {gb:.2f} GB, cpus={os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
    print(f"xxh3_64 alone, one thread: {hash_s:.3f} s ({gb / hash_s:.2f} GB/s)")
    for what, (on, off) in (("save cpu", _CPU[0]), ("load cpu", _CPU[1]), ("save", save), ("load", load)):
        print(
            f"{what}: with checksums min {min(on):.3f} s / median {statistics.median(on):.3f} s, "
            f"without min {min(off):.3f} s / median {statistics.median(off):.3f} s; "
            f"cost (min) {100 * (min(on) - min(off)) / min(off):+.1f}%, "
            f"(median) {100 * (statistics.median(on) - statistics.median(off)) / statistics.median(off):+.1f}%"
        )


if __name__ == "__main__":
    main()
