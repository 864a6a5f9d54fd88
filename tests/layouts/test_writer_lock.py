"""One writer per directory for the HF multi-file and pod writers: a
second process saving into a directory another save is writing is refused with a
DirectoryLockedError naming the first, which commits intact; the lock file is gone after
a save; a killed writer's stale one is ignored by every reader and taken over (and
removed) by the next writer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnx_save
from nnx_save.cli import _main
from nnx_save.errors import DirectoryLockedError
from nnx_save.io import _lock

LOCK = "_nnx_save.lock"
WHAT = {"index": "a multi-file save", "pod": "save_pod"}

# The first writer: a save into argv[1] that stops before its commit (its data files
# written, its record not yet) until a line arrives on stdin.
_FIRST = """
import sys
import numpy as np
import nnx_save
from nnx_save.layouts import _index, _pod

directory, layout = sys.argv[1], sys.argv[2]

def paused(commit):
    def run(*args, **kwargs):
        print("holding", flush=True)
        sys.stdin.readline()
        return commit(*args, **kwargs)
    return run

tree = {"a": np.full(64, 1.0, np.float32), "b": np.full(64, 2.0, np.float32)}
if layout == "index":
    _index._commit_index = paused(_index._commit_index)
    nnx_save.save_file(tree, directory, max_shard_size=256)
else:
    _pod._commit_manifest = paused(_pod._commit_manifest)
    nnx_save.save_pod(tree, directory)
print("saved", flush=True)
"""
FIRST = {"a": [1.0] * 64, "b": [2.0] * 64}


def tree(value: float) -> dict[str, np.ndarray]:
    return {"a": np.full(64, value, np.float32), "b": np.full(64, value, np.float32)}


def save(layout: str, values: dict[str, np.ndarray], directory: Path) -> None:
    if layout == "index":
        nnx_save.save_file(values, directory, max_shard_size=256)
    else:
        nnx_save.save_pod(values, directory)


def loaded(directory: Path) -> dict[str, list[float]]:
    return {k: v.tolist() for k, v in nnx_save.load_file(directory).items()}


def listing(directory: Path) -> dict[str, int]:
    return {n: os.stat(directory / n).st_ino for n in sorted(os.listdir(directory))}


def committed(directory: Path) -> list[str]:
    """The record and the files it names: what a clean directory holds."""
    if (directory / "manifest.json").exists():
        manifest = json.loads((directory / "manifest.json").read_text())
        files = {p["file"] for spec in manifest["tensors"].values() for p in spec["pieces"]}
        return sorted({"manifest.json", *files})
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return sorted({"model.safetensors.index.json", *index["weight_map"].values()})


def first_writer(directory: Path, layout: str) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", _FIRST, str(directory), layout], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "holding\n"
    return child


@pytest.mark.parametrize("layout", ["index", "pod"])
def test_a_second_process_saving_into_the_directory_is_refused_ten_of_ten(tmp_path, layout):
    save(layout, tree(0.0), tmp_path)  # a previous version, which stays loadable throughout
    child = first_writer(tmp_path, layout)
    try:
        before = listing(tmp_path)
        refusal = f"{tmp_path} is being written by {WHAT[layout]} in process {child.pid} on host "
        for i in range(10):
            with pytest.raises(DirectoryLockedError, match=re.escape(refusal)) as refused:
                save(layout, tree(9.0 + i), tmp_path)
            assert isinstance(refused.value, nnx_save.NnxSaveError) and refused.value.directory == str(tmp_path)
        assert listing(tmp_path) == before  # a refusal touches nothing
        assert loaded(tmp_path) == {"a": [0.0] * 64, "b": [0.0] * 64}  # readers take no lock
    finally:
        out, _ = child.communicate("\n", timeout=120)
    assert (child.returncode, out) == (0, "saved\n")
    assert loaded(tmp_path) == FIRST  # the first writer's checkpoint, whole
    assert sorted(os.listdir(tmp_path)) == committed(tmp_path)  # no lock file, nothing of the refused saves
    assert LOCK not in committed(tmp_path)


@pytest.mark.parametrize("layout", ["index", "pod"])
def test_a_killed_writers_lock_file_is_ignored_by_readers_and_taken_over(tmp_path, layout, capsys):
    save(layout, tree(0.0), tmp_path)
    child = first_writer(tmp_path, layout)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
    holder = _lock.holder_of(tmp_path)
    assert holder is not None and (holder.pid, holder.what) == (child.pid, WHAT[layout]) and holder.gone()
    assert LOCK in os.listdir(tmp_path)  # stale: the kernel freed its flock, the file stays
    # Every reader ignores it: not a checkpoint file, not an unexpected one.
    assert loaded(tmp_path) == {"a": [0.0] * 64, "b": [0.0] * 64}
    assert nnx_save.read_header(tmp_path).kind == layout
    assert LOCK not in {Path(f.file).name for f in nnx_save.read_header(tmp_path).files}
    assert _main.main(["inspect", str(tmp_path)]) == 0 and _main.main(["verify", str(tmp_path)]) == 0
    assert LOCK not in capsys.readouterr().out
    # The next writer takes it over, then removes it with the killed save's leftovers.
    save(layout, tree(5.0), tmp_path)
    assert loaded(tmp_path) == {"a": [5.0] * 64, "b": [5.0] * 64}
    assert sorted(os.listdir(tmp_path)) == committed(tmp_path)


def test_a_directory_of_files_reads_past_a_stale_lock_file(tmp_path):
    """A directory of *.safetensors files (no record) never counts the lock file as a part."""
    nnx_save.save_file(tree(3.0), tmp_path / "part.safetensors")
    (tmp_path / LOCK).write_text(_lock.Holder("elsewhere.ns1", 1, None, "a multi-file save").to_json())
    assert nnx_save.read_header(tmp_path).kind == "directory"
    assert loaded(tmp_path) == {"a": [3.0] * 64, "b": [3.0] * 64}


# A writer killed while it writes a data file: argv[1] is the directory, argv[2] the layout.
_MID_WRITE = """
import sys
import numpy as np
import nnx_save
from nnx_save.save import _write

