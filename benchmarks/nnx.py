"""NNX model benchmark: ``save_model`` / ``load_model`` against the tools users would
pick instead, on a ~2 GB fp32 NNX model (a stack of ``nnx.Linear`` in an ``nnx.List``).

Every phase runs in a FRESH PROCESS (this script re-executes itself with
``--worker``), so nothing one phase imported, allocated or compiled helps another.
A worker imports its tool, builds what the phase starts from (the model for saves and
instance loads, nothing for builder loads), records its resident set size (the
baseline), resets the kernel's peak-RSS counter (``/proc/self/clear_refs``), times the
phase (to every array ready / the file fsynced or committed) and reads the peak RSS.
After the clock stops it checks the result: loaded models against ``safe_open`` of
the nnx_save file, saved files by reading them back, so a fast wrong answer cannot win.

Tools and phases:

- ``nnx_save``: ``save_model``; ``load_model(model)`` (instance filled in place);
  ``load_model(builder)`` (``nnx.eval_shape``, the random model never exists).
- ``st_flax``: ``safetensors.flax.save_file`` of the flat state; ``load_file`` then
  ``nnx.update`` (instance) or ``nnx.merge`` into the ``eval_shape`` graph (builder).
- ``orbax``: ``StandardCheckpointer().save`` of ``nnx.state(model)``; ``restore`` with
  the model's state (instance, then ``nnx.update``) or the abstract state (builder).

Columns: seconds, GB/s (checkpoint bytes / seconds), and peak RSS above the baseline
divided by the checkpoint size ("mem x"): for saves and instance loads the model is in
the baseline, so this is what the phase adds; for builder loads 1.0 is the floor.

Columns also give CPU seconds (user + system of the worker process), steadier than
wall time on a shared machine. Helpers (fresh processes, RSS phases, page-cache
notes, the table) come from ``benchmarks/_common.py``.

Run: ``.venv/bin/python benchmarks/nnx.py [--size-gb 2] [--dir /tmp/nnx_bench]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
from pathlib import Path

from _common import Phase, page_cache_note, run_fresh, sync, table, warm, worker_main

HERE = Path(__file__).resolve().parent
WIDTH = 2048  # each layer: a 2048 x 2048 fp32 kernel (16.8 MB) and a bias
TOOLS = ("nnx_save", "st_flax", "orbax")
PHASES = ("save", "load_instance", "load_builder")


# ----------------------------------------------------------------------------- model


def make_model_class():
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, layers: int, seed: int) -> None:
            rngs = nnx.Rngs(seed)
            self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(layers)])

    return Stack


def layers_for(size_gb: float) -> int:
    return max(1, round(size_gb * 1e9 / (4 * (WIDTH * WIDTH + WIDTH))))


# ----------------------------------------------------------------------------- tools


def _flat_key(path) -> str:
    return "/".join(str(p) for p in path)


def _save(tool: str, model, path: str) -> None:
    from flax import nnx

    if tool == "nnx_save":
        import nnx_save

        nnx_save.save_model(model, path)
    elif tool == "st_flax":
        from safetensors.flax import save_file

        save_file({_flat_key(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}, path)
    else:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, nnx.state(model))
        checkpointer.wait_until_finished()
        checkpointer.close()


def _load(tool: str, phase: str, target, path: str):
    """``target``: the model (instance phase) or the builder (builder phase)."""
    import jax
    from flax import nnx

    if tool == "nnx_save":
        import nnx_save

        model, _ = nnx_save.load_model(target, path, strict=True)
        return model
    if phase == "load_instance":
        model, state = target, nnx.state(target)
    else:
        graphdef, state = nnx.split(nnx.eval_shape(target))
    if tool == "st_flax":
        from safetensors.flax import load_file

        loaded = load_file(path)
        updates = [(p, v.replace(loaded.pop(_flat_key(p)))) for p, v in nnx.to_flat_state(state)]
        state = nnx.from_flat_state(updates)
    else:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        state = checkpointer.restore(path, state)
        checkpointer.close()
    if phase == "load_instance":
        nnx.update(model, state)
    else:
        model = nnx.merge(graphdef, state)
    jax.block_until_ready(nnx.state(model))
    return model


def _verify_model(model, reference: str) -> None:
    import numpy as np
    from safetensors import safe_open

    with safe_open(reference, "numpy") as f:
        n = len(model.layers)
        for i in sorted({0, n // 2, n - 1}):
            for name in ("kernel", "bias"):
                got = np.asarray(getattr(model.layers[i], name).get_value())
                assert np.array_equal(got, f.get_tensor(f"layers/{i}/{name}")), (i, name)


def _verify_file(tool: str, path: str, reference: str, layers: int) -> None:
    """The saved file/directory reads back (spot-checked against the reference model)."""
    import numpy as np
    from safetensors import safe_open

    if tool == "orbax":
        import orbax.checkpoint as ocp

        restored = ocp.StandardCheckpointer().restore(path)  # plain nested dicts
        stack = restored["layers"]
        kernel = stack[layers - 1] if layers - 1 in stack else stack[str(layers - 1)]
        kernel = kernel["kernel"]
        got = np.asarray(kernel["value"] if isinstance(kernel, dict) else kernel)
    else:
        with safe_open(path, "numpy") as f:
            got = f.get_tensor(f"layers/{layers - 1}/kernel")
    if tool != "nnx_save":
        with safe_open(reference, "numpy") as f:
            assert np.array_equal(got, f.get_tensor(f"layers/{layers - 1}/kernel"))


def _file_bytes(path: str) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def worker(tool: str, phase: str, args: argparse.Namespace) -> dict:
    import jax
    from flax import nnx

    if tool == "nnx_save":
        import nnx_save  # noqa: F401
    elif tool == "st_flax":
        import safetensors.flax  # noqa: F401
    else:
        import orbax.checkpoint  # noqa: F401
    Stack = make_model_class()
    layers = layers_for(args.size_gb)
    reference = os.path.join(args.dir, "nnx_save.safetensors")
    target = os.path.join(args.dir, f"{tool}.{'orbax' if tool == 'orbax' else 'safetensors'}")
    jax.block_until_ready(jax.device_put(0.0))  # the backend starts before the clock
    if phase == "save":
        subject = Stack(layers, 0)
        jax.block_until_ready(nnx.state(subject))
        if os.path.isdir(target):
            shutil.rmtree(target)
    elif phase == "load_instance":
        subject = Stack(layers, 1)
        jax.block_until_ready(nnx.state(subject))
    else:
        subject = lambda: Stack(layers, 1)  # noqa: E731
    with Phase() as measured:
        if phase == "save":
            _save(tool, subject, target)
        else:
            subject = _load(tool, phase, subject, target)
    if phase == "save":
        _verify_file(tool, target, reference, layers)
    else:
        _verify_model(subject, reference)
    return measured.result(bytes=_file_bytes(target))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--dir", default="/tmp/nnx_bench")


WORKERS = {f"{tool}:{phase}": functools.partial(worker, tool, phase) for tool in TOOLS for phase in PHASES}


# ----------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    tools = args.tools.split(",")
    if "nnx_save" not in tools:
        tools.insert(0, "nnx_save")  # its file is the reference every result is checked against
    layers = layers_for(args.size_gb)
    size = layers * 4 * (WIDTH * WIDTH + WIDTH)
    print(f"model: {layers} x nnx.Linear({WIDTH}, {WIDTH}) fp32 = {size / 1e9:.2f} GB; one fresh process per phase")
    print(page_cache_note(args.dir), flush=True)
    rows = []
    for phase in PHASES:  # every save before any load
        for tool in tools:
            sync()  # one phase's writeback must not land in the next one's time
            if phase != "save":
                warm(os.path.join(args.dir, "nnx_save.safetensors"))
            r = run_fresh(
                __file__, f"{tool}:{phase}", ["--size-gb", str(args.size_gb), "--dir", args.dir], timeout=args.timeout
            )
            row = {"tool": tool, "phase": phase, **r}
            if "error" not in r:
                row.update(
                    gbps=size / 1e9 / r["seconds"], cpu=r["user_s"] + r["sys_s"], mem=r["peak_above_kb"] * 1024 / size
                )
            else:
                print(f"{tool} {phase} failed: {r['error']}", file=sys.stderr)
            rows.append(row)
            print(f"  {tool:<9} {phase:<14} {row.get('seconds', float('nan')):8.2f} s", file=sys.stderr, flush=True)
    print(
        table(
            rows,
            [
                ("tool", "tool", ""),
                ("phase", "phase", ""),
                ("seconds", "seconds", ".2f"),
                ("gbps", "GB/s", ".2f"),
                ("cpu", "CPU s", ".2f"),
                ("mem", "peak RSS / ckpt", ".2f"),
            ],
        )
    )


if __name__ == "__main__":
    if worker_main(WORKERS, _add_arguments):
        sys.exit()
    main()
