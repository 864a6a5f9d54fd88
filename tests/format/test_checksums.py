"""Per-tensor xxh3_64 checksums: recorded by every save, checked by verify=True loads."""

import json
import re

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import xxhash
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_save
from nnx_save.format import _checksum


def _tree():
    return {
        "a": np.arange(64, dtype=np.float32).reshape(8, 8),
        "b": np.arange(16, dtype=np.int8),
        "c": np.ones((8, 4), ml_dtypes.bfloat16),
        "s": np.asarray(3.5, np.float64),
    }


def _digests(path):
    return json.loads(nnx_save.read_header(path).metadata[_checksum.KEY])


def _flip(path, key, at=0):
    info = nnx_save.read_header(path)[key]
    with open(path, "r+b") as f:
        f.seek(info.begin + at)
        byte = f.read(1)
        f.seek(info.begin + at)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "w.safetensors"
    nnx_save.save_file(_tree(), path, metadata={"note": "kept"})
    return path


def test_save_records_xxh3_of_stored_bytes(saved):
    meta = nnx_save.read_header(saved).metadata
    assert meta["note"] == "kept" and meta[_checksum.ALGORITHM_KEY] == "xxh3_64"
    raw = saved.read_bytes()
    header = nnx_save.read_header(saved)
    assert _digests(saved) == {k: xxhash.xxh3_64_hexdigest(raw[t.begin : t.end]) for k, t in header.tensors.items()}
    # still a standard file: the reference reader loads it and sees the metadata
    loaded = safetensors.numpy.load_file(saved)
    np.testing.assert_array_equal(loaded["a"], _tree()["a"])


def test_stale_checksums_in_caller_metadata_are_replaced(tmp_path):
    path = tmp_path / "w.safetensors"
    stale = {_checksum.KEY: json.dumps({"a": "f" * 16}), _checksum.ALGORITHM_KEY: "other"}
    nnx_save.save_file({"a": np.ones(3, np.float32)}, path, metadata=stale)
    assert _digests(path)["a"] == xxhash.xxh3_64_hexdigest(np.ones(3, np.float32).tobytes())
    assert nnx_save.read_header(path).metadata[_checksum.ALGORITHM_KEY] == "xxh3_64"


def test_verified_load_of_an_intact_file(saved):
    tree, report = nnx_save.load_file(saved, verify=True, return_report=True)
    assert report.verified == ["a", "b", "c", "s"] and report.unverified == []
    assert "checksums: 4 verified, 0 not verifiable" in str(report)
    np.testing.assert_array_equal(tree["b"], _tree()["b"])


def test_flipped_byte_raises_naming_the_tensor(saved):
    _flip(saved, "b", at=5)
    with pytest.raises(
        nnx_save.ChecksumError, match=re.escape(f"{saved}: tensor 'b': checksum mismatch (xxh3_64 recorded ")
    ) as e:
        nnx_save.load_file(saved, verify=True)
    assert e.value.key == "b" and e.value.file == str(saved) and e.value.expected != e.value.found
    assert isinstance(e.value, nnx_save.NnxSaveError)
    assert nnx_save.load_file(saved)["b"][5] == 5 ^ 1  # verify=False (the default) reads the bytes as they are


def test_abstract_load_verifies_too(saved):
    _flip(saved, "a", at=3)
    abstract = {"a": jax.ShapeDtypeStruct((8, 8), np.float32)}
    with pytest.raises(nnx_save.ChecksumError, match=re.escape("tensor 'a': checksum mismatch")):
        nnx_save.load_file(saved, abstract, verify=True, allow_unexpected=["*"])


def test_file_without_checksums_is_reported_unverified(tmp_path):
    path = tmp_path / "ref.safetensors"
    safetensors.numpy.save_file({"x": np.ones(4, np.float32), "y": np.zeros(2, np.int32)}, str(path))
    _, report = nnx_save.load_file(path, verify=True, return_report=True)
    assert report.verified == [] and report.unverified == ["x", "y"]


