"""The pool of pinned descriptors (io/_files): a header collected inside the pool's lock.

The garbage collector runs a finalizer at any allocation, also while the collecting
thread holds the pool's lock (a full test run hung this way in ``_Pool.drop``): a
collected header must neither wait for that lock nor leave its descriptors open.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import nnx_save
from nnx_save.io import _files


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


_NEXT_USES = {  # every way the pool is next taken drops what a finalizer left first
    "read_header": lambda other: nnx_save.read_header(other).close(),  # _Pool.add
    "an element": lambda handle: handle.get_slice("w")[3],  # _Pool.read_at (the native small read)
    "the engine": lambda handle: handle.get_tensor("w"),  # _Pool.dup, through the engine's reader
}


@pytest.mark.parametrize("next_use", list(_NEXT_USES))
def test_a_header_collected_while_its_thread_holds_the_pool_lock_neither_waits_nor_leaks(tmp_path, next_use):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(8, dtype=np.float32)}, path)
    other = tmp_path / "other.safetensors"
    nnx_save.save_file({"w": np.arange(8, dtype=np.float32)}, other)
    handle = nnx_save.safe_open(other, backend="pread" if next_use == "the engine" else "mmap")
    before = _open_fds()
    header = nnx_save.read_header(path)  # pins the file's descriptor in the pool
    pinned = _open_fds() - before
    assert pinned, "read_header pins a descriptor"
    finished = threading.Event()

    def collect_inside_the_lock() -> None:
        nonlocal header
        with _files._POOL.lock:  # as the collector would run a finalizer inside a locked section
            del header  # the last reference: Pinned.__del__ runs here, in this thread
        finished.set()

    worker = threading.Thread(target=collect_inside_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert finished.is_set(), "Pinned.__del__ waited for the pool lock its own thread holds (deadlock)"
    _NEXT_USES[next_use](other if next_use == "read_header" else handle)  # the pool's next use
    assert not (pinned & _open_fds()), "the collected header's descriptor is still open"
    handle.close()


_DESCRIPTORS = r"""
import os, random, resource, sys
import numpy as np
import nnx_save

where, seed, headroom = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
draw = random.Random(seed)
single = [os.path.join(where, f"m{i}.safetensors") for i in range(4)]
for i, path in enumerate(single):
    nnx_save.save_file({"a": np.full(16, i, np.float32), "b": np.arange(4096, dtype=np.float32) + i}, path)
multi = os.path.join(where, "multi")
nnx_save.save_file({f"t{i}": np.full(64, i, np.float32) for i in range(8)}, multi, max_shard_size=256)
expected = {p: float(i) for i, p in enumerate(single)}
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + headroom, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
handles, typed, done = [], 0, 0
for _ in range(400):
    op = draw.choice(["open", "open", "get", "slice", "load", "iter", "multi", "close"])
    try:
        if op == "open":
            path = draw.choice(single + [multi])
            handles.append((path, nnx_save.safe_open(path, framework="numpy")))
        elif op in ("get", "slice") and handles:
            path, h = draw.choice(handles)
            if path == multi:
                key = f"t{draw.randrange(8)}"
                assert (h.get_tensor(key) == int(key[1:])).all()
            elif op == "get":
                assert (h.get_tensor("a") == expected[path]).all()
            else:
                assert float(h.get_slice("b")[7:9][1]) == 8.0 + expected[path]
        elif op == "load":
            path = draw.choice(single)
            assert (nnx_save.load_file(path)["a"] == expected[path]).all()
        elif op == "iter":
            path = draw.choice(single)
            assert {k: float(v[0]) for k, v in nnx_save.iter_tensors(path)} == {"a": expected[path], "b": expected[path]}
        elif op == "multi":
            assert float(nnx_save.load_file(multi)["t5"][0]) == 5.0
        elif op == "close" and handles:
            handles.pop(draw.randrange(len(handles)))[1].__exit__(None, None, None)
        done += 1
    except nnx_save.NnxSaveError as error:  # a typed refusal: the limit is the caller's
        assert "Too many open files" in str(error), error
        typed += 1
