"""One commit rule for every layout, and one place that chooses the writer.

Data files first under fresh names, then the one record replaced atomically, the
previous version's files removed only after; a reader gets one whole version or an
:class:`~nnx_save.SourceChangedError`, never a mix. Through the public API.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import fsspec
import numpy as np
import pytest
from _errors import raises_check
from flax import nnx
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from reliability.test_reliability_disk import small_fs  # noqa: F401 (the tiny-filesystem fixture)

import nnx_save
from nnx_save.save import _write

INDEX = "model.safetensors.index.json"


def tree(value: float, n: int = 4, size: int = 64) -> dict[str, np.ndarray]:
    """``n`` tensors, every element ``value``: a load tells which save it came from."""
    return {f"t{i:03d}": np.full((size,), value, np.float32) for i in range(n)}


def versions(loaded: dict[str, np.ndarray]) -> set[float]:
    return {float(v) for a in loaded.values() for v in np.unique(a)}


class Versioned(nnx.Module):
    """``n`` parameters of ``size`` elements, every element ``value``."""

    def __init__(self, value: float, n: int = 4, size: int = 64) -> None:
        self.t = nnx.List([nnx.Param(np.full((size,), value, np.float32)) for _ in range(n)])


def memory_url() -> str:
    return f"memory://nnx-save-commit-{uuid.uuid4().hex[:8]}/ckpt"


# --- save_file(max_shard_size) and the one size parser ---------------------------------------


def test_save_file_writes_an_hf_multi_file_checkpoint(tmp_path):
    nnx_save.save_file(tree(3.0), tmp_path / "ck", max_shard_size=600)  # two 256-byte tensors per file
    index = json.loads((tmp_path / "ck" / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    loaded = nnx_save.load_file(tmp_path / "ck")
    assert sorted(loaded) == sorted(tree(3.0)) and versions(loaded) == {3.0}


@pytest.mark.parametrize(("size", "files"), [("100KB", 1), ("1KiB", 1), ("600B", 2), ("0.6kb", 2), (300, 4)])
def test_max_shard_size_takes_hf_size_strings(tmp_path, size, files):
    nnx_save.save_file(tree(1.0), tmp_path / "ck", max_shard_size=size)
    index = json.loads((tmp_path / "ck" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) == files


@pytest.mark.parametrize("size", ["100 parsecs", "5Gx", "", "-3", 0, -1, 1.5, True, "iB"])
def test_max_shard_size_refuses_what_is_not_a_size(tmp_path, size):
    with pytest.raises(nnx_save.OptionError, match=re.escape(f"max_shard_size={size!r}: expected a positive number")):
        nnx_save.save_file(tree(1.0), tmp_path / "ck", max_shard_size=size)
    assert not (tmp_path / "ck").exists()  # refused where it is given, before anything is written


# --- breakage 4: a URL with max_shard_size ---------------------------------------------------


def test_max_shard_size_with_a_url_writes_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = memory_url()
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    nnx_save.save_model(model, url, max_shard_size=300)
    assert os.listdir(tmp_path) == []  # no local directory named "memory:"
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False))
    assert names == sorted([INDEX, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    poisoned = nnx.Linear(8, 16, rngs=nnx.Rngs(1))
    poisoned.kernel[...] = np.full((8, 16), 9.0)
    poisoned.bias[...] = np.full(16, 9.0)
    restored, _ = nnx_save.load_model(poisoned, url, strict=True)
    np.testing.assert_array_equal(restored.kernel[...], model.kernel[...])
    np.testing.assert_array_equal(restored.bias[...], model.bias[...])


def test_resaving_at_a_url_keeps_one_version_and_removes_the_previous_files():
    url = memory_url()
    nnx_save.save_file(tree(1.0), url, max_shard_size=600)
    nnx_save.save_file(tree(2.0), url, max_shard_size=600)
    assert versions(nnx_save.load_file(url)) == {2.0}
    fs = fsspec.filesystem("memory")
    index = json.loads(fs.cat(f"{url}/{INDEX}"))
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False)) == sorted(
        {INDEX, *index["weight_map"].values()}
    )


# --- breakage 2: an index saved over a pod ---------------------------------------------------


def test_a_multi_file_save_over_a_pod_directory_replaces_it(tmp_path):
    directory = tmp_path / "ck"
    nnx_save.save_pod(Versioned(0.0), directory)
    nnx_save.save_model(Versioned(7.0), directory, max_shard_size=16)
    assert versions(nnx_save.load_file(directory)) == {7.0}
    left = sorted(os.listdir(directory))
    assert "manifest.json" not in left and not [n for n in left if n.startswith("shard_")], left


# --- breakage 3: one version per load --------------------------------------------------------


def test_files_of_two_saves_under_one_index_are_refused(tmp_path):
    nnx_save.save_model(Versioned(1.0), tmp_path / "a", max_shard_size=600)
    nnx_save.save_model(Versioned(2.0), tmp_path / "b", max_shard_size=600)
    second = "model-00002-of-00002.safetensors"
    shutil.copyfile(tmp_path / "b" / second, tmp_path / "a" / second)  # what a rewrite in place leaves
    with raises_check("index", match=re.escape(f"{second} is save ")) as caught:
        nnx_save.load_file(tmp_path / "a")
    assert caught.value.file == str(tmp_path / "a" / "model.safetensors.index.json")


def test_an_index_entry_linked_to_another_saves_file_says_so_and_not_to_load_again(tmp_path):
    """Not a SourceChangedError ("replaced while it was read; load it again"), which no
    number of loads would clear: the index itself never changed."""
    nnx_save.save_model(Versioned(1.0), tmp_path / "a", max_shard_size=600)
    nnx_save.save_model(Versioned(2.0), tmp_path / "b", max_shard_size=600)
    second = "model-00002-of-00002.safetensors"
    (tmp_path / "a" / second).unlink()
    (tmp_path / "a" / second).symlink_to(tmp_path / "b" / second)
    index = tmp_path / "a" / "model.safetensors.index.json"
    want = json.loads(index.read_text())["metadata"]["nnx_save.save_id"]
    message = f"{index}: is save {want}, but the file it names {tmp_path / 'a' / second} is save "
    for _ in range(2):  # the same answer every time
        with raises_check("index", match=re.escape(message)) as caught:
            nnx_save.load_file(tmp_path / "a")
        assert "load it again" not in str(caught.value)
        assert "a file of another checkpoint (a link to it, or a copy)" in str(caught.value)


def test_a_resave_gives_its_files_names_the_committed_index_does_not_use(tmp_path):
    directory = tmp_path / "ck"
    nnx_save.save_file(tree(1.0), directory, max_shard_size=600)
    first = set(json.loads((directory / INDEX).read_text())["weight_map"].values())
    nnx_save.save_file(tree(2.0), directory, max_shard_size=600)
    second = set(json.loads((directory / INDEX).read_text())["weight_map"].values())
    assert first.isdisjoint(second) and all(
        re.fullmatch(r"model-0000[12]-of-00002\.[0-9a-f]{8}\.safetensors", n) for n in second
    )
    assert sorted(os.listdir(directory)) == sorted({INDEX, *second})  # the previous files, removed after the commit
    assert versions(nnx_save.load_file(directory)) == {2.0}


def test_transformers_reads_what_a_resave_writes(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)
    ref = transformers.GPT2LMHeadModel(config)
    state = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    directory = tmp_path / "hf"
    nnx_save.save_file(
        {k: np.zeros_like(v) for k, v in state.items()}, directory, max_shard_size=2000, metadata={"format": "pt"}
    )
    ref.config.save_pretrained(directory)
    nnx_save.save_file(state, directory, max_shard_size=2000, metadata={"format": "pt"})  # fresh names
    loaded = transformers.GPT2LMHeadModel.from_pretrained(directory)
    for k, v in loaded.state_dict().items():
        if k in state:
            np.testing.assert_array_equal(v.numpy(), state[k], err_msg=k)
    assert torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)


_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from flax import nnx
    import nnx_save

    class Versioned(nnx.Module):  # 64 tensors of 1 KiB, every element the version
        def __init__(self, version):
            self.t = nnx.List([nnx.Param(np.full((256,), version, np.float32)) for _ in range(64)])

    directory, stop = sys.argv[1], float(sys.argv[2])
    version = 0
    while version < 2 or time.time() < stop:
        version += 1
        nnx_save.save_model(Versioned(version), directory, max_shard_size=1024)  # one tensor per file
    print(version)
    """
)


