"""A reader racing a writer, on every layout, through every reader: each read is one
whole version (every value of one save), a "load again" (``SourceChangedError``) or
"not found" (``SourceNotFoundError``, ``CheckpointNotFoundError``) where the layout can
give it, never a mix, never an untyped exception, never a hang.

The writer saves versions in a loop in a thread of this process, and in a second
process (one process serves every race of the module: one JAX import); the readers
run at once, one thread each, for :data:`SECONDS` and on until each read several versions
(``tests/_race.py`` is the harness).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _race import FIRST, KEYS, Race, Read, race, version, write
from flax import nnx

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore

SECONDS = 1.5  # of racing, per layout and writer, and on until every reader read several versions
SWITCH = {"thread": 1e-5, "process": 0.02}  # thread: a read cut anywhere; process: readers paused long
READERS = {
    "file": ("load_file", "safe_open", "iter_tensors", "load_model"),
    "index": ("load_file", "safe_open", "iter_tensors", "load_model"),
    "directory": ("load_file", "safe_open", "iter_tensors", "load_model"),
    "pod": ("load_file", "safe_open", "iter_tensors", "load_model"),
    "memory": ("load_file", "load_model"),  # a state dict in this process: no writer process
    "store": ("restore_latest", "restore_step", "latest_step"),
}
WRITERS = {layout: ("thread",) if layout == "memory" else ("thread", "process") for layout in READERS}
# What a read may raise besides returning a version: one file is replaced whole, a state
# dict updated at once; a record's files go after its replacement, a store's steps by retention.
TYPED = {
    "file": set(),
    "memory": set(),
    "index": {"changed"},
    "directory": {"changed"},
    "pod": {"changed"},
    "store": {"changed", "not_found"},
}
# Orbax closes its event loop once a read fails (its step deleted under it) while other
# reads of the step are in flight; tensorstore then reports each one's end as ignored.
ORBAX_LEFT_OVER = "RuntimeError('Event loop is closed')"
CASES = [(layout, reader, kind) for layout, names in READERS.items() for reader in names for kind in WRITERS[layout]]


@contextlib.contextmanager
def switching(seconds: float) -> Iterator[None]:
    """Threads switch every ``seconds`` (the interpreter's default is 5 ms)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Model(nnx.Module):
    """``t0`` .. ``t3`` of a version, poisoned (every element -1): a load that does nothing fails."""

    def __init__(self) -> None:
        for key, value in version(FIRST).items():
            if key in KEYS:
                setattr(self, key, nnx.Param(np.full_like(value, -1)))


def _model_read(source: Any) -> Read:
    def read() -> tuple[dict[str, Any], int | None]:
        model, _ = nnx_save.load_model(Model(), source, strict=True, allow_unexpected=["pad"])
        return {key: getattr(model, key)[...] for key in KEYS}, None

    return read


def _safe_open_read(source: Any) -> Read:
    def read() -> tuple[dict[str, Any], int | None]:
        with nnx_save.safe_open(source) as f:
            keys = f.keys()
            return {key: f.get_slice(key)[1:] for key in keys}, None

    return read


def _store_read(store: OrbaxCheckpointStore, reader: str) -> Read:
    def read() -> tuple[dict[str, Any], int | None]:
        if reader == "latest_step":
            return {}, store.latest_step()
        if reader == "restore_latest":
            step = None
        else:  # by number: the step before the latest, which retention deletes two saves on
            steps = store.list_steps()
            step = steps[-2] if len(steps) > 1 else steps[0]
        checkpoint = store.restore(step)
        return checkpoint.items["model"], checkpoint.step

    return read


def opener(layout: str, reader: str, target: Any) -> Callable[[], contextlib.AbstractContextManager[Read]]:
    """What opens ``reader``'s read of ``target`` in its thread."""

    @contextlib.contextmanager
    def open_read() -> Iterator[Read]:
        if layout == "store":
            with OrbaxCheckpointStore(target) as store:
                yield _store_read(store, reader)
        elif reader == "load_file":
            yield lambda: (nnx_save.load_file(target), None)
        elif reader == "iter_tensors":
            yield lambda: (dict(nnx_save.iter_tensors(target, max_batch_bytes=256)), None)  # a tensor at a time
        else:
            yield {"safe_open": _safe_open_read, "load_model": _model_read}[reader](target)

    return open_read


# --------------------------------------------------------------------------- the writers


def thread_writer(layout: str, target: Any) -> Callable[[], int]:
    """Start the writer in a thread; once its first version is saved, what stops it and
    returns its last."""
    ready, stop, result = threading.Event(), threading.Event(), {}

    def run() -> None:
        try:
            result["last"] = write(layout, target, stop.is_set, ready.set)
        except Exception as e:
            result["error"] = e
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(120), "the writer thread did not save its first version"

    def stop_and_wait() -> int:
        stop.set()
        thread.join(120)
        assert not thread.is_alive(), "the writer thread did not stop"
        if "error" in result:
            raise result["error"]
        return result["last"]

    return stop_and_wait


class WriterProcess:
    """``tests/_race.py`` in a second process, one race at a time."""

    def __init__(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        }
        script = Path(__file__).parent.parent / "_race.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def _line(self, want: str) -> str:
        line = self.lines.get(timeout=180).strip()
        assert line.startswith(want), f"the writer process said {line!r}"
        return line

    def start(self, layout: str, target: Any) -> Callable[[], int]:
        stop = Path(tempfile.mkdtemp()) / "stop"  # the writer saves until it exists
        self.proc.stdin.write(f"{layout}\t{target}\t{stop}\n")
        self.proc.stdin.flush()
        self._line("ready")

        def stop_and_wait() -> int:
            stop.touch()
            last = int(self._line("done").split()[1])
            shutil.rmtree(stop.parent)
            return last

        return stop_and_wait

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def races(tmp_path_factory) -> Iterator[Callable[[str, str], Race]]:
    """``races(layout, writer)``: the one race of ``layout`` against ``writer`` (run once, on first use)."""
    done: dict[tuple[str, str], Race] = {}
    process: list[WriterProcess] = []
    # In memory where there is a tmpfs: no fsync waits for a disk, so the writer commits
    # hundreds of times a second and every window of a read is hit.
    fast = tempfile.mkdtemp(prefix="nnx_save-race-", dir="/dev/shm") if os.access("/dev/shm", os.W_OK) else None

    def run(layout: str, kind: str) -> Race:
        if (layout, kind) not in done:
            where = Path(tempfile.mkdtemp(dir=fast)) if fast else tmp_path_factory.mktemp(f"{layout}-{kind}")
            target: Any = where / "ck"
            if layout == "file":
                target = target.with_suffix(".safetensors")
            if layout == "memory":
                target = version(FIRST)
            if kind == "process" and not process:
                process.append(WriterProcess())
            start = functools.partial(process[0].start if kind == "process" else thread_writer, layout, target)
            readers = {reader: opener(layout, reader, target) for reader in READERS[layout]}
            with switching(SWITCH[kind]):
                done[layout, kind] = race(layout, readers, start, SECONDS)
        return done[layout, kind]

    try:
        yield run
    finally:
        for p in process:
            p.close()
        if fast:
            shutil.rmtree(fast)


@pytest.mark.parametrize(("layout", "reader", "writer"), CASES)
def test_a_reader_racing_a_writer_gets_one_version_or_a_typed_error(races, layout, reader, writer):
    run = races(layout, writer)
    got, last = run.outcomes[reader], run.last
    assert got.problems == [], (
        f"{len(got.problems)} bad reads of {len(got.problems) + len(got.versions)}: {got.problems[:3]}"
    )
    assert all(FIRST <= k <= last for k in got.versions), (FIRST, last, sorted(set(got.versions))[-5:])
    errors = {"changed": got.changed, "not_found": got.not_found}
    assert {name for name, n in errors.items() if n} <= TYPED[layout], errors
    assert got.raced(), (got.versions, errors, last)
    assert [u for u in run.unraisable if not (layout == "store" and ORBAX_LEFT_OVER in u)] == []
