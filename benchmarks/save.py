"""Saving benchmark: nnx_save against the savers users would pick instead, one file and
HuggingFace multi-file, durable (fsync) and not, side by side.

    .venv/bin/python benchmarks/save.py [--size-gb 1] [--repeat 5] [--shard-mb 256] [--dir DIR]

Each run is one save of a generated fp32 checkpoint (:func:`_common.transformer_shapes`:
~1 GB, 288 tensors from 512 B to 33.5 MB) by one strategy in a FRESH PROCESS. The worker
imports its library, builds the arrays (every page resident), records its RSS (the
baseline: the arrays being saved and the imports), resets the kernel's peak-RSS counter,
times the save, and reports the peak RSS above the baseline. Between runs the parent
deletes the output and calls ``sync()``, so every save starts with the target absent and
no dirty pages queued; the repeats are interleaved over the strategies, in an order
rotated each round, so drift in the machine's load hits every strategy alike. The
table gives the median of the runs with their spread (min-max).

One file:

- ``nnx_save``: ``nnx_save.save_file(arrays, path)``: atomic (temporary file, fsync,
  rename, fsync of the directory), per-tensor checksums; always durable.
- ``st_numpy`` / ``st_numpy_fsync``: ``safetensors.numpy.save_file``, then (``_fsync``)
  ``fsync`` of the file and its directory: the durability nnx_save gives.
- ``nnx_save_jax`` (not run unless named): ``save_file`` of the same arrays as jax CPU arrays.

HuggingFace multi-file, ``--shard-mb`` MB files:

- ``nnx_save_hf``: ``nnx_save.save_file(arrays, directory, max_shard_size=...)``: files
  and index committed atomically; always durable.
- ``hfhub`` / ``hfhub_fsync``: ``huggingface_hub.save_torch_state_dict`` of the arrays as
  torch tensors (``torch.from_numpy``, no copy), then (``_fsync``) every file and the
  directory fsynced.
- ``fst`` / ``fst_fsync``: fastsafetensors' parallel shard saver (``ParallelSaver``, as
  many shards as the size asks for, 8 threads; its own ``fsync=True`` for ``_fsync``).
  It writes no index.

After the clock stops each worker checks what it wrote (names, sizes, a sample of
values), so a fast wrong answer cannot win.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

ONE_FILE = ("nnx_save", "st_numpy", "st_numpy_fsync")
MULTI_FILE = ("nnx_save_hf", "hfhub", "hfhub_fsync", "fst", "fst_fsync")
STRATEGIES = (*ONE_FILE, "nnx_save_jax", *MULTI_FILE)
DURABLE = {"nnx_save", "nnx_save_jax", "nnx_save_hf", "st_numpy_fsync", "hfhub_fsync", "fst_fsync"}


# ----------------------------------------------------------------------------- worker (child)


def _fsync_path(path: Path) -> None:
    """fsync ``path`` (a file, or a directory's files) and the directory holding them."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    for target in (*files, path if path.is_dir() else path.parent):
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check(path: Path, arrays: dict[str, np.ndarray]) -> None:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    found: dict[str, Path] = {}
    for file in files:
        with safe_open(file, "numpy") as f:
            found.update(dict.fromkeys(f.keys(), file))
    assert set(found) == set(arrays), "tensor names differ"
    for k in sorted(arrays)[:: max(1, len(arrays) // 16)]:
        with safe_open(found[k], "numpy") as f:
            assert f.get_tensor(k).tobytes() == arrays[k].tobytes(), k
    assert sum(f.stat().st_size for f in files) > sum(a.nbytes for a in arrays.values()), "files smaller than the data"


def _saver(strategy: str, args: argparse.Namespace):
    """Import the strategy's library (before the clock) and return ``save(arrays, path)``."""
    shard = f"{args.shard_mb}MB"
    if strategy.startswith("nnx_save"):
        import jax

        import nnx_save

        jax.process_count()  # start the backend now: a jax program has it running before it saves
        if strategy == "nnx_save_hf":
            return lambda arrays, path: nnx_save.save_file(arrays, path, max_shard_size=shard)
        return nnx_save.save_file
    if strategy.startswith("st_numpy"):
        import safetensors.numpy

        return safetensors.numpy.save_file
    import torch

    if strategy.startswith("hfhub"):
        import huggingface_hub

        return lambda arrays, path: huggingface_hub.save_torch_state_dict(
            {k: torch.from_numpy(v) for k, v in arrays.items()}, path, max_shard_size=shard
        )
    from fastsafetensors.saver import ParallelSaver

    def fst(arrays: dict[str, np.ndarray], path: Path) -> None:
        shards = max(1, math.ceil(sum(a.nbytes for a in arrays.values()) / (args.shard_mb * 1e6)))
        saver = ParallelSaver(num_shards=shards, framework="pytorch", fsync=strategy == "fst_fsync")
        saver.save({k: torch.from_numpy(v) for k, v in arrays.items()}, str(path / "model"))

    return fst


def save_worker(args: argparse.Namespace) -> dict:
    strategy, path = args.worker, Path(args.path)
    save = _saver(strategy, args)
    shapes = _common.transformer_shapes(args.size_gb)
    arrays = _common.make_arrays(shapes)
    tree = arrays
    if strategy == "nnx_save_jax":
        import jax
        import jax.numpy as jnp

        tree = {k: jnp.asarray(v) for k, v in arrays.items()}
        jax.block_until_ready(tree)
    if strategy in MULTI_FILE:
        path.mkdir()
    with _common.Phase() as phase:
        save(tree, path)
        if strategy in ("st_numpy_fsync", "hfhub_fsync"):
            _fsync_path(path)
    _check(path, arrays)
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return phase.result(
        nbytes=_common.total_bytes(shapes),
        tensors=len(shapes),
        largest=max(a.nbytes for a in arrays.values()),
        files=len([f for f in files if f.suffix == ".safetensors"]),
    )


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True)
    parser.add_argument("--size-gb", type=float, required=True)
    parser.add_argument("--shard-mb", type=int, required=True)


# ----------------------------------------------------------------------------- parent


def _remove(path: Path) -> None:
    if path.is_dir():
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


def run(strategies: list[str], args: argparse.Namespace, directory: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {s: [] for s in strategies}
    for i in range(args.repeat):
        order = strategies[i % len(strategies) :] + strategies[: i % len(strategies)]
        for s in order:  # interleaved and rotated: drift in the machine's load hits every strategy alike
            path = directory / (s if s in MULTI_FILE else f"{s}.safetensors")
            _remove(path)
            _common.sync()
            r = _common.run_fresh(
                __file__, s, ["--path", str(path), "--size-gb", str(args.size_gb), "--shard-mb", str(args.shard_mb)]
            )
            _remove(path)
            print(
                f"run {i + 1}/{args.repeat} {s:<15} "
                + (
                    f"{r['seconds']:.2f} s (cpu {r['user_s']:.2f} user {r['sys_s']:.2f} sys), "
                    f"peak +{r['peak_above_kb'] / 1e3:.0f} MB"
                    if "error" not in r
                    else f"ERROR {r['error']}"
                ),
                file=sys.stderr,
            )
            runs[s].append(r)
    _common.sync()
    return runs


def summarise(strategy: str, rs: list[dict], reference: float | None) -> dict:
    ok = [r for r in rs if "error" not in r]
    row: dict = {"case": "multi-file" if strategy in MULTI_FILE else "one file", "strategy": strategy}
    row["durable"] = "yes" if strategy in DURABLE else "no"
    if not ok:
        return {**row, "error": rs[-1]["error"]}
    seconds = [r["seconds"] for r in ok]
    median = statistics.median(seconds)
    return {
        **row,
        "median": f"{median:.2f} ({min(seconds):.2f}-{max(seconds):.2f})",
        "seconds": median,
        "gbps": ok[0]["nbytes"] / median / 1e9,
        "cpu_s": statistics.median(r["user_s"] + r["sys_s"] for r in ok),
        "peak_mb": max(r["peak_above_kb"] for r in ok) / 1e3,
        "peak_tensors": max(r["peak_above_kb"] for r in ok) * 1e3 / ok[0]["largest"],
        "files": ok[0]["files"],
        "vs_nnx_save": median / reference if reference else None,
        "runs": len(ok),
        "nbytes": ok[0]["nbytes"],
        "tensors": ok[0]["tensors"],
        "largest_mb": ok[0]["largest"] / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shard-mb", type=int, default=256, help="the multi-file savers' file size")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--strategies", default=",".join(ONE_FILE + MULTI_FILE))
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="nnx_save-bench-") as tmp:
        directory = Path(tmp)
        before = _common.page_cache_note(directory)
        runs = run(strategies, args, directory)
        after = _common.page_cache_note(directory)
    ok = {s: [r["seconds"] for r in rs if "error" not in r] for s, rs in runs.items()}
    refs = {name: statistics.median(ok[name]) if ok.get(name) else None for name in ("nnx_save", "nnx_save_hf")}
    rows = [summarise(s, rs, refs["nnx_save_hf" if s in MULTI_FILE else "nnx_save"]) for s, rs in runs.items()]
    first = next((r for r in rows if "error" not in r), None)
    if first is not None:
        print(
            f"\nsave of {first['nbytes'] / 1e9:.2f} GB fp32, {first['tensors']} tensors (largest "
            f"{first['largest_mb']:.1f} MB), multi-file at {args.shard_mb} MB; a fresh process per run, "
            f"{args.repeat} interleaved rounds; median (min-max); cpu: median CPU seconds of the saving process"
        )
    print(f"page cache before: {before}\npage cache after:  {after}\n")
    print(
        _common.table(
            rows,
            [
                ("case", "case", ""),
                ("strategy", "strategy", ""),
                ("durable", "durable", ""),
                ("median", "median s (min-max)", ""),
                ("gbps", "GB/s", ".2f"),
                ("cpu_s", "cpu s", ".2f"),
                ("peak_mb", "peak RSS above arrays MB", ".1f"),
                ("peak_tensors", "in largest tensors", ".2f"),
                ("files", "files", "d"),
                ("vs_nnx_save", "median / nnx_save", ".2f"),
            ],
        )
    )
    for r in rows:
        if "error" in r:
            print(f"{r['strategy']}: ERROR {r['error']}")


if __name__ == "__main__":
    if not _common.worker_main(dict.fromkeys(STRATEGIES, save_worker), add_worker_arguments):
        main()
