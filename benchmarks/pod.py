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

Per case: total bytes from storage (the library's ``report.io.bytes_read`` summed over
processes; for orbax the kernel's ``rchar``), bytes per process, bytes received from
peers, wall time (barrier to barrier, the slowest process) and peak RSS above the
baseline (the largest process). Each process warms every case once (imports,
compiles), then runs ``--repeat`` rounds over the cases in rotated order; the table
has medians. Each launch checks a sample of every result against the file.

    python benchmarks/pod.py [--size-mb 256] [--processes 2 4] [--repeat 3] [--rate 50m]
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

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid, initialization_timeout=120)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate", default="50m", help="nginx limit_rate per connection ('' : no HTTP cases)")
    parser.add_argument("--cases", nargs="*", default=[], help="run only these cases (names as in the table)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    import nnx_save

    work = Path(tempfile.mkdtemp(prefix="nnx_save_pod_bench_"))
    (work / "www").mkdir()
    (work / "nginx").mkdir()
    weights = _weights(args.size_mb)
    native, torch = work / "www" / "native.safetensors", work / "www" / "torch.safetensors"
    nnx_save.save_file(weights, native)
    nnx_save.save_file({f"{k}.weight": np.ascontiguousarray(v.T) for k, v in weights.items()}, torch)
    del weights
    size = native.stat().st_size
    warm(native)
    warm(torch)
    proc = None
    spec = {"local": {"native": str(native), "torch": str(torch)}, "repeat": args.repeat, "cases": args.cases}
    if args.rate:
        proc, url = _start_nginx(work / "www", work / "nginx", args.rate)
        spec["http"] = {"native": f"{url}/native.safetensors", "torch": f"{url}/torch.safetensors"}
    try:
        rows = []
        for n in args.processes:
            rows += _rows(n, _launch(n, args.devices, spec, timeout=3600), size)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
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
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, n, port = (int(x) for x in sys.argv[2:5])
        print(json.dumps(worker(pid, n, port, json.loads(sys.argv[5]))))
    else:
        main()
