"""Full disks and file size limits: a save that runs out of space fails with a
:class:`~nnx_save.SaveError` naming the path, keeps the previous checkpoint, and
leaves no temporary file.

Two ways to run out of space: a real, small tmpfs (needs root, which CI has; the
tests skip where ``mount`` is refused), and ``RLIMIT_FSIZE`` in a subprocess with
``SIGXFSZ`` ignored (runs everywhere: writes past the limit fail with ``EFBIG``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import nnx_save
from nnx_save.checkpoint import CheckpointWriteError, OrbaxCheckpointStore

TMP_MARKER = ".nnx_save-tmp-"  # in every temporary file's name (docs/reliability.md)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(size, inodes=None)``: a fresh tmpfs of ``size`` bytes."""
    mounts = []

    def make(size: int, inodes: int | None = None) -> Path:
        where = tmp_path / f"fs{len(mounts)}"
        where.mkdir()
        options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if done.returncode:
            pytest.skip(
                f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); test_rlimit_fsize_* covers the same paths"
            )
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=True)


def model(seed: int, width: int = 96) -> nnx.Module:
    return nnx.Sequential(nnx.Linear(width, 256, rngs=nnx.Rngs(seed)), nnx.Linear(256, width, rngs=nnx.Rngs(seed + 1)))


def noise() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(512 << 10).astype(np.float32)  # 2 MiB, incompressible


def no_space(path: Path) -> str:
    return re.escape(f"{path}: save failed (no space left on the device); the previous file, if any, is intact")


def test_save_file_into_a_full_filesystem(small_fs):
    fs = small_fs(256 << 10)
    path = fs / "m.safetensors"
    nnx_save.save_file({"w": np.arange(1024, dtype=np.float32)}, path)
    before = snapshot(fs)
    with pytest.raises(nnx_save.SaveError, match=no_space(path)) as info:
        nnx_save.save_file({"w": np.ones(128 << 10, np.float32)}, path)  # 512 KiB
    assert info.value.file == str(path) and isinstance(info.value, nnx_save.NnxSaveError)
    assert snapshot(fs) == before  # nothing else in the directory: the temporary file is gone
    np.testing.assert_array_equal(nnx_save.load_file(path)["w"], np.arange(1024, dtype=np.float32))
    nnx_save.save_file({"w": np.ones(16 << 10, np.float32)}, path)  # the space came back
    assert sorted(os.listdir(fs)) == ["m.safetensors"]


def test_save_model_into_a_full_filesystem(small_fs):
    fs = small_fs(128 << 10)
    path = fs / "model.safetensors"
    nnx_save.save_model(model(0, width=8), path)
    before = snapshot(fs)
    with pytest.raises(nnx_save.SaveError, match=no_space(path)):
        nnx_save.save_model(model(1, width=256), path)  # 512 KiB
    assert snapshot(fs) == before
    restored, _ = nnx_save.load_model(lambda: model(5, width=8), path, strict=True)
    np.testing.assert_array_equal(restored.layers[0].kernel[...], model(0, width=8).layers[0].kernel[...])


def test_multi_file_save_into_a_full_filesystem_keeps_every_previous_file(small_fs):
    # Each kernel is 96 KiB and gets a file of its own. The old checkpoint plus one
    # new file fit; the second new file does not. Writing files one by one, each
    # renamed as it completes, would leave a new first file beside an old second one.
    fs = small_fs(320 << 10)
    directory = fs / "ckpt"
    nnx_save.save_model(model(0), directory, max_shard_size=100_000)
    before = snapshot(directory)
    assert len(before) == 3 and "model.safetensors.index.json" in before
    with pytest.raises(
        nnx_save.SaveError,
        match=r"ckpt/model-0000[12]-of-00002\.[0-9a-f]{8}\.safetensors: save failed "
        r"\(no space left on the device\)",
    ):
        nnx_save.save_model(model(1), directory, max_shard_size=100_000)
    assert snapshot(directory) == before  # the same names and bytes: no new file, no temporary
    restored, _ = nnx_save.load_model(lambda: model(7), directory, strict=True)
    for i in (0, 1):
        np.testing.assert_array_equal(restored.layers[i].kernel[...], model(0).layers[i].kernel[...])


def test_no_inode_left_for_the_temporary_file(small_fs):
    fs = small_fs(1 << 20, inodes=2)  # the root directory and one file
    path = fs / "m.safetensors"
    nnx_save.save_file({"w": np.zeros(4, np.float32)}, path)
    before = snapshot(fs)
    with pytest.raises(
        nnx_save.SaveError, match=re.escape(f"{path}: cannot create a temporary file in {fs}: No space left on device")
    ):
        nnx_save.save_file({"w": np.ones(4, np.float32)}, path)
    assert snapshot(fs) == before


