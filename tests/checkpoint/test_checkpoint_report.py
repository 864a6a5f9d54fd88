"""The restore report describes the restore: the leaves restored (templated or not)
and the bytes restored and read from disk, or that they cannot be counted."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from nnx_save.checkpoint import OrbaxCheckpointStore, _placement


@pytest.fixture
def store(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as s:
        noise = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)  # 256 KiB, incompressible
        s.save(1, {"model": {"w": jnp.asarray(noise), "b": jnp.zeros(8)}, "data_iterator": {"position": 3}})
        yield s


def test_a_restore_as_stored_counts_its_leaves_and_bytes(store):
    report = store.restore(1).report
    assert sorted(report.loaded) == ["data_iterator/position", "model/b", "model/w"]
    io = report.io
    assert io.counted and io.bytes_needed == 256 * 256 * 4 + 8 * 4
    assert io.bytes_read > 200_000  # random floats barely compress: most of the array came off the disk
    assert re.search(
        r"I/O: restored 0\.3 MB onto this process's devices from \d+ file\(s\); read 0\.\d MB from disk "
        r"\(Orbax's compressed chunks\) in \d+ read calls, in \d+\.\d{3}s",
        str(report),
    ), str(report)
    assert str(report).startswith(f"{store.directory / '1'}: 3 loaded, 0 missing")


def test_a_templated_restore_counts_the_same(store):
    report = store.restore(1, templates={"model": {"w": jnp.zeros((256, 256)), "b": jnp.ones(8)}}).report
    assert sorted(report.loaded) == ["data_iterator/position", "model/b", "model/w"]


def test_without_io_counters_the_report_says_it_cannot_count(store, monkeypatch):
    monkeypatch.setattr(_placement, "io_counters", lambda: None)
    io = store.restore(1).report.io
    assert not io.counted and io.bytes_read == 0
    assert "the bytes read from disk cannot be counted here (no /proc/self/io)" in str(io)
