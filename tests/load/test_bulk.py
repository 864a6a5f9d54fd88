"""The bulk ways of a load of many leaves against the per-leaf ways they stand in for.

The tree's keys, the targets and the header's tensor records are made in columns, and
the refusals, the report's checks and the batch path's split are first asked of every
leaf at once; each bulk way declines (and the per-leaf way decides) as soon as one leaf
is not plain. Here every bulk way is made to decline (``per_leaf``) and the two must give
the very values, reports and errors, for any mix of plain, cast, reshaped, missing,
host and unexpected leaves; and a load of plain leaves must take the bulk ways, making
no per-leaf record or check at all (that per-leaf Python work is what made a hundred
thousand small tensors slow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import warnings
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import SingleDeviceSharding

import nnx_save
from nnx_save._frozen import frozen_many
from nnx_save.bridges import _leaves, _pytree
from nnx_save.format import _header, _paths
from nnx_save.load import _batch, _match
from nnx_save.load._target import Target

DEV = jax.devices()


@contextlib.contextmanager
def per_leaf():
    """Every bulk way declines: each leaf, path and target takes the per-leaf way."""
    with contextlib.ExitStack() as stack:
        for owner, name, value in [
            (_paths, "_joined_plainly", lambda keys, segments: False),
            (_leaves, "_segment_values", lambda keypaths: None),
            (_pytree, "_all_shaped", lambda header, targets: False),
            (_match, "whole_reads", lambda tensors, targets, x64: None),
            (_batch, "_all_batched", lambda tensors, targets, x64, cpu: None),
        ]:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


def _outcome(load):
    """What ``load()`` gives: ``(tree, comparable report)``, or the error's type and text."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # mismatches: in the report, compared
            tree, report = load()
    except nnx_save.NnxSaveError as e:
        return type(e), str(e)
    io = dataclasses.replace(
        report.io, requests=0, plan_seconds=0, read_seconds=0, assemble_seconds=0, max_inflight_bytes=0
    )
    return tree, dataclasses.replace(report, io=io)


def _same_tree(a, b):
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape
        if isinstance(x, jax.Array):
            assert x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@st.composite
def trees(draw):
    """A file and an abstract tree over it: layers (a list) of dicts and a few top-level
    leaves, each leaf one device, the host, a cast, a reshape (an array, allowed), not in
    the file, or plain; and tensors no leaf reads."""
    tensors, layers, top, reshaped = {}, [], {}, []
    names = [f"layers/{i}/{n}" for i in range(draw(st.integers(0, 4))) for n in ("w", "b")] + ["head", "emb/table"]
    for i, key in enumerate(names):
        value = np.full((2, draw(st.integers(1, 5))), i, np.float32)
        how = draw(st.sampled_from(["device", "device", "device", "host", "cast", "reshape", "missing"]))
        if how != "missing":
            tensors[key] = value
        if how == "host":
            leaf = np.zeros(value.shape, np.float32)
        elif how == "reshape":
            leaf = np.zeros((3, 3), np.float32)
            reshaped.append(key)
        else:
            dtype = np.float16 if how == "cast" else np.float32
            leaf = jax.ShapeDtypeStruct(value.shape, dtype, sharding=SingleDeviceSharding(DEV[i % len(DEV)]))
        parts = key.split("/")
        if parts[0] == "layers":
            while len(layers) <= int(parts[1]):
                layers.append({})
            layers[int(parts[1])][parts[2]] = leaf
        elif len(parts) == 2:
            top.setdefault(parts[0], {})[parts[1]] = leaf
        else:
            top[key] = leaf
    for j in range(draw(st.integers(0, 2))):
        tensors[f"extra/{j}"] = np.zeros(3, np.int8)
    if not tensors:
        tensors["extra/0"] = np.zeros(3, np.int8)
    abstract = {"layers": layers, **top} if layers else top
    return tensors, abstract, reshaped, draw(st.booleans())


