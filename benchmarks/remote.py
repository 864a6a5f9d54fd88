"""Loads from HTTP and S3, and saves to S3, against what a user would write instead.

A HuggingFace-style checkpoint (fp32, several files and ``model.safetensors.index.json``)
is served three ways on 127.0.0.1: nginx with ``limit_rate`` per connection (as object
stores and CDNs cap each stream), nginx uncapped, and moto's S3 server
(tests/s3_server.py). On each, side by side, every load in a fresh process, the
contenders interleaved, median of ``--repeat`` with the spread (min-max), CPU seconds and
peak RSS above the process's baseline, over the checkpoint's size. Each worker imports
what it uses before its phase (nnx_save: its front door, which imports the engine on
first use, and its HTTP or S3 client), so no contender's time holds its imports:

- ``nnx_save``: ``load_file(url)`` (the directory's URL; ``s3://`` through obstore),
  its default options; on S3 also with ``read_chunk_bytes=128 MiB`` (one request per
  file here), as moto's server copies the whole object out for each ranged GET.
- ``download, then load``: every file downloaded in one stream each (all at once) to
  a local directory, then ``safetensors.numpy.load_file`` on each.
- ``runai-model-streamer``: its ``SafetensorsStreamer`` over the ``s3://`` files (it
  reads local files and object stores, not HTTP URLs); skipped when not installed.
- ``floor: N GETs``: ``N`` threads of ranged GETs of 16 MiB straight into one
  preallocated buffer per file (urllib3, ``readinto``), the best ``N`` of 16 and 32:
  the rate the link gives to the simplest parallel reader, decoding nothing.

Saves to S3: ``nnx_save.save_file(tree, "s3://...")`` from memory against boto3's
``upload_file`` (multipart, ``--boto3-concurrency`` threads, 16 MiB parts) of the same
bytes from a local file.

``--shard-mib N`` cuts the checkpoint as HuggingFace does (files of N MiB, the last one
smaller) instead of ``--files`` equal ones; ``--baseline DIR`` adds ``nnx_save (baseline)``
rows: the same worker importing nnx_save from another checkout's ``DIR/src``, interleaved.

    python benchmarks/remote.py [--size-gb 0.4] [--repeat 3] [--cap 100m]
    python benchmarks/remote.py --only capped --cap 10m --shard-mib 160 --baseline ../main
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from _common import Phase, gb, make_arrays, page_cache_note, run_fresh, table, transformer_shapes, worker_main

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
NGINX_CONF = TESTS / "remote" / "nginx.conf"
FLOOR_RANGE = 16 << 20
FLOOR_N = (16, 32)
PART = 16 << 20


# ----------------------------------------------------------------------------- workers (fresh processes)


def _import_nnx_save():
    """nnx_save with the modules a load or save imports on first use (the front door and the
    HTTP client), imported before the phase as every other contender's are."""
    import jax  # noqa: F401  (a JAX program has it imported before it loads; the load uses it)
    import urllib3  # noqa: F401  (imported by the floor's and the download's workers before theirs)

    import nnx_save

    return nnx_save.load_file, nnx_save.save_file


def nnx_worker(args: argparse.Namespace) -> dict:
    load_file, _ = _import_nnx_save()
    with Phase() as phase:
        chunk = {"read_chunk_bytes": args.chunk_mib << 20} if args.chunk_mib else {}
        _tree, report = load_file(args.url, return_report=True, **chunk)  # numpy: no device to wait for
    return phase.result(bytes=report.io.bytes_read, requests=report.io.requests)


def _download(url: str, path: Path) -> None:
    import urllib3

    with urllib3.PoolManager().request("GET", url, preload_content=False) as r, open(path, "wb") as f:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
        shutil.copyfileobj(r, f, 16 << 20)