def test_store_save_into_a_full_filesystem_keeps_the_previous_steps(small_fs):
    fs = small_fs(1 << 20)
    w = np.arange(64, dtype=np.float32)
    with OrbaxCheckpointStore(fs / "ckpt") as store:
        store.save(1, {"model": {"w": w}})
        with pytest.raises(Exception, match="No space left on device"):
            store.save(2, {"model": {"w": noise()}})  # 2 MiB that zstd cannot shrink
        assert store.list_steps() == [1]
    with OrbaxCheckpointStore(fs / "ckpt") as store:  # a fresh store: the next save cleans up
        assert store.list_steps() == [1]
        np.testing.assert_array_equal(store.restore(1).items["model"]["w"], w)
        store.save(2, {"model": {"w": w + 1}})
        np.testing.assert_array_equal(store.restore(2).items["model"]["w"], w + 1)
    assert sorted(os.listdir(fs / "ckpt")) == [
        "1",
        "2",
        "_nnx_save.lock",
        "_nnx_save_store.json",
    ]  # the writer lock, the retention record


def test_store_save_into_a_full_filesystem_raises_a_typed_error(small_fs):
    fs = small_fs(1 << 20)
    with OrbaxCheckpointStore(fs / "ckpt") as store:
        store.save(1, {"model": {"w": np.zeros(4, np.float32)}})
        with pytest.raises(CheckpointWriteError, match=re.escape(f"{fs / 'ckpt'}: step 2 was not written (")) as info:
            store.save(2, {"model": {"w": noise()}})
        assert isinstance(info.value, nnx_save.NnxSaveError) and info.value.step == 2
        assert "No space left on device" in str(info.value)
        assert store.list_steps() == [1]


def _fill(fs: Path) -> None:
    """Take every free byte of ``fs`` (a tmpfs: pages; inodes stay free)."""
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 4096, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)


def _save_multi_file(directory: Path, w: np.ndarray) -> None:
    nnx_save.save_file({"a": w, "b": w + 1}, directory, max_shard_size=w.nbytes)


def _save_pod(directory: Path, w: np.ndarray) -> None:
    nnx_save.save_pod({"a": w, "b": w + 1}, directory)


def _save_store(directory: Path, w: np.ndarray) -> None:
    with OrbaxCheckpointStore(directory) as store:
        store.save(int(w[0]) + 1, {"model": {"a": w}})


def _load_back(directory: Path, save) -> np.ndarray:
    if save is _save_store:
        with OrbaxCheckpointStore(directory) as store:
            return np.asarray(store.restore(store.latest_step()).items["model"]["a"])
    return np.asarray(nnx_save.load_file(directory)["a"])


@pytest.mark.parametrize("flock", ["flock", "no flock"])
@pytest.mark.parametrize("save", [_save_multi_file, _save_pod, _save_store])
def test_a_full_disk_at_the_lock_record_is_a_typed_error_and_leaves_no_lock(small_fs, monkeypatch, save, flock):
    """The writer's lock record is the first byte a directory save writes: on a full disk it
    fails as a :class:`SaveError` naming the lock file, no lock file stays (with ``flock``
    or without, where the record is the lock), and the previous version still loads."""
    if flock == "no flock":
        import errno

        from nnx_save.io import _lock

        def no_flock(fd, operation):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(_lock.fcntl, "flock", no_flock)
    fs = small_fs(4 << 20)
    directory = fs / "ckpt"
    save(directory, np.zeros(64, np.float32))
    before = {name for name in os.listdir(directory) if name != "_nnx_save.lock"}
    _fill(fs)
    lock = directory / "_nnx_save.lock"
    with pytest.raises(
        nnx_save.SaveError,
        match=re.escape(
            f"{lock}: cannot write the writer's lock record (No space left on device); nothing was written"
        ),
    ):
        save(directory, np.ones(64, np.float32))
    assert set(os.listdir(directory)) == before
    os.unlink(fs / "filler")
    np.testing.assert_array_equal(_load_back(directory, save), np.zeros(64, np.float32))


# --- RLIMIT_FSIZE: the same failures without root ------------------------------------------------

