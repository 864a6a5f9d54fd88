"""Accelerator benchmark: the machine's floors, then loads and saves
of a bf16 Llama-shaped checkpoint on device 0, in one run.

    PYTHONPATH=src python benchmarks/accelerator.py [--size-gb 8] [--repeat 2] [--dir DIR]
    PYTHONPATH=src python benchmarks/accelerator.py --smoke      # CPU, seconds, tiny sizes

Every measurement runs in a FRESH PROCESS (``_common.run_fresh``), started with the
machine's own jax backend (``--platform``: the default backend, or ``cpu``; ``--smoke``
forces the CPU backend), and the repeats are interleaved over the strategies, so
drift in the machine's load hits them alike. Each row gives the median over the
repeats with the spread (min-max).

Floors:

- ``read``: ``--threads`` threads ``os.preadv`` the checkpoint (page cache warm)
  into one aligned host buffer, each its own contiguous part, 64 MiB per call.
- ``h2d pinned``: ``jax.device_put`` of a ``--h2d-gb`` buffer (2 GiB) that lives in
  the device's ``pinned_host`` memory (``SingleDeviceSharding(dev,
  memory_kind="pinned_host")``) onto the device's default memory; best of 3 in the
  process. A device without ``pinned_host`` gives ``n/a`` and the reason.
- ``h2d pageable``: the same from a numpy buffer (``may_alias=False``, so the CPU
  backend copies too).
- ``write+fsync``: ``os.write`` of the save size from a host buffer, then ``fsync``.

Loads of the checkpoint onto device 0 (``SingleDeviceSharding``), up to every array
being ready: ``nnx_save`` (``load_file(path, abstract, max_inflight_bytes=...)``),
``safe_open`` (``safe_open(path, "numpy")`` + ``jax.device_put`` per tensor),
``st_flax`` (``safetensors.flax.load_file``) and ``orbax`` (orbax v1 ``ocp.load``
with the safetensors layout, as in ``benchmarks/load.py``). Peak host RSS growth is
measured above the RSS once the backend is up (``_common.Phase``). After the clock a
sample of tensors is compared bit for bit with the file.

Saves of ``--save-gb`` of bf16 arrays made on the device: ``nnx_save``
(``save_file``: atomic, fsync, checksums) and ``st_flax``
(``safetensors.flax.save_file`` then ``fsync``).

``--smoke`` also sets ``NNX_SAVE_STREAM=1`` and ``NNX_SAVE_FORCE_HOST_STAGING=1`` for
the workers (the library's testing aids), so nnx_save loads through its streaming
path and saves through its staged device -> host copies, as on an accelerator.

Targets, PASS/FAIL beside the numbers: load >= 70% of min(read floor,
pinned h2d floor); load RSS growth <= ``max_inflight_bytes`` + 10%; save >= 90% of
the write+fsync floor. They are accelerator targets: on the CPU backend jax arrays
are host memory, so the RSS target cannot hold for a checkpoint above the budget
and the table says which backend ran. A peer that is not installed prints
``n/a: <reason>``; the run goes on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402

FLOORS = ("read", "h2d_pinned", "h2d_pageable", "write_fsync")
LOADS = ("nnx_save", "safe_open", "st_flax", "orbax")
SAVES = ("nnx_save_save", "st_flax_save")
PARTS = ("floors", "loads", "saves")
GiB = 1 << 30
CHUNK = 64 << 20


class NotAvailable(Exception):
    """A strategy this machine cannot run (a peer not installed, no pinned memory)."""


# ----------------------------------------------------------------------------- checkpoint


def llama_shapes(size_gb: float, d: int = 4096, ffn: int = 14336, vocab: int = 128256, kv: int = 1024) -> dict:
    """A Llama-shaped bf16 state of about ``size_gb`` GB: embedding, layers of 9
    tensors (q, k, v, o, gate, up, down, two norms), final norm and head."""
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * vocab * d - d) / per_layer))
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (ffn, d),
                p + "mlp.up_proj.weight": (ffn, d),
                p + "mlp.down_proj.weight": (d, ffn),
            }
        )
    shapes.update({"model.norm.weight": (d,), "lm_head.weight": (vocab, d)})
    return shapes


def shape_args(args: argparse.Namespace) -> dict:
    return {"d": args.d_model, "ffn": args.ffn, "vocab": args.vocab, "kv": args.kv}


def ensure_checkpoint(path: Path, shapes: dict) -> None:
    """Write a deterministic bf16 checkpoint (finite values, distinct per tensor) once."""
    sys.path.insert(0, str(HERE.parent / "src"))
    from nnx_save.format._header import encode_header

    head, _ = encode_header([(k, "BF16", s) for k, s in shapes.items()])
    size = len(head) + 2 * sum(math.prod(s) for s in shapes.values())
    if path.exists() and path.stat().st_size == size:
        with open(path, "rb") as f:
            if f.read(len(head)) == head:
                return
    print(f"generating {path} ({size / 1e9:.2f} GB, {len(shapes)} tensors)", file=sys.stderr)
    # bf16 bit patterns 0x3000-0x3fff: finite, positive, below 2; one random block
    # rotated per tensor keeps generation at disk speed
    block = np.random.default_rng(0).integers(0x3000, 0x4000, CHUNK // 2, dtype=np.uint16)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for i, shape in enumerate(shapes.values()):
            left, shift = math.prod(shape), (i * 7919) % len(block)
            rolled = np.roll(block, shift)
            while left:
                n = min(left, len(rolled))
                f.write(rolled[:n].tobytes())
                left -= n
    tmp.rename(path)


# ----------------------------------------------------------------------------- workers (children)


def _jax(args: argparse.Namespace):
    """Start jax on the asked platform; returns (jax, device 0)."""
    if args.platform:
        os.environ["JAX_PLATFORMS"] = args.platform
    import jax

    dev = jax.local_devices()[0]
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32), dev))  # the backend is up
    return jax, dev


def memory_kinds(dev) -> set[str]:
    """The memory kinds ``dev`` offers (empty where the backend has no memory spaces)."""
    try:
        return {m.kind for m in dev.addressable_memories()}
    except Exception:  # older backends raise their own error types here
        return set()


def read_floor(args: argparse.Namespace) -> dict:
    size = os.path.getsize(args.path)
    raw = np.empty(size + 64, np.uint8)
    buf = raw[-raw.ctypes.data % 64 :][:size]
    fd = os.open(args.path, os.O_RDONLY)
    parts = np.linspace(0, size, args.threads + 1).astype(np.int64) // 4096 * 4096
    parts[-1] = size

    def read(begin: int, end: int) -> None:
        for pos in range(begin, end, CHUNK):
            n = min(CHUNK, end - pos)
            if os.preadv(fd, [memoryview(buf[pos : pos + n])], pos) != n:
                raise EOFError(args.path)

    try:
        with _common.Phase() as phase:
            threads = [threading.Thread(target=read, args=(int(a), int(b))) for a, b in itertools.pairwise(parts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        os.close(fd)
    return phase.result(nbytes=size)


def h2d_floor(args: argparse.Namespace) -> dict:
    jax, dev = _jax(args)
    kinds = memory_kinds(dev)
    n = int(args.h2d_gb * GiB)
    target = jax.sharding.SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)
    if args.worker == "h2d_pinned":
        if "pinned_host" not in kinds:
            raise NotAvailable(f"device {dev} has no pinned_host memory (kinds: {sorted(kinds) or 'none'})")
        src = jax.device_put(np.ones(n, np.uint8), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
        put = lambda: jax.device_put(src, target)  # noqa: E731
    else:
        src = np.ones(n, np.uint8)
        put = lambda: jax.device_put(src, target, may_alias=False)  # noqa: E731
    jax.block_until_ready(src)
    best = None
    for _ in range(3):
        with _common.Phase() as phase:
            out = jax.block_until_ready(put())
        del out
        best = phase if best is None or phase.seconds < best.seconds else best
    return best.result(nbytes=n, kinds=sorted(kinds), platform=dev.platform)


def write_floor(args: argparse.Namespace) -> dict:
    n = int(args.save_bytes)
    buf = memoryview(np.ones(min(n, 256 << 20), np.uint8))
    path = Path(args.dir) / "write-floor.bin"
    try:
        with _common.Phase() as phase:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                done = 0
                while done < n:
                    done += os.write(fd, buf[: min(len(buf), n - done)])
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return phase.result(nbytes=n)


def _peer(name: str):
    """Import a peer's module, or say why it cannot run."""
    try:
        if name == "safe_open":
            from safetensors import safe_open

            return safe_open
        if name.startswith("st_flax"):
            import safetensors.flax

            return safetensors.flax
        if name == "orbax":
            from orbax.checkpoint.experimental import v1

            return v1
        import nnx_save

        return nnx_save
    except ImportError as e:
        raise NotAvailable(f"{name} is not installed ({e})") from None


