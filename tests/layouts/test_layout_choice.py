"""The layout a save writes is data (``SaveOptions.layout``; ``max_shard_size`` and
``save_pod`` are its shortcuts), and one function, ``owners``, says who owns a
directory, on a filesystem and in an object store alike."""

from __future__ import annotations

import os
import re
import uuid

import fsspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nnx_save
from nnx_save import OptionError, SaveOptions
from nnx_save.io import _storage
from nnx_save.layouts._registry import owners

TREE = {"a": np.arange(64, dtype=np.float32), "b": np.ones((4, 8), np.float32)}
MEMORY = fsspec.filesystem("memory")


def kinds(where) -> list[str]:
    location = _storage.locate(where)
    return [owner.kind for owner in owners(location, location.names())]


@given(layout=st.sampled_from([None, "file", "index", "pod"]), shard=st.sampled_from([None, 256, "1KB"]))
def test_the_layout_written_is_the_one_the_options_name(tmp_path_factory, layout, shard):
    target = tmp_path_factory.mktemp("c") / "ck"
    if shard is not None and layout in ("file", "pod"):  # two things at once: refused where it is given
        with pytest.raises(OptionError, match=re.escape(f"layout={layout!r} writes no HuggingFace index")):
            SaveOptions(layout=layout, max_shard_size=shard)
        return
    nnx_save.save_file(TREE, target, options=SaveOptions(layout=layout, max_shard_size=shard))
    expected = layout or ("file" if shard is None else "index")
    header = nnx_save.read_header(target)
    assert header.kind == expected
    loaded = nnx_save.load_file(target)
    assert sorted(loaded) == ["a", "b"] and all(np.array_equal(loaded[k], TREE[k]) for k in TREE)
    if expected == "index":  # no max_shard_size: the default size, so one data file and its index
        files = sorted(n for n in os.listdir(target) if n.endswith(".safetensors"))
        assert len(files) == (1 if shard in (None, "1KB") else 2)


def test_a_layout_that_is_not_one_and_save_pod_given_another_are_refused(tmp_path):
    with pytest.raises(OptionError, match=re.escape("layout must be None, 'file', 'index' or 'pod', got 'zip'")):
        SaveOptions(layout="zip")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=re.escape("save_pod writes a pod: layout='index' is for save_file")):
        nnx_save.save_pod(TREE, tmp_path, options=SaveOptions(layout="index"))
    assert os.listdir(tmp_path) == []
    assert nnx_save.save_pod(TREE, tmp_path, options=SaveOptions(layout="pod")) == tmp_path / "manifest.json"


def test_owners_names_every_layout_the_store_and_orbax_on_a_filesystem(tmp_path):
    assert kinds(tmp_path / "absent") == [] and kinds(tmp_path) == []
    nnx_save.save_file(TREE, tmp_path / "index", max_shard_size=256)
    nnx_save.save_pod(TREE, tmp_path / "pod")
    (tmp_path / "file").mkdir()  # one file's save makes no directory
    nnx_save.save_file(TREE, tmp_path / "file" / "model.safetensors")
    assert (kinds(tmp_path / "index"), kinds(tmp_path / "pod"), kinds(tmp_path / "file")) == (
        ["index", "files"],
        ["pod", "files"],
        ["files"],
    )
    (tmp_path / "orbax").mkdir()
    (tmp_path / "orbax" / "_CHECKPOINT_METADATA").write_text("{}")
    (tmp_path / "pod" / "_nnx_save_store.json").write_text("{}")
    assert kinds(tmp_path / "orbax") == ["foreign"] and kinds(tmp_path / "pod") == ["store", "pod", "files"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text('{"format": "someone else"}')  # by content: not a pod
    assert kinds(tmp_path / "other") == []


def test_owners_names_the_layouts_of_an_object_store_prefix():
    root = f"memory://nnx-save-owners-{uuid.uuid4().hex[:8]}"
    nnx_save.save_file(TREE, f"{root}/index", max_shard_size=256)
    nnx_save.save_file(TREE, f"{root}/file/model.safetensors")
    assert (kinds(f"{root}/index"), kinds(f"{root}/file"), kinds(f"{root}/absent")) == (
        ["index", "files"],
        ["files"],
        [],
    )


def test_an_index_saved_over_a_prefix_that_held_one_file_replaces_it():
    """One layout is left in an object store too: the index's commit retires the
    ``model.safetensors`` the prefix held, as it does in a local directory."""
    root = f"memory://nnx-save-retire-{uuid.uuid4().hex[:8]}/ck"
    nnx_save.save_file({"old": np.zeros(4, np.float32)}, f"{root}/model.safetensors")
    nnx_save.save_file(TREE, root, max_shard_size=256)
    names = {p.rsplit("/", 1)[-1] for p in MEMORY.ls(root, detail=False)}
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert sorted(nnx_save.load_file(root)) == ["a", "b"]
