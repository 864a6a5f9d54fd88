"""Permissions: every file a save creates has the mode a plain ``open(path, "w")``
would give a new file under the caller's umask (``0o666 & ~umask``), and every
directory the mode of ``mkdir`` (``0o777 & ~umask``).

Overwriting: a save writes a new file and renames it over the old one (that is
what makes it atomic), so the result is a new inode. Its mode follows the umask,
as for a new file; the old file's mode (and owner, ACLs, hard links) is *not*
carried over, unlike ``open(path, "w")`` on an existing file, which keeps the
existing mode. We chose the umask: a checkpoint made private by a ``chmod 600``
before a save that runs under ``umask 022`` becomes readable by the group again,
which is what the umask of the saving process asks for (see docs/reliability.md).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.checkpoint import OrbaxCheckpointStore

UMASKS = [0o022, 0o077, 0o002, 0o027]


@pytest.fixture(params=UMASKS, ids=[f"umask{u:03o}" for u in UMASKS])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def plain_open_mode(directory: Path) -> int:
    """What ``open()`` gives a new file here, under the current umask."""
    probe = directory / ".probe"
    with open(probe, "w"):
        pass
    m = mode(probe)
    probe.unlink()
    return m


def small_model() -> nnx.Module:
    return nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 4, rngs=nnx.Rngs(1)))


SAVES = {
    "save_file": lambda path: nnx_save.save_file({"w": np.zeros(4, np.float32)}, path),
    "save_model": lambda path: nnx_save.save_model(small_model(), path),
}


@pytest.mark.parametrize("previous", [None, 0o600, 0o644, 0o755, 0o400])
@pytest.mark.parametrize("how", SAVES)
def test_a_saved_file_has_the_mode_open_gives_a_new_file(tmp_path, umask, how, previous):
    path = tmp_path / "m.safetensors"
    if previous is not None:
        path.write_bytes(b"old")
        os.chmod(path, previous)
    SAVES[how](path)
    assert mode(path) == plain_open_mode(tmp_path) == 0o666 & ~umask
    assert nnx_save.read_header(path)  # and it is the new, complete file


def test_a_multi_file_checkpoint_has_umask_modes(tmp_path, umask):
    directory = tmp_path / "ckpt"
    nnx_save.save_model(small_model(), directory, max_shard_size=300)
    for name in os.listdir(directory):  # overwrite one with a stricter mode, then save again
        os.chmod(directory / name, 0o600)
    nnx_save.save_model(small_model(), directory, max_shard_size=300)
    names = sorted(os.listdir(directory))
    assert "model.safetensors.index.json" in names and len(names) >= 3
    assert mode(directory) == 0o777 & ~umask
    assert {n: mode(directory / n) for n in names} == dict.fromkeys(names, 438 & ~umask)


def test_a_store_step_has_umask_modes(tmp_path, umask):
    with OrbaxCheckpointStore(tmp_path / "store") as store:
        store.save(1, {"model": {"w": np.arange(4, dtype=np.float32)}})
        store.save(1, {"model": {"w": np.arange(4, dtype=np.float32) + 1}}, overwrite=True)
    files, dirs = {}, {}
    for root, dnames, fnames in os.walk(tmp_path / "store" / "1"):
        dirs.update({os.path.join(root, d): mode(Path(root, d)) for d in dnames})
        files.update({os.path.join(root, f): mode(Path(root, f)) for f in fnames})
    assert files and dirs
    assert set(files.values()) == {0o666 & ~umask}, files
    assert set(dirs.values()) | {mode(tmp_path / "store" / "1")} == {0o777 & ~umask}, dirs
