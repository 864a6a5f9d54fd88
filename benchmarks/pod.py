"""A pod loading one checkpoint: N JAX processes (gloo on 127.0.0.1), each with
``--devices`` CPU devices, every case run by all of them at once.

Cases (fp32 1024 x 1024 matrices, ``--size-mb`` in all; a native file with kernels
``[in, out]`` and a torch-layout file with the same values as ``nn.Linear`` weights
``[out, in]``):

- ``native sharded``: ``load_file`` onto ``P("x", None)`` over every device (FSDP).
- ``renamed sharded``: ``load_model`` of the native file through rename rules,
  kernels on ``P("x", None)``: the model-building baseline (the split that reads
  contiguous rows of the native ``[in, out]`` layout).
- ``ported sharded``: ``load_model`` of the torch file through ``torch_linear`` rules,
  kernels on ``P(None, "x")``: each kernel shard is read as weight rows, transposed.
- ``replicated``: ``load_file`` onto ``P()``: every process reads everything.
- ``replicated, share_reads``: the same with ``share_reads=True``: each process reads
  1/N and the rest comes from its peers through one jitted reshard (gloo).
- ``orbax v1``: ``ocp.load`` with the safetensors layout, sharded and replicated
  (local files only: it reads no URL).

Sources: the local file (page cache warm: the processes share it) and HTTP from
nginx on loopback with a per-connection ``limit_rate`` (``--rate``) standing in for
an object store.

``--rates``: the rate each process gets on its own byte ranges. Two processes (``--processes``)
load the HTTP file onto ``P("x", None)`` with ``share_reads=False`` (each reads only its own
rows), in rounds of: each process alone while the others wait at a barrier, then all at once.
Per process, its bytes read over its own load's time; together they must match alone
within the spread (nothing between processes, not the server, not the library, divides a
process's rate). ``--rate`` is the per-connection cap: pick it so that requests in flight
times the cap stays below what the CPUs can copy, so the link, not the CPU, sets the rate
(``--rate 4m``: 32 requests of at most 4 MB/s each, about 130 MB/s per process).

Per case: total bytes from storage (the library's ``report.io.bytes_read`` summed over
processes; for orbax the kernel's ``rchar``), bytes per process, bytes received from
peers, wall time (barrier to barrier, the slowest process) and peak RSS above the
baseline (the largest process). Each process warms every case once (imports,
compiles), then runs ``--repeat`` rounds over the cases in rotated order; the table
has medians. Each launch checks a sample of every result against the file.

    python benchmarks/pod.py [--size-mb 256] [--processes 2 4] [--repeat 3] [--rate 50m]
    python benchmarks/pod.py --rates [--processes 2] [--rate 4m] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import Phase, fresh_env, page_cache_note, table, warm

HERE = Path(__file__).resolve().parent
NGINX_CONF = HERE.parent / "tests" / "remote" / "nginx.conf"
SIDE = 1024
LOCAL_CASES = [
    "native sharded",
    "renamed sharded",
    "ported sharded",
    "replicated",
    "replicated, share_reads",
    "orbax v1 sharded",
]
LOCAL_CASES += ["orbax v1 replicated"]
HTTP_CASES = ["native sharded", "ported sharded", "replicated", "replicated, share_reads"]


def _weights(size_mb: int) -> dict[str, np.ndarray]:
    n = max(1, size_mb * (1 << 20) // (SIDE * SIDE * 4))
    rng = np.random.default_rng(0)
    return {f"fc{i}": rng.standard_normal((SIDE, SIDE), dtype=np.float32) for i in range(n)}


# ----------------------------------------------------------------------------- worker


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _net(names, spec):
    from flax import nnx

    kernel = nnx.with_partitioning(nnx.initializers.zeros, spec)

    class Net(nnx.Module):
        def __init__(self):
            for n in names:
                setattr(self, n, nnx.Linear(SIDE, SIDE, use_bias=False, kernel_init=kernel, rngs=nnx.Rngs(0)))

    return Net


def _load(case: str, source: dict, names: list[str], mesh):
    """One load of ``case``; ``(flat {name: array}, report or None)``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import nnx_save
    from nnx_save.porting import Rules, rename, torch_linear

    spec = P() if "replicated" in case else P("x", None)
    abstract = {n: jax.ShapeDtypeStruct((SIDE, SIDE), np.float32, sharding=NamedSharding(mesh, spec)) for n in names}
    if case.startswith("orbax"):
        from orbax.checkpoint.experimental import v1 as ocp

        ctx = ocp.Context()
        ctx.checkpoint_layout = "safetensors"
        with ctx:
            return dict(ocp.load(source["native"], abstract)), None
    if case in ("ported sharded", "renamed sharded"):  # load_model, transposing, or renaming only
        ported = case == "ported sharded"
        rules = Rules(*(torch_linear(n, n, bias=False) if ported else rename(n, f"{n}/kernel") for n in names))
        file = source["torch" if ported else "native"]
        spec = (None, "x") if ported else ("x", None)  # each the contiguous split of its file's layout
        model, report = nnx_save.load_model(_net(names, spec), file, rules=rules, mesh=mesh)
        return {n: getattr(model, n).kernel.get_value() for n in names}, report
    share = case.endswith("share_reads")
    return nnx_save.load_file(source["native"], abstract, share_reads=share, return_report=True)


