"""Saving from devices: device -> host copies started ahead of the
write under a byte budget, forced on the CPU backend by NNX_SAVE_FORCE_HOST_STAGING
(the testing aid), where the copies are real."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import threading
import types
import weakref
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx_save
from nnx_save import _config
from nnx_save.bridges._leaves import leaf_entry
from nnx_save.io._atomic import TMP_MARKER
from nnx_save.save import _background, _stage, _write

ROOT = Path(__file__).resolve().parents[2]
KIB = 1 << 10


@pytest.fixture(params=_config.SAVE_STAGING_KINDS)
def forced(request, monkeypatch):
    """The staged path on the CPU backend, into each kind of host memory (``numpy``
    aliases the CPU buffer: the bookkeeping runs, no byte moves; the memory kinds copy)."""
    monkeypatch.setenv(_config.FORCE_HOST_STAGING.name, "1")
    monkeypatch.setenv(_config.SAVE_STAGING.name, request.param)
    return request.param


class Live:
    """Counts the bytes of host copies alive: each copy made by ``_stage._copy_shard``
    adds its size, taken off once both the copy and the host array read from it
    (``Piece.host``, the block being written) are gone."""

    def __init__(self, monkeypatch, fail_at: int | None = None) -> None:
        self.now = self.peak = self.calls = 0
        self.lock = threading.Lock()
        self.holds: dict[int, tuple[int, list[int]]] = {}
        real_copy, real_host = _stage._copy_shard, _stage.Piece.host

        def copy(data, wanted):
            self.calls += 1
            if self.calls == fail_at:
                raise RuntimeError("injected copy failure")
            out = real_copy(data, wanted)
            n, holders = int(data.nbytes), [1]
            with self.lock:
                self.now += n
                self.peak = max(self.peak, self.now)
            self.holds[id(out)] = (n, holders)
            weakref.finalize(out, self._drop, n, holders)
            return out

        def host(piece, c):
            out = real_host(piece, c)
            n, holders = self.holds[id(c)]
            holders[0] += 1
            weakref.finalize(out, self._drop, n, holders)
            return out

        monkeypatch.setattr(_stage, "_copy_shard", copy)
        monkeypatch.setattr(_stage.Piece, "host", host)

    def _drop(self, n: int, holders: list[int]) -> None:
        with self.lock:
            holders[0] -= 1
            if not holders[0]:
                self.now -= n


def tensors(n: int, nbytes: int) -> dict:
    """``n`` single-device float32 arrays of ``nbytes`` each, distinct values."""
    return {f"t{i}": jnp.full((nbytes // 4,), i + 1, jnp.float32) for i in range(n)}


def mixed_tree() -> dict:
    mesh = jax.make_mesh((8,), ("x",))
    rows = jax.NamedSharding(mesh, jax.P("x"))
    cols = jax.NamedSharding(mesh, jax.P(None, "x"))
    return {
        "rows": jax.device_put(jnp.arange(64 * 24, dtype=jnp.float32).reshape(64, 24), rows),
        "cols": jax.device_put(jnp.arange(6 * 32, dtype=jnp.bfloat16).reshape(6, 32), cols),
        "repl": jax.device_put(jnp.arange(16, dtype=jnp.int8), jax.NamedSharding(mesh, jax.P())),
        "flags": jnp.array([True, False, True]),
        "scalar": jnp.float16(3.5),
        "host": np.arange(10, dtype=np.int64),
        "big": jnp.linspace(0, 1, 70_000, dtype=jnp.float32),
    }


# --- the bookkeeping -----------------------------------------------------------------------------


def test_window_starts_ahead_while_the_bytes_fit(forced, monkeypatch):
    sizes = [1, 1, 1, 3, 1]  # units of 64 KiB
    arrays = [jnp.zeros((s * 16 * KIB,), jnp.float32) for s in sizes]
    events = []
    real = _stage.Staged

    def staged(shape, dtype, pieces, wanted):
        events.append(("start", [x is pieces[0].shard.data for x in arrays].index(True)))
        return real(shape, dtype, pieces, wanted)

    monkeypatch.setattr(_stage, "Staged", staged)
    window = _stage.Window(arrays, [f"k{i}" for i in range(5)], int(2.5 * 64 * KIB), "f")
    for i in range(5):
        window.take(i, lambda c: c.assemble(), lambda: None)
        events.append(("take", i))
    # 0 and 1 fit in 2.5 units; 2 once 0 is written; 3 (3 units, over the budget) alone
    assert events == [
        ("start", 0), ("start", 1), ("take", 0),
        ("start", 2), ("take", 1),
        ("take", 2),
        ("start", 3), ("take", 3),
        ("start", 4), ("take", 4),
    ]  # fmt: skip
    assert window.peak == 3 * 64 * KIB  # the one tensor over the budget, alone


def test_cpu_arrays_are_not_copied_unless_forced(tmp_path, monkeypatch):
    monkeypatch.delenv(_config.FORCE_HOST_STAGING.name, raising=False)
    live = Live(monkeypatch)
    nnx_save.save_file(mixed_tree(), tmp_path / "a.safetensors")
    _background.snapshot([leaf_entry(("x",), jnp.ones(8))])
    assert live.calls == 0  # the CPU backend's zero-copy alias is kept


@pytest.mark.parametrize("text", ["0", "-5", "lots"])
def test_a_bad_budget_is_refused(tmp_path, monkeypatch, text):
    monkeypatch.setenv(_config.SAVE_INFLIGHT_BYTES.name, text)
    with pytest.raises(nnx_save.NnxSaveError, match=re.escape(f"{_config.SAVE_INFLIGHT_BYTES.name}={text!r}")):
        nnx_save.save_file({"w": np.ones(2)}, tmp_path / "w.safetensors")
    assert not os.listdir(tmp_path)


# --- bytes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 40 * KIB, 1 << 30])
def test_staged_saves_write_the_reference_bytes(tmp_path, monkeypatch, budget):
    tree = mixed_tree()
    nnx_save.save_file(tree, tmp_path / "ref.safetensors")  # the CPU path: no copies
    monkeypatch.setenv(_config.FORCE_HOST_STAGING.name, "1")
    monkeypatch.setenv(_config.SAVE_STAGING.name, "pinned_host")  # real copies on the CPU backend
    monkeypatch.setenv(_config.SAVE_INFLIGHT_BYTES.name, str(budget))
    live = Live(monkeypatch)
    nnx_save.save_file(tree, tmp_path / "staged.safetensors")
    handle = nnx_save.save_file(tree, tmp_path / "async.safetensors", blocking=False)
    handle.result(timeout=60)
    ref = (tmp_path / "ref.safetensors").read_bytes()
    assert (tmp_path / "staged.safetensors").read_bytes() == ref
    assert (tmp_path / "async.safetensors").read_bytes() == ref
    assert live.calls == 2 * (8 + 8 + 1 + 1 + 1 + 1)  # every replica-0 shard, twice: the path ran


# --- memory -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("budget", "expected"), [(1, 1), (600 * KIB, 2), (1 << 30, 8)])
def test_host_copies_alive_stay_within_the_budget(tmp_path, forced, monkeypatch, budget, expected):
    tree = tensors(8, 256 * KIB)
    live = Live(monkeypatch)
    _write.write_file(
        tmp_path / "v.safetensors",
        [leaf_entry((k,), v) for k, v in tree.items()],
        max_inflight_bytes=budget,
    )
    gc.collect()
    assert live.peak == expected * 256 * KIB  # one alone, two overlapped, or all: never more
    assert live.now == 0  # every copy freed once written
    got = nnx_save.load_file(tmp_path / "v.safetensors")
    assert all(np.array_equal(got[k], np.asarray(v)) for k, v in tree.items())


def test_tensors_over_half_the_budget_are_copied_in_row_blocks_within_it(tmp_path, forced, monkeypatch):
    """A 5 MiB tensor under a 4 MiB budget, and row-sharded shards of 3 MiB: each is
    copied in blocks of whole rows of at most half the budget, so the copies alive,
    the block being written included, stay within the budget."""
    mesh = jax.make_mesh((8,), ("x",))
    tree = {
        "big": jnp.arange(1283 * 1024, dtype=jnp.float32).reshape(1283, 1024),  # 1283 rows of 4 KiB
        "rows": jax.device_put(
            jnp.arange(8 * 750 * 1024, dtype=jnp.int32).reshape(8 * 750, 1024), jax.NamedSharding(mesh, jax.P("x"))
        ),
        "cols": jax.device_put(
            jnp.arange(4 * 64, dtype=jnp.float32).reshape(4, 64), jax.NamedSharding(mesh, jax.P(None, "x"))
        ),
        **{f"s{i}": v for i, v in tensors(3, 256 * KIB).items()},
    }
    nnx_save.save_file(tree, tmp_path / "ref.safetensors")  # the CPU path: no copies
    live = Live(monkeypatch)
    budget = 4 << 20
    _write.write_file(
        tmp_path / "v.safetensors", [leaf_entry((k,), v) for k, v in tree.items()], max_inflight_bytes=budget
    )
    gc.collect()
    assert live.calls == 3 + 8 * 2 + 8 + 3  # big in 3 blocks, each 3 MiB shard in 2, cols' shards whole
    assert 3 << 20 < live.peak <= budget
    assert live.now == 0
    assert (tmp_path / "v.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


@hypothesis.given(
    rows=st.integers(1, 5000), row=st.integers(1, 4096), cap=st.integers(1, 1 << 22), dims=st.integers(1, 3)
)
def test_row_blocks_cover_the_rows_once_in_order_each_within_the_cap(rows, row, cap, dims):
    shape = (rows, row) if dims == 2 else (rows, 1, row) if dims == 3 else (rows * row,)
    data = types.SimpleNamespace(shape=shape, ndim=len(shape), nbytes=rows * row)
    pieces = _stage.row_blocks(types.SimpleNamespace(data=data), cap)
    if rows * row <= cap or len(pieces) == 1:
        assert pieces == [_stage.Piece(pieces[0].shard)]
        assert rows * row <= cap or shape[0] < 2
        return
    total, per_row = shape[0], rows * row // shape[0]
    kept = [(p.start + p.skip, p.start + p.rows) for p in pieces]
    assert [a for a, _ in kept] == [0, *[b for _, b in kept[:-1]]] and kept[-1][1] == total  # once, in order
    assert len({p.rows for p in pieces}) == 1 and all(0 <= p.start <= total - p.rows for p in pieces)
    assert all(p.nbytes == p.rows * per_row <= max(cap, per_row) for p in pieces)
    assert all(p.skip == 0 for p in pieces[:-1])


def test_async_snapshot_bounds_the_copies_in_flight(tmp_path, forced, monkeypatch):
    tree = tensors(6, 256 * KIB)
    in_flight, peak = [0], [0]
    real_copy, real_wait = _stage._copy_shard, _stage.Staged.host_shards

    def copy(data, wanted):
        in_flight[0] += int(data.nbytes)
        peak[0] = max(peak[0], in_flight[0])
        return real_copy(data, wanted)

    def wait(self):
        out = real_wait(self)
        in_flight[0] -= self.nbytes
        return out

    monkeypatch.setattr(_stage, "_copy_shard", copy)
    monkeypatch.setattr(_stage.Staged, "host_shards", wait)
    entries = [leaf_entry((k,), v) for k, v in tree.items()]
    snap = _background.snapshot(entries, max_inflight_bytes=520 * KIB)
    assert peak[0] == 512 * KIB and in_flight[0] == 0  # two at a time, all completed
    assert [np.asarray(e.value()).tobytes() for e in snap] == [np.asarray(v).tobytes() for v in tree.values()]


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["copy", "wait"])
def test_a_failure_mid_save_keeps_the_previous_file_and_leaves_nothing(tmp_path, forced, monkeypatch, stage):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"old": np.arange(3.0)}, path)
    before = path.read_bytes()
    threads = set(threading.enumerate())
    live = Live(monkeypatch, fail_at=3 if stage == "copy" else None)
    if stage == "wait":
        real_wait, calls = _stage.Piece.host, [0]

        def wait(self, copy):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected copy failure")
            return real_wait(self, copy)

        monkeypatch.setattr(_stage.Piece, "host", wait)
    with pytest.raises(
        nnx_save.SaveError,
        match=re.escape(f"{path}: the device -> host copy of 't2' failed (RuntimeError: injected copy failure)"),
    ):
        _write.write_file(path, [leaf_entry((k,), v) for k, v in tensors(5, 64 * KIB).items()], None)
    gc.collect()
    assert path.read_bytes() == before
    assert not [p for p in os.listdir(tmp_path) if TMP_MARKER in p]
    assert set(threading.enumerate()) <= threads  # the hashing helper is gone too
    assert live.now == 0  # no copy outlives the failed save


# --- a fresh process ------------------------------------------------------------------------------

RSS_SCRIPT = """
import json, os, sys
import jax, jax.numpy as jnp
import nnx_save
from _common import Phase
if sys.argv[3] == "big":  # 128 MiB in one tensor: over the budget, copied in row blocks
    tree = {"big": jnp.ones((8192, 4096), jnp.float32)}