def test_partial_checksum_map_is_tolerated(tmp_path):
    # as the multi-process writer leaves it: tensors split across processes have no entry
    path = tmp_path / "partial.safetensors"
    x = np.ones(4, np.float32)
    meta = {_checksum.KEY: json.dumps({"x": xxhash.xxh3_64_hexdigest(x.tobytes())})}
    safetensors.numpy.save_file({"x": x, "y": np.zeros(2, np.int32)}, str(path), metadata=meta)
    _, report = nnx_save.load_file(path, verify=True, return_report=True)
    assert report.verified == ["x"] and report.unverified == ["y"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "__metadata__['nnx_save.checksums'] is not valid JSON"),
        ('{"x": "abc"}', "__metadata__['nnx_save.checksums'] must map tensor names to 16 hex digits"),
    ],
)
def test_malformed_checksum_metadata(tmp_path, bad, message):
    path = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file({"x": np.ones(4, np.float32)}, str(path), metadata={_checksum.KEY: bad})
    with pytest.raises(nnx_save.ChecksumError, match=re.escape(f"{path}: {message}")):
        nnx_save.load_file(path, verify=True)
    nnx_save.load_file(path)  # without verify the metadata is not consulted


def test_unknown_algorithm(tmp_path):
    path = tmp_path / "algo.safetensors"
    meta = {_checksum.KEY: json.dumps({"x": "0" * 16}), _checksum.ALGORITHM_KEY: "sha1"}
    safetensors.numpy.save_file({"x": np.ones(4, np.float32)}, str(path), metadata=meta)
    with pytest.raises(
        nnx_save.ChecksumError,
        match=re.escape("checksums use algorithm 'sha1'; this version of nnx_save knows only 'xxh3_64'"),
    ):
        nnx_save.load_file(path, verify=True)


def test_sharded_load_checks_leading_dim_tilings_only(saved):
    mesh = jax.make_mesh((8,), ("x",))
    rows = {"a": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x", None)))}
    cols = {"a": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P(None, "x")))}
    _, report = nnx_save.load_file(saved, rows, verify=True, allow_unexpected=["*"], return_report=True)
    assert report.verified == ["a"]
    _, report = nnx_save.load_file(saved, cols, verify=True, allow_unexpected=["*"], return_report=True)
    assert report.verified == [] and report.unverified == ["a"]
    _flip(saved, "a", at=200)
    with pytest.raises(nnx_save.ChecksumError, match=re.escape("tensor 'a': checksum mismatch")):
        nnx_save.load_file(saved, rows, verify=True, allow_unexpected=["*"])


def test_full_buffers_rules():
    assert _checksum.full_buffers((4, 2), [(((0, 4), (0, 2)), "w")]) == ["w"]
    assert _checksum.full_buffers((4, 2), [(((2, 4), (0, 2)), "b"), (((0, 2), (0, 2)), "a")]) == ["a", "b"]
    assert _checksum.full_buffers((4, 2), [(((0, 2), (0, 2)), "a")]) is None  # half the rows
    assert _checksum.full_buffers((4, 2), [(((0, 4), (0, 1)), "a"), (((0, 4), (1, 2)), "b")]) is None
    assert _checksum.full_buffers((), [((), "s")]) == ["s"]


def test_models_and_multifile_checkpoints(tmp_path):
    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    nnx_save.save_model(model, tmp_path / "sharded", max_shard_size=100)
    files = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 1 and all(_checksum.KEY in nnx_save.read_header(f).metadata for f in files)

    def build():
        return nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(5)), nnx.Linear(8, 2, rngs=nnx.Rngs(5)))

    _, report = nnx_save.load_model(build, tmp_path / "sharded", verify=True, strict=True)
    assert len(report.verified) == 4 and report.unverified == []
    victim = next(k for k in nnx_save.read_header(tmp_path / "sharded") if k.endswith("kernel"))
    info = nnx_save.read_header(tmp_path / "sharded")[victim]
    _flip(info.file, victim)
    with pytest.raises(nnx_save.ChecksumError, match=re.escape(f"{info.file}: tensor {victim!r}: checksum mismatch")):
        nnx_save.load_model(build, tmp_path / "sharded", verify=True)