def download_worker(args: argparse.Namespace) -> dict:
    from safetensors.numpy import load_file

    files = json.loads(args.files)
    where = Path(tempfile.mkdtemp(prefix="nnx_save_download_"))
    try:
        with Phase() as phase:
            threads = [
                threading.Thread(target=_download, args=(url, where / f"{i}.safetensors"))
                for i, url in enumerate(files)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            tree = {}
            for i in range(len(files)):
                tree.update(load_file(where / f"{i}.safetensors"))
        return phase.result(bytes=sum(v.nbytes for v in tree.values()), requests=len(files))
    finally:
        shutil.rmtree(where, ignore_errors=True)


def runai_worker(args: argparse.Namespace) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    paths = json.loads(args.files)
    with Phase() as phase:
        tree = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(paths)
            for name, tensor in streamer.get_tensors():
                tree[name] = tensor  # owned (the default): valid for as long as it is held
    return phase.result(bytes=sum(t.nbytes for t in tree.values()), requests=0)


def _size(pool, url: str) -> int:
    r = pool.request("GET", url, headers={"Range": "bytes=0-0"}, preload_content=False)
    r.release_conn()
    return int(r.headers["Content-Range"].split("/")[1])


def floor_worker(args: argparse.Namespace) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import urllib3

    files = json.loads(args.files)
    pool = urllib3.PoolManager(maxsize=args.n)
    sizes = [_size(pool, url) for url in files]

    def get(url: str, view: memoryview, begin: int) -> None:
        r = pool.request("GET", url, headers={"Range": f"bytes={begin}-{begin + len(view) - 1}"}, preload_content=False)
        raw, done = r._fp, 0  # http.client's response: reads from the socket into the buffer
        while done < len(view):
            n = raw.readinto(view[done:])
            if not n:
                raise RuntimeError(f"{url}: short body")
            done += n
        r.release_conn()

    with Phase() as phase:
        buffers = [np.empty(size, np.uint8) for size in sizes]
        jobs = [
            (url, memoryview(buf)[at : at + FLOOR_RANGE], at)
            for url, buf, size in zip(files, buffers, sizes, strict=True)
            for at in range(0, size, FLOOR_RANGE)
        ]
        with ThreadPoolExecutor(args.n) as ex:
            list(ex.map(lambda job: get(*job), jobs))
    return phase.result(bytes=sum(sizes), requests=len(jobs))


def save_nnx_worker(args: argparse.Namespace) -> dict:
    import obstore  # noqa: F401  (the S3 client, as boto3's worker imports boto3 before its phase)

    _, save_file = _import_nnx_save()
    tree = make_arrays(transformer_shapes(args.size_gb))
    with Phase() as phase:
        save_file(tree, args.url)
    return phase.result(bytes=sum(v.nbytes for v in tree.values()))


def save_boto3_worker(args: argparse.Namespace) -> dict:
    import boto3
    from boto3.s3.transfer import TransferConfig

    import nnx_save

    bucket, key = args.url.removeprefix("s3://").split("/", 1)
    local = Path(tempfile.mkdtemp(prefix="nnx_save_boto3_")) / "model.safetensors"
    nnx_save.save_file(make_arrays(transformer_shapes(args.size_gb)), local)  # the same bytes, before the phase
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    config = TransferConfig(
        multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=args.n, use_threads=True
    )
    try:
        with Phase() as phase:
            client.upload_file(str(local), bucket, key, Config=config)
        return phase.result(bytes=local.stat().st_size)
    finally:
        shutil.rmtree(local.parent, ignore_errors=True)


WORKERS = {
    "nnx": nnx_worker,
    "download": download_worker,
    "runai": runai_worker,
    "floor": floor_worker,
    "save-nnx": save_nnx_worker,
    "save-boto3": save_boto3_worker,
}


def _add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="")
    parser.add_argument("--files", default="[]")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--chunk-mib", type=int, default=0)
    parser.add_argument("--size-gb", type=float, default=0.4)


# ----------------------------------------------------------------------------- servers


