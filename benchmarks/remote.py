"""Loading over HTTP from nginx on loopback, against the same load from the local file.

Each phase runs in a fresh process (benchmarks/_common.py), page cache warm, on one
device (whole file) and on 8 devices split on dim 0. The HTTP rows go through the
same engine with ranged GETs (one per read chunk, pooled connections); nginx serves
the file from the same page cache, so the gap is the cost of HTTP on loopback.

    python benchmarks/remote.py [--size-gb 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Phase, gb, make_arrays, page_cache_note, run_fresh, table, transformer_shapes, warm, worker_main

HERE = Path(__file__).resolve().parent
NGINX_CONF = HERE.parent / "tests" / "remote" / "nginx.conf"


def _abstract(header, devices: int):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((devices,), ("x",))
    out = {}
    for name, t in header.tensors.items():
        split = len(t.shape) >= 1 and t.shape[0] % devices == 0
        spec = P("x", *([None] * (len(t.shape) - 1))) if split else P()
        out[name] = jax.ShapeDtypeStruct(t.shape, np.dtype(t.dtype.numpy), sharding=NamedSharding(mesh, spec))
    return out


def load_worker(args: argparse.Namespace) -> dict:
    import nnx_save

    header = nnx_save.read_header(args.source)
    abstract = _abstract(header, args.devices)
    with Phase() as phase:
        tree, report = nnx_save.load_file(header, abstract, return_report=True)
        for v in tree.values():
            v.block_until_ready()
    return phase.result(bytes=report.io.bytes_read, requests=report.io.requests)


def _add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", required=True)
    parser.add_argument("--devices", type=int, default=1)


def _start_nginx(root: Path, prefix: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.read_text().format(root=root, port=port, prefix=prefix))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(prefix)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nginx did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nnx_save_remote_bench_"))
    (work / "www").mkdir()
    (work / "nginx").mkdir()
    sys.path.insert(0, str(HERE.parent / "src"))
    import nnx_save

    path = work / "www" / "model.safetensors"
    nnx_save.save_file(make_arrays(transformer_shapes(args.size_gb)), path)
    size = path.stat().st_size
    warm(path)
    proc, url = _start_nginx(work / "www", work / "nginx")
    try:
        rows = []
        for devices in (1, 8):
            for label, source in (("local file", str(path)), ("HTTP (nginx, loopback)", f"{url}/model.safetensors")):
                runs = [
                    run_fresh(__file__, "load", ["--source", source, "--devices", str(devices)], devices=devices)
                    for _ in range(args.repeat)
                ]
                bad = [r["error"] for r in runs if "error" in r]
                if bad:
                    raise SystemExit(f"{label}: {bad[0]}")
                secs = statistics.median(r["seconds"] for r in runs)
                rows.append(
                    {
                        "case": f"{devices} device{'s' if devices > 1 else ''}, dim 0" if devices > 1 else "1 device",
                        "source": label,
                        "seconds": secs,
                        "gbps": gb(size) / secs,
                        "rss": statistics.median(r["peak_above_kb"] for r in runs) * 1024 / size,
                        "requests": runs[0]["requests"],
                    }
                )
            local, http = rows[-2]["seconds"], rows[-1]["seconds"]
            rows[-1]["ratio"] = http / local
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"checkpoint {gb(size):.2f} GB, median of {args.repeat} fresh processes each; {page_cache_note(work)}")
    print(
        table(
            rows,
            [
                ("case", "case", ""),
                ("source", "source", ""),
                ("seconds", "seconds", ".2f"),
                ("gbps", "GB/s", ".2f"),
                ("rss", "peak RSS / file", ".2f"),
                ("requests", "requests", "d"),
                ("ratio", "HTTP / local", ".2f"),
            ],
        )
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if not worker_main({"load": load_worker}, _add):
        main()
