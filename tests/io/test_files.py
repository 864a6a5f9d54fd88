"""The pool of pinned descriptors (io/_files): a header collected inside the pool's lock.

The garbage collector runs a finalizer at any allocation, also while the collecting
thread holds the pool's lock (a full test run hung this way in ``_Pool.drop``): a
collected header must neither wait for that lock nor leave its descriptors open.
"""

from __future__ import annotations

import os
import threading

import numpy as np

import nnx_save
from nnx_save.io import _files


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_a_header_collected_while_its_thread_holds_the_pool_lock_neither_waits_nor_leaks(tmp_path):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file({"w": np.arange(8, dtype=np.float32)}, path)
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
    nnx_save.read_header(path)  # the pool's next use drops what the finalizer left
    assert not (pinned & _open_fds()), "the collected header's descriptor is still open"
