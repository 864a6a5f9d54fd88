"""How the flow walks the package: a save and a load of an HF checkpoint, traced at run time.

``sys.setprofile`` (and ``threading.setprofile``, for the helper threads a save writes
files on) sees every call into a Python frame of nnx_save's own modules; in each thread,
each call whose module differs from the previous call's is a change of module, and each
whose package (of layouts/, load/, save/, io/) differs from the previous such package's
is a package switch; the counts are summed over the threads. Run: ``PYTHONPATH=src python benchmarks/flow.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGES = ("layouts", "load", "save", "io")


def trace(run: Callable[[], Any]) -> dict[str, Any]:
    """``run()`` traced, in every thread it starts (a save writes files on helper
    threads): its module changes and package switches, summed over the threads, and
    the package walk of the thread that called it."""
    import nnx_save

    root = os.path.dirname(nnx_save.__file__) + os.sep
    modules: dict[int, list[str]] = {}

    def profile(frame, event, arg):
        if event == "call":
            file = frame.f_code.co_filename
            if file.startswith(root):
                modules.setdefault(threading.get_ident(), []).append(file[len(root) :])

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]  # None removes it, as sys.setprofile(None) does
    changes = {t: sum(a != b for a, b in itertools.pairwise(seq)) for t, seq in modules.items()}
    walks = {t: _walk(seq) for t, seq in modules.items()}
    me = threading.get_ident()
    return {
        "calls": sum(map(len, modules.values())),
        "module_changes": sum(changes.values()),
        "package_switches": sum(max(len(w) - 1, 0) for w in walks.values()),
        "caller_module_changes": changes.get(me, 0),  # the calling thread alone
        "caller_package_switches": max(len(walks.get(me, [])) - 1, 0),
        "walk": walks.get(me, []),
    }


def _walk(modules: list[str]) -> list[str]:
    """The packages of :data:`PACKAGES` entered, in order, each run of one counted once."""
    packages = [p for m in modules if (p := m.split(os.sep, 1)[0]) in PACKAGES]
    return [p for i, p in enumerate(packages) if i == 0 or p != packages[i - 1]]


def model(n: int = 5):
    """A 10-tensor model: ``n`` linear layers (kernel and bias each)."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(n)])

    return Net


def measure(directory: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Trace ``save_model(model, dir, max_shard_size=...)`` then ``load_model(builder, dir)``
    (each after one untraced warm-up, so imports and compilation are not counted)."""
    import jax
    from flax import nnx

    import nnx_save

    Net = model()
    m = Net(nnx.Rngs(0))
    d = Path(directory)
    builder = lambda: Net(nnx.Rngs(1))  # noqa: E731
    nnx_save.save_model(m, d / "warm", max_shard_size=2048)
    nnx_save.load_model(builder, d / "warm")
    save = trace(lambda: nnx_save.save_model(m, d / "ck", max_shard_size=2048))
    loaded = {}
    load = trace(lambda: loaded.setdefault("m", nnx_save.load_model(builder, d / "ck")))
    got = jax.tree.leaves(nnx.state(loaded["m"]))
    assert all((a == b).all() for a, b in zip(got, jax.tree.leaves(nnx.state(m)), strict=True))
    return {"save": save, "load": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walk", action="store_true", help="also print the package walk")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = measure(d)
    keys = ("module_changes", "package_switches", "caller_module_changes", "caller_package_switches")
    for name, row in result.items():
        print(
            f"{name}: {row['calls']} calls; all threads: {row['module_changes']} module changes, "
            f"{row['package_switches']} package switches; the calling thread: {row['caller_module_changes']} and "
            f"{row['caller_package_switches']}"
        )
        if args.walk:
            print("  " + " > ".join(row["walk"]))
    print(json.dumps({k: {x: v[x] for x in keys} for k, v in result.items()}))


if __name__ == "__main__":
    main()