@pytest.mark.slow  # a writer process and a reader racing for 30 s
def test_a_reader_racing_a_multi_file_writer_never_mixes_versions(tmp_path):
    directory = tmp_path / "ck"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    stop = time.time() + 30
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(directory), str(stop)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    while not (directory / INDEX).exists() and writer.poll() is None:
        time.sleep(0.01)
    whole, retried, mixed = 0, 0, []
    try:
        while time.time() < stop:
            try:
                loaded = nnx_save.load_file(directory)
            except nnx_save.NnxSaveError as e:  # only "load again" is allowed
                if type(e).__name__ != "SourceChangedError" or not str(e).endswith("load it again"):
                    raise
                retried += 1
                continue
            assert len(loaded) == 64
            seen = versions(loaded)
            whole += len(seen) == 1
            if len(seen) > 1:
                mixed.append(sorted(seen))
    finally:
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err.decode()[-3000:]
    saves = int(out.decode().split()[-1])
    assert mixed == [], f"{len(mixed)} of {whole + len(mixed)} loads mixed versions: {mixed[:5]}"
    assert saves >= 5 and whole >= 5, (saves, whole, retried)
    assert versions(nnx_save.load_file(directory)) == {float(saves)}
    assert len(os.listdir(directory)) == 65  # the last version's 64 files and its index, nothing else


