"""Weights files saved to a URL through fsspec: streamed one tensor
at a time, committed under the final name only when complete, checksummed as local
files are; load_file reads them back."""

from __future__ import annotations

import importlib
import json
import re
import uuid

import fsspec
import jax.numpy as jnp
import numpy as np
import pytest
import xxhash
from flax import nnx
from fsspec.implementations.memory import MemoryFileSystem

import nnx_save
from nnx_save import SaveError
from nnx_save.io._atomic import TMP_MARKER
from nnx_save.io._storage import locate_file
from nnx_save.save._entry import Entry
from nnx_save.save._remote import write_remote

MEMORY = fsspec.filesystem("memory")


@pytest.fixture
def url():
    base = f"memory://nnx-save-test-{uuid.uuid4().hex[:8]}"
    yield f"{base}/w.safetensors"
    MEMORY.rm(base, recursive=True) if MEMORY.exists(base) else None


def tree() -> dict:
    return {
        "embed": np.arange(4096, dtype=np.float32).reshape(64, 64),
        "layers": [{"w": jnp.full((32, 16), 0.5, jnp.bfloat16), "b": jnp.arange(16, dtype=jnp.int32)}],
    }


def test_a_remote_file_is_byte_identical_to_a_local_one_and_loads_back(url, tmp_path):
    nnx_save.save_file(tree(), url, metadata={"run": "7"})
    local = tmp_path / "w.safetensors"
    nnx_save.save_file(tree(), local, metadata={"run": "7"})
    assert MEMORY.cat(url) == local.read_bytes()  # same header, same checksums, same bytes
    back = nnx_save.load_file(url, verify=True)
    np.testing.assert_array_equal(back["embed"], tree()["embed"])
    np.testing.assert_array_equal(back["layers/0/b"], np.arange(16))
    assert nnx_save.read_header(url).metadata["run"] == "7"
    assert MEMORY.ls(url.rsplit("/", 1)[0], detail=False) == [url.removeprefix("memory:/")]  # no temporary left


def test_save_model_to_a_url(url):
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    nnx_save.save_model(model, url)
    loaded, report = nnx_save.load_model(lambda: nnx.Linear(3, 4, rngs=nnx.Rngs(1)), url, strict=True, verify=True)
    assert report.clean
    np.testing.assert_array_equal(loaded.kernel[...], model.kernel[...])


def test_an_asynchronous_save_to_a_url(url):
    handle = nnx_save.save_file(tree(), url, blocking=False)
    assert handle.result() == url
    assert sorted(nnx_save.load_file(url)) == ["embed", "layers/0/b", "layers/0/w"]


class Recording(MemoryFileSystem):
    """memory:// that records every write call's size, and can fail after some bytes."""

    protocol = "recording"
    store: dict = {}  # noqa: RUF012 (fsspec keeps a memory filesystem's files in class attributes)
    pseudo_dirs = [""]  # noqa: RUF012
    writes: list[int] = []  # noqa: RUF012
    fail_after: int | None = None

    def _open(self, path, mode="rb", **kwargs):
        file = super()._open(path, mode, **kwargs)
        if "w" in mode:
            plain_write = file.write

            def write(data):
                self.writes.append(len(data))
                if self.fail_after is not None and sum(self.writes) > self.fail_after:
                    raise OSError("connection reset by peer")
                return plain_write(data)

            file.write = write
        return file


@pytest.fixture
def recording(monkeypatch):
    Recording.store, Recording.pseudo_dirs, Recording.writes, Recording.fail_after = {}, [""], [], None
    monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, "recording", Recording)
    Recording.clear_instance_cache()
    yield Recording()
    Recording.clear_instance_cache()