_LIMITED = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import numpy as np
    from flax import nnx
    import nnx_save

    directory = sys.argv[1]
    def model(seed, width):
        return nnx.Sequential(nnx.Linear(width, 256, rngs=nnx.Rngs(seed)), nnx.Linear(256, width, rngs=nnx.Rngs(seed + 1)))

    file, mfile, mdir = (os.path.join(directory, n) for n in ("t.safetensors", "m.safetensors", "multi"))
    nnx_save.save_file({"w": np.arange(16, dtype=np.float32)}, file)
    nnx_save.save_model(model(0, 8), mfile)
    nnx_save.save_model(model(0, 96), mdir, max_shard_size=100_000)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    results = {}
    for name, save in [("save_file", lambda: nnx_save.save_file({"w": np.ones(1 << 16, np.float32)}, file)),
                       ("save_model", lambda: nnx_save.save_model(model(1, 96), mfile)),
                       ("multi_file", lambda: nnx_save.save_model(model(1, 96), mdir, max_shard_size=100_000))]:
        try:
            save()
            results[name] = None
        except Exception as e:
            results[name] = [type(e).__name__, isinstance(e, nnx_save.NnxSaveError), str(e), getattr(e, "file", None)]
    print(json.dumps(results))
    """
)


def test_rlimit_fsize_save_errors_keep_previous_files_and_remove_temporaries(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    done = subprocess.run([sys.executable, "-c", _LIMITED, str(tmp_path)], capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    results = json.loads(done.stdout.decode().strip().splitlines()[-1])
    for name, target in [("save_file", tmp_path / "t.safetensors"), ("save_model", tmp_path / "m.safetensors")]:
        kind, typed, message, path = results[name]
        assert (kind, typed, path) == ("SaveError", True, str(target)), results[name]
        assert message == f"{target}: save failed (no space left on the device); the previous file, if any, is intact"
    kind, typed, message, path = results["multi_file"]
    assert (kind, typed) == ("SaveError", True) and re.fullmatch(
        rf"{re.escape(str(tmp_path / 'multi'))}/model-0000[12]-of-00002\.[0-9a-f]{{8}}\.safetensors: save failed "
        r"\(no space left "
        r"on the device\); the previous file, if any, is intact",
        message,
    ), results["multi_file"]
    # The previous files, bit for bit in value, and nothing else.
    np.testing.assert_array_equal(nnx_save.load_file(tmp_path / "t.safetensors")["w"], np.arange(16, dtype=np.float32))
    restored, _ = nnx_save.load_model(lambda: model(9, width=8), tmp_path / "m.safetensors", strict=True)
    np.testing.assert_array_equal(restored.layers[1].kernel[...], model(0, width=8).layers[1].kernel[...])
    restored, _ = nnx_save.load_model(lambda: model(9), tmp_path / "multi", strict=True)
    np.testing.assert_array_equal(restored.layers[1].kernel[...], model(0).layers[1].kernel[...])
    names = [n for d in (tmp_path, tmp_path / "multi") for n in os.listdir(d)]
    assert not [n for n in names if TMP_MARKER in n], names
    assert sorted(os.listdir(tmp_path / "multi")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


# --- a multi-process save into a full filesystem -------------------------------------------------

_MP_WORKER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {workers!r})
    import mp_boot
    ctx = mp_boot.init()
    import jax
    import numpy as np
    import nnx_save

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    whole = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)  # 1 MiB over both processes
    w = jax.make_array_from_callback(whole.shape, sharding, lambda i: whole[i])
    try:
        nnx_save.save_file({{"w": w}}, ctx.args["path"])
        error = None
    except nnx_save.SaveError as e:
        error = [str(e), e.file]
    ctx.write({{"error": error}})
    """
)


@pytest.mark.slow  # two JAX processes
@pytest.mark.multiprocess
def test_multi_process_save_into_a_full_filesystem(small_fs, tmp_path):
    import importlib.util

    harness_path = Path(__file__).parents[1] / "multiprocess" / "conftest.py"
    spec = importlib.util.spec_from_file_location("reliability_mp_harness", harness_path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    fs = small_fs(256 << 10)
    path = fs / "m.safetensors"
    nnx_save.save_file({"w": np.arange(16, dtype=np.float32)}, path)
    before = snapshot(fs)
    worker = tmp_path / "save_full.py"
    worker.write_text(_MP_WORKER.format(workers=str(harness.WORKERS)))
    workers = harness.launch(str(worker), 2, 2, tmp_path / "run", {"path": str(path)}, timeout=120)
    for w in workers:
        message, where = w.result["error"]
        assert where == str(path), w.describe()
        assert (
            message.startswith(f"{path}: the multi-process save failed (process ")
            and "No space left on device" in message
            and "the previous file, if any, is intact" in message
        ), message
    assert snapshot(fs) == before  # the previous file, and no temporary file