def _check(values: dict, weights_of) -> None:
    """A sample of shards against the native file (the torch file holds the transposes)."""
    for name in list(values)[:: max(1, len(values) // 4)]:
        want = weights_of(name)
        for shard in values[name].addressable_shards[:2]:
            got = np.asarray(shard.data)
            expected = want[shard.index]
            if not np.array_equal(got, expected):
                raise AssertionError(f"{name}: shard {shard.index} differs")


def _run_case(case: str, source: dict, names: list[str], mesh, weights_of) -> dict:
    import jax
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(f"before {case}")
    before = _rchar()
    with Phase() as phase:
        values, report = _load(case, source, names, mesh)
        jax.block_until_ready(list(values.values()))
        multihost_utils.sync_global_devices(f"after {case}")
    read = _rchar() - before
    _check(values, weights_of)
    del values
    gc.collect()
    _libc().malloc_trim(0)
    io = report.io if report is not None else None
    return {
        "seconds": phase.seconds,
        "peak_above_kb": phase.result()["peak_above_kb"],
        "rchar": read,
        "bytes_read": io.bytes_read if io is not None else read,
        "bytes_received": io.bytes_received if io is not None else None,
    }


def _libc():
    import ctypes

    return ctypes.CDLL("libc.so.6")


def worker(pid: int, n: int, port: int, args: dict) -> dict:
    import jax

    _libc().mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD fixed: freed buffers go back to the system, so each
    # case's peak RSS is its own and not hidden by heap a previous case left behind

    _join(pid, n, port)
    import nnx_save

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    names = sorted(nnx_save.read_header(args["local"]["native"]), key=lambda k: int(k[2:]))
    weights_of = _weights_reader(args["local"]["native"])
    jobs = [("local", c) for c in LOCAL_CASES] + [("http", c) for c in HTTP_CASES if args.get("http")]
    jobs = [(s, c) for s, c in jobs if not args["cases"] or c in args["cases"]]
    out: dict[str, list[dict]] = {f"{s}|{c}": [] for s, c in jobs}
    for s, c in jobs:  # warm: imports, compiles, first calls
        _run_case(c, args[s], names, mesh, weights_of)
    for r in range(args["repeat"]):
        for s, c in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:
            out[f"{s}|{c}"].append(_run_case(c, args[s], names, mesh, weights_of))
    return out


def _join(pid: int, n: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid, initialization_timeout=120)


def rates_worker(pid: int, n: int, port: int, args: dict) -> dict:
    """``--rates``: per round, each process loading alone (the others wait at the barrier),
    then all of them at once, in rotated order; this process's bytes read and seconds of
    each of its own loads (its own clock: load call to its arrays ready)."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _libc().mallopt(-3, 1 << 20)  # as in worker: each load's memory goes back to the system
    _join(pid, n, port)
    import nnx_save

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    names = sorted(nnx_save.read_header(args["local"]["native"]), key=lambda k: int(k[2:]))
    sharding = NamedSharding(mesh, P("x", None))
    abstract = {k: jax.ShapeDtypeStruct((SIDE, SIDE), np.float32, sharding=sharding) for k in names}
    weights_of = _weights_reader(args["local"]["native"])

    def load() -> dict:
        with Phase() as phase:
            values, report = nnx_save.load_file(args["http"]["native"], abstract, share_reads=False, return_report=True)
            jax.block_until_ready(list(values.values()))
        _check(values, weights_of)
        del values
        gc.collect()
        _libc().malloc_trim(0)
        cpu = phase.result()
        return {
            "seconds": phase.seconds,
            "cpu": cpu["user_s"] + cpu["sys_s"],
            "bytes_read": report.io.bytes_read,
            "requests": report.io.requests,
        }

    def run(phase: str) -> dict | None:
        multihost_utils.sync_global_devices(f"before {phase}")
        row = load() if phase in ("together", f"alone {pid}") else None
        multihost_utils.sync_global_devices(f"after {phase}")
        return row

    phases = [f"alone {p}" for p in range(n)] + ["together"]
    run("together")  # warm: imports, the connection pool
    out: dict[str, list[dict]] = {p: [] for p in phases}
    for r in range(args["repeat"]):
        for phase in phases[r % len(phases) :] + phases[: r % len(phases)]:
            if (row := run(phase)) is not None:
                out[phase].append(row)
    return {p: rows for p, rows in out.items() if rows}


def _weights_reader(path: str):
    from safetensors import safe_open

    def get(name: str) -> np.ndarray:
        with safe_open(path, "numpy") as f:
            return f.get_tensor(name)

    return get


# ----------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_nginx(root: Path, prefix: Path, rate: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    conf = NGINX_CONF.read_text().format(root=root, port=port, prefix=prefix)
    conf = conf.replace("max_ranges 1;", f"max_ranges 1;\n        limit_rate {rate};")
    (prefix / "nginx.conf").write_text(conf)
    proc = subprocess.Popen(
        [shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(prefix / "nginx.conf"), "-p", str(prefix)]
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nginx did not start")


def _launch(n: int, devices: int, args: dict, timeout: float) -> list[dict]:
    port, procs = _free_port(), []
    env = fresh_env(devices)
    for i in range(n):
        cmd = [sys.executable, __file__, "--worker", str(i), str(n), str(port), json.dumps(args)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"pod benchmark: workers still running after {timeout:.0f} s") from None
        if p.returncode != 0:
            raise SystemExit(f"pod benchmark worker failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _rows(n: int, results: list[dict], size: int) -> list[dict]:
    rows = []
    for key in results[0]:
        source, case = key.split("|")
        runs = [[proc[key][r] for proc in results] for r in range(len(results[0][key]))]
        total = [sum(p["bytes_read"] for p in run) for run in runs]
        received = [p["bytes_received"] for p in runs[0]]
        rows.append(
            {
                "procs": n,
                "source": source,
                "case": case,
                "total": statistics.median(total) / size,
                "per_proc": statistics.median(max(p["bytes_read"] for p in run) for run in runs) / size,
                "received": None if received[0] is None else max(received) / size,
                "seconds": statistics.median(max(p["seconds"] for p in run) for run in runs),
                "spread": f"{min(max(p['seconds'] for p in run) for run in runs):.2f}-"
                f"{max(max(p['seconds'] for p in run) for run in runs):.2f}",
                "rss": statistics.median(max(p["peak_above_kb"] for p in run) for run in runs) * 1024 / size,
            }
        )
    return rows


def _rate_rows(n: int, results: list[dict], size: int) -> list[dict]:
    """``--rates``: per process, alone and together: its bytes read, seconds and rate (MB/s)."""
    rows = []
    for pid, runs_of in enumerate(results):
        for phase, label in ((f"alone {pid}", "alone"), ("together", f"together ({n})")):
            runs = runs_of[phase]
            secs = [r["seconds"] for r in runs]
            rates = [r["bytes_read"] / r["seconds"] / 1e6 for r in runs]
            rows.append(
                {
                    "process": pid,
                    "phase": label,
                    "read": runs[0]["bytes_read"] / size,
                    "requests": runs[0]["requests"],
                    "seconds": statistics.median(secs),
                    "spread": f"{min(secs):.2f}-{max(secs):.2f}",
                    "cpu": statistics.median(r["cpu"] for r in runs),
                    "rate": statistics.median(rates),
                    "rate_spread": f"{min(rates):.0f}-{max(rates):.0f}",
                    "lo": min(rates),
                    "hi": max(rates),
                }
            )
        alone, together = rows[-2], rows[-1]
        together["vs_alone"] = together["rate"] / alone["rate"]
        together["overlap"] = "yes" if together["lo"] <= alone["hi"] and alone["lo"] <= together["hi"] else "NO"
    return rows


def _print_rates(rows: list[dict], args: argparse.Namespace, size: int, work: Path) -> None:
    print(
        f"checkpoint {size / 1e6:.0f} MB ({size // (SIDE * SIDE * 4)} fp32 {SIDE}x{SIDE} matrices) over HTTP: nginx "
        f"on loopback, limit_rate {args.rate} per connection; {args.processes} processes, {args.devices} CPU devices "
        f'each, P("x", None), share_reads=False; medians of {args.repeat} rounds (each process alone, then all '
        f"together, rotated); {page_cache_note(work)}"
    )
    print(
        table(
            rows,
            [
                ("process", "process", "d"),
                ("phase", "phase", ""),
                ("read", "read / file", ".2f"),
                ("requests", "requests", "d"),
                ("seconds", "median s", ".2f"),
                ("spread", "min-max s", ""),
                ("cpu", "CPU s", ".2f"),
                ("rate", "MB/s", ".0f"),
                ("rate_spread", "min-max MB/s", ""),
                ("vs_alone", "together / alone", ".2f"),
                ("overlap", "spreads overlap", ""),
            ],
        )
    )


def _print_cases(rows: list[dict], args: argparse.Namespace, size: int, work: Path) -> None:
    print(
        f"checkpoint {size / 1e6:.0f} MB ({size // (SIDE * SIDE * 4)} fp32 {SIDE}x{SIDE} matrices), "
        f"{args.devices} CPU devices per process, medians of {args.repeat} interleaved rounds; "
        f"HTTP: nginx on loopback, limit_rate {args.rate or '-'} per connection; {page_cache_note(work)}"
    )
    print(
        table(
            rows,
            [
                ("procs", "procs", "d"),
                ("source", "source", ""),
                ("case", "case", ""),
                ("total", "total read / file", ".2f"),
                ("per_proc", "max per process / file", ".2f"),
                ("received", "received from peers / file", ".2f"),
                ("seconds", "wall s", ".2f"),
                ("spread", "min-max s", ""),
                ("rss", "peak RSS / file", ".2f"),
            ],
        )
    )


def _checkpoint(www: Path, size_mb: int) -> tuple[Path, Path]:
    """The native file and its torch-layout twin, in the page cache."""
    import nnx_save

    weights = _weights(size_mb)
    native, torch = www / "native.safetensors", www / "torch.safetensors"
    nnx_save.save_file(weights, native)
    nnx_save.save_file({f"{k}.weight": np.ascontiguousarray(v.T) for k, v in weights.items()}, torch)
    del weights
    warm(native)
    warm(torch)
    return native, torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate", default="50m", help="nginx limit_rate per connection ('' : no HTTP cases)")
    parser.add_argument("--cases", nargs="*", default=[], help="run only these cases (names as in the table)")
    parser.add_argument("--rates", action="store_true", help="per-process rates over HTTP, alone and together")
    args = parser.parse_args()
    if args.rates and not args.rate:
        parser.error("--rates reads over HTTP: give --rate")
    sys.path.insert(0, str(HERE.parent / "src"))
    work = Path(tempfile.mkdtemp(prefix="nnx_save_pod_bench_"))
    (work / "www").mkdir()
    (work / "nginx").mkdir()
    native, torch = _checkpoint(work / "www", args.size_mb)
    size = native.stat().st_size
    proc = None
    spec = {"local": {"native": str(native), "torch": str(torch)}, "repeat": args.repeat, "cases": args.cases}
    spec["mode"] = "rates" if args.rates else "cases"
    if args.rate:
        proc, url = _start_nginx(work / "www", work / "nginx", args.rate)
        spec["http"] = {"native": f"{url}/native.safetensors", "torch": f"{url}/torch.safetensors"}
    rows_of = _rate_rows if args.rates else _rows
    try:
        rows = []
        for n in args.processes:
            rows += rows_of(n, _launch(n, args.devices, spec, timeout=3600), size)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    (_print_rates if args.rates else _print_cases)(rows, args, size, work)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, n, port = (int(x) for x in sys.argv[2:5])
        spec = json.loads(sys.argv[5])
        print(json.dumps((rates_worker if spec["mode"] == "rates" else worker)(pid, n, port, spec)))
    else:
        main()
