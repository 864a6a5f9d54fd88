"""benchmarks/accelerator.py: ``--smoke`` runs every part on the
CPU backend and prints every row; absent peers and absent pinned memory print
``n/a`` with the reason instead of stopping the run."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import accelerator  # noqa: E402


def smoke(script: str, directory: Path, timeout: int, *extra: str) -> subprocess.CompletedProcess:
    """``benchmarks/<script> --smoke --dir <directory> *extra`` in a fresh process, against this tree's src."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--dir", str(directory), *extra],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_smoke_runs_every_row_on_cpu(tmp_path):
    out = smoke("accelerator.py", tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "jax backend cpu" in text
    number = r"\s+\d+\.\d{3}\s+\(\d+\.\d{3}-\d+\.\d{3}\)\s+\d+\.\d{2}"  # median (min-max) GB/s
    for name, label in accelerator.LABELS.items():
        assert re.search(re.escape(label) + number, text), f"{name}: no measured row in\n{text}"
    for target in ("target load >= 70% of min(read", "target load RSS growth", "target save >= 90% of write+fsync"):
        assert re.search(re.escape(target) + r".*: .*(PASS|FAIL)$", text, re.M), f"{target!r} missing in\n{text}"
    assert "n/a" not in text  # on CPU every peer and pinned_host are present: nothing skipped


@pytest.mark.slow
def test_the_save_probe_measures_every_staging_kind_on_cpu(tmp_path):
    import accelerator_probe

    out = smoke("accelerator_probe.py", tmp_path, 600, "--snapshots")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "backend cpu" in text
    number = r"\s+\d+\.\d{3}\s+\(\d+\.\d{3}-\d+\.\d{3}\)\s+\d+\.\d{2}\s+\d+\.\d{3}\s+\d+\.\d{3}\s+0\s+1$"
    for name in accelerator_probe.NAMES + accelerator_probe.SNAPSHOTS:  # every kind exists on CPU: none is n/a
        assert re.search(re.escape(name) + number, text, re.M), f"{name}: no measured row in\n{text}"
    for kind in accelerator_probe.KINDS:
        assert re.search(
            rf"^save {kind}: RSS\+ .* (PASS|FAIL); .* (PASS|FAIL); cached on caller's arrays 0$", text, re.M
        )


def args(**kw) -> argparse.Namespace:
    base = {"platform": "", "h2d_gb": 1 / 1024, "path": "", "dir": "", "shapes": "{}", "size_gb": 0.001}
    return argparse.Namespace(**{**base, **kw})


def test_a_device_without_pinned_memory_gives_na(monkeypatch):
    monkeypatch.setattr(accelerator, "memory_kinds", lambda dev: {"device"})
    row = accelerator.worker(args(worker="h2d_pinned"))
    assert re.fullmatch(r"device .* has no pinned_host memory \(kinds: \['device'\]\)", row["na"]), row
    assert "na" not in accelerator.worker(args(worker="h2d_pageable"))  # the pageable floor still runs


def test_a_missing_peer_gives_na_and_the_run_goes_on(monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint.experimental", None)  # makes the import fail
    row = accelerator.worker(args(worker="orbax"))
    assert row["na"].startswith("orbax is not installed ("), row
    rows = {"orbax": accelerator.summarise("orbax", [row])}
    assert "load: orbax v1 safetensors" in accelerator.render(list(rows.values()))
    assert f"n/a: {row['na']}" in accelerator.render(list(rows.values()))
    lines = accelerator.targets(rows, 1 << 30, 1 << 30)
    assert lines == [
        "target load >= 70% of min(read, pinned h2d): n/a (a floor or the load is missing)",
        "target load RSS growth <= max_inflight_bytes + 10%: n/a (no nnx_save load)",
        "target save >= 90% of write+fsync: n/a (the floor or the save is missing)",
    ]


def test_rows_report_the_median_and_spread():
    runs = [{"seconds": s, "peak_above_kb": kb, "nbytes": 10**9} for s, kb in ((3.0, 10), (1.0, 30), (2.0, 20))]
    row = accelerator.summarise("nnx_save", runs)
    assert (row["median"], row["min"], row["max"], row["gbps"]) == (2.0, 1.0, 3.0, 0.5)
    assert row["rss_max_gb"] == 30 * 1024 / 1e9
    lines = accelerator.targets(
        {
            "read": {**row, "gbps": 4.0},
            "h2d_pinned": {**row, "gbps": 0.6},
            "nnx_save": row,
        },
        1 << 30,
        1 << 30,
    )
    assert lines[0].endswith("= 0.42 GB/s: 0.50 GB/s PASS"), lines  # 70% of the slower floor


@pytest.mark.slow  # four Orbax saves and restores of a few hundred small tensors: ~20 s here
def test_the_store_benchmark_saves_and_restores_both_ways(tmp_path):
    """benchmarks/store.py: each worker runs one phase and checks what it restored;
    the table puts the store beside the manager."""
    import store as store_bench

    rows = {}
    for strategy in store_bench.STRATEGIES:
        for phase in store_bench.PHASES:
            ns = argparse.Namespace(worker=f"{strategy}:{phase}", path=str(tmp_path / strategy), size_gb=0.003)
            rows[(strategy, phase)] = [store_bench.worker(ns)]
    assert all(r[0]["seconds"] > 0 and r[0]["nbytes"] > 0 for r in rows.values())
    table = {(r["strategy"], r["phase"]): r for r in store_bench.summarise(rows)}
    assert table[("manager", "save")]["vs_time"] == table[("manager", "restore")]["vs_cpu"] == 1.0
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["1", "_nnx_save.lock", "_nnx_save_store.json"]


@pytest.mark.slow
def test_ported_smoke_measures_every_phase_on_both_layouts(tmp_path):
    """benchmarks/ported.py: ``--smoke`` builds a small HF Llama offline, runs
    every phase in a fresh process on one device and on 8, checks each model against the
    file, and prints every row and every target."""
    import ported

    out = smoke("ported.py", tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    number = r"\s+\d+\.\d{3}\s+\(\d+\.\d{3}-\d+\.\d{3}\)\s+\d+\.\d{2}\s+\d+\.\d{2}"  # median (min-max) cpu rss
    for layout in ported.LAYOUTS:
        for label in ported.LABELS.values():
            assert re.search(re.escape(layout) + r"\s+" + re.escape(label) + number, out.stdout), (label, out.stdout)
        for target in ("the best hand-written port (<= 0.8)", "read once + eval_shape (<= 1.25)", "(<= 1.05)"):
            assert re.search(f"^{layout}: .*{re.escape(target)}: (PASS|FAIL)$", out.stdout, re.M), (target, out.stdout)


def test_ported_targets_compare_medians():
    import ported

    def row(key, median, rss=1.0):
        return {"key": key, "layout": "1dev", "median": median, "rss": rss}

    rows = [row("nnx_save", 1.0, 1.02), row("host_T", 1.5), row("device_T", 1.2), row("read_once", 0.5)]
    rows.append(row("eval_shape", 0.4))
    assert ported.targets(rows) == [
        "1dev: 0.83x the best hand-written port (<= 0.8): FAIL",
        "1dev: 1.11x read once + eval_shape (<= 1.25): PASS",
        "1dev: peak RSS 1.02x the checkpoint (<= 1.05): PASS",
    ]
    runs = [
        {"seconds": s, "user_s": 1.0, "sys_s": 0.5, "peak_above_kb": kb} for s, kb in ((3.0, 10), (1.0, 30), (2.0, 20))
    ]
    summary = ported.summarise("host_T", "last", runs, 20 * 1024)
    assert (summary["median"], summary["spread"], summary["cpu"], summary["rss"]) == (2.0, "(1.000-3.000)", 1.5, 1.0)


def test_the_count_benchmark_checks_every_phase_and_judges_the_largest_count(tmp_path):
    """benchmarks/count.py: each worker loads and checks its tensors; the
    target compares nnx_save with numpy-only safe_open at the largest count."""
    import count

    path = count.ensure_file(tmp_path, 100)
    runs = {ph: [count.worker(argparse.Namespace(worker=ph, path=str(path)))] for ph in count.PHASES}
    assert all(r[0]["count"] == 100 and r[0]["seconds"] > 0 for r in runs.values())
    rows = [count.summarise(ph, 100, r) for ph, r in runs.items()]
    rows[0]["us"], rows[1]["us"] = 3.0, 2.0  # the target's arithmetic, on fixed numbers
    assert count.targets(rows) == ["100 tensors: nnx_save 1.50x safe_open (numpy) per tensor (<= 2): PASS"]


def test_the_lazy_benchmark_gathers_right_and_judges_its_targets(tmp_path):
    """benchmarks/lazy.py: each gather strategy reads the column slice and the block
    right (the worker checks, and exits otherwise); the targets' arithmetic."""
    import lazy

    args = argparse.Namespace(path=str(tmp_path / "w.safetensors"), rows=2048, cols=2048, repeat=1, calls=1)
    lazy._save(Path(args.path), args)
    times = lazy.gather_worker(args)["times"]
    assert set(times) == {
        "native copy from a map (SIGBUS caught)",
        "process_vm_readv from a map",
        "preadv over the span",
        "pread per run",
        "copy loaded from an mmap (unsafe)",
    }
    assert all(len(found) == 1 and found[0] > 0 for cases in times.values() for found in cases.values())
    warm = {name: {case: [1.0] for case in lazy.CASES} for name in ("safetensors", "nnx_save")}
    warm["nnx_save"]["element [5, 7]"] = [2.0]
    fresh = {"nnx_save": [{"seconds": 1.0}], "safetensors": [{"seconds": 2.0}]}
    lines = lazy.targets(warm, fresh)
    assert "warm element [5, 7]: 2.00x safetensors (<= 1.5): FAIL" in lines
    assert "warm rows [100:228, :]: 1.00x safetensors (<= 1.5): PASS" in lines
    assert lines[-1] == "fresh process, nnx_save: 0.50x safetensors (<= 1.0): PASS"


def test_the_pod_rates_compare_each_process_alone_and_together():
    """benchmarks/pod.py --rates: per process, its rate (bytes read / its own seconds)
    alone and together, their ratio, and whether the spreads overlap."""
    import pod

    def runs(*seconds: float) -> list[dict]:
        return [{"seconds": s, "cpu": 0.5, "bytes_read": 100e6, "requests": 8} for s in seconds]

    results = [
        {"alone 0": runs(1.0, 2.0, 1.25), "together": runs(1.25, 1.0, 2.5)},  # 80 MB/s both: overlap
        {"alone 1": runs(1.0, 1.0, 1.0), "together": runs(2.0, 2.0, 2.5)},  # 100 against 50: apart
    ]
    rows = pod._rate_rows(2, results, size=200e6)
    assert [(r["process"], r["phase"]) for r in rows] == [
        (0, "alone"),
        (0, "together (2)"),
        (1, "alone"),
        (1, "together (2)"),
    ]
    assert [r["rate"] for r in rows] == [80.0, 80.0, 100.0, 50.0]
    assert [r["read"] for r in rows] == [0.5] * 4
    assert (rows[0]["spread"], rows[0]["rate_spread"]) == ("1.00-2.00", "50-100")
    assert (rows[1]["vs_alone"], rows[1]["overlap"]) == (1.0, "yes")
    assert (rows[3]["vs_alone"], rows[3]["overlap"]) == (0.5, "NO")