def _load(name: str, module, path: str, abstract: dict, sharding, jax, inflight: int):
    if name == "nnx_save":
        return module.load_file(path, abstract, max_inflight_bytes=inflight)
    if name == "safe_open":
        with module(path, "numpy") as f:
            return {k: jax.device_put(f.get_tensor(k), sharding) for k in f.keys()}  # noqa: SIM118
    if name == "st_flax":
        return module.load_file(path)  # jnp arrays on the default device: device 0
    ctx = module.Context()
    ctx.checkpoint_layout = "safetensors"
    with ctx:
        return module.load(path, abstract)


def _verify(result: dict, path: str, dev, sample: int = 8) -> None:
    from safetensors import safe_open

    keys = sorted(result)
    with safe_open(path, "numpy") as f:
        assert sorted(f.keys()) == keys, "key set differs"
        for k in keys[:: max(1, len(keys) // sample)]:
            assert result[k].devices() == {dev}, (k, result[k].devices())
            assert np.asarray(result[k]).tobytes() == f.get_tensor(k).tobytes(), k


def load_worker(args: argparse.Namespace) -> dict:
    module = _peer(args.worker)
    jax, dev = _jax(args)
    header = _common_header(args.path)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    abstract = {k: jax.ShapeDtypeStruct(s, jax.numpy.bfloat16, sharding=sharding) for k, s in header.items()}
    with _common.Phase() as phase:
        result = jax.block_until_ready(_load(args.worker, module, args.path, abstract, sharding, jax, args.inflight))
    _verify(result, args.path, dev)
    return phase.result(nbytes=os.path.getsize(args.path), platform=dev.platform)


def _common_header(path: str) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: tuple(v["shape"]) for k, v in header.items()}


def save_worker(args: argparse.Namespace) -> dict:
    module = _peer(args.worker)
    jax, dev = _jax(args)
    shapes, total = {}, 0
    for k, s in llama_shapes(args.size_gb, **json.loads(args.shapes)).items():
        if total + 2 * math.prod(s) > args.save_bytes and shapes:
            continue
        shapes[k], total = s, total + 2 * math.prod(s)
    with jax.default_device(dev):
        keys = jax.random.split(jax.random.key(0), len(shapes))
        tree = {k: jax.random.uniform(r, s, jax.numpy.bfloat16) for r, (k, s) in zip(keys, shapes.items(), strict=True)}
    jax.block_until_ready(tree)
    path = Path(args.dir) / f"save-{args.worker}.safetensors"
    try:
        with _common.Phase() as phase:
            if args.worker == "nnx_save_save":
                module.save_file(tree, path)
            else:
                module.save_file(tree, str(path))
                _fsync(path)
        key = max(shapes, key=lambda k: math.prod(shapes[k]))
        from safetensors import safe_open

        with safe_open(str(path), "numpy") as f:
            assert f.get_tensor(key).tobytes() == np.asarray(tree[key]).tobytes(), key
    finally:
        path.unlink(missing_ok=True)
    return phase.result(nbytes=total, platform=dev.platform)


def _fsync(path: Path) -> None:
    for target in (path, path.parent):
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def worker(args: argparse.Namespace) -> dict:
    try:
        if args.worker == "read":
            return read_floor(args)
        if args.worker.startswith("h2d"):
            return h2d_floor(args)
        if args.worker == "write_fsync":
            return write_floor(args)
        if args.worker in LOADS:
            return load_worker(args)
        return save_worker(args)
    except NotAvailable as e:
        return {"na": str(e)}


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    for name in ("--path", "--dir", "--platform", "--shapes"):
        p.add_argument(name, default="")
    for name in ("--h2d-gb", "--size-gb"):
        p.add_argument(name, type=float, default=0.0)
    for name in ("--threads", "--inflight", "--save-bytes"):
        p.add_argument(name, type=int, default=0)


# ----------------------------------------------------------------------------- parent


def run_all(names: list[str], args: argparse.Namespace, path: Path) -> dict[str, list[dict]]:
    """Every name ``--repeat`` times, interleaved; each in a fresh process."""
    extra = [
        *("--path", str(path), "--dir", str(args.dir), "--platform", args.platform),
        *("--shapes", json.dumps(shape_args(args)), "--size-gb", str(args.size_gb)),
        *("--h2d-gb", str(args.h2d_gb), "--threads", str(args.threads), "--inflight", str(args.max_inflight_bytes)),
        *("--save-bytes", str(int(args.save_gb * 1e9))),
    ]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(args.repeat):
        for name in names:
            if name in ("read", *LOADS):
                _common.warm(path)
            _common.sync()
            r = _common.run_fresh(__file__, name, extra, timeout=args.timeout, platform=args.platform or None)
            runs[name].append(r)
            print(f"run {i + 1}/{args.repeat} {name:<13} {_brief(r)}", file=sys.stderr, flush=True)
    return runs


def _brief(r: dict) -> str:
    if "na" in r or "error" in r:
        return f"n/a: {r['na']}" if "na" in r else f"ERROR {r['error']}"
    return f"{r['seconds']:.3f} s, peak +{r['peak_above_kb'] / 1e3:.0f} MB"


def summarise(name: str, rs: list[dict]) -> dict:
    """Median and spread (min-max) of the seconds; GB/s and RSS growth at the median run."""
    bad = next((r for r in rs if "na" in r or "error" in r), None)
    if bad is not None:
        return {"name": name, "na": bad.get("na") or f"error: {bad['error']}"}
    secs = sorted(r["seconds"] for r in rs)
    median = statistics.median(secs)
    nbytes = rs[0]["nbytes"]
    return {
        "name": name,
        "median": median,
        "min": secs[0],
        "max": secs[-1],
        "gbps": nbytes / median / 1e9,
        "rss_gb": statistics.median(r["peak_above_kb"] for r in rs) * 1024 / 1e9,
        "rss_max_gb": max(r["peak_above_kb"] for r in rs) * 1024 / 1e9,
        "nbytes": nbytes,
        "runs": len(rs),
        "platform": rs[0].get("platform", "host"),
    }


LABELS = {
    "read": "floor: preadv into one buffer",
    "h2d_pinned": "floor: h2d from pinned_host",
    "h2d_pageable": "floor: h2d from pageable",
    "write_fsync": "floor: write + fsync",
    "nnx_save": "load: nnx_save.load_file",
    "safe_open": "load: safe_open + device_put",
    "st_flax": "load: safetensors.flax",
    "orbax": "load: orbax v1 safetensors",
    "nnx_save_save": "save: nnx_save.save_file",
    "st_flax_save": "save: safetensors.flax + fsync",
}


def render(rows: list[dict]) -> str:
    lines = [f"{'what':<32} {'median s':>9} {'(min-max)':>17} {'GB/s':>7} {'GB':>7} {'RSS+ GB':>8} {'runs':>4}"]
    lines.append("-" * len(lines[0]))
    for r in rows:
        if "na" in r:
            lines.append(f"{LABELS[r['name']]:<32} n/a: {r['na']}")
            continue
        spread = f"({r['min']:.3f}-{r['max']:.3f})"
        lines.append(
            f"{LABELS[r['name']]:<32} {r['median']:>9.3f} {spread:>17} {r['gbps']:>7.2f} {r['nbytes'] / 1e9:>7.3f} "
            f"{r['rss_gb']:>8.3f} {r['runs']:>4}"
        )
    return "\n".join(lines)


def targets(rows: dict[str, dict], inflight: int, save_budget: int) -> list[str]:
    """The targets, PASS/FAIL with their numbers (n/a where a number is missing)."""
    ok = {k: r for k, r in rows.items() if "na" not in r}
    out = []
    floors = [ok[k]["gbps"] for k in ("read", "h2d_pinned") if k in ok]
    load = ok.get("nnx_save")
    if load and len(floors) == 2:
        need = 0.7 * min(floors)
        out.append(
            f"target load >= 70% of min(read {floors[0]:.2f}, pinned h2d {floors[1]:.2f} GB/s) = {need:.2f} GB/s: "
            f"{load['gbps']:.2f} GB/s {'PASS' if load['gbps'] >= need else 'FAIL'}"
        )
    else:
        out.append("target load >= 70% of min(read, pinned h2d): n/a (a floor or the load is missing)")
    if load:
        cap = 1.1 * inflight / 1e9
        out.append(
            f"target load RSS growth <= max_inflight_bytes + 10% = {cap:.3f} GB ({load['platform']} backend): "
            f"{load['rss_max_gb']:.3f} GB (worst run) {'PASS' if load['rss_max_gb'] <= cap else 'FAIL'}"
        )
    else:
        out.append("target load RSS growth <= max_inflight_bytes + 10%: n/a (no nnx_save load)")
    save, floor = ok.get("nnx_save_save"), ok.get("write_fsync")
    if save and floor:
        need = 0.9 * floor["gbps"]
        out.append(
            f"target save >= 90% of write+fsync {floor['gbps']:.2f} GB/s = {need:.2f} GB/s: "
            f"{save['gbps']:.2f} GB/s {'PASS' if save['gbps'] >= need else 'FAIL'}"
        )
        cap = 1.1 * save_budget / 1e9
        out.append(
            f"save RSS growth <= NNX_SAVE_SAVE_INFLIGHT_BYTES + 10% = {cap:.3f} GB: "
            f"{save['rss_max_gb']:.3f} GB (worst run) {'PASS' if save['rss_max_gb'] <= cap else 'FAIL'}"
        )
    else:
        out.append("target save >= 90% of write+fsync: n/a (the floor or the save is missing)")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the whole run on the CPU backend, tiny sizes, seconds")
    p.add_argument("--size-gb", type=float, default=8.0, help="checkpoint size (bf16, Llama-shaped)")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--kv", type=int, default=1024, help="k/v projection rows (grouped-query attention)")
    p.add_argument("--save-gb", type=float, default=4.0, help="bytes of device arrays saved")
    p.add_argument("--h2d-gb", type=float, default=2.0, help="GiB moved by the host->device floors")
    p.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="read floor threads")
    p.add_argument("--max-inflight-bytes", type=int, default=2 * GiB, help="nnx_save.load_file's budget")
    p.add_argument("--repeat", type=int, default=2, help="fresh processes per row, interleaved")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--strategies", default=",".join(LOADS), help="which loads (saves follow nnx_save / st_flax)")
    p.add_argument("--platform", default="", help="JAX_PLATFORMS for the workers (default: jax's choice)")
    p.add_argument("--dir", default="", help="where the checkpoint is generated and kept (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per fresh process")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if args.smoke:
        args.platform, args.size_gb, args.save_gb, args.h2d_gb, args.repeat = "cpu", 0.004, 0.002, 1 / 256, 1
        args.d_model, args.ffn, args.vocab, args.kv, args.max_inflight_bytes = 128, 448, 1024, 64, 1 << 20
    return args


