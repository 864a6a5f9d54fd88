"""A process forked while an asynchronous save runs: DataLoader-style
fork workers inherit the pending handle but not the writer thread, so a child that waited
on it would hang at its next blocking save or at exit. After ``os.fork`` the child's async
state starts empty; the parent's handles fail at once in the child, and the parent
finishes its save. Each scenario runs in a fresh interpreter, bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import nnx_save

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import numpy as np
    import nnx_save
    from nnx_save.save import _background
    from nnx_save.bridges._pytree import save_file

    out, gate = sys.argv[1], threading.Event()

    def slow_write(path, entries):  # the parent's background write waits for the fork
        gate.wait(30)
        from nnx_save.layouts._registry import plan_save
        plan_save(None).write_now(path, entries)

    from nnx_save.bridges._leaves import flatten, leaf_entry
    pairs, _ = flatten({"w": np.arange(4, dtype=np.float32)})
    handle = _background.start(os.path.join(out, "parent.safetensors"), [leaf_entry(p, v) for p, v in pairs],
                          slow_write)
    pid = os.fork()
    if pid == 0:  # the child: a blocking save, wait_for_saves, the inherited handle, then a normal exit
        signal.alarm(45)  # a hanging child must not outlive the test
        result = {}
        save_file({"c": np.ones(3, np.float32)}, os.path.join(out, "child.safetensors"))
        result["child_saved"] = True
        nnx_save.wait_for_saves(timeout=10)
        result["waited"] = True
        try:
            handle.result(timeout=10)
        except nnx_save.SaveError as e:
            result["inherited"] = str(e)
        h2 = save_file({"d": np.zeros(2, np.float32)}, os.path.join(out, "child_async.safetensors"), blocking=False)
        result["child_async"] = str(h2.result(timeout=10))
        with open(os.path.join(out, "child.json"), "w") as f:
            json.dump(result, f)
        sys.exit(0)  # runs the exit hooks: they must not wait for the parent's save
    time.sleep(0.5)
    gate.set()
    print(json.dumps({"parent": str(handle.result(timeout=30)), "child_status": os.waitpid(pid, 0)[1]}))
    """
)


def test_a_child_forked_during_an_async_save_neither_hangs_nor_inherits_the_save(tmp_path):
    """A child that waited on the parent's pending handle would hang in its blocking
    save and again at exit; this run would then hit the timeout."""
    proc = subprocess.run(
        [sys.executable, "-W", "ignore::RuntimeWarning", "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parent == {"parent": str(tmp_path / "parent.safetensors"), "child_status": 0}
    child = json.loads((tmp_path / "child.json").read_text())
    assert child["child_saved"] and child["waited"]
    assert child["inherited"] == (
        f"{tmp_path / 'parent.safetensors'}: this process was forked while the asynchronous save was running; "
        "the parent process finishes it, this one cannot wait for it"
    )
    assert child["child_async"] == str(tmp_path / "child_async.safetensors")
    assert nnx_save.load_file(tmp_path / "parent.safetensors")["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert np.array_equal(nnx_save.load_file(tmp_path / "child.safetensors")["c"], np.ones(3, np.float32))
