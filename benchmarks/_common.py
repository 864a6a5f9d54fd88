"""Shared helpers for the benchmarks: checkpoints, fresh processes, memory, page cache.

A benchmark measures one phase (one save, one load) of one strategy in a FRESH
PROCESS, so nothing one strategy imported, allocated, compiled or left in its heap
helps or hurts another. The usual shape of a benchmark script::

    from _common import Phase, run_fresh, worker_main

    def my_worker(args) -> dict:          # runs in the child
        arrays = make_arrays(transformer_shapes(args.size_gb))
        with Phase() as phase:            # baseline RSS, peak reset, clock
            do_the_thing(arrays)
        return phase.result()             # {"seconds", "peak_above_kb", "baseline_kb", ...}

    if __name__ == "__main__":
        if worker_main({"mine": my_worker}):  # the child: `script.py --worker mine ...`
            sys.exit()
        row = run_fresh(__file__, "mine", ["--size-gb", "2"])   # the parent

Pieces:

- :func:`transformer_shapes`: a transformer-like fp32 state of a given size
  (embedding, N layers of 15 tensors from 128 elements to the MLP matrices, head).
- :func:`make_arrays`: deterministic arrays for those shapes, written page by page
  so they are resident before any baseline is taken.
- :class:`Phase`: resident set size before, kernel peak RSS during (``VmHWM`` after
  resetting it through ``/proc/self/clear_refs``; ``getrusage`` max RSS where that
  is not possible), and wall time of one block.
- :func:`run_fresh` / :func:`worker_main`: start ``python script --worker NAME ...``
  with a clean environment (``PYTHONPATH`` on ``src``, jax on CPU) and read back the
  JSON dict the worker prints as its last line.
- :func:`page_cache_note`, :func:`sync`, :func:`drop_file_cache`, :func:`warm`:
  state the page cache honestly and put it where the benchmark wants it.
- :func:`table`: a fixed-width text table.

Only the standard library and numpy are imported here, so a worker pays for nothing
it does not use.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

__all__ = [
    "Phase",
    "drop_file_cache",
    "gb",
    "make_arrays",
    "page_cache_note",
    "peak_rss_kb",
    "reset_peak_rss",
    "rss_kb",
    "run_fresh",
    "sync",
    "table",
    "total_bytes",
    "transformer_shapes",
    "warm",
    "worker_main",
]


# ----------------------------------------------------------------------------- checkpoints


def transformer_shapes(size_gb: float, *, d_model: int | None = None) -> dict[str, tuple[int, ...]]:
    """Names -> shapes of a transformer-like fp32 state of about ``size_gb`` GB.

    An embedding and a head of ``(vocab, d)``, then as many layers as fit, each with
    norms and biases (``d`` elements), attention ``q, k, v, o`` kernels ``(d, d)``,
    an MLP ``(d, 4d)`` / ``(4d, d)`` and a few small vectors: about 15 tensors per layer,
    from 128 elements to ``4 d^2``, the size mix of real checkpoints.

    Examples:
        >>> s = transformer_shapes(2.0)
        >>> 300 < len(s) < 1000, round(total_bytes(s) / 1e9, 1)
        (True, 2.0)
    """
    target = size_gb * 1e9 / 4  # elements
    d = d_model or (1024 if target >= 5e7 else 256 if target >= 2e6 else 64)
    vocab = 8 * d
    f = 4 * d
    per_layer = 4 * d * d + 2 * d * f + 6 * d + f + 256
    layers = max(1, round((target - 2 * vocab * d) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"embed.embedding": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "attn_norm.scale": (d,),
                p + "attn_norm.bias": (d,),
                p + "attn.q.kernel": (d, d),
                p + "attn.k.kernel": (d, d),
                p + "attn.v.kernel": (d, d),
                p + "attn.o.kernel": (d, d),
                p + "attn.o.bias": (d,),
                p + "attn.q_norm": (128,),
                p + "attn.k_norm": (128,),
                p + "mlp_norm.scale": (d,),
                p + "mlp_norm.bias": (d,),
                p + "mlp.up.kernel": (d, f),
                p + "mlp.up.bias": (f,),
                p + "mlp.down.kernel": (f, d),
                p + "mlp.down.bias": (d,),
            }
        )
    shapes.update({"final_norm.scale": (d,), "head.kernel": (d, vocab)})
    return shapes


def total_bytes(shapes: Mapping[str, Sequence[int]], itemsize: int = 4) -> int:
    return itemsize * sum(math.prod(s) for s in shapes.values())


def make_arrays(shapes: Mapping[str, Sequence[int]], seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Deterministic arrays, every page written (resident before a baseline is taken)."""
    rng = np.random.default_rng(seed)
    return {k: rng.random(tuple(s), dtype=np.float32).astype(dtype, copy=False) for k, s in shapes.items()}


def gb(nbytes: float) -> float:
    return nbytes / 1e9


