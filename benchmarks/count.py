"""Load time against the tensor count: many small tensors in one file.

One ``.safetensors`` file per count (``--counts``, 1k, 10k and 100k by default) of
1 KiB fp32 tensors (256 elements each, a MoE-sized count at the top), made once under
``--dir``. Each phase runs in a FRESH PROCESS with the page cache warm, the phases
interleaved round by round (``--repeat``); each row shows the median wall time per
tensor with its spread (min-max) and the median CPU seconds:

- ``nnx_save``: ``nnx_save.load_file(path, abstract)``, every leaf a
  ``jax.ShapeDtypeStruct`` on the first device (jax arrays, as a model load makes).
- ``safe_open``: ``safetensors.safe_open(path, "numpy")`` and ``get_tensor`` of every
  key (numpy only: the floor of per-tensor work).
- ``safe_open_put``: the same, then ``jax.device_put`` of each array to the device.

``--baseline DIR`` adds a ``nnx_save (baseline)`` row: the same worker importing
nnx_save from another checkout's ``DIR/src`` (say, main's), interleaved with the others.

    python benchmarks/count.py --repeat 3
    python benchmarks/count.py --counts 10000,100000 --repeat 5 --baseline ../main
    python benchmarks/count.py --smoke          # 1k and 2k tensors, once
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from _common import Phase, add_ratios, print_results, run_fresh, warm, worker_main

PHASES = ("nnx_save", "safe_open", "safe_open_put")
BASELINE = "nnx_save (baseline)"
ELEMENTS = 256  # 1 KiB of fp32


def ensure_file(directory: Path, count: int) -> Path:
    """``count`` tensors of 1 KiB in one file, made once (tensor ``t{i}`` holds ``i``)."""
    path = directory / f"count_{count}.safetensors"
    if not path.exists():
        import nnx_save

        directory.mkdir(parents=True, exist_ok=True)
        nnx_save.save_file({f"t{i}": np.full(ELEMENTS, i, np.float32) for i in range(count)}, path)
    return path


def worker(args: argparse.Namespace) -> dict:
    import jax
    import safetensors

    import nnx_save

    nnx_save.load_file  # noqa: B018 - the API is imported on first use: here, before the clock
    device = jax.devices()[0]
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32), device))
    with safetensors.safe_open(args.path, "numpy") as f:
        keys = list(f.keys())
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = {k: jax.ShapeDtypeStruct((ELEMENTS,), np.float32, sharding=sharding) for k in keys}
    with Phase() as phase:
        if args.worker == "nnx_save":
            out = nnx_save.load_file(args.path, abstract)
            jax.block_until_ready(out)
        else:
            with safetensors.safe_open(args.path, "numpy") as f:
                out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a mapping
            if args.worker == "safe_open_put":
                out = {k: jax.device_put(v, device) for k, v in out.items()}
                jax.block_until_ready(out)
    for k in keys[:: max(1, len(keys) // 50)]:  # a fast wrong answer cannot win
        assert np.asarray(out[k])[0] == int(k[1:]), k
    return phase.result(count=len(keys))


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path")


def summarise(phase: str, count: int, runs: list[dict]) -> dict:
    """A row: median microseconds per tensor with the spread, and median CPU seconds."""
    row = {"count": count, "phase": phase}
    bad = [r for r in runs if "error" in r]
    if bad:
        return {**row, "error": bad[0]["error"]}
    per = sorted(r["seconds"] / count * 1e6 for r in runs)
    return {
        **row,
        "us": statistics.median(per),
        "spread": f"({per[0]:.1f}-{per[-1]:.1f})",
        "seconds": statistics.median(r["seconds"] for r in runs),
        "cpu": statistics.median(r["user_s"] + r["sys_s"] for r in runs),
    }


COLUMNS = [
    ("count", "tensors", ","),
    ("phase", "phase", ""),
    ("us", "us / tensor", ".1f"),
    ("spread", "(min-max)", ""),
    ("seconds", "median s", ".3f"),
    ("cpu", "cpu s", ".2f"),
    ("vs", "x safe_open", ".2f"),
]


def targets(rows: list[dict]) -> list[str]:
    """The target: at the largest count, nnx_save <= 2x numpy-only safe_open per tensor."""
    measured = [r for r in rows if "us" in r]
    if not measured:
        return []
    top = max(r["count"] for r in measured)
    got = {r["phase"]: r for r in measured if r["count"] == top}
    if "nnx_save" not in got or "safe_open" not in got:
        return []
    x = got["nnx_save"]["us"] / got["safe_open"]["us"]
    return [f"{top:,} tensors: nnx_save {x:.2f}x safe_open (numpy) per tensor (<= 2): {'PASS' if x <= 2 else 'FAIL'}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="1000,10000,100000")
    p.add_argument("--dir", default="/tmp/nnx_save_bench")
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per row, interleaved")
    p.add_argument("--smoke", action="store_true", help="1k and 2k tensors, once")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--baseline", help="another checkout: its src/'s nnx_save as one more row, interleaved")
    args = p.parse_args()
    if args.smoke:
        args.counts, args.repeat = "1000,2000", 1
    rows = []
    for count in (int(c) for c in args.counts.split(",")):
        path = ensure_file(Path(args.dir), count)
        phases = [*PHASES, *([BASELINE] if args.baseline else [])]
        runs: dict[str, list[dict]] = {ph: [] for ph in phases}
        for r in range(args.repeat):  # round robin: background load hits every phase alike
            for phase in phases if r % 2 == 0 else phases[::-1]:
                warm(path)
                src = Path(args.baseline) / "src" if phase == BASELINE else None
                worker = "nnx_save" if phase == BASELINE else phase
                runs[phase].append(run_fresh(__file__, worker, ["--path", str(path)], src=src))
        group = [summarise(ph, count, r) for ph, r in runs.items()]
        floor = next((r for r in group if r["phase"] == "safe_open" and "us" in r), None)
        rows += add_ratios(group, "us", floor)
    print(f"median over {args.repeat} interleaved fresh-process runs per row, (min-max) the spread")
    print_results(rows, COLUMNS, targets(rows), args.json)


if __name__ == "__main__":
    if worker_main(dict.fromkeys(PHASES, worker), _worker_args):
        sys.exit()
    main()
