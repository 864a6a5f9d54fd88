"""Every format owns its files: a save removes only files it can prove are of
the version it replaces, a save over another layout replaces it in its commit, and a
directory two layouts claim is a typed conflict. Through the public API.
"""

from __future__ import annotations

import json
import os
import re

import fsspec
import numpy as np
import pytest
from _errors import raises_check
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.cli import main as cli_main

INDEX = "model.safetensors.index.json"


def tree(value: float, n: int = 4) -> dict[str, np.ndarray]:
    """``n`` tensors of 64 float32s, every element ``value``."""
    return {f"t{i}": np.full((64,), value, np.float32) for i in range(n)}


def value_of(loaded: dict[str, np.ndarray]) -> set[float]:
    return {float(v) for a in loaded.values() for v in np.unique(a)}


def test_a_resave_keeps_every_file_a_hostile_index_names(tmp_path):
    """Breakage 1: the files another tool's index names (``config.json``, ``README.md``,
    the index itself) are not the save's to remove."""
    d = tmp_path / "ck"
    d.mkdir()
    others = {"config.json": b'{"model_type": "gpt2"}', "README.md": b"# my model\n", "notes.safetensors": b"x"}
    for name, data in others.items():
        (d / name).write_bytes(data)
    hostile = {"weight_map": {"a": "config.json", "b": "README.md", "c": INDEX, "d": "notes.safetensors"}}
    (d / INDEX).write_text(json.dumps(hostile))
    nnx_save.save_file(tree(1.0), d, max_shard_size=512)
    assert {n: (d / n).read_bytes() for n in others} == others
    assert value_of(nnx_save.load_file(d)) == {1.0}  # its own index is there, and whole
    nnx_save.save_file(tree(2.0), d, max_shard_size=512)  # a re-save over its own: the old files go
    assert value_of(nnx_save.load_file(d)) == {2.0}
    assert {n: (d / n).read_bytes() for n in others} == others
    named = set(json.loads((d / INDEX).read_text())["weight_map"].values())
    assert {p.name for p in d.glob("model*.safetensors")} == named


def test_a_resave_over_a_url_keeps_what_the_index_names_and_did_not_write():
    fs = fsspec.filesystem("memory")
    root = "memory://nnx-save-ownership/ck"
    fs.pipe(f"{root}/config.json", b"{}")
    fs.pipe(f"{root}/{INDEX}", json.dumps({"weight_map": {"a": "config.json", "b": INDEX}}).encode())
    nnx_save.save_file(tree(3.0), root, max_shard_size=512)
    assert fs.cat(f"{root}/config.json") == b"{}"
    assert value_of(nnx_save.load_file(root)) == {3.0}


def test_save_pod_over_an_hf_checkpoint_replaces_it(tmp_path):
    """Breakage 2: the pod's commit retires the index and its files: one layout is left."""
    nnx_save.save_file(tree(1.0), tmp_path, max_shard_size=512)
    nnx_save.save_pod(tree(2.0), tmp_path)
    assert not (tmp_path / INDEX).exists() and not list(tmp_path.glob("model*.safetensors"))
    assert value_of(nnx_save.load_file(tmp_path)) == {2.0}
    nnx_save.save_file(tree(3.0), tmp_path, max_shard_size=512)  # and back: the pod goes
    assert not (tmp_path / "manifest.json").exists() and not list(tmp_path.glob("shard_*"))
    assert value_of(nnx_save.load_file(tmp_path)) == {3.0}


def test_a_single_file_beside_an_index_it_is_not_part_of_is_a_conflict(tmp_path):
    """Breakage 3: transformers reads ``model.safetensors`` first; nnx_save must not
    quietly read the index instead."""
    nnx_save.save_file(tree(1.0), tmp_path, max_shard_size=512)
    nnx_save.save_file(tree(2.0), tmp_path / "model.safetensors")
    message = f"{tmp_path}: holds both {INDEX} (index) and model.safetensors (file)"
    with raises_check("layout", match=re.escape(message)) as info:
        nnx_save.load_file(tmp_path)
    assert info.value.file == str(tmp_path)
    nnx_save.save_file(tree(3.0), tmp_path, max_shard_size=512)  # an index save replaces the single file
    assert not (tmp_path / "model.safetensors").exists()
    assert value_of(nnx_save.load_file(tmp_path)) == {3.0}


def test_verify_fails_on_a_pod_whose_shard_files_are_gone(tmp_path, capsys):
    """Breakage 4."""
    nnx_save.save_pod(tree(1.0), tmp_path)
    assert cli_main(["verify", str(tmp_path)]) == 0
    for shard in tmp_path.glob("shard_*.safetensors"):
        shard.unlink()
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path)]) == 1
    assert re.search(
        r"FAIL shard_00000-of-00001\.[0-9a-f]{8}\.safetensors: named by the checkpoint, not present",
        capsys.readouterr().out,
    )


def test_an_index_file_named_itself_is_read_as_the_index(tmp_path):
    """Breakage 5, local: told by content, not by name."""
    nnx_save.save_file(tree(4.0), tmp_path, max_shard_size=512)
    assert value_of(nnx_save.load_file(tmp_path / INDEX)) == {4.0}
    assert nnx_save.read_header(str(tmp_path / INDEX)).kind == "index"
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    message = f"{tmp_path / 'config.json'}: a JSON file, not a safetensors file, nor an index (no 'weight_map' object)"
    with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape(message)):
        nnx_save.read_header(tmp_path / "config.json")


