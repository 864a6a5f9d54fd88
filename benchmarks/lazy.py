"""``nnx_save.safe_open`` against ``safetensors.safe_open(..., "np")``, side by side.

A fp32 matrix (``--rows`` x ``--cols``, 4096 x 4096 = 64 MiB by default) is saved once
with a small tensor before it; the page cache is warm (the file is read once first).

1. **Warm handle** (one process holding both libraries' open handles): rows
   ``[100:228, :]``, columns ``[:, 1000:1064]``, a 1024 x 1024 block, one element,
   the whole tensor, each as ``f.get_slice("w")[index]``. One warm-up round (the values
   checked, then three calls whose median sizes the rounds' call counts), then
   ``--repeat`` interleaved rounds (the libraries' order alternates round by round);
   a round's figure for a case is the mean of back-to-back calls (enough to take
   ~2 ms, at least one). nnx_save is timed with its default ``backend="mmap"`` (small
   local slices copied out of a memory map, large ones by the engine) and with
   ``backend="pread"`` (every read by the engine: the path all reads took before).
2. **Fresh process**: open + one column slice ``[:, 1000:1064]``, each run in a new
   process (the libraries alternate), with the peak RSS the phase added and the CPU
   seconds it took (user + sys: steadier than wall time on a shared machine); both
   libraries are imported before the phase starts (nnx_save's bytes read, ``f.io``,
   whose stats type is imported on first use, are asked for after it). The
   ``+ import`` rows time the library's import too (numpy is imported before, by
   both), from compiled bytecode as an installed package has it: the workers write
   and read theirs under a temporary ``PYTHONPYCACHEPREFIX`` (the warm-handle worker,
   run first, compiles it), even where ``PYTHONDONTWRITEBYTECODE`` is set, which
   would have every fresh process compile nnx_save's sources again.

3. **Gather strategies** (one process, warm page cache, ``--gather``): the ways to read
   the scattered runs of the column slice and of the block, each into a preallocated
   result, timed the same way as the warm handle: the native copy out of a private map
   whose SIGBUS is caught (what ``safe_open`` does where the extension was built; the
   first call drops its pages, the later ones keep them), ``process_vm_readv`` out of
   the map (what it does without the extension, for runs far apart), one ``preadv`` over
   the span with the gaps read into scratch (runs close together, without the
   extension), one ``pread`` per run, and a copy loaded straight out of a memory map
   (safetensors' way: the floor, and the one a truncating writer turns into SIGBUS).
   Two row ranges, one run each (64 KiB and 2 MiB), show where a single run is better
   copied out of the map than read (``load/_direct.MAP_COPY_BYTES``).

``--baseline DIR`` adds the fresh-process rows of another checkout (say, main's), run by
its own ``benchmarks/lazy.py`` against its own ``src/``, interleaved with these.

Every result is checked against the values it must hold. Medians with min-max.

    python benchmarks/lazy.py --repeat 9 [--gather] [--baseline ../main]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# numpy's BLAS threads spin for a while after import, on every core: their CPU time would
# fill the fresh-process CPU column of both libraries (the workers inherit this).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from _common import Phase, run_fresh, table, warm, worker_main

CASES = {
    "rows [100:228, :]": (slice(100, 228), slice(None)),
    "columns [:, 1000:1064]": (slice(None), slice(1000, 1064)),
    "block [1000:2024, 1000:2024]": (slice(1000, 2024), slice(1000, 2024)),
    "element [5, 7]": (5, 7),
    "whole tensor [...]": (Ellipsis,),
}
HANDLES = ("safetensors", "nnx_save", "nnx_save pread")


def _value(args: argparse.Namespace) -> np.ndarray:
    return np.arange(args.rows * args.cols, dtype=np.float32).reshape(args.rows, args.cols)  # value = flat index


def _open(name: str, path: str):
    if name == "safetensors":
        import safetensors

        return safetensors.safe_open(path, "np")
    import nnx_save

    return nnx_save.safe_open(path, "np", backend="pread" if name.endswith("pread") else "mmap")


def _time(handle, index, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        handle.get_slice("w")[index]
    return (time.perf_counter() - t0) / calls


def warm_worker(args: argparse.Namespace) -> dict:
    """Every case on warm handles of every library, interleaved round by round."""
    value = _value(args)
    handles = {name: _open(name, args.path) for name in HANDLES}
    calls: dict[tuple[str, str], int] = {}
    for case, index in CASES.items():  # the warm-up round: check values, size the call counts
        for name, handle in handles.items():
            if not np.array_equal(handle.get_slice("w")[index], value[index]):
                raise SystemExit(f"{name}: wrong values for {case}")
            # Sized on warm calls: the first calls may map pages, fault them in, or drop
            # them again (nnx_save's first gather of a tensor); timed once, that cost
            # would leave one call a round, each paying for the cache the others evicted.
            one = statistics.median(_time(handle, index, 1) for _ in range(3))
            calls[name, case] = max(1, int(2e-3 / max(one, 1e-7)))
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CASES} for n in HANDLES}
    for r in range(args.repeat):
        order = list(HANDLES) if r % 2 == 0 else list(reversed(HANDLES))
        for case, index in CASES.items():
            for name in order:
                times[name][case].append(_time(handles[name], index, calls[name, case]))
    return {"times": times}


def _fresh(args: argparse.Namespace, open_slice) -> dict:
    expected = _value(args)[:, 1000:1064]
    with Phase() as phase:
        got, handle = open_slice(args.path)()
    if not np.array_equal(got, expected):
        raise SystemExit("wrong values")
    read = handle.io.bytes_read if handle is not None else None  # after the clock: not part of open + slice
    return phase.result(bytes_read=read)


def _nnx_open(path: str):
    import nnx_save

    safe_open = nnx_save.safe_open  # the lazy import happens here (as safetensors' own)

    def run():
        with safe_open(path, "np") as f:
            return f.get_slice("w")[:, 1000:1064], f  # its counts outlive close()

    return run


def _safetensors_open(path: str):
    import safetensors

    def run():
        with safetensors.safe_open(path, "np") as f:
            return f.get_slice("w")[:, 1000:1064], None

    return run


def nnx_worker(args: argparse.Namespace) -> dict:
    run = _nnx_open(args.path)  # imported before the phase
    return _fresh(args, lambda path: run)


def safetensors_worker(args: argparse.Namespace) -> dict:
    run = _safetensors_open(args.path)
    return _fresh(args, lambda path: run)


def nnx_import_worker(args: argparse.Namespace) -> dict:
    return _fresh(args, _nnx_open)  # the import runs inside the phase


def safetensors_import_worker(args: argparse.Namespace) -> dict:
    return _fresh(args, _safetensors_open)


GATHERED = {
    "columns [:, 1000:1064]": CASES["columns [:, 1000:1064]"],
    "block": CASES["block [1000:2024, 1000:2024]"],
    # one run each, either side of load/_direct.MAP_COPY_BYTES (4 and 128 rows of 16 KiB)
    "rows, 64 KiB": (slice(100, 104), slice(None)),
    "rows, 2 MiB": CASES["rows [100:228, :]"],
}


def _strategies(path: str, begin: int, shape: tuple[int, ...]):
    """``name -> read(out, offsets, length)`` for each way of gathering runs."""
    import mmap
    import os

    from nnx_save.io import _mapped
    from nnx_save.io._mapped import MappedFile
    from nnx_save.io._reader import LocalReader
    from nnx_save.load import _direct

    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    mapped, reader = MappedFile(fd, size), LocalReader(path, fd)
    matrix = np.ndarray(shape, np.float32, mmap.mmap(fd, 0, access=mmap.ACCESS_READ), begin)

    def loaded(out, offsets, length, index):  # numpy loads from the map: SIGBUS if the file is truncated
        np.copyto(out, matrix[index])

    def vm_readv(out, offsets, length, index):  # the way an install without the native gather takes
        native, _mapped._native = _mapped._native, None
        try:
            return mapped.gather(out.ctypes.data, offsets, length)
        finally:
            _mapped._native = native

    ways = {"native copy from a map (SIGBUS caught)": lambda out, o, n, i: mapped.gather(out.ctypes.data, o, n)}
    return {
        **(ways if _mapped._native is not None else {}),
        "process_vm_readv from a map": vm_readv,
        "preadv over the span": lambda out, o, n, i: _direct._gather(reader, out.ctypes.data, o, n),
        "pread per run": lambda out, o, n, i: reader.read_runs(
            [out.ctypes.data + k * n for k in range(len(o))], [n] * len(o), o.tolist()
        ),
        "copy loaded from an mmap (unsafe)": loaded,
    }


def gather_worker(args: argparse.Namespace) -> dict:
    """Each way of gathering the runs of the column slice and the block, interleaved."""
    import nnx_save
    from nnx_save.format._boxes import box_runs
    from nnx_save.load._slices import slice_box

    value = _value(args)
    with nnx_save.safe_open(args.path) as f:
        begin = f.header.tensors["w"].begin
    strategies = _strategies(args.path, begin, value.shape)
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in GATHERED} for n in strategies}
    for r in range(args.repeat + 1):
        order = list(strategies) if r % 2 == 0 else list(reversed(strategies))
        for case, index in GATHERED.items():
            box, _ = slice_box(index, value.shape)
            offsets, length = box_runs(value.shape, 4, box, begin)
            for name in order:
                out = np.empty(value[index].shape, np.float32)
                calls = 1 if r == 0 else max(1, args.calls)
                t0 = time.perf_counter()
                for _ in range(calls):
                    strategies[name](out, offsets, length, index)
                if r == 0:  # the warm-up round: check the values
                    if not np.array_equal(out, value[index]):
                        raise SystemExit(f"{name}: wrong values for {case}")
                    continue
                times[name][case].append((time.perf_counter() - t0) / calls)
    return {"times": times}


def _gather_table(times: dict[str, dict[str, list[float]]]) -> str:
    floor = "copy loaded from an mmap (unsafe)"
    rows = []
    for name, cases in times.items():
        row: dict[str, object] = {"strategy": name}
        for case, found in cases.items():
            med, lo, hi = _spread(found)
            row[case] = f"{med:.3f} ({lo:.3f}-{hi:.3f})"
            row[case + " ratio"] = statistics.median(found) / statistics.median(times[floor][case])
        rows.append(row)
    columns = [("strategy", "gathering the runs (warm)", "")]
    for case in GATHERED:
        columns += [(case, f"{case} ms", ""), (case + " ratio", "/ mmap copy", ".1f")]
    return table(rows, columns)


FRESH = {
    "nnx_save": nnx_worker,
    "safetensors": safetensors_worker,
    "nnx_save + import": nnx_import_worker,
    "safetensors + import": safetensors_import_worker,
}


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default="")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument(
        "--baseline",
        default=None,
        help="another checkout (its benchmarks/lazy.py and src/): its fresh nnx_save rows, interleaved with these",
    )
    p.add_argument("--gather", action="store_true", help="also compare the ways of gathering scattered runs")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per round in the gather comparison")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")


def _save(path: Path, args: argparse.Namespace) -> None:
    import nnx_save

    nnx_save.save_file({"a_bias": np.ones(100, np.float32), "w": _value(args)}, path)


def _spread(values: list[float], scale: float = 1e3) -> tuple[float, float, float]:
    return statistics.median(values) * scale, min(values) * scale, max(values) * scale


def _warm_table(times: dict[str, dict[str, list[float]]]) -> str:
    rows = []
    for case in CASES:
        theirs = statistics.median(times["safetensors"][case])
        row: dict[str, object] = {"case": case}
        for name in HANDLES:
            med, lo, hi = _spread(times[name][case])
            row[name] = f"{med:.4f} ({lo:.4f}-{hi:.4f})"
        row["ratio"] = statistics.median(times["nnx_save"][case]) / theirs
        row["ratio pread"] = statistics.median(times["nnx_save pread"][case]) / theirs
        rows.append(row)
    columns = [("case", "warm handle, one call", "")]
    columns += [(name, f"{name} ms", "") for name in HANDLES]
    columns += [("ratio", "nnx_save / safetensors", ".2f"), ("ratio pread", "pread / safetensors", ".2f")]
    return table(rows, columns)


def _fresh_table(runs: dict[str, list[dict]]) -> str:
    rows = []
    for name, found in runs.items():
        ok = [r for r in found if "error" not in r]
        if not ok:
            rows.append({"strategy": name, "note": found[0]["error"]})
            continue
        med, lo, hi = _spread([r["seconds"] for r in ok])
        cpu, cpu_lo, cpu_hi = _spread([r["user_s"] + r["sys_s"] for r in ok])
        read = ok[0]["bytes_read"]
        rss = statistics.median(r["peak_above_kb"] for r in ok) / 1024
        rows.append(
            {
                "strategy": name,
                "wall": f"{med:.2f} ({lo:.2f}-{hi:.2f})",
                "cpu": f"{cpu:.1f} ({cpu_lo:.1f}-{cpu_hi:.1f})",
                "median": med,
                "read": read / 1e3 if read else None,
                "rss": rss,
            }
        )
    peers = {r["strategy"]: r.get("median") for r in rows}
    for r in rows:
        theirs = peers.get(r["strategy"].replace("nnx_save", "safetensors"))
        r["ratio"] = r["median"] / theirs if r["strategy"].startswith("nnx_save") and theirs and "median" in r else None
    columns = [
        ("strategy", "fresh process: open + [:, 1000:1064]", ""),
        ("wall", "median ms (min-max)", ""),
        ("cpu", "CPU ms (min-max)", ""),
        ("ratio", "wall / safetensors", ".2f"),
        ("read", "KB read", ".0f"),
        ("rss", "peak RSS added MiB", ".1f"),
    ]
    return table(rows, columns)


def targets(times: dict[str, dict[str, list[float]]], fresh: dict[str, list[dict]]) -> list[str]:
    """One PASS / FAIL line per target: every warm case <= 1.5x safetensors, the
    fresh-process open + slice <= 1.0x, and with the import <= 2x (medians)."""
    lines = []
    for case in CASES:
        ratio = statistics.median(times["nnx_save"][case]) / statistics.median(times["safetensors"][case])
        lines.append(f"warm {case}: {ratio:.2f}x safetensors (<= 1.5): {'PASS' if ratio <= 1.5 else 'FAIL'}")
    for ours, bound in (("nnx_save", 1.0), ("nnx_save + import", 2.0)):
        mine = [r["seconds"] for r in fresh.get(ours, []) if "error" not in r]
        theirs = [r["seconds"] for r in fresh.get(ours.replace("nnx_save", "safetensors"), []) if "error" not in r]
        if mine and theirs:
            ratio = statistics.median(mine) / statistics.median(theirs)
            verdict = "PASS" if ratio <= bound else "FAIL"
            lines.append(f"fresh process, {ours}: {ratio:.2f}x safetensors (<= {bound}): {verdict}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the workers import compiled bytecode, as installed
        os.environ["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        path = Path(tmp) / "lazy.safetensors"
        _save(path, args)
        warm(path)
        forward = [f"--path={path}", f"--rows={args.rows}", f"--cols={args.cols}", f"--repeat={args.repeat}"]
        hot = run_fresh(__file__, "warm", forward)
        gathered = run_fresh(__file__, "gather", [*forward, f"--calls={args.calls}"]) if args.gather else None
        runs = {name: (__file__, name) for name in FRESH}
        if args.baseline:  # the same workers of the other checkout, against its own src/
            other = str(Path(args.baseline) / "benchmarks" / "lazy.py")
            runs |= {f"{name} (baseline)": (other, name) for name in FRESH if name.startswith("nnx_save")}
        fresh: dict[str, list[dict]] = {name: [] for name in runs}
        for r in range(args.repeat):
            for name in list(fresh) if r % 2 == 0 else list(reversed(fresh)):
                src = Path(args.baseline) / "src" if name.endswith("(baseline)") else None
                fresh[name].append(run_fresh(runs[name][0], runs[name][1], forward, src=src))
    mb = args.rows * args.cols * 4 / 2**20
    print(f"get_slice of a {args.rows}x{args.cols} fp32 matrix ({mb:.0f} MiB), page cache warm, {args.repeat} rounds\n")
    print(_warm_table(hot["times"]) if "times" in hot else f"warm handle: {hot['error']}")
    print()
    print(_fresh_table(fresh))
    if "times" in hot:
        print()
        print("\n".join(targets(hot["times"], fresh)))
    if gathered is not None:
        print()
        print(_gather_table(gathered["times"]) if "times" in gathered else f"gather: {gathered['error']}")


if __name__ == "__main__":
    if worker_main({"warm": warm_worker, "gather": gather_worker, **FRESH}, _arguments):
        sys.exit()
    main()
