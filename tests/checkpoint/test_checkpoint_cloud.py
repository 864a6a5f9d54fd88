"""Cloud directories: gs:// and s3:// are handed to Orbax unchanged (never
turned into a local directory named gs:), file:// is a local path, and a scheme
Orbax cannot write to is refused before anything runs."""

from __future__ import annotations

import importlib
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_usage
from etils.epath.backend import fsspec_backend
from fsspec.implementations.memory import MemoryFileSystem

from nnx_save.checkpoint import OrbaxCheckpointStore, resolve_checkpoint_dir


@pytest.mark.parametrize("url", ["gs://bucket/run", "s3://bucket/some/run"])
def test_cloud_urls_are_kept_as_given(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = OrbaxCheckpointStore(url)  # nothing is touched before the first use
    assert str(store.directory) == url and repr(store) == f"OrbaxCheckpointStore({url!r})"
    assert str(store._step_path(7)) == f"{url}/7"
    assert os.listdir(tmp_path) == []  # no ./gs:/bucket/run
    assert str(resolve_checkpoint_dir(None, url)) == f"{url}/checkpoints"


@pytest.mark.parametrize("url", ["ftp://host/run", "memory://run", "hf://org/model", "az://container/run"])
def test_a_scheme_orbax_cannot_write_is_refused_at_once(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scheme = url.split("://")[0]
    message = (
        f"checkpoint directory {url!r}: the URL scheme {scheme!r} is not supported; give a local path, a file:// "
        "URL, or a gs:// or s3:// URL"
    )
    with raises_usage("directory", match=re.escape(message)) as info:
        OrbaxCheckpointStore(url)
    assert isinstance(info.value, ValueError) and info.value.directory == url
    with raises_usage("directory", match=re.escape(message.replace("checkpoint directory", "checkpoint directory", 1))):
        resolve_checkpoint_dir(url)
    assert os.listdir(tmp_path) == []


def test_a_file_url_is_a_local_directory(tmp_path):
    url = f"file://{tmp_path}/run%20one"
    with OrbaxCheckpointStore(url) as store:
        store.save(1, {"model": {"w": jnp.arange(3.0)}})
        assert store.directory == tmp_path / "run one"
    np.testing.assert_array_equal(OrbaxCheckpointStore(tmp_path / "run one").restore(1).items["model"]["w"], [0, 1, 2])
    with raises_usage("directory", match=re.escape("a file:// URL on host 'host'; use file:///absolute/path")):
        OrbaxCheckpointStore("file://host/x")


class FakeBucket(MemoryFileSystem):
    """An in-memory filesystem answering for s3:// (its own store, not memory://'s)."""

    protocol = "s3"
    store: dict = {}  # noqa: RUF012 (fsspec's MemoryFileSystem keeps its files in class attributes)
    pseudo_dirs = [""]  # noqa: RUF012


@pytest.fixture
def bucket(monkeypatch):
    FakeBucket.store, FakeBucket.pseudo_dirs = {}, [""]
    registry = importlib.import_module("fsspec.registry")._registry
    for name in ("s3",):
        monkeypatch.setitem(registry, name, FakeBucket)
    fsspec_backend._get_filesystem.cache_clear()  # etils caches the filesystem per name
    FakeBucket.clear_instance_cache()
    yield FakeBucket()
    fsspec_backend._get_filesystem.cache_clear()
    FakeBucket.clear_instance_cache()


def _upload(fs, local, remote):
    for root, _, names in os.walk(local):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                fs.pipe(f"{remote}/{os.path.relpath(path, local)}", f.read())


def test_the_store_reads_an_s3_directory_through_the_url(tmp_path, bucket):
    """Listing, the damage scan, metadata and Orbax's own manager all go through
    s3://bucket/run (served here by an in-memory fsspec filesystem; the array reads
    and writes would go to tensorstore's S3 driver, which needs the network)."""
    with OrbaxCheckpointStore(tmp_path / "local") as local:
        local.save(3, {"model": {"w": jnp.ones(2)}}, metrics={"loss": 0.5})
        local.save(4, {"model": {"w": jnp.ones(2)}}, metrics={"loss": 0.25})
    _upload(bucket, tmp_path / "local", "s3://bucket/run")
    bucket.rm("s3://bucket/run/4/model/_METADATA")
    store = OrbaxCheckpointStore("s3://bucket/run")
    with pytest.warns(UserWarning, match=re.escape("step 4: s3://bucket/run/4/model/_METADATA: Orbax's metadata file")):
        assert store.list_steps() == [3]
    assert store.read_metadata(3).metrics == {"loss": 0.5}
    assert store.best_step("loss") == 3
    assert str(store._reader().directory) == "s3://bucket/run"  # Orbax was handed the URL
    assert sorted(store._reader().all_steps()) == [3, 4]
    shutil.rmtree(tmp_path / "local")
    assert not any(p.startswith("s3:") for p in os.listdir(tmp_path))