def names_for(args: argparse.Namespace) -> list[str]:
    parts, loads = args.parts.split(","), [s for s in args.strategies.split(",") if s]
    bad = (set(parts) - set(PARTS)) | (set(loads) - set(LOADS))
    if bad:
        raise SystemExit(f"unknown parts or strategies {sorted(bad)}: parts {PARTS}, strategies {LOADS}")
    names = list(FLOORS) if "floors" in parts else []
    names += loads if "loads" in parts else []
    names += [s for s in SAVES if "saves" in parts and s.removesuffix("_save") in ("nnx_save", *loads)]
    return names


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    names = names_for(args)
    if args.smoke:  # the testing aids: nnx_save's accelerator paths (streamed load, staged save) on CPU too
        os.environ.update({"NNX_SAVE_STREAM": "1", "NNX_SAVE_FORCE_HOST_STAGING": "1"})
    with tempfile.TemporaryDirectory(prefix="nnx_save-accel-") as tmp:
        args.dir = args.dir or tmp
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        path = Path(args.dir) / f"llama-bf16-{args.size_gb:g}GB-d{args.d_model}.safetensors"
        ensure_checkpoint(path, llama_shapes(args.size_gb, **shape_args(args)))
        note = _common.page_cache_note(args.dir)
        t0 = time.perf_counter()
        runs = run_all(names, args, path)
        rows = {n: summarise(n, rs) for n, rs in runs.items()}
        count = len(_common_header(str(path)))
    platform = next((r["platform"] for r in rows.values() if r.get("platform", "host") != "host"), "?")
    print(
        f"\naccelerator benchmark: {path.name} ({count} tensors), jax backend {platform}, "
        f"{args.repeat} interleaved fresh-process runs per row (median, min-max), {time.perf_counter() - t0:.0f} s"
    )
    print(f"page cache: {note}\n")
    print(render(list(rows.values())))
    print()
    print("\n".join(targets(rows, args.max_inflight_bytes, _save_budget())))
    if args.json:
        Path(args.json).write_text(json.dumps(list(rows.values()), indent=1))


def _save_budget() -> int:
    text = os.environ.get("NNX_SAVE_SAVE_INFLIGHT_BYTES", "")
    return int(text) if text.isdigit() else GiB


if __name__ == "__main__":
    if not _common.worker_main(dict.fromkeys(FLOORS + LOADS + SAVES, worker), add_worker_arguments):
        main()
