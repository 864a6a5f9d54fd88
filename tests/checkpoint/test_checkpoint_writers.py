"""One writer per store directory: a second writer, in this process or
another, is refused with a DirectoryLockedError naming the holder; no step is replaced or
lost; an asynchronous save in flight survives other stores opening; a dead holder is taken
over. And SIGTERM handlers that chain (item 3), whatever the order stores open and close."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnx_save.checkpoint import CheckpointNotFoundError, CheckpointNotWrittenError, OrbaxCheckpointStore
from nnx_save.errors import DirectoryLockedError
from nnx_save.io import _lock
from nnx_save.io._lock import LOCK_NAME, Holder, WriterLock, process_start


def tree(value: float) -> dict:
    return {"model": {"w": jnp.full((8,), value, jnp.float32)}}


def stored(directory, step: int) -> list[float]:
    with OrbaxCheckpointStore(directory) as reader:
        return np.asarray(reader.restore(step).items["model"]["w"]).tolist()


def refusal(directory, pid: int) -> str:
    return f"{directory} is being written by OrbaxCheckpointStore in process {pid} on host "


# -- two store objects, one process ------------------------------------------------------


def test_a_second_store_is_refused_and_replaces_no_step(tmp_path):
    first, second = OrbaxCheckpointStore(tmp_path), OrbaxCheckpointStore(tmp_path)
    assert first.list_steps() == second.list_steps() == []  # both looked before either wrote
    first.save(1, tree(1.0))
    for step in [2, 1] * 5:  # 10 of 10 refused, a new step and the held one alike
        with pytest.raises(DirectoryLockedError, match=re.escape(refusal(tmp_path, os.getpid()))) as refused:
            second.save(step, tree(99.0))
        assert refused.value.directory == str(tmp_path) and f"process {os.getpid()}" in refused.value.holder
    with pytest.raises(DirectoryLockedError):
        second.delete(1)
    first.save(2, tree(2.0))  # the writer goes on; its view was never stale
    assert (stored(tmp_path, 1), stored(tmp_path, 2)) == ([1.0] * 8, [2.0] * 8)
    first.close()
    # The holder is gone; the second store's refusal reads the disk, not what it saw before steps 1 and 2.
    with pytest.raises(CheckpointNotWrittenError, match=re.escape(f"step 2 already exists in {tmp_path}")):
        second.save(2, tree(99.0))
    second.save(3, tree(3.0))
    second.close()
    assert [stored(tmp_path, s) for s in (1, 2, 3)] == [[1.0] * 8, [2.0] * 8, [3.0] * 8]


def test_readers_never_take_the_lock(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as writer:
        writer.save(1, tree(1.0))
        for _ in range(3):
            with OrbaxCheckpointStore(tmp_path) as reader:  # list, read, restore: no lock, no refusal
                assert reader.list_steps() == [1] and reader.read_metadata(1).step == 1
                assert np.asarray(reader.restore(1).items["model"]["w"]).tolist() == [1.0] * 8
        writer.save(2, tree(2.0))  # still the writer
    assert stored(tmp_path, 2) == [2.0] * 8


class _Gate:
    """An Orbax future that completes when the test says so: the save stays in flight."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def result(self, timeout: float | None = None) -> None:
        assert self.open.wait(60), "the gate was never opened"


def test_an_async_save_in_flight_survives_other_stores_opening(tmp_path, monkeypatch):
    gate, original = _Gate(), ocp.PyTreeCheckpointHandler.async_save

    async def held(self, *args, **kwargs):
        return [*(await original(self, *args, **kwargs) or []), gate]

    writer = OrbaxCheckpointStore(tmp_path)
    writer.save(1, tree(1.0))
    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "async_save", held)
    writer.save(2, tree(2.0), blocking=False)
    in_flight = sorted(n for n in os.listdir(tmp_path) if "orbax-checkpoint-tmp" in n)
    assert in_flight == ["2.orbax-checkpoint-tmp"]
    for i in range(6):
        other = OrbaxCheckpointStore(tmp_path)
        assert other.list_steps() == [1]
        if i % 2:  # a would-be writer: refused before it touches anything
            with pytest.raises(DirectoryLockedError, match=re.escape(refusal(tmp_path, os.getpid()))):
                other.save(3 + i, tree(9.0))
        other.close()
        assert sorted(n for n in os.listdir(tmp_path) if "orbax-checkpoint-tmp" in n) == in_flight
    gate.open.set()
    writer.close()
    assert stored(tmp_path, 2) == [2.0] * 8


# -- two processes ---------------------------------------------------------------------

_HOLDER = """
import sys
import jax.numpy as jnp
from nnx_save.checkpoint import OrbaxCheckpointStore
store = OrbaxCheckpointStore(sys.argv[1])
store.save(1, {"model": {"w": jnp.full((8,), 1.0, jnp.float32)}})
print("holding", flush=True)
sys.stdin.readline()
store.close()
"""