# ----------------------------------------------------------------------------- memory


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_kb() -> int:
    """The resident set size now (``VmRSS``; ``getrusage`` max RSS where /proc is absent)."""
    now = _status_kb("VmRSS")
    return now if now is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (``VmHWM``) to the current RSS. False if impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_kb() -> int:
    """The peak RSS since the last :func:`reset_peak_rss` (or since the process began)."""
    peak = _status_kb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class Phase:
    """Measure one block: wall seconds, and peak RSS above the RSS at entry.

    The baseline is taken after a ``gc.collect()``, once everything the phase needs
    (imports, input arrays) exists, so ``peak_above_kb`` is what the phase itself
    added at its worst moment.
    """

    def __enter__(self) -> Phase:
        gc.collect()
        self.baseline_kb = rss_kb()
        self.peak_reset = reset_peak_rss()
        self.cpu0 = _cpu_seconds()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu = tuple(b - a for a, b in zip(self.cpu0, _cpu_seconds(), strict=False))
        self.peak_kb = peak_rss_kb()

    def result(self, **extra: object) -> dict:
        """``seconds`` (wall), ``user_s`` / ``sys_s`` (CPU of this process and its
        threads: on a shared machine a steadier measure of the work done than wall
        time), and ``peak_above_kb``."""
        return {
            "seconds": self.seconds,
            "user_s": self.cpu[0],
            "sys_s": self.cpu[1],
            "baseline_kb": self.baseline_kb,
            "peak_above_kb": max(0, self.peak_kb - self.baseline_kb),
            "peak_reset": self.peak_reset,
            **extra,
        }


def _cpu_seconds() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


# ----------------------------------------------------------------------------- processes


def fresh_env(devices: int = 1, platform: str | None = "cpu", src: Path | None = None) -> dict[str, str]:
    """The environment of a worker: ``src`` (this checkout's by default) and the
    benchmarks on ``PYTHONPATH``, jax on ``platform`` with ``devices`` CPU devices
    (``platform=None``: the machine's own backend, as jax picks it, e.g. a GPU)."""
    env = dict(os.environ)
    first = [str(src or SRC), str(HERE)]
    env["PYTHONPATH"] = os.pathsep.join(first + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if platform is not None:
        env["JAX_PLATFORMS"] = platform
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def run_fresh(
    script: str | os.PathLike,
    worker: str,
    args: Sequence[str] = (),
    *,
    devices: int = 1,
    timeout: float = 3600,
    platform: str | None = "cpu",
    src: Path | None = None,
) -> dict:
    """Run ``python script --worker WORKER *args`` in a new process, importing nnx_save
    from ``src`` (this checkout's by default); its last stdout line is the JSON result.
    A failure comes back as ``{"error": last stderr line}``."""
    cmd = [sys.executable, str(script), "--worker", worker, *args]
    env = fresh_env(devices, platform, src)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        return {"error": lines[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_main(
    workers: Mapping[str, Callable[[argparse.Namespace], dict]],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> bool:
    """In a child started by :func:`run_fresh`: run the named worker, print its JSON,
    and return True. In the parent (no ``--worker``): return False."""
    if "--worker" not in sys.argv:
        return False
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=sorted(workers), required=True)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    print(json.dumps(workers[args.worker](args)))
    return True


# ----------------------------------------------------------------------------- page cache


def sync() -> None:
    """Flush every dirty page, so one run's writeback does not land in the next's time."""
    os.sync()


def drop_file_cache(path: str | os.PathLike) -> None:
    """Evict one file's pages from the page cache (after flushing it); other files stay."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: str | os.PathLike) -> None:
    """Read a file once so it starts in the page cache."""
    buf = bytearray(64 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def _meminfo_kb(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def page_cache_note(directory: str | os.PathLike) -> str:
    """One line on the state that decides write and read speed: free memory, dirty
    pages, the kernel's writeback thresholds, and the file system."""
    avail, dirty = _meminfo_kb("MemAvailable"), _meminfo_kb("Dirty")
    st = os.statvfs(directory)
    return (
        f"MemAvailable {avail / 1e6 if avail else float('nan'):.1f} GB, Dirty {dirty / 1e3 if dirty else 0:.0f} MB, "
        f"vm.dirty_ratio {_read('/proc/sys/vm/dirty_ratio')}%, "
        f"vm.dirty_background_ratio {_read('/proc/sys/vm/dirty_background_ratio')}%, "
        f"{directory}: {st.f_bavail * st.f_frsize / 1e9:.0f} GB free, CPUs {os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )


# ----------------------------------------------------------------------------- output


def table(rows: Sequence[Mapping[str, object]], columns: Sequence[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec). Missing values print as ``-``."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else format(r[k], spec) for k, _, spec in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=False)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_ratios(group: Sequence[dict], field: str, base: dict | None) -> list[dict]:
    """``group`` with ``vs``: each row's ``field`` over ``base``'s (rows with an error have none)."""
    for r in group:
        if base is not None and field in r:
            r["vs"] = r[field] / base[field]
        print(json.dumps(r), file=sys.stderr, flush=True)
    return list(group)


def print_results(rows: Sequence[dict], columns: Sequence, target_lines: Sequence[str], json_path: str | None) -> None:
    """The table (an error row shows its error as the spread), the target lines, and the
    rows as JSON when ``json_path`` is given."""
    print(table([r if "error" not in r else {**r, "spread": "ERROR " + r["error"]} for r in rows], columns))
    print("\n".join(target_lines))
    if json_path:
        Path(json_path).write_text(json.dumps(list(rows), indent=1))
