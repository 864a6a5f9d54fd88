"""The training store against the Orbax manager it wraps.

    .venv/bin/python benchmarks/store.py [--size-gb 0.8] [--repeat 3] [--dir DIR]

A train state of ``--size-gb`` fp32 (params plus adam's two moments, each a third:
:func:`_common.transformer_shapes`) as jax CPU arrays on one device, saved blocking and
restored onto templates, by:

- ``store``: ``OrbaxCheckpointStore.save(step, {"model": params, "optimizer": opt})``
  and ``store.restore(step, templates=...)`` (its guards, dtype record, metadata record,
  retention and writer lock included);
- ``manager``: Orbax's own ``CheckpointManager`` with ``args.Composite(model=
  StandardSave(params), optimizer=StandardSave(opt))`` and ``StandardRestore`` of the
  same abstract trees.

Each phase of each strategy runs in a FRESH PROCESS (import, build the state, start the
clock; the store's modules, which ``nnx_save.checkpoint`` loads on first use, are imported
before the clock as Orbax's are: ``python -X importtime`` is the measure of imports); the strategies are interleaved run by run, so drift in the machine's load hits
both alike. The table gives the median with the spread (min-max) of wall time and of
peak RSS above the state (the baseline: the arrays and the imports), and the ratio of
the medians; and the CPU seconds (user + sys, all threads) of the phase, steadier than
wall time where other jobs share the machine. A restore is checked against the saved
values after the clock stops.
The page cache is warm for restores (each reads what a save just wrote).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

STRATEGIES = ("store", "manager")
PHASES = ("save", "restore")


def _state(size_gb: float) -> tuple[dict, dict]:
    """Params and adam's two moments (a third of the bytes each), as jax arrays."""
    import jax.numpy as jnp

    shapes = _common.transformer_shapes(size_gb / 3)
    params = {k.replace(".", "_"): jnp.asarray(v) for k, v in _common.make_arrays(shapes, seed=0).items()}
    opt = {
        moment: {k.replace(".", "_"): jnp.asarray(v) for k, v in _common.make_arrays(shapes, seed=s).items()}
        for s, moment in ((1, "mu"), (2, "nu"))
    }
    return params, opt


def _abstract(tree: dict) -> dict:
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _manager(directory: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True))


def _save(strategy: str, directory: Path, params: dict, opt: dict) -> None:
    if strategy == "store":
        from nnx_save.checkpoint import OrbaxCheckpointStore

        with OrbaxCheckpointStore(directory) as store:
            store.save(1, {"model": params, "optimizer": opt})
    else:
        import orbax.checkpoint as ocp

        manager = _manager(directory)
        manager.save(
            1, args=ocp.args.Composite(model=ocp.args.StandardSave(params), optimizer=ocp.args.StandardSave(opt))
        )
        manager.wait_until_finished()
        manager.close()


def _restore(strategy: str, directory: Path, params: dict, opt: dict) -> tuple[dict, dict]:
    if strategy == "store":
        from nnx_save.checkpoint import OrbaxCheckpointStore

        with OrbaxCheckpointStore(directory) as store:
            items = store.restore(1, templates={"model": params, "optimizer": opt}).items
        return items["model"], items["optimizer"]
    import orbax.checkpoint as ocp

    manager = _manager(directory)
    restored = manager.restore(
        1, args=ocp.args.Composite(model=ocp.args.StandardRestore(params), optimizer=ocp.args.StandardRestore(opt))
    )
    manager.close()
    return restored["model"], restored["optimizer"]


def worker(args: argparse.Namespace) -> dict:
    strategy, phase_name = args.worker.split(":")
    import jax
    import orbax.checkpoint  # noqa: F401

    from nnx_save.checkpoint import OrbaxCheckpointStore  # noqa: F401 - the store's modules load on first use:
    # imported here, before the clock, as Orbax's are for both (a training job imports once, saves many times)

    jax.process_count()  # the backend started before the clock, as in a training job
    params, opt = _state(args.size_gb)
    jax.block_until_ready((params, opt))
    directory = Path(args.path)
    if phase_name == "save":
        with _common.Phase() as phase:
            _save(strategy, directory, params, opt)
        return phase.result(nbytes=sum(a.nbytes for a in jax.tree.leaves((params, opt))))
    templates = (_abstract(params), _abstract(opt))
    expected = {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path((params, opt))}
    del params, opt
    with _common.Phase() as phase:
        got = _restore(strategy, directory, *templates)
        jax.block_until_ready(got)
    for path, value in jax.tree_util.tree_leaves_with_path(got):
        assert np.array_equal(np.asarray(value), expected[path]), path
    return phase.result(nbytes=sum(a.nbytes for a in expected.values()))


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True)
    parser.add_argument("--size-gb", type=float, required=True)