def paused(final_header):
    def run(*args, **kwargs):  # inside the data file's write: its temporary exists, unnamed
        print("writing", flush=True)
        sys.stdin.readline()
        return final_header(*args, **kwargs)
    return run

_write.final_header = paused(_write.final_header)
tree = {"a": np.full(64, 1.0, np.float32), "b": np.full(64, 2.0, np.float32)}
if sys.argv[2] == "index":
    nnx_save.save_file(tree, sys.argv[1], max_shard_size=256)
else:
    nnx_save.save_pod(tree, sys.argv[1])
"""


@pytest.mark.parametrize("layout", ["index", "pod"])
def test_a_writer_killed_mid_write_leaves_a_temporary_the_next_save_removes(tmp_path, layout):
    """A pod save killed while writing its shard left that temporary file (as large as
    the shard) for good: each pod save names its shards anew, so no later save of the
    same name ever came to remove it."""
    save(layout, tree(0.0), tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", _MID_WRITE, str(tmp_path), layout],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().startswith("writing")  # HF: two files at once
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
    temps = [n for n in os.listdir(tmp_path) if ".nnx_save-tmp-" in n]
    assert temps and all(f"-{child.pid}-" in t for t in temps)  # the killed save's (an HF save writes two at once)
    assert loaded(tmp_path) == {"a": [0.0] * 64, "b": [0.0] * 64}
    save(layout, tree(5.0), tmp_path)
    assert loaded(tmp_path) == {"a": [5.0] * 64, "b": [5.0] * 64}
    assert sorted(os.listdir(tmp_path)) == committed(tmp_path)