@settings(max_examples=40)
@given(trees())
def test_the_bulk_ways_give_what_the_per_leaf_ways_give(tmp_path_factory, case):
    tensors, abstract, reshaped, strict = case
    path = tmp_path_factory.mktemp("bulk") / "m.safetensors"
    nnx_save.save_file(tensors, path)

    def load():
        return nnx_save.load_file(
            path, abstract, strict=strict, allow_shape_mismatch=reshaped, allow_casts="lossless", return_report=True
        )

    bulk = _outcome(load)
    with per_leaf():
        each = _outcome(load)
    if isinstance(each[0], type):  # an error: the same one, word for word
        assert bulk == each
        return
    _same_tree(bulk[0], each[0])
    assert bulk[1] == each[1]


def _targets(draw, tensors):
    """Targets over ``tensors``: some reading one twice, some missing, reshaped, cast or
    on the host, in any order."""
    keys = sorted(tensors)
    out = []
    for i in range(draw(st.integers(1, 8))):
        key = draw(st.sampled_from([*keys, "absent"]))
        shape = tensors[key].shape if key in tensors else (2,)
        how = draw(st.sampled_from(["device", "device", "host", "cast", "reshape"]))
        shape = (7,) if how == "reshape" else shape
        dtype = np.dtype(np.float16 if how == "cast" else np.float32)
        sharding = None if how == "host" else SingleDeviceSharding(DEV[i % 2])
        out.append(Target(f"p{i}", shape, dtype, sharding, (key,)))
    return out


@settings(max_examples=60)
@given(st.data())
def test_the_report_and_the_batch_split_in_bulk_are_the_per_target_ones(tmp_path_factory, data):
    """check_targets and Batch.split on targets a tree cannot make (two reading one
    tensor, a source the file lacks), each way against the other."""
    from nnx_save.bridges._state_dict import source_header
    from nnx_save.load._batch import Batch

    tensors = {
        f"t{i}": np.full(data.draw(st.integers(1, 4)), i, np.float32) for i in range(data.draw(st.integers(1, 5)))
    }
    path = tmp_path_factory.mktemp("split") / "m.safetensors"
    nnx_save.save_file(tensors, path)
    header = source_header(str(path))
    targets = _targets(data.draw, tensors)

    def run():
        loadable, report = _match.check_targets(header, targets, (), (), (), frozenset(), None, ())
        batch, rest = Batch.split(header, loadable, False, lambda platform: False, True)
        runs = {f: (r.targets, r.infos, r.held, r.starts.tolist()) for f, r in batch.by_file.items()}
        return list(loadable), report, runs, rest

    bulk = run()
    with per_leaf():
        each = run()
    assert bulk == each
    header.close()


