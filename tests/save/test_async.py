"""Asynchronous saves (``blocking=False``): snapshot semantics under buffer donation,
failures, the in-flight bound, wait_for_saves and reporting at interpreter exit.

Most tests hold the background writer at a gate (``gate``) until the caller has
moved on, so every write happens after the donations and mutations it must not see.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save import _config
from nnx_save.bridges._leaves import leaf_entry
from nnx_save.io._atomic import TMP_MARKER
from nnx_save.save import _background
from nnx_save.save import _write as _file  # the one-file writer the layouts call

SRC = Path(__file__).resolve().parents[2] / "src"


class Gate:
    """Holds every background write until :meth:`open`; counts writes started."""

    def __init__(self, write):
        self.event, self.started, self._write = threading.Event(), 0, write

    def __call__(self, *args, **kwargs):
        self.started += 1
        assert self.event.wait(30), "the gate was never opened"
        return self._write(*args, **kwargs)

    def open(self):
        self.event.set()


@pytest.fixture
def gate(monkeypatch):
    g = Gate(_file.write_file)
    monkeypatch.setattr(_file, "write_file", g)
    yield g
    g.open()
    _background._wait_all(30)
    with _background._lock:  # failures a test provoked on purpose are not reported at exit
        _background._uncollected.clear()


def _ramp(key, shape, dtype=jnp.float32):
    """A cheap, key-dependent initializer (random ones compile slowly on a busy machine)."""
    n = int(np.prod(shape))
    return (jnp.sin(jnp.arange(n, dtype=dtype) + jax.random.key_data(key)[-1].astype(dtype))).reshape(shape)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = {"kernel_init": _ramp, "bias_init": _ramp, "rngs": rngs}
        self.layers = nnx.List([nnx.Linear(16, 32, **init), nnx.Linear(32, 4, **init)])
        self.count = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


def _train_step(state, graphdef, x):
    """A cheap stand-in for an optimizer step (compiles in a fraction of a grad's
    time): every parameter moves, the int counter ticks; the state is donated."""
    params, rest = nnx.split_state(state, nnx.Param, ...)
    params = jax.tree.map(lambda p: p - 0.1 * jnp.tanh(p * x.mean()) + 0.01, params)
    rest = jax.tree.map(lambda c: c + 1, rest)
    return nnx.merge_state(params, rest)


_step = jax.jit(_train_step, static_argnums=1, donate_argnums=0)


def _run(steps: int, on_step):
    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    step = _step
    x = jnp.linspace(-1, 1, 8 * 16, dtype=jnp.float32).reshape(8, 16)
    for i in range(steps):
        on_step(i, graphdef, state)
        state = step(state, graphdef, x)
    return graphdef, state


def _flat_np(state) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.array(v.get_value()) for p, v in nnx.to_flat_state(state)}


def test_training_loop_with_donation_saves_the_state_of_each_step(tmp_path, gate, monkeypatch):
    monkeypatch.setenv(_config.MAX_ASYNC_SAVES.name, "100")  # every write waits at the gate until training ends
    handles, donated = {}, []

    def save(i, graphdef, state):
        if i % 3 == 0:
            model = nnx.merge(graphdef, state)
            handles[i] = nnx_save.save_model(model, tmp_path / f"step{i}.safetensors", blocking=False)
        else:
            donated.append(jax.tree.leaves(state)[0])  # to check that donation really frees buffers

    _run(10, save)
    assert isinstance(handles[0], nnx_save.SaveHandle) and not any(h.done() for h in handles.values())
    assert all(a.is_deleted() for a in donated[1:])  # the steps really donate their input
    gate.open()
    nnx_save.wait_for_saves()
    expected = {}  # replay without donation or saving, reading each state at its step
    _run(10, lambda i, g, s: expected.__setitem__(i, _flat_np(s)) if i % 3 == 0 else None)
    assert sorted(handles) == [0, 3, 6, 9]
    for i, h in handles.items():
        assert h.result() == tmp_path / f"step{i}.safetensors"
        got = nnx_save.load_file(h.result())
        assert sorted(got) == sorted(expected[i]) and len(got) == 5
        for k, v in expected[i].items():
            assert got[k].tobytes() == v.tobytes() and got[k].dtype == v.dtype, (i, k)
    assert not np.array_equal(expected[0]["layers/0/kernel"], expected[9]["layers/0/kernel"])


def test_a_lazy_reference_would_not_survive_donation():
    """Why a snapshot is needed: without one, the donated buffer is gone."""
    x = jnp.arange(1024, dtype=jnp.float32) + 1
    y = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    assert x.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(x)
    assert float(y[1]) == 4.0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's aliasing rule")
def test_cpu_snapshot_aliases_the_buffer_and_donation_then_copies():
    """On CPU the snapshot takes no copy: it aliases the device buffer, and PJRT
    refuses to donate a buffer that has an external reference."""
    x = jnp.arange(1 << 16, dtype=jnp.float32) * 3
    jax.block_until_ready(x)
    entry = leaf_entry(("x",), x)
    (snap,) = _background.snapshot([entry])
    host = snap.array.addressable_shards[0].data
    assert host.ctypes.data == x.unsafe_buffer_pointer()  # no copy
    y = jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    jax.block_until_ready(y)
    assert not x.is_deleted() and y.unsafe_buffer_pointer() != host.ctypes.data
    assert np.array_equal(snap.value(), np.arange(1 << 16, dtype=np.float32) * 3)


def test_sharded_and_numpy_leaves_keep_their_values(tmp_path, gate):
    mesh = jax.make_mesh((8,), ("x",))
    sharded = jax.device_put(jnp.arange(64.0).reshape(8, 8), jax.NamedSharding(mesh, jax.P("x")))
    replicated = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.P()))
    host = np.arange(6, dtype=np.int16)
    meta = {"note": "before"}
    path = tmp_path / "tree.safetensors"
    handle = nnx_save.save_file({"s": sharded, "r": replicated, "h": host}, path, metadata=meta, blocking=False)
    step = jax.jit(lambda a, b: (a * 0 - 1, b * 0 - 1), donate_argnums=(0, 1))
    sharded, replicated = step(sharded, replicated)
    host[:] = -7
    meta["note"] = "after"
    gate.open()
    assert handle.result() == path
    got = nnx_save.load_file(path)
    np.testing.assert_array_equal(got["s"], np.arange(64.0, dtype=np.float32).reshape(8, 8))
    np.testing.assert_array_equal(got["r"], np.arange(8.0, dtype=np.float32))
    np.testing.assert_array_equal(got["h"], np.arange(6, dtype=np.int16))
    assert nnx_save.read_header(path).files[0].metadata["note"] == "before"


def test_a_background_failure_raises_from_result_with_the_path(tmp_path, gate):
    directory = tmp_path / "gone"
    directory.mkdir()
    path = directory / "m.safetensors"
    handle = nnx_save.save_file({"w": jnp.ones(4)}, path, blocking=False)
    shutil.rmtree(directory)
    gate.open()
    assert handle.wait(30) and handle.done()
    with pytest.raises(nnx_save.SaveError, match=re.escape(f"{path}: cannot create a temporary file")):
        handle.result()
    with pytest.raises(nnx_save.SaveError):  # every call, not only the first
        handle.result()
    nnx_save.wait_for_saves()  # collected already: not raised again
    assert "failed" in repr(handle)


def test_wait_for_saves_raises_failures_nobody_collected_once(tmp_path, gate):
    good = nnx_save.save_file({"w": jnp.ones(2)}, tmp_path / "good.safetensors", blocking=False)
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    nnx_save.save_file({"w": jnp.ones(2)}, bad_dir / "bad.safetensors", blocking=False)
    with pytest.raises(TimeoutError, match="still running"):
        nnx_save.wait_for_saves(timeout=0.05)
    bad_dir.rmdir()
    gate.open()
    with pytest.raises(nnx_save.SaveError, match=re.escape(str(bad_dir / "bad.safetensors"))):
        nnx_save.wait_for_saves()
    nnx_save.wait_for_saves()
    assert good.result().is_file()


def test_in_flight_saves_are_bounded(tmp_path, gate, monkeypatch):
    monkeypatch.setenv(_config.MAX_ASYNC_SAVES.name, "2")
    first = [nnx_save.save_file({"w": jnp.ones(2)}, tmp_path / f"{i}.safetensors", blocking=False) for i in range(2)]
    returned = threading.Event()
    third = threading.Thread(
        target=lambda: (
            nnx_save.save_file({"w": jnp.ones(2)}, tmp_path / "2.safetensors", blocking=False),
            returned.set(),
        )
    )
    third.start()
    assert not returned.wait(0.5)  # waits for the oldest: two are in flight
    assert len(_background._unfinished()) == 2
    gate.open()
    third.join(30)
    assert returned.is_set() and all(h.result().is_file() for h in first)
    nnx_save.wait_for_saves()
    assert (tmp_path / "2.safetensors").is_file()


def test_a_bad_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(_config.MAX_ASYNC_SAVES.name, "0")
    with pytest.raises(nnx_save.NnxSaveError, match=re.escape("NNX_SAVE_MAX_ASYNC_SAVES='0': expected a positive")):
        nnx_save.save_file({"w": np.ones(2)}, tmp_path / "w.safetensors", blocking=False)


def test_a_blocking_save_lands_after_earlier_async_saves_to_the_path(tmp_path, gate):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.full(3, 1.0)}, path, blocking=False)
    blocking = threading.Thread(target=nnx_save.save_file, args=({"w": np.full(3, 2.0)}, path))
    blocking.start()
    blocking.join(0.3)
    assert blocking.is_alive()  # waiting for the asynchronous save
    gate.open()
    blocking.join(30)
    np.testing.assert_array_equal(nnx_save.load_file(path)["w"], np.full(3, 2.0))


def test_save_model_async_multi_file(tmp_path, gate):
    model = MLP(nnx.Rngs(1))
    want = _flat_np(nnx.state(model))
    handle = nnx_save.save_model(model, tmp_path / "ckpt", max_shard_size=1000, blocking=False)
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model)))
    gate.open()
    handle.result()
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    got = nnx_save.load_file(tmp_path / "ckpt")
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}


_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys, time
    import numpy as np
    import nnx_save
    from nnx_save.save import _write as _file  # the one-file writer the layouts call

    d = sys.argv[1]
    # Out of space: RLIMIT_FSIZE with SIGXFSZ ignored, so writes past 1 MiB fail with EFBIG.
    prev = os.path.join(d, "m.safetensors")
    nnx_save.save_file({"w": np.arange(16, dtype=np.float32)}, prev)
    before = open(prev, "rb").read()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    big = {"w": np.ones(1 << 20, np.float32)}
    try:
        nnx_save.save_file(big, prev, blocking=False).result()
        error = None
    except nnx_save.SaveError as e:
        error = str(e)
    nnx_save.save_file(big, os.path.join(d, "forgotten.safetensors"), blocking=False)  # never collected

    # Then leave while a slow save is still being written.
    write = _file.write_file
    def slow(*args, **kwargs):
        time.sleep(1.0)
        write(*args, **kwargs)
    _file.write_file = slow
    late = os.path.join(d, "late.safetensors")
    nnx_save.save_file({"w": np.arange(1000, dtype=np.float32)}, late, blocking=False)
    print(json.dumps({"error": error, "intact": open(prev, "rb").read() == before,
                      "late_exists_at_return": os.path.exists(late)}))
""")


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """One child process (starting jax dominates): a save out of space, a failure
    nobody collects, and an exit while a slow save is still being written."""
    directory = tmp_path_factory.mktemp("child")
    env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(directory)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return directory, proc, json.loads(proc.stdout.splitlines()[-1])


