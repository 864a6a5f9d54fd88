"""A store's asynchronous save outlives the process's end: a normal exit,
``sys.exit``, an uncaught exception and ``SIGTERM`` each finish the pending step
(it is listed and restores exactly afterwards), and a step that cannot be finished
ends the process with a non-zero status and a message naming it. Each path runs in
a child process whose commit is slowed, so the save is surely in flight at the end."""

from __future__ import annotations

import gc
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore

SRC = pathlib.Path(nnx_save.__file__).resolve().parents[1]  # the child imports the nnx_save under test

CHILD = textwrap.dedent(
    """
    import faulthandler, os, sys, time
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from nnx_save.checkpoint import OrbaxCheckpointStore

    directory, mode = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(40, exit=True)  # a hang shows every thread's stack
    finalize = ocp.CheckpointManager._finalize_checkpoint

    def slow_finalize(self, step):
        time.sleep(1.0)  # the commit is still to come when the process starts to end
        if mode == "fail":
            raise OSError(28, "No space left on device")
        return finalize(self, step)

    ocp.CheckpointManager._finalize_checkpoint = slow_finalize
    store = OrbaxCheckpointStore(directory)
    store.save(7, {"model": {"w": jnp.arange(4096, dtype=jnp.float32) * 0.5}}, blocking=False)
    print("saved", flush=True)
    if mode == "exit":
        sys.exit(0)
    if mode == "raise":
        raise RuntimeError("the training loop crashed")
    if mode == "sigterm":
        for _ in range(600):  # a loop running Python, as training does: a signal that reaches another
            time.sleep(0.1)  # thread interrupts no sleep, Python runs the handler at the next bytecode
    """
)


def _child(tmp_path: pathlib.Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt"), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(child: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail(f"the child hung at exit: {child.communicate()[1][-8000:]}")
    return child.returncode, err


def _assert_step_restores(tmp_path: pathlib.Path) -> None:
    with OrbaxCheckpointStore(tmp_path / "ckpt") as store:
        assert store.list_steps() == [7]
        restored = store.restore(7).items["model"]["w"]
    np.testing.assert_array_equal(np.asarray(restored), np.arange(4096, dtype=np.float32) * 0.5)


@pytest.mark.parametrize(("mode", "status"), [("normal", 0), ("exit", 0), ("raise", 1)])
def test_a_pending_async_step_is_committed_at_interpreter_exit(tmp_path, mode, status):
    code, err = _finish(_child(tmp_path, mode))
    assert code == status, err[-2000:]
    assert "cannot schedule new futures" not in err
    _assert_step_restores(tmp_path)


def test_sigterm_commits_the_pending_async_step_then_ends_by_the_signal(tmp_path):
    child = _child(tmp_path, "sigterm")
    assert child.stdout is not None and child.stdout.readline() == "saved\n"
    child.send_signal(signal.SIGTERM)
    code, err = _finish(child)
    assert code == -signal.SIGTERM, err[-2000:]
    _assert_step_restores(tmp_path)


def test_an_async_step_that_cannot_be_committed_at_exit_fails_the_process_naming_it(tmp_path):
    code, err = _finish(_child(tmp_path, "fail"))
    assert code == 1, err[-2000:]
    assert f"the asynchronous checkpoint step 7 in {tmp_path / 'ckpt'} was not committed" in err
    assert "No space left on device" in err


def test_the_exit_hook_lets_go_of_a_settled_store(tmp_path):
    """While a step is in flight the exit hook holds the store (so it can finish it) and
    handles SIGTERM; once the step settles both are let go: the store can be collected."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the hook takes SIGTERM only over the default
    try:
        store = OrbaxCheckpointStore(tmp_path)
        store.save(1, {"model": {"w": jnp.ones(3)}}, blocking=False)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        alive = weakref.ref(store)
        del store
        gc.collect()
        store = alive()
        assert store is not None  # held while its step is in flight
        store.wait_until_finished()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        store.close()
        del store
        gc.collect()
        assert alive() is None
    finally:
        signal.signal(signal.SIGTERM, previous)
