"""``get_slice`` of a last-dim slice: ``nnx_save.safe_open`` against
``safetensors.safe_open(..., "np")``.

A fp32 matrix (``--rows`` x ``--cols``, 256 MiB by default) is saved once with a small
tensor before it; each run opens the file in a FRESH PROCESS, slices ``[:, a:b]`` of
``--width`` columns and checks it against the values it knows. Strategies alternate
run by run (``--repeat`` each); the table gives the median wall time of open + slice
with min-max, the bytes nnx_save read (counted by its I/O statistics) and the peak RSS
the phase added. Page cache warm (the file is read once before the runs).

    python benchmarks/lazy.py --repeat 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import Phase, run_fresh, table, warm, worker_main

STRATEGIES = {"nnx_save": "nnx_save.safe_open(...).get_slice", "safetensors": "safetensors.safe_open(...).get_slice"}


def _expected(args: argparse.Namespace) -> np.ndarray:
    cols = np.arange(args.start, args.start + args.width, dtype=np.float32)
    return np.arange(args.rows, dtype=np.float32)[:, None] * args.cols + cols  # value = flat index


def _work(args: argparse.Namespace, open_slice) -> dict:
    expected = _expected(args)
    with Phase() as phase:
        got, read = open_slice(args.path, slice(args.start, args.start + args.width))
    if not np.array_equal(got, expected):
        raise SystemExit("wrong values")
    return phase.result(bytes_read=read)


def nnx_worker(args: argparse.Namespace) -> dict:
    import nnx_save

    def run(path, cols):
        with nnx_save.safe_open(path) as f:
            got = f.get_slice("w")[:, cols]
            return got, f.io.bytes_read

    return _work(args, run)


def safetensors_worker(args: argparse.Namespace) -> dict:
    import safetensors

    def run(path, cols):
        with safetensors.safe_open(path, "np") as f:
            return f.get_slice("w")[:, cols], None

    return _work(args, run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default="")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--start", type=int, default=1000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")


def _save(path: Path, args: argparse.Namespace) -> None:
    import nnx_save

    w = np.arange(args.rows * args.cols, dtype=np.float32).reshape(args.rows, args.cols)
    nnx_save.save_file({"a_bias": np.ones(100, np.float32), "w": w}, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "lazy.safetensors"
        _save(path, args)
        warm(path)
        forward = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("dir", "path", "repeat")]
        runs: dict[str, list[dict]] = {name: [] for name in STRATEGIES}
        for _ in range(args.repeat):
            for name in STRATEGIES:
                runs[name].append(run_fresh(__file__, name, [f"--path={path}", *forward]))
    rows = []
    for name, label in STRATEGIES.items():
        ok = [r for r in runs[name] if "error" not in r]
        if not ok:
            rows.append({"strategy": label, "note": runs[name][0]["error"]})
            continue
        secs = [r["seconds"] * 1e3 for r in ok]
        rows.append(
            {
                "strategy": label,
                "median": statistics.median(secs),
                "min": min(secs),
                "max": max(secs),
                "read": ok[0]["bytes_read"] / 1e3 if ok[0]["bytes_read"] is not None else None,
                "rss": statistics.median(r["peak_above_kb"] for r in ok) / 1e3,
                "note": f"{len(ok)} runs",
            }
        )
    mb = args.rows * args.cols * 4 / 1e6
    slice_kb = args.rows * args.width * 4 / 1e3
    print(f"get_slice[:, {args.start}:{args.start + args.width}] of a {args.rows}x{args.cols} fp32 matrix")
    print(f"({mb:.0f} MB; the slice is {slice_kb:.0f} KB), fresh process per run, page cache warm\n")
    columns = [
        ("strategy", "strategy", ""),
        ("median", "median ms", ".2f"),
        ("min", "min ms", ".2f"),
        ("max", "max ms", ".2f"),
        ("read", "KB read", ".0f"),
        ("rss", "peak RSS added MB", ".1f"),
        ("note", "", ""),
    ]
    print(table(rows, columns))


if __name__ == "__main__":
    if worker_main({"nnx_save": nnx_worker, "safetensors": safetensors_worker}, _arguments):
        sys.exit()
    main()
