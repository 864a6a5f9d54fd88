"""Layouts as pieces: pod manifests are validated (pieces inside the shape, pairwise
disjoint, covering it exactly) before any byte is read, and pod loads go through the
one engine: pieces spanning a needed box fill it in place, with held-dtype casting,
verify, statistics and progress like any load.

Pods here are written by hand (one process cannot make pieces with save_pod):
each "process" file is a standard safetensors file of boxes, plus a manifest.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from _errors import raises_check
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_save
from nnx_save.format._boxes import check_tiling

DEV = jax.devices()
TOKEN = "0123abcd"


def _write_pod(tmp_path, tensors: dict[str, tuple[np.ndarray, list[list[tuple[int, int]]]]], code=None):
    """Pieces per process: ``tensors[key] = (full array, [boxes of process 0, of process 1])``."""
    n = max(len(boxes) for _, boxes in tensors.values())
    files = [f"shard_{p:05d}-of-{n:05d}.{TOKEN}.safetensors" for p in range(n)]
    contents: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    manifest = {"format": "nnx_save.pod", "version": 1, "num_processes": n, "metadata": {}, "tensors": {}}
    for key, (full, per_process) in tensors.items():
        pieces = []
        for p, boxes in enumerate(per_process):
            for box in boxes:
                name = f"{key}[{','.join(f'{lo}:{hi}' for lo, hi in box)}]"
                contents[p][name] = np.ascontiguousarray(full[tuple(slice(lo, hi) for lo, hi in box)])
                pieces.append({"file": files[p], "name": name, "box": [list(b) for b in box], "process": p})
        dtype = code or {"float32": "F32", "bfloat16": "BF16", "int32": "I32"}[str(full.dtype)]
        manifest["tensors"][key] = {"dtype": dtype, "shape": list(full.shape), "pieces": pieces}
    for f, content in zip(files, contents, strict=True):
        nnx_save.save_file(content, tmp_path / f)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def _edit_manifest(pod, edit) -> None:
    m = json.loads((pod / "manifest.json").read_text())
    edit(m)
    (pod / "manifest.json").write_text(json.dumps(m))


def test_overlapping_pieces_are_refused_naming_the_tensor_and_boxes(tmp_path):
    # volumes sum to 8, yet [6, 8) is never written
    full = np.arange(8, dtype=np.float32)
    pod = _write_pod(tmp_path, {"w": (full, [[((0, 6),)], [((1, 3),)]])})
    where = pod / "manifest.json"
    with raises_check("pieces", match=re.escape(f"{where}: tensor 'w': pieces [[0, 6]] and [[1, 3]] overlap")):
        nnx_save.read_header(pod)
    with pytest.raises(nnx_save.HeaderError):  # the typed error is a HeaderError, also with verify=True
        nnx_save.load_file(pod, verify=True)


def test_a_hole_and_a_box_outside_the_shape_are_refused(tmp_path):
    full = np.arange(8, dtype=np.float32)
    pod = _write_pod(tmp_path, {"w": (full, [[((0, 4),)], [((4, 8),)]])})
    _edit_manifest(pod, lambda m: m["tensors"]["w"]["pieces"].pop())
    with raises_check("pieces", match=re.escape("tensor 'w': pieces [[[0, 4]]] cover 4 of the 8 elements")):
        nnx_save.read_header(pod)
    pod = _write_pod(tmp_path, {"w": (full, [[((0, 4),)], [((4, 8),)]])})
    _edit_manifest(pod, lambda m: m["tensors"]["w"]["pieces"][1].update(box=[[4, 9]]))
    with raises_check("pieces", match=re.escape("tensor 'w': piece [[4, 9]] does not lie inside shape [8]")):
        nnx_save.read_header(pod)


@pytest.mark.parametrize("bad", [["shard", "w", [[0, 8]]], "w", 3, None])
def test_a_piece_that_is_not_an_object_is_a_typed_error(tmp_path, bad):
    pod = _write_pod(tmp_path, {"w": (np.arange(8, dtype=np.float32), [[((0, 8),)]])})
    _edit_manifest(pod, lambda m: m["tensors"]["w"]["pieces"].append(bad))
    with raises_check(
        "pieces",
        match=re.escape(f"tensor 'w': piece {bad!r:.80} must be an object with file, name and box"),
    ):
        nnx_save.read_header(pod)


def test_a_box_of_the_wrong_rank_or_type_is_refused(tmp_path):
    pod = _write_pod(tmp_path, {"w": (np.arange(8, dtype=np.float32), [[((0, 8),)]])})
    _edit_manifest(pod, lambda m: m["tensors"]["w"]["pieces"][0].update(box=[[0, 8.0]]))
    with raises_check("pieces", match=re.escape("must be 1 [start, stop) integer pairs")):
        nnx_save.read_header(pod)


def test_tiling_check_is_fast_and_exact_for_many_pieces():
    rows = [((i, i + 1), (0, 4)) for i in range(4096)]
    check_tiling("w", (4096, 4), rows + rows[:7], "m")  # replicas of the same boxes are fine
    with raises_check("pieces", match=re.escape("pieces [[10, 12], [1, 2]] and [[10, 11], [0, 4]] overlap")):
        check_tiling("w", (4096, 4), [*rows[:10], ((10, 12), (1, 2)), *rows[10:]], "m")


def _sharded(shape, spec, devices=8):
    return NamedSharding(Mesh(np.array(DEV[:devices]), ("x",)), spec)


def test_a_needed_box_spanning_several_pieces_is_filled_in_place(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 12)).astype(np.float32)
    b = rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16)
    # pieces split on the last dim across two processes, and a 2x2 grid
    pod = _write_pod(
        tmp_path,
        {
            "a": (a, [[((0, 16), (0, 5))], [((0, 16), (5, 12))]]),
            "b": (b, [[((0, 4), (0, 3)), ((4, 8), (3, 6))], [((0, 4), (3, 6)), ((4, 8), (0, 3))]]),
        },
    )
    abstract = {
        "a": jax.ShapeDtypeStruct(a.shape, np.float32, sharding=_sharded(a.shape, P("x", None))),  # rows: every piece
        "b": jax.ShapeDtypeStruct(b.shape, np.float32, sharding=_sharded(b.shape, P(None, None))),  # cast, whole
    }
    with pytest.warns(nnx_save.LoadWarning, match=re.escape("dtype: b: bfloat16 in the file -> float32 in the model")):
        tree, report = nnx_save.load_file(pod, abstract, verify=True, return_report=True)
    np.testing.assert_array_equal(np.asarray(tree["a"]), a)
    np.testing.assert_array_equal(np.asarray(tree["b"]), b.astype(np.float32))
    assert tree["a"].sharding == abstract["a"].sharding and tree["b"].dtype == np.float32
    for shard in tree["a"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), a[shard.index])
    assert [c.path for c in report.dtype_casts] == ["b"]  # the held dtype, reported like any load
    assert report.verified == ["a", "b"] and report.unverified == []  # every piece read in full
    assert report.io.files == 2 and report.io.bytes_needed == a.nbytes + b.nbytes


def test_pieces_read_in_strips_are_unverified_and_whole_ones_verified(tmp_path):
    a = np.arange(4 * 4096, dtype=np.float32).reshape(4, 4096)
    pod = _write_pod(tmp_path, {"a": (a, [[((0, 2), (0, 4096))], [((2, 4), (0, 4096))]])})
    sharding = _sharded(a.shape, P(None, "x"))  # every device wants a column strip of both pieces
    abstract = {"a": jax.ShapeDtypeStruct(a.shape, np.float32, sharding=sharding)}
    tree, report = nnx_save.load_file(pod, abstract, verify=True, return_report=True, max_over_read_ratio=1.0)
    np.testing.assert_array_equal(np.asarray(tree["a"]), a)
    assert (report.verified, report.unverified) == ([], ["a"])  # column strips: no file-order bytes to hash
    one = NamedSharding(Mesh(np.array(DEV[:1]), ("x",)), P())
    part = {"a": jax.ShapeDtypeStruct((4, 4096), np.float32, sharding=one)}
    tree, report = nnx_save.load_file(pod, part, verify=True, return_report=True)
    assert report.verified == ["a"]


class _FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_a_pod_load_advances_the_progress_bar(tmp_path, monkeypatch):
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    pod = _write_pod(tmp_path, {"a": (a, [[((0, 8), (0, 4))], [((0, 8), (4, 8))]]), "c": (a + 1, [[((0, 8), (0, 8))]])})
    tty = _FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    tree = nnx_save.load_file(pod, {"a": a, "c": a}, progress=True)
    np.testing.assert_array_equal(tree["c"], a + 1)
    assert re.search(r"\rloading 2 files \(pod\) 100% \|#+\| 512 B/512 B  2/2 tensors", tty.getvalue())


def test_a_manifest_is_read_like_an_index_duplicate_keys_fifo_and_size_refused(tmp_path, monkeypatch):
    # A repeated key would let json.loads keep the last of two piece lists in silence.
    full = np.arange(8, dtype=np.float32)
    pod = _write_pod(tmp_path, {"w": (full, [[((0, 4),)], [((4, 8),)]])})
    where = pod / "manifest.json"
    text = where.read_text()
    where.write_text(text.replace('"num_processes": 2', '"num_processes": 2, "num_processes": 3'))
    with pytest.raises(
        nnx_save.HeaderError, match=re.escape(f"{where}: key 'num_processes' appears more than once in the manifest")
    ):
        nnx_save.read_header(pod)
    where.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(nnx_save.HeaderError, match=re.escape(f"{where}: not a valid JSON manifest")):
        nnx_save.read_header(pod)
    # A FIFO named manifest.json is refused without blocking on its open.
    where.unlink()
    os.mkfifo(where)
    with pytest.raises(nnx_save.SourceError, match=re.escape(f"{where}: is a FIFO, not a regular file")):
        nnx_save.read_header(pod)
    # A manifest larger than any index cap is refused before it is read.
    where.unlink()
    where.write_text(text)
    monkeypatch.setattr(nnx_save.layouts._pod, "MAX_INDEX_BYTES", len(text) - 1)
    with pytest.raises(
        nnx_save.HeaderError,
        match=re.escape(f"{where}: manifest of {len(text)} bytes exceeds the cap of {len(text) - 1}"),
    ):
        nnx_save.read_header(pod)
