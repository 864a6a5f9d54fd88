"""A short probe of a save's host memory on an accelerator, per staging kind.

    PYTHONPATH=src python benchmarks/accelerator_probe.py [--save-gb 4] [--budget 1073741824] [--repeat 2]
    PYTHONPATH=src python benchmarks/accelerator_probe.py --smoke      # CPU backend, tiny sizes, seconds

Saves ``--save-gb`` of bf16 Llama-shaped arrays made on device 0 (the embedding first,
as ``benchmarks/accelerator.py`` does) under a ``--budget`` of
``NNX_SAVE_SAVE_INFLIGHT_BYTES``. Every run is a FRESH PROCESS, the variants interleaved
over ``--repeat`` rounds; after the first round no run is begun past ``--deadline``
seconds, so the probe ends in time and says how many runs each row had. Rows:

- ``write_fsync``: the floor, ``os.write`` of the save size from a host buffer, then ``fsync``.
- ``copy <kind>``: the save's device -> host copies alone (``_stage.Window`` over the
  tree, each block dropped once copied, nothing written), with
  ``NNX_SAVE_SAVE_STAGING=<kind>``: the copy rate and the host memory they take.
- ``snapshot <kind>`` (``--snapshots``): what ``save_file(..., blocking=False)`` waits
  for, the host snapshot of every tensor (held whole until written, by design).
- ``save <kind>``: ``nnx_save.save_file`` with ``NNX_SAVE_SAVE_STAGING=<kind>`` (atomic,
  fsync, checksums); the largest tensor is compared bit for bit with the file after.

Columns: median seconds (min-max) and GB/s at the median; ``RSS+``: the worst run's peak
host RSS growth during the phase, above the RSS once the arrays exist; ``kept``: the
worst run's RSS growth still there after the phase (memory a pool holds on to);
``cached``: caller's arrays left with a host copy cached on them (must be 0). A kind
the device does not offer prints ``n/a`` (``numpy`` exists everywhere). Then one verdict
line per save: RSS growth <= budget + 10% and speed >= 90% of the write floor.
``--smoke`` sets ``NNX_SAVE_FORCE_HOST_STAGING=1`` so the CPU backend copies too.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402
import accelerator  # noqa: E402

KINDS = ("numpy", "pinned_host", "unpinned_host")
NAMES = ("write_fsync", *(f"copy_{k}" for k in KINDS), *(f"save_{k}" for k in KINDS))
SNAPSHOTS = tuple(f"snapshot_{k}" for k in KINDS)  # only with --snapshots
GiB = 1 << 30


# ----------------------------------------------------------------------------- workers (children)


def _tree(args: argparse.Namespace):
    """Device 0 and ``--save-gb`` of bf16 arrays on it (the embedding first), once
    nnx_save has saved one small array there with the worker's staging kind (its
    modules loaded outside the clock)."""
    jax, dev = accelerator._jax(args)
    if args.worker != "write_fsync":
        _kind(args, dev)
    import nnx_save

    with jax.default_device(dev):
        nnx_save.save_file({"warm": jax.numpy.ones(4)}, Path(args.dir) / f"warm-{args.worker}.safetensors")
    shapes, total = {}, 0
    for k, s in accelerator.llama_shapes(args.size_gb, **json.loads(args.shapes)).items():
        if total + 2 * math.prod(s) > args.save_bytes and shapes:
            continue
        shapes[k], total = s, total + 2 * math.prod(s)
    with jax.default_device(dev):
        keys = jax.random.split(jax.random.key(0), len(shapes))
        tree = {k: jax.random.uniform(r, s, jax.numpy.bfloat16) for r, (k, s) in zip(keys, shapes.items(), strict=True)}
    return dev, jax.block_until_ready(tree), total


def _kind(args: argparse.Namespace, dev) -> str:
    kind = args.worker.split("_", 1)[1]
    os.environ["NNX_SAVE_SAVE_STAGING"] = kind
    if kind != "numpy" and kind not in accelerator.memory_kinds(dev):
        raise accelerator.NotAvailable(
            f"device {dev} offers no {kind} (kinds: {sorted(accelerator.memory_kinds(dev))})"
        )
    return kind


def _kept(phase: _common.Phase) -> int:
    gc.collect()
    return max(0, _common.rss_kb() - phase.baseline_kb)


def _cached(tree: dict) -> int:
    """Caller's arrays holding a host copy (jax caches one on an array after np.asarray)."""
    return sum(getattr(a, "_npy_value", None) is not None for a in tree.values())


