"""Reading a pod manifest of many pieces: ``read_header`` of a directory whose
``manifest.json`` lists one tensor in N one-row pieces (the shard files absent, so
only the manifest is read and validated), and the same with one irregular piece
(an overlap the check must find and name). The figure docs/multihost.md quotes.

    PYTHONPATH=src python benchmarks/manifest.py --pieces 100000 --rounds 7

Each round times both manifests once (interleaved); the table gives the median
and the spread over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import nnx_save

SHARD = "shard_00000-of-00001.0123abcd.safetensors"


def _write(directory: Path, n: int, overlap: bool) -> Path:
    boxes = [[[i, i + 1], [0, 2]] for i in range(n)] + ([[[n - 3, n - 1], [1, 2]]] if overlap else [])
    pieces = [{"file": SHARD, "name": f"w[{i}]", "box": b, "process": 0} for i, b in enumerate(boxes)]
    tensors = {"w": {"dtype": "F32", "shape": [n, 2], "pieces": pieces}}
    directory.mkdir()
    manifest = {"format": "nnx_save.pod", "version": 1, "num_processes": 1, "metadata": {}, "tensors": tensors}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def _time(directory: Path) -> float:
    t0 = time.perf_counter()
    with contextlib.suppress(nnx_save.HeaderError):  # the overlap, found
        nnx_save.read_header(directory)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    cases = {
        "regular grid": _write(root / "a", args.pieces, False),
        "one overlap": _write(root / "b", args.pieces, True),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, directory in cases.items():
            times[name].append(_time(directory))
    size = (cases["regular grid"] / "manifest.json").stat().st_size
    print(f"read_header of a manifest of {args.pieces} pieces ({size / 1e6:.1f} MB), {args.rounds} rounds")
    for name, ts in times.items():
        print(f"  {name:<14} median {statistics.median(ts):.3f} s  ({min(ts):.3f}-{max(ts):.3f})")


if __name__ == "__main__":
    main()