def _start_nginx(root: Path, prefix: Path, cap: str) -> tuple[subprocess.Popen, str]:
    """nginx serving ``root``; paths under ``/capped/`` at ``cap`` per connection."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = NGINX_CONF.read_text().format(root=root, port=port, prefix=prefix)
    conf = conf.replace("max_ranges 1;", f"max_ranges 1;\n        location /capped/ {{ limit_rate {cap}; }}")
    conf = conf.replace(f"access_log {prefix}/access.log ranges;", "access_log off;")
    (prefix / "nginx.conf").write_text(conf)
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    proc = subprocess.Popen(
        [nginx, "-c", str(prefix / "nginx.conf"), "-p", str(prefix)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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


def _s3(directory: Path):
    """moto's server, a bucket holding the checkpoint; ``(generator, client, bucket)``."""
    sys.path.insert(0, str(TESTS))
    import boto3
    from boto3.s3.transfer import TransferConfig
    from s3_server import start_s3

    servers = start_s3()
    server = next(servers)
    os.environ.update(
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
    )
    client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=8)
    for path in sorted(directory.iterdir()):
        client.upload_file(str(path), bucket, f"ckpt/{path.name}", Config=config)
    return servers, client, bucket


# ----------------------------------------------------------------------------- the parent


def _contenders(kind: str, url: str, files: list[str], s3_files: list[str], runai: bool) -> list[tuple[str, str, list]]:
    """``(label, worker, args)`` per contender on one source."""
    rows = [
        ("nnx_save", "nnx", ["--url", url]),
        ("download, then load", "download", ["--files", json.dumps(files)]),
    ]
    if kind == "s3":  # moto copies the whole object out for every ranged GET: fewer, larger ranges win there
        rows.append(("nnx_save, read_chunk_bytes=128 MiB", "nnx", ["--url", url, "--chunk-mib", "128"]))
    if kind == "s3" and runai:
        rows.append(("runai-model-streamer", "runai", ["--files", json.dumps(s3_files)]))
    rows += [(f"floor: {n} GETs", "floor", ["--files", json.dumps(files), "--n", str(n)]) for n in FLOOR_N]
    return rows


def _summary(runs: list[dict], size: int) -> dict:
    """Medians of the runs that completed; a failed run is counted and its error kept."""
    bad = [r["error"] for r in runs if "error" in r]
    runs = [r for r in runs if "error" not in r]
    if not runs:
        return {"error": bad[0]}
    secs = [r["seconds"] for r in runs]
    return {
        "seconds": statistics.median(secs),
        "spread": f"{min(secs):.2f}-{max(secs):.2f}",
        "gbps": gb(size) / statistics.median(secs),
        "rss": statistics.median(r["peak_above_kb"] for r in runs) * 1024 / size,
        "cpu": statistics.median(r["user_s"] + r["sys_s"] for r in runs),
        "requests": runs[0].get("requests", 0),
        "failed": f"{len(bad)}: {bad[0][:80]}" if bad else "",
    }


