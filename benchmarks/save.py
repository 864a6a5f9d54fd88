"""Saving benchmark: ``nnx_save.save_file`` against ``safetensors.numpy.save_file``.

    .venv/bin/python benchmarks/save.py [--size-gb 2] [--repeat 3] [--dir DIR]

Each run is one save of a generated fp32 checkpoint (:func:`_common.transformer_shapes`:
~2 GB, 573 tensors from 512 B to 33.5 MB) by one strategy in a FRESH PROCESS. The
worker imports its library, builds the arrays (every page resident), records its RSS
(the baseline: the arrays being saved and the imports), resets the kernel's peak-RSS
counter, times the save, and reports the peak RSS above the baseline. Between runs
the parent deletes the output and calls ``sync()``, so every save starts with the
target absent and no dirty pages queued for writeback; the page-cache state
(free memory, dirty pages, writeback thresholds) is printed with the table.

Strategies:

- ``nnx_save``: ``nnx_save.save_file(arrays, path)``: streaming, atomic (temporary
  file, fsync, rename, fsync of the directory), per-tensor checksums. The jax backend
  is started before the clock (a jax program has it running when it saves).
- ``nnx_save_nofsync``: the same with ``os.fsync`` a no-op: the write path alone.
- ``nnx_save_jax``: ``nnx_save.save_file`` of the same arrays as jax CPU arrays.
- ``st_numpy``: ``safetensors.numpy.save_file(arrays, path)``: writes, no fsync.
- ``st_numpy_fsync``: the same, then ``fsync`` of the file and of its directory:
  the durability nnx_save gives, at the reference's write speed.

After the clock stops each worker checks the file (size, tensor names, a sample of
values), so a fast wrong answer cannot win.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

STRATEGIES = ("nnx_save", "nnx_save_nofsync", "nnx_save_jax", "st_numpy", "st_numpy_fsync")


# ----------------------------------------------------------------------------- worker (child)


def _fsync_path(path: Path) -> None:
    for target, flags in ((path, os.O_RDONLY), (path.parent, os.O_RDONLY)):
        fd = os.open(target, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check(path: Path, arrays: dict[str, np.ndarray]) -> None:
    from safetensors import safe_open

    expected = sum(a.nbytes for a in arrays.values())
    with safe_open(path, "numpy") as f:
        names = set(f.keys())
        assert names == set(arrays), "tensor names differ"
        for k in sorted(arrays)[:: max(1, len(arrays) // 16)]:
            assert f.get_tensor(k).tobytes() == arrays[k].tobytes(), k
    assert path.stat().st_size > expected, "file smaller than its data"


def save_worker(args: argparse.Namespace) -> dict:
    strategy, path = args.worker, Path(args.path)
    if strategy.startswith("nnx_save"):
        import jax
        import jax.numpy as jnp

        import nnx_save

        jax.process_count()  # start the backend now: a jax program has it running before it saves
    else:
        import safetensors.numpy

    shapes = _common.transformer_shapes(args.size_gb)
    arrays = _common.make_arrays(shapes)
    tree = arrays
    if strategy == "nnx_save_jax":
        tree = {k: jnp.asarray(v) for k, v in arrays.items()}
        jax.block_until_ready(tree)
    if strategy == "nnx_save_nofsync":
        os.fsync = lambda fd: None  # the write path alone (this process only)
    with _common.Phase() as phase:
        if strategy.startswith("nnx_save"):
            nnx_save.save_file(tree, path)
        else:
            safetensors.numpy.save_file(arrays, path)
            if strategy == "st_numpy_fsync":
                _fsync_path(path)
    _check(path, arrays)
    nbytes = _common.total_bytes(shapes)
    return phase.result(
        nbytes=nbytes,
        tensors=len(shapes),
        largest=max(a.nbytes for a in arrays.values()),
        file_bytes=path.stat().st_size,
    )


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True)
    parser.add_argument("--size-gb", type=float, required=True)


# ----------------------------------------------------------------------------- parent


def run(strategies: list[str], size_gb: float, repeat: int, directory: Path) -> list[dict]:
    runs: dict[str, list[dict]] = {s: [] for s in strategies}
    for i in range(repeat):
        for s in strategies:  # interleaved, so drift in the machine's load hits every strategy alike
            path = directory / f"bench-{s}.safetensors"
            path.unlink(missing_ok=True)
            _common.sync()
            r = _common.run_fresh(__file__, s, ["--path", str(path), "--size-gb", str(size_gb)])
            path.unlink(missing_ok=True)
            print(
                f"run {i + 1}/{repeat} {s:<17} "
                + (
                    f"{r['seconds']:.2f} s (cpu {r['user_s']:.2f} user "
                    f"{r['sys_s']:.2f} sys), peak +{r['peak_above_kb'] / 1e3:.0f} MB"
                    if "error" not in r
                    else f"ERROR {r['error']}"
                ),
                file=sys.stderr,
            )
            runs[s].append(r)
    _common.sync()
    return [summarise(s, rs) for s, rs in runs.items()]


def summarise(strategy: str, rs: list[dict]) -> dict:
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return {"strategy": strategy, "error": rs[-1]["error"]}
    best = min(ok, key=lambda r: r["seconds"])
    median = statistics.median(r["seconds"] for r in ok)
    cpu = statistics.median(r["user_s"] + r["sys_s"] for r in ok)
    return {
        "strategy": strategy,
        "seconds": best["seconds"],
        "median": median,
        "gbps": best["nbytes"] / best["seconds"] / 1e9,
        "cpu_s": cpu,
        "user_s": statistics.median(r["user_s"] for r in ok),
        "sys_s": statistics.median(r["sys_s"] for r in ok),
        "peak_mb": max(r["peak_above_kb"] for r in ok) / 1e3,
        "largest_mb": best["largest"] / 1e6,
        "tensors": best["tensors"],
        "nbytes": best["nbytes"],
        "runs": len(ok),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="nnx_save-bench-") as tmp:
        directory = Path(tmp)
        before = _common.page_cache_note(directory)
        rows = run(strategies, args.size_gb, args.repeat, directory)
        after = _common.page_cache_note(directory)
    ref = next((r for r in rows if r["strategy"] == "st_numpy" and "error" not in r), None)
    ref_sync = next((r for r in rows if r["strategy"] == "st_numpy_fsync" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            continue
        r["vs_st"] = r["gbps"] / ref["gbps"] if ref else None
        r["vs_st_fsync"] = r["gbps"] / ref_sync["gbps"] if ref_sync else None
        r["peak_tensors"] = r["peak_mb"] / r["largest_mb"]
    first = next(r for r in rows if "error" not in r)
    print(
        f"\nsave of {first['nbytes'] / 1e9:.2f} GB fp32, {first['tensors']} tensors (largest "
        f"{first['largest_mb']:.1f} MB); fresh process per run, best of {args.repeat} (median shown too); "
        "user/sys: median CPU seconds of the saving process"
    )
    print(f"page cache before: {before}\npage cache after:  {after}")
    print(
        "each run: target absent, sync() first (no dirty pages queued); data written into the page cache, "
        "fsync'ed only where the strategy says so\n"
    )
    print(
        _common.table(
            rows,
            [
                ("strategy", "strategy", ""),
                ("seconds", "best s", ".2f"),
                ("median", "median s", ".2f"),
                ("gbps", "GB/s", ".2f"),
                ("user_s", "user s", ".2f"),
                ("sys_s", "sys s", ".2f"),
                ("peak_mb", "peak RSS above arrays MB", ".1f"),
                ("peak_tensors", "in largest tensors", ".2f"),
                ("vs_st", "GB/s vs st_numpy", ".2f"),
                ("vs_st_fsync", "GB/s vs st_numpy_fsync", ".2f"),
            ],
        )
    )
    for r in rows:
        if "error" in r:
            print(f"{r['strategy']}: ERROR {r['error']}")


if __name__ == "__main__":
    if not _common.worker_main(dict.fromkeys(STRATEGIES, save_worker), add_worker_arguments):
        main()