def test_out_of_space_in_the_background_keeps_the_previous_file_and_reports_at_exit(child):
    tmp_path, proc, out = child
    path = tmp_path / "m.safetensors"
    assert out["error"] == f"{path}: save failed (no space left on the device); the previous file, if any, is intact"
    assert out["intact"]
    assert not [n for n in os.listdir(tmp_path) if TMP_MARKER in n]
    forgotten = tmp_path / "forgotten.safetensors"
    assert f"the asynchronous save to {forgotten} failed and nobody collected its error" in proc.stderr
    assert str(path) + " failed" not in proc.stderr  # the collected one is not reported again


def test_interpreter_exit_waits_for_unfinished_saves(child):
    tmp_path, proc, out = child
    assert out["late_exists_at_return"] is False
    got = nnx_save.load_file(tmp_path / "late.safetensors", verify=True)
    np.testing.assert_array_equal(got["w"], np.arange(1000, dtype=np.float32))
    assert "late.safetensors failed" not in proc.stderr


def test_a_relative_path_is_where_it_was_at_the_call(tmp_path, gate, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    handle = nnx_save.save_file({"w": np.ones(2)}, "w.safetensors", blocking=False)
    assert handle.path == tmp_path / "a" / "w.safetensors"
    monkeypatch.chdir(tmp_path / "b")
    gate.open()
    assert handle.result() == tmp_path / "a" / "w.safetensors" and handle.result().is_file()
    assert os.listdir(tmp_path / "b") == []


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(_background, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0


def test_an_uncollected_failure_does_not_keep_its_snapshot_alive(tmp_path, monkeypatch):
    import gc
    import weakref

    seen = []

    def failing(path, entries, metadata, **options):
        seen.append(weakref.ref(entries[0].value()))  # the snapshot's private copy of the numpy leaf
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_file, "write_file", failing)
    handle = nnx_save.save_file({"w": np.ones(1000)}, tmp_path / "w.safetensors", blocking=False)
    assert handle.wait(30)
    gc.collect()
    assert seen and seen[0]() is None  # the error is kept, the state is not
    with pytest.raises(
        nnx_save.SaveError,
        match=re.escape(
            f"{tmp_path / 'w.safetensors'}: the asynchronous save failed (OSError: [Errno 28] No space left on device)"
        ),
    ):
        handle.result()