def _save_plain(tmp_path, n):
    path = tmp_path / "plain.safetensors"
    nnx_save.save_file({f"layers/{i}/w": np.full(4, i, np.float32) for i in range(n)}, path)
    sharding = SingleDeviceSharding(DEV[0])
    abstract = {"layers": [{"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding)} for _ in range(n)]}
    return path, abstract


def test_a_load_of_plain_leaves_makes_no_record_or_check_per_leaf(tmp_path):
    path, abstract = _save_plain(tmp_path, 300)
    calls = {"Target": 0, "TensorInfo": 0, "_check": 0, "to_key": 0, "segment": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(Target, "__init__", counted("Target", Target.__init__)))
        info_init = _header.TensorInfo.__init__
        stack.enter_context(mock.patch.object(_header.TensorInfo, "__init__", counted("TensorInfo", info_init)))
        stack.enter_context(mock.patch.object(_match, "_check", counted("_check", _match._check)))
        stack.enter_context(mock.patch.object(_paths, "to_key", counted("to_key", _paths.to_key)))
        stack.enter_context(mock.patch.object(_paths, "segment", counted("segment", _paths.segment)))
        out, report = nnx_save.load_file(path, abstract, return_report=True)
    assert calls == dict.fromkeys(calls, 0)
    assert [float(layer["w"][0]) for layer in out["layers"]] == list(range(300))
    assert report.clean and len(report.loaded) == 300


@pytest.mark.parametrize("return_report", [False, True])
def test_no_collection_runs_inside_load_file(tmp_path, return_report):
    """The collection a load puts off runs after it, once its targets and records are
    freed, never inside it while they are all alive (the pause's end allocates nothing)."""
    path, abstract = _save_plain(tmp_path, 2000)
    collections = []

    def note(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(note)
    try:
        out = nnx_save.load_file(path, abstract, return_report=return_report)
        during = len(collections)
    finally:
        gc.callbacks.remove(note)
    assert during == 0
    assert len(jax.tree_util.tree_leaves(out)) >= 2000


segments = st.one_of(
    st.integers(-2, 12),
    st.booleans(),
    st.sampled_from(["", "a", "b/c", "0", "007", "é", "\ud800", "w", "名前"]),
    st.tuples(st.sampled_from(["k", "sigma"])),
)


@given(st.lists(st.lists(segments, max_size=4).map(tuple), max_size=6))
def test_keys_in_bulk_are_to_key_of_each_path_or_its_refusal(paths):
    def each():
        try:
            return [_paths.to_key(p) for p in paths]
        except nnx_save.KeyPathError as e:
            return type(e), str(e)

    def bulk():
        try:
            return _paths.to_keys(paths)
        except nnx_save.KeyPathError as e:
            return type(e), str(e)

    assert bulk() == each()
    names = [p[0] for p in paths if len(p) == 1]
    try:
        expected = [_paths.to_key((n,)) for n in names]
    except nnx_save.KeyPathError as e:
        with pytest.raises(nnx_save.KeyPathError, match=re.escape(str(e))):
            _paths.names_to_keys(names)
    else:
        assert _paths.names_to_keys(names) == expected


keys = st.one_of(st.sampled_from(["a", "b", "w", "0", "é", "x/y", ""]), st.integers(0, 3))
leaves = st.sampled_from([None, 1.0, np.float32(2)])
nests = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "w", "é", "x/y", ""]), inner, max_size=3),
        st.dictionaries(st.integers(0, 3), inner, max_size=3),
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
    ),
    max_leaves=8,
)


# flatten_keys' own fast way (a dict of str names, each value one leaf), and names it refuses
flat_dicts = st.dictionaries(
    st.one_of(st.text("ab0é", min_size=1, max_size=3), st.sampled_from(["", "x/y", "."])),
    st.sampled_from([1.0, np.float32(2)]),
    max_size=20,
)


@given(st.one_of(nests, flat_dicts))
def test_flatten_keys_is_flatten_then_to_keys(tree):
    def each():
        try:
            pairs, treedef = _leaves.flatten(tree)
            return _paths.to_keys([p for p, _ in pairs]), [v for _, v in pairs], treedef
        except nnx_save.KeyPathError as e:
            return type(e), str(e)

    def bulk():
        try:
            return _leaves.flatten_keys(tree)
        except nnx_save.KeyPathError as e:
            return type(e), str(e)

    with per_leaf():
        expected = each()
    assert bulk() == expected


def test_frozen_many_refuses_a_field_left_out_or_a_short_column():
    dt = _header._dtypes.DTYPES["F32"]
    columns = {"name": ["a"], "shape": [(2,)], "begin": [8], "end": [16], "nbytes": [8]}
    with pytest.raises(ValueError, match="every field given once"):
        frozen_many(_header.TensorInfo, 1, columns, {"dtype": dt})
    with pytest.raises(ValueError, match="1 of each field"):
        frozen_many(_header.TensorInfo, 1, {**columns, "name": []}, {"dtype": dt, "file": "f"})