def run(size_gb: float, repeat: int, directory: Path) -> dict[tuple[str, str], list[dict]]:
    runs: dict[tuple[str, str], list[dict]] = {(s, p): [] for p in PHASES for s in STRATEGIES}
    for i in range(repeat):
        for phase in PHASES:
            for strategy in STRATEGIES if i % 2 == 0 else STRATEGIES[::-1]:  # interleaved, order alternating
                path = directory / strategy
                if phase == "save":
                    shutil.rmtree(path, ignore_errors=True)
                    _common.sync()
                extra = ["--path", str(path), "--size-gb", str(size_gb)]
                r = _common.run_fresh(__file__, f"{strategy}:{phase}", extra)
                shown = f"{r['seconds']:.2f} s, peak +{r['peak_above_kb'] / 1e3:.0f} MB" if "error" not in r else r
                print(f"run {i + 1}/{repeat} {phase:<8}{strategy:<8} {shown}", file=sys.stderr)
                runs[(strategy, phase)].append(r)
    return runs


def summarise(runs: dict[tuple[str, str], list[dict]]) -> list[dict]:
    rows = []
    for (strategy, phase), rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            rows.append({"phase": phase, "strategy": strategy, "error": rs[-1]["error"]})
            continue
        seconds = [r["seconds"] for r in ok]
        cpu = [r["user_s"] + r["sys_s"] for r in ok]
        peaks = [r["peak_above_kb"] / 1e3 for r in ok]
        rows.append(
            {
                "phase": phase,
                "strategy": strategy,
                "median": statistics.median(seconds),
                "spread": f"{min(seconds):.2f}-{max(seconds):.2f}",
                "cpu": statistics.median(cpu),
                "cpu_spread": f"{min(cpu):.2f}-{max(cpu):.2f}",
                "peak": statistics.median(peaks),
                "peak_spread": f"{min(peaks):.0f}-{max(peaks):.0f}",
                "state_mb": ok[0]["nbytes"] / 1e6,
                "runs": len(ok),
            }
        )
    by = {(r["strategy"], r["phase"]): r for r in rows if "error" not in r}
    for r in rows:
        ref = by.get(("manager", r["phase"]))
        if "error" not in r and ref:
            r["vs_time"] = r["median"] / ref["median"]
            r["vs_cpu"] = r["cpu"] / ref["cpu"]
            r["vs_peak"] = (r["peak"] + r["state_mb"]) / (ref["peak"] + ref["state_mb"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="nnx_save-bench-store-") as tmp:
        note = _common.page_cache_note(Path(tmp))
        rows = summarise(run(args.size_gb, args.repeat, Path(tmp)))
    print(
        f"\nstore vs CheckpointManager: {rows[0].get('state_mb', 0) / 1e3:.2f} GB fp32 train state (params, mu, nu) "
        f"on one CPU device, blocking; fresh process per phase, {args.repeat} interleaved repeats, median (min-max)"
    )
    print(f"page cache: {note}\n")
    columns = [
        ("phase", "phase", ""),
        ("strategy", "strategy", ""),
        ("median", "median s", ".2f"),
        ("spread", "min-max s", ""),
        ("peak", "peak RSS above state MB", ".0f"),
        ("peak_spread", "min-max MB", ""),
        ("cpu", "median CPU s", ".2f"),
        ("cpu_spread", "min-max CPU s", ""),
        ("vs_time", "time vs manager", ".3f"),
        ("vs_cpu", "CPU vs manager", ".3f"),
        ("vs_peak", "state+peak vs manager", ".3f"),
    ]
    print(_common.table(rows, columns))
    for r in rows:
        if "error" in r:
            print(f"{r['phase']} {r['strategy']}: ERROR {r['error']}")


if __name__ == "__main__":
    workers = {f"{s}:{p}": worker for s in STRATEGIES for p in PHASES}
    if not _common.worker_main(workers, add_worker_arguments):
        main()