# --- files written in parallel ----------------------------------------------------------------


def test_local_files_are_written_two_at_a_time_within_the_budget(tmp_path, monkeypatch):
    real, lock, running, seen = _write.write_file, threading.Lock(), [0], []

    def slow(path, entries, metadata=None, **kwargs):
        with lock:
            running[0] += 1
            seen.append((running[0], kwargs["max_inflight_bytes"]))
        time.sleep(0.2)  # long enough for the other writer to start
        try:
            return real(path, entries, metadata, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setenv("NNX_SAVE_SAVE_INFLIGHT_BYTES", str(64 << 20))
    monkeypatch.setattr(_write, "write_file", slow)
    nnx_save.save_file(tree(1.0, n=5), tmp_path / "ck", max_shard_size=256)  # one file per tensor
    assert len(seen) == 5 and max(n for n, _ in seen) == _write.SHARD_WRITERS == 2
    assert {b for _, b in seen} == {(64 << 20) // 2}  # each writer holds its share of the budget
    assert versions(nnx_save.load_file(tmp_path / "ck")) == {1.0}


def test_a_failed_file_among_parallel_ones_keeps_the_previous_version(tmp_path, monkeypatch):
    nnx_save.save_file(tree(1.0, n=6), tmp_path / "ck", max_shard_size=256)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    real, started = _write.write_file, []

    def fails_second(path, entries, metadata=None, **kwargs):
        started.append(path.name)
        if len(started) == 2:
            raise nnx_save.SaveError(f"{path}: save failed (no space left on the device)", str(path))
        time.sleep(0.2)  # the failure lands while this file is still being written
        return real(path, entries, metadata, **kwargs)

    monkeypatch.setattr(_write, "write_file", fails_second)
    with pytest.raises(nnx_save.SaveError, match=re.escape("save failed (no space left on the device)")):
        nnx_save.save_file(tree(2.0, n=6), tmp_path / "ck", max_shard_size=256)
    assert len(started) < 6  # the files not begun were cancelled
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == before  # no new file, no temporary
    assert versions(nnx_save.load_file(tmp_path / "ck")) == {1.0}


# --- full disk and quota: the previous version loads exactly afterwards ------------------------


class QuotaFile(MemoryFile):
    def write(self, data):  # type: ignore[override]
        used = sum(f.getbuffer().nbytes for p, f in self.fs.store.items() if p != self.path)
        if used + self.tell() + len(data) > self.fs.quota:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return super().write(data)


class QuotaFileSystem(MemoryFileSystem):
    """An in-memory object store with a byte quota over every object it holds."""

    protocol = "quotamem"
    store: dict = {}  # noqa: RUF012 (fsspec's own layout: one store per class)
    pseudo_dirs = [""]  # noqa: RUF012
    quota = 1 << 40

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "w" in mode or "x" in mode:
            f.__class__ = QuotaFile
        return f


@pytest.fixture
def quota_fs():
    fsspec.register_implementation("quotamem", QuotaFileSystem, clobber=True)
    fs = fsspec.filesystem("quotamem")
    fs.store.clear()
    yield fs
    fs.store.clear()
    QuotaFileSystem.quota = 1 << 40


def stored(fs) -> dict[str, bytes]:
    return {p: bytes(f.getbuffer()) for p, f in sorted(fs.store.items())}


@pytest.mark.parametrize("shard", [None, 600], ids=["one_file", "hf_index"])
def test_a_save_over_quota_keeps_the_previous_version(quota_fs, shard):
    url = "quotamem://bucket/ck" if shard else "quotamem://bucket/ck.safetensors"
    save = nnx_save.save_file if shard is None else functools.partial(nnx_save.save_file, max_shard_size=shard)
    save(tree(1.0), url)
    before = stored(quota_fs)
    QuotaFileSystem.quota = sum(len(b) for b in before.values()) + 700  # room for part of the new save
    with pytest.raises(nnx_save.SaveError, match=r"the upload failed \(OSError: \[Errno \d+\] Disk quota exceeded\)"):
        save(tree(2.0), url)
    assert stored(quota_fs) == before  # the same objects, byte for byte: nothing new, no temporary
    assert versions(nnx_save.load_file(url)) == {1.0}


def test_a_multi_file_save_over_a_pod_on_a_full_disk_keeps_the_pod(small_fs):  # noqa: F811 (the fixture)
    directory = small_fs(320 << 10) / "ck"
    nnx_save.save_pod(Versioned(3.0, n=2, size=25_000), directory)  # 200 KB
    before = sorted(os.listdir(directory))
    with pytest.raises(nnx_save.SaveError, match=r"save failed \(no space left on the device\)"):
        nnx_save.save_model(Versioned(4.0, n=2, size=25_000), directory, max_shard_size=100_000)
    assert sorted(os.listdir(directory)) == before  # the pod's manifest and shard file, nothing new
    assert versions(nnx_save.load_file(directory)) == {3.0}
