"""s3:// through obstore against moto's S3 server on 127.0.0.1 (tests/s3_server.py):
ranged reads into the caller's buffers pinned to the object's ETag, multipart uploads
that appear only when complete (and are aborted when not), listing for multi-file
saves, and the requests in flight set by the source."""

from __future__ import annotations

import io
import itertools
import re
import sys
import threading
import uuid

import boto3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save import _progress
from nnx_save.io import _object_store, _storage
from nnx_save.load._options import LoadOptions

PART = 5 << 20  # S3's smallest part


@pytest.fixture
def bucket(s3_server, monkeypatch):
    """``(client, name)``: a fresh bucket on moto, the library pointed at it by the environment."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setattr(_object_store, "PART_BYTES", PART)
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    name = f"nnx-save-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    yield client, name
    for upload in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
        client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
    for listed in client.list_objects_v2(Bucket=name).get("Contents", []):
        client.delete_object(Bucket=name, Key=listed["Key"])
    client.delete_bucket(Bucket=name)


def keys(client, name: str) -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=name).get("Contents", []))


def pending_uploads(client, name: str) -> list:
    return client.list_multipart_uploads(Bucket=name).get("Uploads", [])


def weights(seed: int = 0, rows: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)  # 12 MiB + a bit: three 5 MiB parts
    return {"embed": rng.standard_normal((rows, 768), np.float32), "bias": rng.standard_normal(768, np.float32)}


def test_a_save_is_a_multipart_upload_byte_identical_to_a_local_file(bucket, tmp_path):
    client, name = bucket
    url = f"s3://{name}/run/model.safetensors"
    nnx_save.save_file(weights(), url, metadata={"run": "7"})
    local = tmp_path / "model.safetensors"
    nnx_save.save_file(weights(), local, metadata={"run": "7"})
    got = client.get_object(Bucket=name, Key="run/model.safetensors")
    assert got["Body"].read() == local.read_bytes()
    assert re.fullmatch(r'"[0-9a-f]{32}-3"', got["ETag"]), got["ETag"]  # an S3 multipart ETag: 3 parts
    assert keys(client, name) == ["run/model.safetensors"] and pending_uploads(client, name) == []


def test_a_load_reads_ranges_into_place_and_verifies(bucket):
    _, name = bucket
    url = f"s3://{name}/model.safetensors"
    nnx_save.save_file(weights(1), url)
    poison = {k: np.full_like(v, 7.0) for k, v in weights(1).items()}
    tree, report = nnx_save.load_file(url, poison, return_report=True, verify=True, read_chunk_bytes=1 << 20)
    for key, value in weights(1).items():
        np.testing.assert_array_equal(tree[key], value)
    assert report.verified == ["bias", "embed"]
    assert report.io.bytes_read == report.io.bytes_needed == sum(v.nbytes for v in weights(1).values())
    assert report.io.requests >= 12  # 12 MiB in ranges of at most 1 MiB


def test_a_sharded_load_reads_each_device_its_rows(bucket):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _, name = bucket
    url = f"s3://{name}/model.safetensors"
    nnx_save.save_file(weights(2), url)
    mesh = jax.make_mesh((8,), ("x",))
    abstract = {
        "embed": jax.ShapeDtypeStruct((4096, 768), np.float32, sharding=NamedSharding(mesh, P("x", None))),
        "bias": jax.ShapeDtypeStruct((768,), np.float32, sharding=NamedSharding(mesh, P())),
    }
    tree = nnx_save.load_file(url, abstract)
    for key, value in weights(2).items():
        np.testing.assert_array_equal(np.asarray(tree[key]), value)
    assert len(tree["embed"].addressable_shards) == 8


def test_an_object_replaced_after_its_header_was_read_is_a_change(bucket):
    _client, name = bucket
    url = f"s3://{name}/model.safetensors"
    nnx_save.save_file(weights(3), url)
    header = nnx_save.read_header(url)
    nnx_save.save_file(weights(4), url)  # the same size, other bytes: another ETag
    with pytest.raises(nnx_save.SourceChangedError, match=re.escape(f"{url}: the object changed during the load")):
        nnx_save.load_file(header)
    np.testing.assert_array_equal(nnx_save.load_file(url)["embed"], weights(4)["embed"])


def test_a_missing_object_names_the_url(bucket):
    _, name = bucket
    url = f"s3://{name}/nothing/model.safetensors"
    with pytest.raises(FileNotFoundError, match=re.escape(url)):
        nnx_save.read_header(url)


def test_a_failed_upload_is_aborted_and_the_previous_object_stays(bucket, monkeypatch):
    """A tensor that changes between the hashing pass and the upload fails the save
    after parts were sent: the upload is aborted, the previous object is intact."""
    client, name = bucket
    url = f"s3://{name}/model.safetensors"
    nnx_save.save_file(weights(5), url)
    before = client.get_object(Bucket=name, Key="model.safetensors")["Body"].read()
    from nnx_save.save import _entry

    real, calls = _entry.host_bytes, []

    def changing(array, code):
        calls.append(code)
        data = real(array, code)
        return memoryview(bytes(len(data))) if len(calls) == 4 else data  # "embed", second pass, zeros

    monkeypatch.setattr("nnx_save.save._remote.host_bytes", changing)
    with pytest.raises(nnx_save.SaveError, match=re.escape(f"{url}: tensors ['embed'] changed while they were saved")):
        nnx_save.save_file(weights(6), url)
    assert client.get_object(Bucket=name, Key="model.safetensors")["Body"].read() == before
    assert keys(client, name) == ["model.safetensors"] and pending_uploads(client, name) == []


def test_a_multi_file_save_lists_commits_the_index_last_and_loads_back(bucket):
    client, name = bucket
    url = f"s3://{name}/ckpt"
    tree = weights(7, rows=2048)
    nnx_save.save_file(tree, url, max_shard_size=4 << 20)
    names = keys(client, name)
    assert "ckpt/model.safetensors.index.json" in names and len(names) == 3, names
    back = nnx_save.load_file(url, verify=True)
    for key, value in tree.items():
        np.testing.assert_array_equal(back[key], value)
    nnx_save.save_file(weights(8, rows=1024), url, max_shard_size=4 << 20)  # replaces: the old shards go
    assert len(keys(client, name)) == 2 and pending_uploads(client, name) == []
    np.testing.assert_array_equal(nnx_save.load_file(url)["embed"], weights(8, rows=1024)["embed"])


@settings(max_examples=30)
@given(
    cuts=st.lists(st.integers(0, 3 << 20), max_size=6),
    offset=st.integers(0, 1 << 20),
    length=st.integers(1, 3 << 20),
)
def test_readv_fills_any_split_of_any_range_exactly(blob, cuts, offset, length):
    """The reader's contract over a class of inputs: ``readv`` fills the buffers, in
    order, with exactly the object's bytes from ``offset`` (pieces of the body cross
    buffer boundaries anywhere)."""
    url, data = blob
    length = min(length, len(data) - offset)
    edges = sorted({0, length, *(c for c in cuts if c < length)})
    out = bytearray(length)
    view = memoryview(out)
    reader = _storage.open_remote(url)
    assert isinstance(reader, _object_store.ObjectStoreReader) and reader.size == len(data)
    reader.readv([view[a:b] for a, b in itertools.pairwise(edges)], offset)
    assert out == data[offset : offset + length]


@pytest.fixture(scope="module")
def blob(s3_server):
    """A 4 MiB object of random bytes on moto (module-wide: hypothesis draws many splits)."""
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    name = f"nnx-save-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    data = np.random.default_rng(9).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    client.put_object(Bucket=name, Key="blob", Body=data)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
        yield f"s3://{name}/blob", data
    client.delete_object(Bucket=name, Key="blob")
    client.delete_bucket(Bucket=name)


def test_a_remote_load_keeps_tens_of_requests_in_flight(bucket, monkeypatch):
    """Concurrency is set by the source: with the defaults, a URL gets 32 requests in
    flight whatever the CPU count (counted here at the reader)."""
    _, name = bucket
    url = f"s3://{name}/model.safetensors"
    nnx_save.save_file(weights(10, rows=8192), url)  # 24 MiB
    now = peak = 0
    lock = threading.Lock()
    real = _object_store.ObjectStoreReader._get

    def counting(self, offset, total):
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
        try:
            threading.Event().wait(0.05)  # hold the request open: the others start meanwhile
            return real(self, offset, total)
        finally:
            with lock:
                now -= 1

    monkeypatch.setattr(_object_store.ObjectStoreReader, "_get", counting)
    _, report = nnx_save.load_file(url, max_inflight_bytes=32 << 20, return_report=True)
    assert report.io.requests >= 24 and peak >= 16, (report.io.requests, peak)


def test_options_are_set_by_the_source():
    local, remote = LoadOptions().for_source(remote=False), LoadOptions().for_source(remote=True)
    assert (remote.num_threads, remote.read_chunk_bytes) == (32, 16 << 20)
    assert local.read_chunk_bytes == 128 << 20 and local.num_threads == LoadOptions().threads
    small = LoadOptions(max_inflight_bytes=8 << 20).for_source(remote=True)
    assert small.read_chunk_bytes == 1 << 20  # 1 MiB floor: the budget still bounds what is in flight
    given_ = LoadOptions(num_threads=3, read_chunk_bytes=5 << 20).for_source(remote=True)
    assert (given_.num_threads, given_.read_chunk_bytes) == (3, 5 << 20)


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_moves_per_piece_on_a_save_and_per_chunk_on_a_load(bucket, monkeypatch):
    """On a terminal, a remote save's bar moves per 8 MiB written and a load's per
    chunk read (each with its rate), not once per file."""
    _, name = bucket
    url = f"s3://{name}/model.safetensors"
    moves: list[int] = []
    real = _progress.Bar.update

    def update(self, nbytes=0, items=0):
        moves.append(nbytes)
        real(self, nbytes, items)

    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setattr(_progress.Bar, "update", update)
    tree = weights(11)
    nnx_save.save_file(tree, url, progress=True)
    embed = tree["embed"].nbytes
    assert [n for n in moves if n] == [tree["bias"].nbytes, 8 << 20, embed - (8 << 20)]
    assert re.search(
        r"\rsaving model\.safetensors 100% \|#+\| 12\.0 MiB/12\.0 MiB  2/2 tensors  .*/s  in ", tty.getvalue()
    )
    moves.clear()
    nnx_save.load_file(url, progress=True, read_chunk_bytes=1 << 20)
    assert len([n for n in moves if n]) >= 12 and max(moves) <= 1 << 20 and sum(moves) == embed + tree["bias"].nbytes


@pytest.mark.parametrize("algorithm", [None, "CRC64NVME"])
def test_each_part_is_sent_with_its_sha256_unless_the_environment_names_another_checksum(
    bucket, tmp_path, monkeypatch, algorithm
):
    """A save's parts carry their SHA-256 (the store verifies each as it comes): the
    object's checksum is then S3's composite of the parts' digests; AWS_CHECKSUM_ALGORITHM,
    where set, is obstore's to apply instead."""
    import base64
    import hashlib

    client, name = bucket
    if algorithm is not None:
        monkeypatch.setenv("AWS_CHECKSUM_ALGORITHM", algorithm)
    nnx_save.save_file(weights(), f"s3://{name}/m.safetensors")
    head = client.head_object(Bucket=name, Key="m.safetensors", ChecksumMode="ENABLED")
    if algorithm is not None:
        assert "ChecksumSHA256" not in head, head
        return
    local = tmp_path / "m.safetensors"
    nnx_save.save_file(weights(), local)
    data = local.read_bytes()
    parts = [hashlib.sha256(data[at : at + PART]).digest() for at in range(0, len(data), PART)]
    composite = base64.b64encode(hashlib.sha256(b"".join(parts)).digest()).decode()
    assert head["ChecksumSHA256"].split("-")[0] == composite, head  # S3 adds "-<parts>"; moto does not