def copy_worker(args: argparse.Namespace) -> dict:
    dev, tree, total = _tree(args)
    from nnx_save.bridges._leaves import leaf_entry
    from nnx_save.save import _stage, _write

    entries = [leaf_entry((k,), v) for k, v in tree.items()]
    with _common.Phase() as phase:
        window = _stage.Window(
            [e.array for e in entries],
            [e.key for e in entries],
            args.budget,
            "probe",
            split=[_write.cuttable(e) for e in entries],
        )
        for i, e in enumerate(entries):
            for block in window.blocks(i, e.value):
                del block
        window.close()
    return phase.result(nbytes=total, platform=dev.platform, kept_kb=_kept(phase), cached=_cached(tree))


def snapshot_worker(args: argparse.Namespace) -> dict:
    dev, tree, total = _tree(args)
    from nnx_save.bridges._leaves import leaf_entry
    from nnx_save.save import _background

    entries = [leaf_entry((k,), v) for k, v in tree.items()]
    with _common.Phase() as phase:
        snap = _background.snapshot(entries, args.budget, "probe")
    del snap
    return phase.result(nbytes=total, platform=dev.platform, kept_kb=_kept(phase), cached=_cached(tree))


def save_worker(args: argparse.Namespace) -> dict:
    dev, tree, total = _tree(args)
    import nnx_save

    path = Path(args.dir) / f"probe-{args.worker}.safetensors"
    try:
        with _common.Phase() as phase:
            nnx_save.save_file(tree, path)
        kept = _kept(phase)
        key = max(tree, key=lambda k: tree[k].size)
        from safetensors import safe_open

        with safe_open(str(path), "numpy") as f:
            assert f.get_tensor(key).tobytes() == np.asarray(tree[key]).tobytes(), key
        cached = _cached({k: v for k, v in tree.items() if k != key})  # the check above cached this one
    finally:
        path.unlink(missing_ok=True)
    return phase.result(nbytes=total, platform=dev.platform, kept_kb=kept, cached=cached)


def worker(args: argparse.Namespace) -> dict:
    os.environ["NNX_SAVE_SAVE_INFLIGHT_BYTES"] = str(args.budget)
    try:
        if args.worker == "write_fsync":
            return accelerator.write_floor(args)
        run = {"copy": copy_worker, "snapshot": snapshot_worker, "save": save_worker}[args.worker.split("_", 1)[0]]
        return run(args)
    except accelerator.NotAvailable as e:
        return {"na": str(e)}


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    for name in ("--dir", "--platform", "--shapes"):
        p.add_argument(name, default="")
    p.add_argument("--size-gb", type=float, default=0.0)
    for name in ("--save-bytes", "--budget"):
        p.add_argument(name, type=int, default=0)


# ----------------------------------------------------------------------------- parent