def test_streamed_one_tensor_at_a_time(recording):
    big = {f"t{i}": np.full((256, 256), i, np.float32) for i in range(8)}  # 8 x 256 KiB
    nnx_save.save_file(big, "recording://b/big.safetensors")
    header = len(recording.cat("recording://b/big.safetensors")) - 8 * 256 * 1024
    assert max(recording.writes) == 256 * 1024  # never the whole file, never two tensors at once
    assert sorted(recording.writes) == sorted([header] + [256 * 1024] * 8)


def test_a_failed_upload_leaves_the_previous_object_and_no_temporary(recording):
    url = "recording://b/w.safetensors"
    nnx_save.save_file({"w": np.zeros(4, np.float32)}, url)
    before = recording.cat(url)
    Recording.fail_after = 5000
    message = f"{url}: the upload failed (OSError: connection reset by peer); nothing was saved"
    with pytest.raises(SaveError, match=re.escape(message)) as info:
        nnx_save.save_file(tree(), url)
    assert info.value.file == url
    assert recording.cat(url) == before
    assert recording.ls("recording://b", detail=False) == [url]  # the temporary object is gone
    assert not any(TMP_MARKER in p for p in recording.store)


def test_a_tensor_that_changes_between_the_passes_is_never_published(url):
    calls = iter(range(100))

    def changing() -> np.ndarray:
        return np.full(4, next(calls), np.float32)

    entries = [Entry("w", "F32", (4,), changing)]
    with pytest.raises(
        SaveError, match=re.escape(f"{url}: tensors ['w'] changed while they were saved; nothing was saved")
    ):
        write_remote(*locate_file(url), entries, None)
    assert not MEMORY.exists(url)
    assert MEMORY.find(url.rsplit("/", 1)[0]) == []  # nor its temporary object


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nosuchscheme://b/w.safetensors", "nosuchscheme://b/w.safetensors: no fsspec filesystem for 'nosuchscheme'"),
        (
            "https://example.invalid/w.safetensors",
            "https://example.invalid/w.safetensors: an HTTP URL cannot be written to; give an object-store URL",
        ),
    ],
)
def test_destinations_that_cannot_work_are_refused_before_writing(target, message):
    with pytest.raises(SaveError, match=re.escape(message)):
        nnx_save.save_file({"w": np.zeros(2, np.float32)}, target)


def test_checksums_are_recorded_as_for_local_files(url):
    nnx_save.save_file({"w": np.arange(8, dtype=np.float32)}, url)
    metadata = nnx_save.read_header(url).metadata
    assert metadata["nnx_save.checksum_algorithm"] == "xxh3_64"
    recorded = json.loads(metadata["nnx_save.checksums"])
    assert recorded == {"w": xxhash.xxh3_64_hexdigest(np.arange(8, dtype=np.float32).tobytes())}


@pytest.fixture
def s3(s3_server, monkeypatch):
    """s3:// pointed at moto's S3 server on 127.0.0.1 (tests/conftest.py), for the
    library (obstore, by the environment) and for fsspec (the test's own view), with a
    bucket of its own for this test."""
    import fsspec.config

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "s3", s3_server.options)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = f"nnx-save-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)  # no region: s3fs would send a LocationConstraint us-east-1 refuses
    try:
        yield fs, bucket
    finally:
        fs.rm(bucket, recursive=True)
        fsspec.filesystem("s3").clear_instance_cache()


def test_s3_on_a_local_server(s3, tmp_path):
    s3, bucket = s3
    url = f"s3://{bucket}/run/w.safetensors"
    nnx_save.save_file(tree(), url, metadata={"run": "7"})
    local = tmp_path / "w.safetensors"
    nnx_save.save_file(tree(), local, metadata={"run": "7"})
    s3.invalidate_cache()
    assert s3.cat(url) == local.read_bytes()
    assert s3.ls(f"{bucket}/run", detail=False) == [f"{bucket}/run/w.safetensors"]  # no temporary
    back = nnx_save.load_file(url, verify=True)
    np.testing.assert_array_equal(back["embed"], tree()["embed"])