else:
    tree = {f"t{i:02d}": jnp.full((4 << 20,), i, jnp.float32) for i in range(16)}  # 16 x 16 MiB on the device
jax.block_until_ready(tree)
nnx_save.save_file({"warm": jnp.ones(4)}, os.path.join(sys.argv[1], "warm.safetensors"))
with Phase() as phase:
    handle = nnx_save.save_file(tree, os.path.join(sys.argv[1], "w.safetensors"), blocking=sys.argv[2] == "blocking")
    if handle is not None:  # an asynchronous save's snapshot holds every tensor until written
        handle.result()
print(json.dumps(phase.result()))
"""


def peak_growth(directory: Path, budget: int, mode: str, kind: str, tree: str = "many") -> int:
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]),
        # glibc raises its mmap threshold after the first 16 MiB block is freed and then
        # keeps freed blocks in per-thread arenas (XLA allocates on its own threads):
        # RSS would then count memory already freed (150-220 MiB here, run to run).
        # A fixed threshold returns each freed block to the kernel, so RSS is what is alive.
        MALLOC_MMAP_THRESHOLD_=str(1 << 20),
        **{
            _config.FORCE_HOST_STAGING.name: "1",
            _config.SAVE_INFLIGHT_BYTES.name: str(budget),
            _config.SAVE_STAGING.name: kind,
        },
    )
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(directory), mode, tree],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["peak_reset"], "cannot reset VmHWM here: the peak would include the arrays' creation"
    return result["peak_above_kb"] * KIB


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])  # real copies on the CPU backend
def test_peak_rss_of_a_staged_save_is_the_budget_not_the_checkpoint(tmp_path, kind):
    """256 MiB on the device, a 48 MiB budget: a save adds the budget (3 tensors of
    16 MiB) and no more than 10% over it. An asynchronous save's snapshot must hold
    every tensor: the same measure sees the whole checkpoint there."""
    bounded = peak_growth(tmp_path, 48 << 20, "blocking", kind)
    assert bounded <= (48 << 20) * 1.1, bounded
    snapshot = peak_growth(tmp_path, 48 << 20, "async", kind)
    assert snapshot >= 0.95 * (256 << 20), snapshot


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_peak_rss_of_a_tensor_over_the_budget_is_the_budget_not_the_tensor(tmp_path, kind):
    """One 128 MiB tensor, a 48 MiB budget: it goes in row blocks of at most half the
    budget left beside the writer's chunks (7 of 18.3 MiB, two in flight), so a save
    adds the budget and, on the CPU backend only, the device-side slices of the two
    blocks in flight (device memory is host memory there, not on an accelerator), no
    more than 10% over that; copied whole, the tensor alone would be 128 MiB."""
    block = 1171 * 4096 * 4
    bounded = peak_growth(tmp_path, 48 << 20, "blocking", kind, "big")
    assert bounded <= ((48 << 20) + 2 * block) * 1.1, bounded


def test_a_kind_the_device_lacks_is_numpy():
    class Bare:  # a backend without memory spaces
        def addressable_memories(self):
            raise RuntimeError("no memory spaces here")

    class DeviceOnly:
        def addressable_memories(self):
            return [types.SimpleNamespace(kind="device")]

    cpu = jax.devices()[0]
    assert [_stage.staging_kind(d, k) for d in (Bare(), DeviceOnly()) for k in _config.SAVE_STAGING_KINDS] == [
        "numpy"
    ] * 6
    assert [_stage.staging_kind(cpu, k) for k in _config.SAVE_STAGING_KINDS] == list(_config.SAVE_STAGING_KINDS)


def test_numpy_staging_copies_through_new_handles_never_the_callers_arrays(tmp_path, monkeypatch):
    """``numpy`` (also where a device lacks the kind asked for): each copy is started on
    a new handle of the shard's buffer, so the host copy dies with it; the caller's
    arrays never carry one (``copy_to_host_async`` on them would cache it there)."""
    tree = mixed_tree()
    nnx_save.save_file(tree, tmp_path / "ref.safetensors")
    monkeypatch.setenv(_config.FORCE_HOST_STAGING.name, "1")
    monkeypatch.setenv(_config.SAVE_STAGING.name, "pinned_host")
    monkeypatch.setattr(_stage, "staging_kind", lambda device, wanted: "numpy")  # a device without it
    callers = {id(s.data) for a in tree.values() if isinstance(a, jax.Array) for s in a.addressable_shards}
    callers |= {id(a) for a in tree.values()}
    issued = []
    real = type(tree["big"]).copy_to_host_async
    monkeypatch.setattr(type(tree["big"]), "copy_to_host_async", lambda self: issued.append(id(self)) or real(self))
    nnx_save.save_file(tree, tmp_path / "numpy.safetensors")
    assert len(issued) == 20  # every replica-0 shard
    assert not callers & set(issued)
    assert (tmp_path / "numpy.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
