"""The pod layout through the public API: a full disk keeps the previous pod, a
huge manifest validates fast, a directory with two records is refused, the CLI
verifies and compares pods, and save_pod saves in the background with a progress
bar like save_file. (Multi-process pods: tests/multiprocess/test_pod.py.)"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import time

import jax
import numpy as np
import pytest
from _errors import raises_check
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reliability.test_reliability_disk import small_fs, snapshot  # noqa: F401 (small_fs: a fixture, shared)
from test_layout import _write_pod

import nnx_save
from nnx_save.cli import main as cli

SHARD = "shard_00000-of-00001.0123abcd.safetensors"


def _tree(n: int, value: float) -> dict[str, np.ndarray]:
    return {f"layer_{i:05d}": {"scale": np.full(4, value, np.float32)} for i in range(n)}


def test_a_full_disk_during_the_manifest_keeps_the_previous_pod(small_fs):  # noqa: F811 (the fixture)
    fs = small_fs(4 << 20)
    pod = fs / "pod"
    first = _tree(2000, 1.0)  # a manifest of ~500 KB: more than the room left below
    nnx_save.save_pod(first, pod)
    before = snapshot(pod)
    shard = next(n for n in before if n.startswith("shard_"))
    st = os.statvfs(fs)
    room = len(before[shard]) + len(before["manifest.json"]) // 3  # the new shard file fits, its manifest does not
    (fs / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - room))
    where = pod / "manifest.json"
    with pytest.raises(nnx_save.SaveError, match=re.escape(f"{where}: save failed (no space left on the device)")):
        nnx_save.save_pod(_tree(2000, 2.0), pod)
    assert snapshot(pod) == before  # the new shard file and the temporary manifest are gone
    loaded = nnx_save.load_file(pod)
    assert len(loaded) == len(first) and all((v == 1.0).all() for v in loaded.values())
    (fs / "filler").unlink()
    nnx_save.save_pod(_tree(2000, 2.0), pod)  # the space came back
    assert all((v == 2.0).all() for v in nnx_save.load_file(pod).values())


def _manifest(pod, boxes: list[list[list[int]]], shape: list[int]) -> None:
    pieces = [
        {"file": SHARD, "name": f"w[{i}]", "box": box, "process": 0} for i, box in enumerate(boxes)
    ]  # the shard file is not here: only a load would need it
    tensors = {"w": {"dtype": "F32", "shape": shape, "pieces": pieces}}
    manifest = {"format": "nnx_save.pod", "version": 1, "num_processes": 1, "metadata": {}, "tensors": tensors}
    (pod / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_of_100000_pieces_validates_fast_and_still_finds_an_overlap(tmp_path):
    n = 100_000
    rows = [[[i, i + 1], [0, 2]] for i in range(n)]
    _manifest(tmp_path, rows, [n, 2])
    t0 = time.perf_counter()
    header = nnx_save.read_header(tmp_path)
    assert time.perf_counter() - t0 < 5  # a guard only: the pairwise check took minutes
    assert header["w"].shape == (n, 2) and header.missing_files == (SHARD,)
    where = tmp_path / "manifest.json"
    _manifest(tmp_path, [*rows, [[n - 3, n - 1], [1, 2]]], [n, 2])  # one irregular piece, listed last
    t0 = time.perf_counter()
    with raises_check(
        "pieces",
        match=re.escape(f"{where}: tensor 'w': pieces [[{n - 3}, {n - 2}], [0, 2]] and [[{n - 3}, {n - 1}], [1, 2]]"),
    ):
        nnx_save.read_header(tmp_path)
    assert time.perf_counter() - t0 < 5
    _manifest(tmp_path, [*rows[:500], [[499, 501], [1, 2]], *rows[500:1000]], [1000, 2])  # mid-list
    with raises_check("pieces", match=re.escape("pieces [[499, 500], [0, 2]] and [[499, 501], [1, 2]] overlap")):
        nnx_save.read_header(tmp_path)


def test_an_irregular_layout_too_large_to_check_is_refused_by_the_cap(tmp_path):
    n = 3000  # staggered cuts in both dimensions: a grid of n * n cells, more than the pairwise bound
    boxes = [[[i, i + 1], [0, n - i]] for i in range(n)] + [[[i, i + 1], [n - i, n]] for i in range(1, n)]
    _manifest(tmp_path, boxes, [n, n])
    with raises_check("pieces", match=re.escape("pieces of irregular sizes (more than 2048")):
        nnx_save.read_header(tmp_path)


def test_a_directory_with_both_an_index_and_a_pod_manifest_is_refused(tmp_path):
    pod, hf = tmp_path / "pod", tmp_path / "hf"
    nnx_save.save_pod({"w": np.zeros(8, np.float32)}, pod)
    from flax import nnx

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    nnx_save.save_model(model, hf, max_shard_size=16)
    for name in os.listdir(hf):
        shutil.copy(hf / name, pod / name)
    expected = (
        f"{pod}: holds both manifest.json (pod) and model.safetensors.index.json (index), so it is two checkpoints "
        "and nnx_save will not guess which one is current. Remove the record of the stale one"
    )
    for call in (nnx_save.read_header, nnx_save.load_file):
        with raises_check("layout", match=re.escape(expected)) as info:
            call(pod)
        assert info.value.file == str(pod)
    os.unlink(pod / "manifest.json")  # the remedy: one record left
    assert nnx_save.read_header(pod).kind == "index"


def test_verify_and_diff_read_a_pod(tmp_path, capsys):
    full = np.arange(16, dtype=np.float32)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = _write_pod(tmp_path / "a", {"w": (full, [[((0, 8),)], [((8, 16),)]])})
    b = _write_pod(tmp_path / "b", {"w": (full * (np.arange(16) != 11), [[((0, 8),)], [((8, 16),)]])})
    assert cli(["verify", str(a)]) == 0
    out = capsys.readouterr().out
    assert f"verify: {a}: 2 file(s), 1 tensors, 2 verified, 0 without a checksum, 0 problem(s)" in out
    assert cli(["diff", str(a), str(a)]) == 0
    assert cli(["diff", str(a), str(b)]) == 1
    assert "values: w: max |a - b| = 11" in capsys.readouterr().out
    shard = next(p for p in sorted(a.iterdir()) if p.name.startswith("shard_00001"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli(["verify", str(a)]) == 1
    assert re.search(rf"FAIL {re.escape(str(shard))}: tensor 'w\[8:16\]': checksum mismatch", capsys.readouterr().out)


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_save_pod_in_the_background_with_a_progress_bar(tmp_path, monkeypatch):
    tty = _TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharded = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("x")))
    host = np.arange(5, dtype=np.int32)
    handle = nnx_save.save_pod({"s": sharded, "h": host}, tmp_path, blocking=False, progress=True)
    assert isinstance(handle, nnx_save.SaveHandle)
    host[:] = -1  # after the call: the snapshot keeps the saved values
    assert handle.result() == tmp_path
    assert tty.getvalue() == ""  # a background save draws no bar over the caller's output
    loaded = nnx_save.load_file(tmp_path)
    np.testing.assert_array_equal(loaded["s"], np.arange(64, dtype=np.float32).reshape(8, 8))
    np.testing.assert_array_equal(loaded["h"], np.arange(5, dtype=np.int32))
    assert nnx_save.save_pod({"h": host}, tmp_path, progress=True) == tmp_path / "manifest.json"
    assert re.search(r"\rsaving shard_00000-of-00001\.[0-9a-f]{8}\.safetensors 100% .*1/1 tensors", tty.getvalue())


def _dup(m: dict) -> str:
    m["tensors"]["a"]["pieces"].append(dict(m["tensors"]["a"]["pieces"][0]))
    return "manifest.json: tensor 'a': piece 'a' of shard_00000-of-00001."


def _process(value: object):
    def edit(m: dict) -> str:
        m["tensors"]["a"]["pieces"][0]["process"] = value
        return f"process must be an integer from 0 to 0 (num_processes is 1), found {value!r}"

    return edit


def _processes(value: object):
    def edit(m: dict) -> str:
        m["num_processes"] = value
        return f'manifest.json: "num_processes" must be an integer from 1 to 99999, found {value!r}'

    return edit


def _save_id(m: dict) -> str:
    was, m["save_id"] = m["save_id"], "0badc0de"
    return f"manifest.json: is save 0badc0de, but its shard file shard_00000-of-00001.{was}.safetensors is save {was}"


@pytest.mark.parametrize(
    ("edit", "check"),
    [
        (_dup, "pieces"),
        (_process(-1), "manifest"),
        (_process(10**30), "manifest"),
        (_process(1), "manifest"),
        (_process("0"), "manifest"),
        (_processes(0), "manifest"),
        (_processes(10**12), "manifest"),
        (_save_id, "manifest"),
    ],
)
def test_a_manifest_with_a_repeated_piece_a_foreign_process_or_another_save_is_refused(tmp_path, edit, check):
    """Each of these loaded in silence: a piece listed twice, a process outside the pod,
    an absurd process count, a save id that is not its shard files'."""
    nnx_save.save_pod({"a": np.arange(4, dtype=np.float32), "b": np.ones(3, np.float32)}, tmp_path)
    np.testing.assert_array_equal(nnx_save.load_file(tmp_path)["a"], np.arange(4))  # whole before the edit
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    message = edit(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with raises_check(check, match=re.escape(message)):
        nnx_save.load_file(tmp_path)
