"""The leaf record: every step records each leaf's stored shape and dtype, or
its Python type, so a templated restore compares templates against the record instead of
asking Orbax for the metadata of every array (that cost the store a fifth more than the
manager it wraps). The record must say exactly what Orbax's metadata says."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_usage
from hypothesis import given, settings
from hypothesis import strategies as st

from nnx_save.checkpoint import OrbaxCheckpointStore, UnsupportedCheckpointError, _orbax
from nnx_save.checkpoint._tree import parse_leaf_record

LEAVES = st.sampled_from(
    [
        lambda: jnp.ones((3, 4), jnp.bfloat16),
        lambda: jnp.float32(2.0),
        lambda: np.asarray(np.float32(1.5)),
        lambda: np.arange(3, dtype=np.int8),
        lambda: jnp.zeros((2,), bool),
        lambda: jax.random.key(0),
        lambda: jax.random.split(jax.random.key(1), 3),
        lambda: jax.random.key(0, impl="rbg"),
        lambda: True,
        lambda: 3,
        lambda: 2.5,
        lambda: "text",
    ]
)
KEYS = st.text("abxyz_", min_size=1, max_size=3)
TREES = st.recursive(
    LEAVES.map(lambda make: make()),
    lambda inner: st.dictionaries(KEYS, inner, min_size=1, max_size=3) | st.lists(inner, min_size=1, max_size=3),
    max_leaves=6,
)


@settings(max_examples=12)
@given(tree=TREES)
def test_the_leaf_record_says_what_orbax_metadata_says(tmp_path_factory, tree):
    directory = tmp_path_factory.mktemp("leaves")
    with OrbaxCheckpointStore(directory) as store:
        store.save(1, {"model": tree})
    record = json.loads((directory / "1" / "nnx_save_dtypes" / "metadata").read_text())
    recorded = parse_leaf_record(record)["model"]
    manager = _orbax.make_manager(directory, create=False)
    try:
        stored = _orbax.stored_trees(manager, 1, ["model"])["model"]
        assert recorded.specs == _orbax.stored_specs(stored)
        assert recorded.kinds == _orbax.stored_kinds(stored)
    finally:
        manager.close()


@pytest.fixture
def saved(tmp_path):
    with OrbaxCheckpointStore(tmp_path) as store:
        store.save(1, {"model": {"w": jnp.arange(6.0).reshape(2, 3), "n": 4}, "rng": jax.random.key(3)})
    return tmp_path


def test_a_templated_restore_reads_no_orbax_metadata(saved, monkeypatch):
    asked = []
    original = _orbax.stored_trees
    monkeypatch.setattr(
        _orbax, "stored_trees", lambda m, step, names: asked.append(list(names)) or original(m, step, names)
    )
    template = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32), "n": 0}
    with OrbaxCheckpointStore(saved) as store:
        restored = store.restore(1, templates={"model": template}).items
    assert asked == [["rng"]]  # only the item restored as stored
    assert restored["model"]["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and restored["model"]["n"] == 4


def _rewrite_record(directory, change) -> None:
    path = directory / "1" / "nnx_save_dtypes" / "metadata"
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def test_a_step_recorded_without_leaves_restores_through_orbax_metadata(saved):
    _rewrite_record(saved, lambda record: record.pop("leaves"))  # as written before leaves were recorded
    template = {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32), "n": 0}
    with OrbaxCheckpointStore(saved) as store:
        with raises_usage(
            "template", match=re.escape("model/w: shape (2, 4) in the template, (2, 3) in the checkpoint")
        ):
            store.restore(1, templates={"model": template})
        restored = store.restore(1, templates={"model": {**template, "w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}})
    assert restored.items["model"]["w"].shape == (2, 3)


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (lambda r: r.update(leaves=[1]), "holds a malformed leaf record '[1]'"),
        (
            lambda r: r["leaves"]["model"].append([["x"], "complex"]),
            "holds a malformed leaf record entry \"[['x'], 'complex']\"",
        ),
        (lambda r: r["leaves"]["model"].append([["x"], "float32", [-1]]), "a malformed leaf record entry"),
        (lambda r: r["leaves"].pop("rng"), "a dtype record without items ['rng']"),
    ],
)
def test_a_malformed_leaf_record_is_refused(saved, change, found):
    _rewrite_record(saved, change)
    with OrbaxCheckpointStore(saved) as store, pytest.raises(UnsupportedCheckpointError, match=re.escape(found)):
        store.restore(1, templates={"model": {"w": jnp.zeros((2, 3)), "n": 0}})


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 3) | st.sampled_from(["", "w", "float32", "int", "str", "complex"]),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)
ROWS = st.one_of(
    JSON_VALUES,
    st.tuples(st.lists(st.sampled_from(["a", "0", 0, True, None]), max_size=2), JSON_VALUES).map(list),
    st.tuples(st.lists(st.just("a"), max_size=2), st.just("float32"), JSON_VALUES).map(list),
)


def _reference_row(row):
    """What a leaf-record row means, written out plainly: ``(spec, kind)``, or None for a malformed row."""
    if not (isinstance(row, list) and len(row) in (2, 3) and isinstance(row[1], str) and isinstance(row[0], list)):
        return None
    if not all(isinstance(segment, str) for segment in row[0]):
        return None
    if len(row) == 2:
        return (None, row[1]) if row[1] in ("bool", "int", "float", "str") else None
    shape = row[2]
    if isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape):
        return ((tuple(shape), row[1]), None)
    return None


@settings(max_examples=200)
@given(rows=st.lists(ROWS, max_size=4))
def test_a_leaf_record_row_is_read_or_refused_as_its_definition_says(rows):
    meant = [_reference_row(row) for row in rows]
    if any(m is None for m in meant):
        with pytest.raises(UnsupportedCheckpointError, match=re.escape("a malformed leaf record entry")):
            parse_leaf_record({"leaves": {"model": rows}})
        return
    recorded = parse_leaf_record({"leaves": {"model": rows}})["model"]
    paths = [tuple(row[0]) for row in rows]
    assert recorded.specs == {
        p: (None if spec is None else tuple(spec)) for p, (spec, _) in zip(paths, meant, strict=True)
    }
    assert recorded.kinds == {p: kind for p, (_, kind) in zip(paths, meant, strict=True) if kind is not None}