@pytest.mark.slow
def test_a_writer_in_another_process_refuses_ten_of_ten(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "holding\n"
        store = OrbaxCheckpointStore(tmp_path)
        for step in [1, 2] * 5:
            with pytest.raises(DirectoryLockedError, match=re.escape(refusal(tmp_path, child.pid))):
                store.save(step, tree(99.0))
        assert store.list_steps() == [1] and stored(tmp_path, 1) == [1.0] * 8
    finally:
        child.communicate("\n", timeout=120)
    assert child.returncode == 0
    with pytest.raises(CheckpointNotWrittenError, match=re.escape("step 1 already exists")):
        store.save(1, tree(99.0))
    store.save(2, tree(2.0))
    store.close()
    assert (stored(tmp_path, 1), stored(tmp_path, 2)) == ([1.0] * 8, [2.0] * 8)


_LOCK_AND_FORK = """
import os, sys, time
from pathlib import Path
from nnx_save.io._lock import WriterLock
lock = WriterLock.acquire(Path(sys.argv[1]), "a killed writer")
if os.fork() == 0:  # the child outlives its parent and must not keep the lock
    with open(sys.argv[2] + ".tmp", "w") as f:  # fork has returned here: the at-fork hooks have run
        f.write(str(os.getpid()))
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(60)
    os._exit(0)
print("holding", flush=True)
time.sleep(60)
"""


def test_a_killed_holder_is_taken_over_even_with_a_forked_child_alive(tmp_path):
    forked = tmp_path.parent / f"{tmp_path.name}-forked"
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_AND_FORK, str(tmp_path), str(forked)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
    for _ in range(600):  # the child is running past its fork
        if forked.exists():
            break
        time.sleep(0.05)
    assert forked.exists()
    with pytest.raises(DirectoryLockedError, match=re.escape(f"a killed writer in process {holder.pid} on host")):
        WriterLock.acquire(tmp_path, "me")
    named = _lock.holder_of(tmp_path)
    assert named is not None and (named.pid, named.started) == (holder.pid, process_start(holder.pid))
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    try:
        taken = WriterLock.acquire(tmp_path, "me")
        assert _lock.holder_of(tmp_path) == Holder.this_process("me")
        taken.release()
        assert _lock.holder_of(tmp_path) is None  # released: the record names no one
    finally:
        os.kill(int(forked.read_text()), signal.SIGKILL)  # the orphan


def _record(directory, holder: Holder) -> None:
    (directory / LOCK_NAME).write_text(holder.to_json())


@pytest.mark.parametrize(
    ("who", "taken_over"),
    [("dead", True), ("pid reused", True), ("alive", False), ("other host", False)],
)
def test_without_flock_the_record_decides(tmp_path, monkeypatch, who, taken_over):
    """On a filesystem without flock, a holder is taken over only when provably dead."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    me = Holder.this_process("the holder")
    holder = {
        "dead": Holder(me.host, int(dead.stdout), None, "the holder"),
        "pid reused": Holder(me.host, me.pid, (me.started or 0) + 1, "the holder"),
        "alive": me,
        "other host": Holder("elsewhere.ns1", me.pid, me.started, "the holder"),
    }[who]
    _record(tmp_path, holder)

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(_lock.fcntl, "flock", no_flock)
    if taken_over:
        WriterLock.acquire(tmp_path, "me").release()
    else:
        with pytest.raises(
            DirectoryLockedError, match=re.escape(f"the holder in process {me.pid} on host {holder.host}")
        ):
            WriterLock.acquire(tmp_path, "me")
        assert json.loads((tmp_path / LOCK_NAME).read_text()) == json.loads(holder.to_json())  # untouched


# -- SIGTERM handlers that chain --------------------------------------------------------

_OPS = st.lists(st.tuples(st.sampled_from(["open", "close", "sigterm", "user"]), st.integers(0, 2)), max_size=14)


@settings(max_examples=40)
@given(ops=_OPS)
def test_every_sigterm_reaches_every_open_store_and_the_callers_handlers_once(tmp_path_factory, ops):
    """Stores opened and closed in any order, SIGTERMs between, and a handler the caller
    installs midway: each SIGTERM is seen by every open store and calls each of the
    caller's handlers once; the process lives; the last close leaves the caller's handler."""
    calls: list[str] = []
    base = signal.signal(signal.SIGTERM, lambda s, f: calls.append("base"))
    stores: dict[int, OrbaxCheckpointStore] = {}
    expected: list[str] = []
    users = 0
    try:
        for op, i in ops:
            if op == "open" and i not in stores:
                stores[i] = OrbaxCheckpointStore(tmp_path_factory.mktemp("s"))
                assert stores[i].should_save(1)  # the first due() installs the handler
            elif op == "close" and i in stores:
                stores.pop(i).close()
            elif op == "user":  # a handler the caller installs on top, chaining to what was there
                previous = signal.getsignal(signal.SIGTERM)

                def user(s, f, previous=previous, name=f"user{users}"):
                    calls.append(name)
                    previous(s, f)

                signal.signal(signal.SIGTERM, user)
                expected, users = [f"user{users}", *expected], users + 1
            elif op == "sigterm":
                calls.clear()
                os.kill(os.getpid(), signal.SIGTERM)
                assert calls == [*expected, "base"]
                assert all(s.preemption_requested and s.should_save(2) for s in stores.values())
        for store in stores.values():
            store.close()
        calls.clear()
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [*expected, "base"]  # every caller's handler is still in place, ours are gone
    finally:
        signal.signal(signal.SIGTERM, base)


def test_closing_out_of_order_keeps_the_preemption_handler(tmp_path):
    first, second = OrbaxCheckpointStore(tmp_path / "a"), OrbaxCheckpointStore(tmp_path / "b")
    assert first.should_save(1) and second.should_save(1)
    first.close()
    os.kill(os.getpid(), signal.SIGTERM)  # were the default handler back, this would kill the test process
    assert second.preemption_requested and second.should_save(5)
    second.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_deleting_a_missing_step_creates_nothing(tmp_path):
    directory = tmp_path / "never"
    with OrbaxCheckpointStore(directory) as store, pytest.raises(CheckpointNotFoundError):
        store.delete(3)
    assert not directory.exists()