def run_all(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every variant ``--repeat`` times, interleaved, each in a fresh process; after the
    first round, no run is begun once ``--deadline`` seconds have passed."""
    extra = [
        *("--dir", args.dir, "--platform", args.platform, "--shapes", json.dumps(accelerator.shape_args(args))),
        *("--size-gb", str(args.size_gb), "--save-bytes", str(int(args.save_gb * 1e9)), "--budget", str(args.budget)),
    ]
    names = NAMES + SNAPSHOTS if args.snapshots else NAMES
    runs: dict[str, list[dict]] = {n: [] for n in names}
    t0 = time.monotonic()
    for i in range(args.repeat):
        for name in names:
            if runs[name] and "na" in runs[name][-1]:
                continue
            if i and time.monotonic() - t0 > args.deadline:
                print(f"deadline {args.deadline:.0f} s passed: no more runs", file=sys.stderr)
                return runs
            _common.sync()
            r = _common.run_fresh(__file__, name, extra, timeout=args.timeout, platform=args.platform or None)
            runs[name].append(r)
            print(f"run {i + 1}/{args.repeat} {name:<20} {_brief(r)}", file=sys.stderr, flush=True)
    return runs


def _brief(r: dict) -> str:
    if "na" in r or "error" in r:
        return f"n/a: {r['na']}" if "na" in r else f"ERROR {r['error']}"
    return f"{r['seconds']:.3f} s, peak +{r['peak_above_kb'] / 1e3:.0f} MB, kept +{r.get('kept_kb', 0) / 1e3:.0f} MB"


def summarise(name: str, rs: list[dict]) -> dict:
    bad = next((r for r in rs if "na" in r or "error" in r), None)
    if bad is not None:
        return {"name": name, "na": bad.get("na") or f"error: {bad['error']}"}
    secs = sorted(r["seconds"] for r in rs)
    median = statistics.median(secs)
    return {
        "name": name,
        "median": median,
        "min": secs[0],
        "max": secs[-1],
        "gbps": rs[0]["nbytes"] / median / 1e9,
        "rss_max_gb": max(r["peak_above_kb"] for r in rs) * 1024 / 1e9,
        "kept_max_gb": max(r.get("kept_kb", 0) for r in rs) * 1024 / 1e9,
        "cached": max(r.get("cached", 0) for r in rs),
        "nbytes": rs[0]["nbytes"],
        "runs": len(rs),
        "platform": rs[0].get("platform", "host"),
    }


def render(rows: list[dict]) -> str:
    head = f"{'what':<22} {'median s':>9} {'(min-max)':>17} {'GB/s':>7} {'RSS+ GB':>8} {'kept GB':>8} {'cached':>6} {'runs':>4}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "na" in r:
            lines.append(f"{r['name']:<22} n/a: {r['na']}")
            continue
        spread = f"({r['min']:.3f}-{r['max']:.3f})"
        lines.append(
            f"{r['name']:<22} {r['median']:>9.3f} {spread:>17} {r['gbps']:>7.2f} {r['rss_max_gb']:>8.3f} "
            f"{r['kept_max_gb']:>8.3f} {r['cached']:>6} {r['runs']:>4}"
        )
    return "\n".join(lines)


def verdicts(rows: dict[str, dict], budget: int) -> list[str]:
    """Per save kind: RSS growth within budget + 10%, speed within 90% of the write floor."""
    floor = rows.get("write_fsync", {})
    cap = 1.1 * budget / 1e9
    out = []
    for kind in KINDS:
        r = rows.get(f"save_{kind}", {"na": "not run"})
        if "na" in r:
            out.append(f"save {kind}: n/a ({r['na']})")
            continue
        rss = f"RSS+ {r['rss_max_gb']:.3f} GB <= {cap:.3f} GB {'PASS' if r['rss_max_gb'] <= cap else 'FAIL'}"
        if "na" in floor or "gbps" not in floor:
            speed = "speed: n/a (no write floor)"
        else:
            need = 0.9 * floor["gbps"]
            speed = (
                f"{r['gbps']:.2f} GB/s >= 90% of write floor {need:.2f} GB/s {'PASS' if r['gbps'] >= need else 'FAIL'}"
            )
        out.append(f"save {kind}: {rss}; {speed}; cached on caller's arrays {r['cached']}")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the whole probe on the CPU backend, tiny sizes")
    p.add_argument("--save-gb", type=float, default=4.0, help="bytes of device arrays saved")
    p.add_argument("--budget", type=int, default=GiB, help="NNX_SAVE_SAVE_INFLIGHT_BYTES for every run")
    p.add_argument("--size-gb", type=float, default=8.0, help="the Llama shape the saved arrays come from")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=2, help="fresh processes per row, interleaved")
    p.add_argument("--deadline", type=float, default=150, help="seconds after which no run past the first round begins")
    p.add_argument("--platform", default="", help="JAX_PLATFORMS for the workers (default: jax's choice)")
    p.add_argument("--dir", default="", help="where saves are written (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=120, help="seconds per fresh process")
    p.add_argument("--snapshots", action="store_true", help="also the asynchronous save's snapshot, per kind")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if args.smoke:
        args.platform, args.size_gb, args.save_gb, args.budget, args.repeat = "cpu", 0.004, 0.002, 1 << 20, 1
        args.d_model, args.ffn, args.vocab, args.kv = 128, 448, 1024, 64
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.smoke:  # the testing aid: the staged copies on the CPU backend too
        os.environ["NNX_SAVE_FORCE_HOST_STAGING"] = "1"
    with tempfile.TemporaryDirectory(prefix="nnx_save-probe-") as tmp:
        args.dir = args.dir or tmp
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        note = _common.page_cache_note(args.dir)
        t0 = time.perf_counter()
        rows = {n: summarise(n, rs) for n, rs in run_all(args).items() if rs}
    import jax

    platform = next((r["platform"] for r in rows.values() if r.get("platform", "host") != "host"), "?")
    print(
        f"\nsave probe: {args.save_gb:g} GB of bf16 arrays on device 0, budget {args.budget} bytes, jax {jax.__version__} "
        f"backend {platform}, fresh process per run, {time.perf_counter() - t0:.0f} s"
    )
    print(f"page cache: {note}\n")
    print(render(list(rows.values())))
    print()
    print("\n".join(verdicts(rows, args.budget)))
    if args.json:
        Path(args.json).write_text(json.dumps(list(rows.values()), indent=1))


if __name__ == "__main__":
    if not _common.worker_main(dict.fromkeys(NAMES + SNAPSHOTS, worker), add_worker_arguments):
        main()
