"""How long a save blocks the training loop: blocking, asynchronous, and Orbax's asynchronous save.

    .venv/bin/python benchmarks/async_save.py [--size-gb 2] [--repeat 1] [--dir DIR]

Each run saves a generated fp32 state of jax CPU arrays (:func:`_common.transformer_shapes`)
in a FRESH PROCESS, then runs one jitted training step that donates the whole state
(what a training loop does next). Measured per run:

- ``blocked s``: how long the save call held the caller (the training loop);
- ``durable s``: from the call until the checkpoint is complete on disk
  (``result()`` / ``wait_until_finished()``);
- ``peak MB``: the process's peak RSS above its RSS before the call (the state and
  the imports), over the whole save including the background part.

Strategies:

- ``blocking``: ``nnx_save.save_file(tree, path)`` (streaming, fsync, rename).
- ``async``: ``nnx_save.save_file(tree, path, blocking=False)``, then ``result()``.
- ``orbax_async``: ``ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())``
  ``.save(dir, args=ocp.args.StandardSave(tree))``, then ``wait_until_finished()``.

After the clock stops each worker checks a sample of the saved values against the
state at the time of the call (the donating step ran in between).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

STRATEGIES = ("blocking", "async", "orbax_async")


def _state(size_gb: float) -> tuple[dict, dict]:
    """The jax state, and a sample of its values (numpy copies) to check the file with."""
    import jax
    import jax.numpy as jnp

    arrays = _common.make_arrays(_common.transformer_shapes(size_gb))
    keys = sorted(arrays)[:: max(1, len(arrays) // 16)]
    sample = {k: arrays[k].copy() for k in keys}
    tree = {}
    for k in list(arrays):
        tree[k] = jnp.array(arrays.pop(k))  # a copy on the device; one model alive
    jax.block_until_ready(tree)
    return tree, sample


def save_worker(args: argparse.Namespace) -> dict:
    import jax

    strategy, path = args.worker, Path(args.path)
    if strategy == "orbax_async":
        import orbax.checkpoint as ocp

        checkpointer = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    else:
        import nnx_save
    tree, sample = _state(args.size_gb)
    step = jax.jit(lambda t: jax.tree.map(lambda a: a * 0.5, t), donate_argnums=0).lower(tree).compile()
    nbytes = sum(a.nbytes for a in tree.values())
    with _common.Phase() as phase:
        t0 = time.perf_counter()
        if strategy == "blocking":
            nnx_save.save_file(tree, path)
        elif strategy == "async":
            handle = nnx_save.save_file(tree, path, blocking=False)
        else:
            checkpointer.save(path, args=ocp.args.StandardSave(tree))
        blocked = time.perf_counter() - t0
        tree = jax.block_until_ready(step(tree))  # training goes on, donating the saved buffers
        stepped = time.perf_counter() - t0 - blocked
        if strategy == "async":
            handle.result()
        elif strategy == "orbax_async":
            checkpointer.wait_until_finished()
    if strategy == "orbax_async":
        restored = checkpointer.restore(path)
        got = {k: np.asarray(restored[k]) for k in sample}
        checkpointer.close()
    else:
        got = nnx_save.load_file(path)
    for k, v in sample.items():
        assert got[k].tobytes() == v.tobytes(), f"{strategy}: {k} differs from the state at the call"
    return phase.result(blocked=blocked, step_s=stepped, durable=phase.seconds, nbytes=nbytes, tensors=len(tree))


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True)
    parser.add_argument("--size-gb", type=float, required=True)


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    runs: dict[str, list[dict]] = {s: [] for s in strategies}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="nnx_save-bench-") as tmp:
        before = _common.page_cache_note(tmp)
        for i in range(args.repeat):
            for s in strategies:  # interleaved: drift in the machine's load hits every strategy alike
                path = Path(tmp) / f"bench-{s}"
                _remove(path)
                _common.sync()
                r = _common.run_fresh(__file__, s, ["--path", str(path), "--size-gb", str(args.size_gb)])
                _remove(path)
                print(
                    f"run {i + 1}/{args.repeat} {s:<12} "
                    + (
                        f"blocked {r['blocked']:.2f} s, durable {r['durable']:.2f} s, peak +{r['peak_above_kb'] / 1e3:.0f} MB"
                        if "error" not in r
                        else f"ERROR {r['error']}"
                    ),
                    file=sys.stderr,
                )
                runs[s].append(r)
    rows = []
    for s, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            rows.append({"strategy": s, "error": rs[-1]["error"]})
            continue
        rows.append(
            {
                "strategy": s,
                "blocked": statistics.median(r["blocked"] for r in ok),
                "step_s": statistics.median(r["step_s"] for r in ok),
                "durable": statistics.median(r["durable"] for r in ok),
                "peak_mb": max(r["peak_above_kb"] for r in ok) / 1e3,
                "nbytes": ok[0]["nbytes"],
                "tensors": ok[0]["tensors"],
                "runs": len(ok),
            }
        )
    first = next((r for r in rows if "error" not in r), None)
    if first:
        print(
            f"\nsave of {first['nbytes'] / 1e9:.2f} GB fp32 jax CPU arrays, {first['tensors']} tensors; fresh "
            f"process per run, median of {args.repeat}; then one (precompiled) jitted step donating the whole state"
        )
    print(f"page cache: {before}\n")
    print(
        _common.table(
            rows,
            [
                ("strategy", "strategy", ""),
                ("blocked", "caller blocked s", ".2f"),
                ("step_s", "next step s", ".2f"),
                ("durable", "until durable s", ".2f"),
                ("peak_mb", "peak RSS above state MB", ".0f"),
            ],
        )
    )
    for r in rows:
        if "error" in r:
            print(f"{r['strategy']}: ERROR {r['error']}")


if __name__ == "__main__":
    if not _common.worker_main(dict.fromkeys(STRATEGIES, save_worker), add_worker_arguments):
        main()
