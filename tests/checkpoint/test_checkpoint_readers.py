"""A store opened for reading while another process writes the directory: it sees the
steps saved and deleted since (it looks again at every call, or at ``reload()``), and a
read of a step that is deleted or replaced under it returns the old step, the new one, or
a typed error (``CheckpointNotFoundError``, ``SourceChangedError``), never a mix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import nnx_save
from nnx_save.checkpoint import CheckpointNotFoundError, OrbaxCheckpointStore, UnsupportedCheckpointError, _disk


def _save(store: OrbaxCheckpointStore, step: int) -> None:
    store.save(step, {"model": {"w": np.full(8, step, np.float32)}}, metrics={"loss": float(step)})


def test_a_reader_sees_steps_saved_and_deleted_since_it_opened(tmp_path):
    writer = OrbaxCheckpointStore(tmp_path, max_to_keep=2)
    _save(writer, 1)
    _save(writer, 2)
    reader = OrbaxCheckpointStore(tmp_path)
    assert (reader.list_steps(), reader.latest_step()) == ([1, 2], 2)
    assert float(reader.restore(1).items["model"]["w"][0]) == 1.0  # its record is cached now
    _save(writer, 3)  # retention deletes step 1
    assert (reader.list_steps(), reader.latest_step(), reader.best_step("loss")) == ([2, 3], 3, 2)
    np.testing.assert_array_equal(reader.restore().items["model"]["w"], np.full(8, 3, np.float32))
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at step 1 in .* \(steps held: 2, 3\)"):
        reader.restore(1)
    with pytest.raises(CheckpointNotFoundError):
        reader.read_metadata(1)
    writer.close()
    reader.reload()
    assert reader.list_steps() == [2, 3]
    reader.close()


def test_each_call_looks_at_the_directory_once(tmp_path, monkeypatch):
    """A listing or a read looks at the directory once (a reader looks again at every call);
    a store's first save twice: before and after it opens the directory for writing."""
    looks: list[str] = []
    scan = _disk.scan
    monkeypatch.setattr(_disk, "scan", lambda path: looks.append(str(path)) or scan(path))

    def counted(call):
        looks.clear()
        call()
        return len(looks)

    writer = OrbaxCheckpointStore(tmp_path)
    assert counted(lambda: _save(writer, 1)) == 2
    assert counted(lambda: _save(writer, 2)) == 1
    writer.close()
    reader = OrbaxCheckpointStore(tmp_path)
    assert counted(reader.list_steps) == 1
    assert counted(lambda: reader.restore(1)) == 1
    assert counted(lambda: reader.read_metadata(2)) == 1
    assert counted(reader.reload) == 1
    assert looks == [str(tmp_path)]
    reader.close()


_WRITER = """
import sys
import numpy as np
from nnx_save.checkpoint import OrbaxCheckpointStore
directory, steps = sys.argv[1], int(sys.argv[2])
with OrbaxCheckpointStore(directory, max_to_keep=1) as store:  # every save deletes the step before
    for step in range(1, steps + 1):
        store.save(step, {"model": {"w": np.full(4096, step, np.float32)}})
        if step % 3 == 0:  # and some are saved again in place
            store.save(step, {"model": {"w": np.full(4096, step, np.float32)}}, overwrite=True)
print("done", flush=True)
"""


def test_a_reader_racing_a_writer_gets_a_whole_step_or_a_typed_error(tmp_path):
    """A second process saves step after step (retention keeps one; some are overwritten)
    while this one reads the latest step again and again: each read returns a whole step
    (every element its step number) or ``CheckpointNotFoundError`` / ``SourceChangedError``;
    at the end the reader sees the writer's last step."""
    steps = 12
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WRITER), str(tmp_path), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    reader = OrbaxCheckpointStore(tmp_path)
    whole, typed, seen = 0, 0, set()
    try:
        while writer.poll() is None:
            try:
                checkpoint = reader.restore()
            except (CheckpointNotFoundError, nnx_save.SourceChangedError):
                typed += 1  # deleted or replaced under the read (or no step yet)
                time.sleep(0.005)
                continue
            w = np.asarray(checkpoint.items["model"]["w"])
            assert (w == checkpoint.step).all(), (checkpoint.step, np.unique(w))
            whole, seen = whole + 1, seen | {checkpoint.step}
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0 and out == "done\n", err
        assert reader.latest_step() == steps and reader.list_steps() == [steps]
        np.testing.assert_array_equal(reader.restore().items["model"]["w"], np.full(4096, steps, np.float32))
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.communicate()
        reader.close()
    assert whole > 0 and len(seen) > 1, (whole, typed, seen)  # it saw steps come


def test_a_step_deleted_under_a_reader_is_not_found_not_unsupported(tmp_path, monkeypatch):
    """The step goes between the listing and the read of its record (the writer's retention):
    ``CheckpointNotFoundError``, not ``UnsupportedCheckpointError`` with its upgrade advice."""
    from nnx_save.checkpoint import _health, _store

    with OrbaxCheckpointStore(tmp_path) as writer:
        _save(writer, 1)
    reader = OrbaxCheckpointStore(tmp_path)
    real = _health.load_metadata

    def deleted_first(directory, step):
        import shutil

        shutil.rmtree(tmp_path / str(step))  # another process's retention, just now
        return real(directory, step)

    monkeypatch.setattr(_store, "load_metadata", deleted_first)
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at step 1 in .* \(steps held: none\)") as info:
        reader.restore(1)
    assert not isinstance(info.value, UnsupportedCheckpointError)
    reader.close()


@pytest.mark.parametrize("change", ["overwrite", "delete"])
def test_a_step_changed_while_its_arrays_are_read_is_a_typed_error(tmp_path, monkeypatch, change):
    """Another writer replaces (``overwrite=True``) or deletes the step between the read of
    its record and the read of its arrays: ``SourceChangedError`` or ``CheckpointNotFoundError``,
    never the arrays of one version under the record of the other."""
    from nnx_save.checkpoint import _orbax

    writer = OrbaxCheckpointStore(tmp_path)
    _save(writer, 1)
    writer.wait_until_finished()
    reader = OrbaxCheckpointStore(tmp_path)
    real = _orbax.restore_items

    def changed_first(manager, step, plan, partial):
        if change == "overwrite":
            writer.save(1, {"model": {"w": np.full(8, 7, np.float32)}}, overwrite=True)
        else:
            writer.delete(1)
        return real(manager, step, plan, partial)

    monkeypatch.setattr(_orbax, "restore_items", changed_first)
    expected = (
        (nnx_save.SourceChangedError, re.escape(f"{tmp_path / '1'}: step 1 was replaced while it was read"))
        if change == "overwrite"
        else (CheckpointNotFoundError, re.escape(f"no checkpoint at step 1 in {tmp_path} (steps held: none)"))
    )
    with pytest.raises(expected[0], match=expected[1]):
        reader.restore(1)
    monkeypatch.undo()
    writer.close()
    reader.close()
