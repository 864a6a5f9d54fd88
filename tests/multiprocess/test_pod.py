"""The pod layout (save_pod): one shard file per process plus a manifest; loads
on the same process layout read only their own file, other layouts reshard."""

from __future__ import annotations

import json
import os
import re
import shutil

import mp_common as c
import numpy as np
import pytest

import nnx_save

pytestmark = pytest.mark.multiprocess

SHARD = r"shard_0000{}-of-00002\.[0-9a-f]{{8}}\.safetensors"


def test_two_processes_write_one_shard_file_each_and_a_manifest(files, two):
    names = two[0].result["pod_files"]
    assert len(names) == 3 and names[0] == "manifest.json"
    assert re.fullmatch(SHARD.format(0), names[1]) and re.fullmatch(SHARD.format(1), names[2])
    with open(os.path.join(files["pod"], "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["format"] == "nnx_save.pod" and manifest["num_processes"] == 2
    assert manifest["metadata"]["made_by"] == "save_tree"
    embed = manifest["tensors"]["embed"]
    assert (embed["dtype"], embed["shape"]) == ("F32", [64, 32])
    assert "spec=P(('a', 'b'), None)" in embed["sharding"]
    assert [(p["process"], p["box"]) for p in embed["pieces"]] == [
        (i // 4, [[8 * i, 8 * i + 8], [0, 32]]) for i in range(8)
    ]  # each process its own rows
    host = manifest["tensors"]["host_table"]["pieces"]  # a value every process holds: in every file
    assert [(p["process"], p["name"]) for p in host] == [(0, "host_table"), (1, "host_table")]
    for name in names[1:]:  # each shard file is a standard safetensors file
        assert len(nnx_save.read_header(os.path.join(files["pod"], name))) > 0


def test_same_process_layout_reads_only_its_own_file(two):
    for w in two:
        job = w.result["jobs"][3]
        assert job["checked"] == 7 * 4 and job["clean"]
        assert len(job["files"]) == 1 and re.fullmatch(SHARD.format(w.process_id), job["files"][0])
        assert job["bytes_read"] == job["bytes_needed"]


def test_other_process_layouts_reshard(four):
    for w in four:
        for job in w.result["jobs"][5:7]:
            assert job["checked"] == 7 * 2 and job["clean"]


def test_one_process_reads_the_pod(files, two):
    for shape in ([8], [2, 4]):
        abstract = c.nest({**c.abstract_tree("mixed", c.mesh(shape)), **c.host_values()})
        flat = c.flat(nnx_save.load_file(files["pod"], abstract))
        assert c.check_tree("mixed", flat) == 7 * 8
    whole = nnx_save.load_file(files["pod"])  # no abstract: every tensor whole, as numpy
    single = nnx_save.load_file(files["single"])
    assert sorted(whole) == sorted(single)
    for k in single:
        np.testing.assert_array_equal(whole[k], single[k])


def test_a_missing_shard_file_is_named(files, two, tmp_path):
    pod = tmp_path / "pod"
    shutil.copytree(files["pod"], pod)
    gone = next(n for n in os.listdir(pod) if n.startswith("shard_00001"))
    os.unlink(pod / gone)
    abstract = c.nest({**c.abstract_tree("mixed", c.mesh([8])), **c.host_values()})
    with pytest.raises(nnx_save.NnxSaveError, match=re.escape(f"is in shard file(s) ['{gone}'], not present")):
        nnx_save.load_file(pod, abstract)


def test_a_new_save_replaces_the_old_shard_files(tmp_path):
    first = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    nnx_save.save_pod(first, tmp_path)
    old = sorted(os.listdir(tmp_path))
    nnx_save.save_pod({"w": first["w"] + 1}, tmp_path)
    new = sorted(os.listdir(tmp_path))
    assert len(new) == 2 and new != old and "manifest.json" in new
    np.testing.assert_array_equal(nnx_save.load_file(tmp_path)["w"], first["w"] + 1)


def test_pieces_are_checked_against_their_checksums(tmp_path):
    nnx_save.save_pod({"w": np.arange(64, dtype=np.float32)}, tmp_path)
    shard = next(p for p in tmp_path.iterdir() if p.name.startswith("shard_"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last element
    shard.write_bytes(bytes(data))
    with pytest.raises(nnx_save.ChecksumError, match=re.escape(f"{shard}: tensor 'w': checksum mismatch")):
        nnx_save.load_file(tmp_path, verify=True)
    assert nnx_save.load_file(tmp_path, verify=False)["w"][0] == 0


def test_a_foreign_manifest_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "something else"}')
    with pytest.raises(
        nnx_save.HeaderError,
        match=re.escape(
            f'{tmp_path / "manifest.json"}: not an nnx_save pod manifest (expected "format": "nnx_save.pod")'
        ),
    ):
        nnx_save.read_header(tmp_path)