def _has_runai() -> bool:
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gb", type=float, default=0.4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--files", type=int, default=4, help="files of the checkpoint")
    parser.add_argument("--cap", default="100m", help="nginx limit_rate per connection on the capped source")
    parser.add_argument("--boto3-concurrency", type=int, default=16)
    parser.add_argument("--only", default="", help="comma list of sources: capped,uncapped,s3,save")
    parser.add_argument(
        "--shard-mib", type=int, default=0, help="files of at most this size, the last one smaller (HF's way)"
    )
    parser.add_argument("--baseline", help="another checkout: its src/'s nnx_save as one more row, interleaved")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nnx_save_remote_bench_"))
    for d in ("www/free/ckpt", "nginx"):
        (work / d).mkdir(parents=True)
    (work / "www" / "capped").symlink_to(work / "www" / "free")
    sys.path.insert(0, str(HERE.parent / "src"))
    import nnx_save

    shapes = transformer_shapes(args.size_gb)
    tree = make_arrays(shapes)
    ckpt = work / "www" / "free" / "ckpt"
    shard = args.shard_mib << 20 or sum(v.nbytes for v in tree.values()) // args.files + 1
    nnx_save.save_file(tree, ckpt, max_shard_size=shard)
    del tree
    names = sorted(p.name for p in ckpt.iterdir() if p.suffix == ".safetensors")
    size = sum((ckpt / n).stat().st_size for n in names)
    proc, base = _start_nginx(work / "www", work / "nginx", args.cap)
    servers = client = None
    bucket = ""
    try:
        if not args.only or {"s3", "save"} & set(args.only.split(",")):  # moto only where it is used
            servers, client, bucket = _s3(ckpt)
        results = _run(args, base, client, bucket, names)
    finally:
        proc.terminate()
        proc.wait(10)
        if servers is not None:
            servers.close()
    rows = []
    for (label, contender), runs in results.items():
        rows.append({"source": label, "contender": contender, **_summary(runs, size)})
    _ratios(rows)
    print(
        f"checkpoint {gb(size):.2f} GB in {len(names)} files + index, median of {args.repeat} fresh processes "
        f"each (interleaved); {page_cache_note(work)}"
    )
    if not _has_runai():
        print("runai-model-streamer: not installed (pip install runai-model-streamer runai-model-streamer-s3)")
    for row in rows:
        if "error" in row or row.get("failed"):
            print(f"{row['source']} / {row['contender']}: failed runs: {row.get('error') or row['failed']}")
    print(
        table(
            [r for r in rows if "error" not in r],
            [
                ("source", "source", ""),
                ("contender", "contender", ""),
                ("seconds", "median s", ".2f"),
                ("spread", "min-max s", ""),
                ("gbps", "GB/s", ".2f"),
                ("rss", "peak RSS / ckpt", ".2f"),
                ("cpu", "CPU s", ".2f"),
                ("ratio", "nnx_save / this", ".2f"),
            ],
        )
    )
    shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, base: str, client, bucket: str, names: list[str]) -> dict:
    """Every contender on every source, ``args.repeat`` rounds, interleaved."""
    presigned = [
        client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": f"ckpt/{n}"}, ExpiresIn=7200)
        for n in names
        if client is not None
    ]
    sources = {
        "capped": (
            f"HTTP, nginx limit_rate {args.cap}",
            f"{base}/capped/ckpt",
            [f"{base}/capped/ckpt/{n}" for n in names],
        ),
        "uncapped": ("HTTP, nginx uncapped", f"{base}/free/ckpt", [f"{base}/free/ckpt/{n}" for n in names]),
        "s3": ("S3 (moto server)", f"s3://{bucket}/ckpt", presigned),
    }
    only = set(args.only.split(",")) if args.only else {*sources, "save"}
    s3_files = [f"s3://{bucket}/ckpt/{n}" for n in names]
    baseline = Path(args.baseline) / "src" if args.baseline else None
    plan = [
        (label, contender, worker, wargs, None)
        for kind, (label, url, files) in sources.items()
        if kind in only
        for contender, worker, wargs in _contenders(kind, url, files, s3_files, _has_runai())
    ]
    if baseline is not None:  # main's nnx_save beside this checkout's, on every source
        plan += [(label, f"{c} (baseline)", w, a, baseline) for label, c, w, a, _ in plan if w == "nnx"]
    saves = [
        ("nnx_save save_file(s3://)", "save-nnx", []),
        (f"boto3 upload_file ({args.boto3_concurrency} threads)", "save-boto3", ["--n", str(args.boto3_concurrency)]),
    ]
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.repeat):  # interleaved: every contender once per round
        for label, contender, worker, wargs, src in plan:
            results.setdefault((label, contender), []).append(run_fresh(__file__, worker, wargs, timeout=900, src=src))
        for contender, worker, wargs in saves if "save" in only else ():
            key = f"s3://{bucket}/save-{worker}-{r}/model.safetensors"
            sargs = [*wargs, "--url", key, "--size-gb", str(args.size_gb)]
            results.setdefault(("save to S3 (moto server)", contender), []).append(
                run_fresh(__file__, worker, sargs, timeout=900)
            )
    return results


def _ratios(rows: list[dict]) -> None:
    """Per source, nnx_save's median over each contender's."""
    for row in rows:
        mine = next(
            (
                r
                for r in rows
                if r["source"] == row["source"] and r["contender"].startswith("nnx_save") and "seconds" in r
            ),
            None,
        )
        if mine is not None and "seconds" in row:
            row["ratio"] = mine["seconds"] / row["seconds"]


if __name__ == "__main__":
    if not worker_main(WORKERS, _add):
        main()