def test_max_shard_size_into_a_safetensors_name_is_refused(tmp_path):
    """Breakage 6: no directory named ``x.safetensors``."""
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(nnx_save.OptionError, match=re.escape("x.safetensors: max_shard_size writes a directory")):
        nnx_save.save_model(model, tmp_path / "x.safetensors", max_shard_size=64)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("layout", ["index", "pod"])
@pytest.mark.parametrize("closed", [True, False])
def test_a_multi_file_or_pod_save_into_a_store_directory_is_refused(tmp_path, layout, closed):
    """The save went through once the store was closed: its index or manifest beside the
    store's steps, the directory then loaded as that checkpoint, hiding the store."""
    import jax.numpy as jnp

    from nnx_save.checkpoint import OrbaxCheckpointStore

    store = OrbaxCheckpointStore(tmp_path)
    store.save(1, {"model": {"w": jnp.ones(3)}})
    store.wait_until_finished()
    if closed:
        store.close()
    before = sorted(os.listdir(tmp_path))
    what = "a multi-file save" if layout == "index" else "save_pod"
    refusal = (
        f"{tmp_path}: is the directory of a step store (it holds _nnx_save_store.json: nnx_save.checkpoint); "
        f"{what} into it would mix two checkpoints in one directory, so nothing was written"
    )
    tree = {"a": np.arange(64, dtype=np.float32), "b": np.ones(64, np.float32)}
    with pytest.raises(nnx_save.SaveError, match=re.escape(refusal)):
        if layout == "index":
            nnx_save.save_file(tree, tmp_path, max_shard_size=256)
        else:
            nnx_save.save_pod(tree, tmp_path)
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(nnx_save.errors.NotSafetensorsError, match=re.escape("a directory of Orbax checkpoint steps")):
        nnx_save.read_header(tmp_path)
    store.close()
    with OrbaxCheckpointStore(tmp_path) as again:
        assert again.list_steps() == [1]


def test_a_multi_file_save_into_an_orbax_checkpoint_is_refused(tmp_path):
    """An Orbax checkpoint (no store around it) owns its directory alike."""
    (tmp_path / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(nnx_save.SaveError, match=re.escape(f"{tmp_path}: is an Orbax checkpoint directory")):
        nnx_save.save_file({"a": np.zeros(64, np.float32)}, tmp_path, max_shard_size=128)
    assert os.listdir(tmp_path) == ["_CHECKPOINT_METADATA"]


# -- another tool's file under a name a save uses ----------------------------------------

_LOCK, _STORE_RECORD, _MANIFEST = "_nnx_save.lock", "_nnx_save_store.json", "manifest.json"


def _multi_file(d) -> None:
    nnx_save.save_file(tree(1.0), d, max_shard_size=512)


def _pod(d) -> None:
    nnx_save.save_pod(tree(1.0), d)


def _store(d) -> None:
    from nnx_save.checkpoint import OrbaxCheckpointStore

    with OrbaxCheckpointStore(d) as store:
        store.save(1, {"model": {"w": np.ones(3, np.float32)}}, overwrite=True)  # refused all the same


# Every name each directory writer writes, replaces or retires; the record of its own
# layout is one it would have to replace, so a foreign file there must be refused.
_RESERVED = {
    _multi_file: ([INDEX], [_MANIFEST, _LOCK, "model.safetensors"]),
    _pod: ([_MANIFEST], [INDEX, _LOCK, "model.safetensors"]),
    _store: (["1"], [_STORE_RECORD, _LOCK]),
}
_CASES = [(save, name, name in own) for save, (own, other) in _RESERVED.items() for name in own + other]
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
_FOREIGN = st.one_of(
    st.binary(min_size=1, max_size=64).map(lambda b: ("bytes", b)),
    st.dictionaries(st.text(max_size=10), _JSON, min_size=1, max_size=4)
    .filter(lambda d: "weight_map" not in d and "format" not in d)
    .map(lambda d: ("bytes", json.dumps(d).encode())),
    st.just(("directory", b"mine")),
    st.just(("link", b"outside")),
)


def _plant(where, kind: str, data: bytes, outside) -> None:
    if kind == "bytes":
        where.write_bytes(data)
    elif kind == "directory":
        where.mkdir()
        (where / "mine.txt").write_bytes(data)
    else:
        outside.write_bytes(data)
        where.symlink_to(outside)


def _as_found(where) -> object:
    if where.is_symlink():
        return ("link", os.readlink(where), where.read_bytes())
    if where.is_dir():
        return ("directory", sorted((p.name, p.read_bytes()) for p in where.iterdir()))
    return ("bytes", where.read_bytes())


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(_CASES), foreign=_FOREIGN)
def test_another_tools_file_under_a_reserved_name_is_never_replaced(tmp_path_factory, case, foreign):
    """For every directory writer (multi-file, pod, store) and every name it writes, replaces
    or retires: another tool's file there (any bytes, another tool's JSON, a directory, a
    link out) is left as it was; where the save would have to replace it (its own record,
    its lock, its step) it is refused, typed, naming the file."""
    save, name, own = case
    root = tmp_path_factory.mktemp("reserved")
    d, outside = root / "ck", root / "outside.bin"
    d.mkdir()
    _plant(d / name, *foreign, outside)
    before = _as_found(d / name)
    try:
        save(d)
    except nnx_save.NnxSaveError as error:
        assert str(d) in str(error) and name in str(error), error  # the directory and the name
    else:
        assert not own and name != _LOCK, f"{name} ({foreign[0]}) was not refused"
    assert _as_found(d / name) == before
