"""Files of one load read at once share the load's reading threads: once a small file is
read, its threads read the big one's chunks (a multi-file checkpoint's last file is
usually small), and never more reads run at once than ``num_threads``."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import nnx_save
from nnx_save.load import _execute

MIB = 1 << 20


class Concurrency:
    """Wraps the executor's read methods: the most reads running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def wrap(self, read):
        def timed(reader, *args, **kwargs):
            with self.lock:
                self.now += 1
                self.peak = max(self.peak, self.now)
            try:
                time.sleep(0.02)  # a read long enough for the others to start
                return read(reader, *args, **kwargs)
            finally:
                with self.lock:
                    self.now -= 1

        return timed


@pytest.mark.parametrize("threads", [2, 4])
def test_a_big_file_read_beside_a_small_one_gets_every_thread(tmp_path, monkeypatch, threads):
    rng = np.random.default_rng(0)
    tree = {"a_big": rng.standard_normal(8 * MIB // 4, dtype=np.float32), "b_small": np.arange(16, dtype=np.float32)}
    nnx_save.save_file(tree, tmp_path, max_shard_size=8 * MIB)  # two files: 8 MiB and 64 bytes
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    seen = Concurrency()
    for name in ("_read_table", "_direct", "_scatter", "_read_batch"):
        monkeypatch.setattr(_execute, name, seen.wrap(getattr(_execute, name)))
    got = nnx_save.load_file(tmp_path, num_threads=threads, read_chunk_bytes=MIB // 4)  # 32 chunks in the big file
    for key, value in tree.items():
        np.testing.assert_array_equal(np.asarray(got[key]), value)
    # every thread reads the big file's 32 chunks (split between the two files, it had half),
    # and no more reads than threads run at once
    assert seen.peak == threads, (seen.peak, threads)