print(len(handles), done, typed)
"""


@pytest.mark.parametrize(("seed", "headroom"), [(0, 24), (1, 12), (2, 40)])
def test_open_handles_share_one_pool_of_descriptors_under_a_low_limit(tmp_path, seed, headroom):
    """Handles opened and left open, reads through them, and loads of single files, a
    multi-file checkpoint and ``iter_tensors``, drawn at random under a descriptor limit a
    few above what the process uses: every read is right or a typed error, never a bare
    ``OSError`` (EMFILE), and the handles left open never hold the descriptors the next
    load needs."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _DESCRIPTORS, str(tmp_path), str(seed), str(headroom)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    handles, ok, typed = map(int, done.stdout.split())
    assert handles > 20 and ok + typed == 400
    assert typed == 0, (handles, ok, typed)  # even the lowest limit leaves the pool room to read through


@pytest.mark.parametrize("use", ["an element", "a larger run"])
def test_a_file_read_through_the_pool_is_its_most_recently_used(tmp_path, monkeypatch, use):
    """The pool drops its least recently used descriptor when full: a read on a handle's
    descriptor, by the native small read (``read_at``: an element) or on a duplicate
    (``dup``: a run over 64 KiB), makes that file the most recent, so the file not read
    since goes."""
    names = []
    for i in range(3):
        names.append(str(tmp_path / f"f{i}.safetensors"))
        nnx_save.save_file({"w": np.arange(32768, dtype=np.float32) + i}, names[-1])  # 128 KiB
    monkeypatch.setattr(_files, "max_pinned", lambda: 2)

    def pooled() -> set[str]:
        with _files._POOL.lock:
            return {name for _, name in _files._POOL.fds}

    with nnx_save.safe_open(names[0]) as first, nnx_save.safe_open(names[1]):
        assert pooled() == {names[0], names[1]}
        assert (first.get_slice("w")[3] if use == "an element" else first.get_slice("w")[:][3]) == 3
        with nnx_save.safe_open(names[2]):  # a third: the least recently used goes
            assert pooled() == {names[0], names[2]}


class _SlowNative:
    """The native module, but a read of ``slow`` waits (GIL released, as the C call
    releases it) until ``go`` is set: a read from a cold page cache, held as long as
    the test likes."""

    def __init__(self, real, slow: int) -> None:
        self.real, self.slow = real, slow
        self.reading, self.go = threading.Event(), threading.Event()
        self.waited: bool | None = None

    def read_at(self, fd, out, offset, size, mtime_ns):
        if os.fstat(fd).st_size == self.slow:
            self.reading.set()
            self.waited = self.go.wait(timeout=20)
        return self.real.read_at(fd, out, offset, size, mtime_ns)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("then", ["read another file", "close the slow file's handle", "evict it"])
def test_a_small_read_in_flight_neither_blocks_the_pool_nor_loses_its_descriptor(tmp_path, monkeypatch, then):
    """While one thread's element read waits on the disk, another reads an element of
    another file, closes the reading file's handle or evicts its descriptor: none waits
    for the slow read, the slow read still reads its own file (its descriptor is closed
    by its own end, not under it), and nothing stays open after."""
    slow, fast = tmp_path / "slow.safetensors", tmp_path / "fast.safetensors"
    nnx_save.save_file({"w": np.arange(100, dtype=np.float32)}, slow)
    nnx_save.save_file({"w": np.arange(200, dtype=np.float32) * 2}, fast)
    native = _SlowNative(_files._native, os.path.getsize(slow))
    monkeypatch.setattr(_files, "_native", native)
    before = _open_fds()
    first, other = nnx_save.safe_open(slow), nnx_save.safe_open(fast)
    got: list[float] = []
    reader = threading.Thread(target=lambda: got.append(first.get_slice("w")[42]), daemon=True)
    reader.start()
    assert native.reading.wait(timeout=20), "the slow read never started"
    if then == "read another file":
        assert other.get_slice("w")[7] == 14.0  # the pool's lock is free: this read does not wait
    elif then == "close the slow file's handle":
        first.close()  # drops its descriptor from the pool: left open for the read in flight
    else:
        monkeypatch.setattr(_files, "max_pinned", lambda: 1)
        nnx_save.read_header(fast).close()  # a third descriptor: the slow file's goes
    native.go.set()
    reader.join(timeout=20)
    assert native.waited is True, "the other thread waited for the slow read (the pool's lock was held)"
    assert got == [42.0], "the slow read did not read its own file"
    first.close()
    other.close()
    assert not (_open_fds() - before), "a descriptor stayed open"
