"""The batch path (load/_batch) against the general path: runs of small whole tensors
read into one buffer each must give the very values and report the general path gives,
for any mix of small, large, sharded, BOOL, cast, skipped and verified tensors; a file
truncated under the load stays a typed error; a bad byte is named as before."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import warnings
from unittest import mock

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import nnx_save
from nnx_save import ChecksumError, SourceError, TruncatedFileError
from nnx_save.load import _batch

DEV = jax.devices()
MESH8 = Mesh(np.array(DEV), ("x",))
DTYPES = [np.float32, np.int8, np.bool_, np.float16, ml_dtypes.bfloat16, np.int64]
CASTS = {np.dtype(np.float32): np.float16, np.dtype(np.int8): np.int32, np.dtype(np.float16): np.float32}


@contextlib.contextmanager
def general_path():
    """Nothing is small enough for the batch path: every tensor takes the general one."""
    with mock.patch.object(_batch, "SMALL_BYTES", 0):
        yield


@contextlib.contextmanager
def counting():
    """Count the tensors the batch path reads (requests made for their runs)."""
    placed = {"n": 0}
    original = _batch.Batch.work

    def work(self, file, first):
        runs = self.by_file.get(file)
        placed["n"] += len(runs.targets) if runs is not None else 0
        return original(self, file, first)

    with mock.patch.object(_batch.Batch, "work", work):
        yield placed


def _value(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    return (rng.standard_normal(shape) * 50).astype(dtype)


@st.composite
def mixes(draw):
    """A file of tensors and an abstract tree over some of them, each leaf a host array,
    one device, sharded on 8 devices, or a cast."""
    n = draw(st.integers(1, 24))
    tensors, abstract = {}, {}
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        size = draw(st.sampled_from(["tiny", "small", "large", "empty"]))
        shape = {"tiny": (), "small": (8, draw(st.integers(1, 40))), "large": (24, 1024), "empty": (0, 3)}[size]
        name = f"t{i:02d}"
        tensors[name] = _value(dtype, shape, i)
        how = draw(st.sampled_from(["skip", "numpy", "device", "device", "sharded", "cast"]))
        if how == "skip":
            continue
        if how == "sharded" and (not shape or shape[0] % 8):
            how = "device"
        if how == "cast" and np.dtype(dtype) not in CASTS:
            how = "numpy"
        if how == "numpy":
            abstract[name] = np.zeros(shape, dtype)
        elif how == "cast":
            abstract[name] = jax.ShapeDtypeStruct(shape, CASTS[np.dtype(dtype)], sharding=SingleDeviceSharding(DEV[1]))
        else:
            sharding = NamedSharding(MESH8, P("x")) if how == "sharded" else SingleDeviceSharding(DEV[i % 8])
            abstract[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    if not abstract:
        abstract["t00"] = np.zeros(tensors["t00"].shape, tensors["t00"].dtype)
    return tensors, abstract, draw(st.booleans()), draw(st.sampled_from([None, None, True]))


def _load(path, abstract, verify, stream=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unexpected tensors and casts: in the report, compared
        return nnx_save.load_file(path, abstract, return_report=True, verify=verify, stream=stream)


def _comparable(report):
    """The report without what depends on how the bytes were read: timings, system calls, peak."""
    io = dataclasses.replace(
        report.io, requests=0, plan_seconds=0, read_seconds=0, assemble_seconds=0, max_inflight_bytes=0
    )
    return dataclasses.replace(report, io=io)


def _same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    assert a.dtype == b.dtype and a.shape == b.shape
    if isinstance(a, jax.Array):
        assert a.sharding == b.sharding
        for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
            assert x.device == y.device and x.index == y.index
            np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data))
    else:
        np.testing.assert_array_equal(a, b)


@settings(max_examples=60)
@given(mixes())
def test_the_batch_path_gives_what_the_general_path_gives(tmp_path_factory, mix):
    tensors, abstract, verify, stream = mix
    path = tmp_path_factory.mktemp("batch") / "mix.safetensors"
    nnx_save.save_file(tensors, path)
    with counting() as placed:
        tree, report = _load(path, abstract, verify, stream)
    with general_path(), counting() as none:
        want, want_report = _load(path, abstract, verify, stream)
    assert none["n"] == 0
    # streamed device arrays adopt no host memory, and casts are cast slab by slab: those
    # stay on the general path
    cast = {k for k in abstract if np.asarray(tree[k]).dtype != tensors[k].dtype}
    small = [
        k
        for k, leaf in abstract.items()
        if 0 < tensors[k].nbytes <= _batch.SMALL_BYTES
        and (isinstance(leaf, np.ndarray) or (isinstance(leaf.sharding, SingleDeviceSharding) and not stream))
        and k not in cast
    ]
    assert placed["n"] == len(small)  # every other small whole tensor took the batch path
    assert tree.keys() == want.keys()
    for k in want:
        _same(tree[k], want[k])
        np.testing.assert_array_equal(np.asarray(tree[k]), tensors[k].astype(np.asarray(tree[k]).dtype))
    assert _comparable(report) == _comparable(want_report)


def _small_file(tmp_path, n=64):
    path = tmp_path / "small.safetensors"
    nnx_save.save_file({f"t{i:03d}": np.full(256, i, np.float32) for i in range(n)}, path)
    sharding = SingleDeviceSharding(DEV[0])
    return path, {f"t{i:03d}": jax.ShapeDtypeStruct((256,), np.float32, sharding=sharding) for i in range(n)}


def test_a_file_truncated_under_the_load_is_a_typed_error(tmp_path):
    path, abstract = _small_file(tmp_path)
    header = nnx_save.read_header(path)  # validated: the load reads from here on
    os.truncate(path, header.tensors["t010"].begin + 100)
    with counting() as placed, pytest.raises((TruncatedFileError, SourceError)) as info:
        nnx_save.load_file(header, abstract)
    assert str(path) in str(info.value)
    assert placed["n"] == 64  # read on the batch path


def test_the_batch_path_reads_one_request_per_run(tmp_path):
    path, abstract = _small_file(tmp_path, 1000)
    with counting() as placed:
        tree, report = nnx_save.load_file(path, abstract, return_report=True)
    assert placed["n"] == 1000
    assert report.io.requests == 1  # one run, one read
    assert report.io.bytes_read == report.io.bytes_needed == 1000 * 1024
    assert [float(tree[f"t{i:03d}"][7]) for i in (0, 1, 999)] == [0.0, 1.0, 999.0]
    pointers = [tree[f"t{i:03d}"].unsafe_buffer_pointer() for i in range(1000)]
    assert np.diff(pointers).tolist() == [1024] * 999  # views of one buffer, adopted without a copy


def test_a_bad_bool_byte_is_named_on_the_batch_path(tmp_path):
    path = tmp_path / "b.safetensors"
    nnx_save.save_file({"a": np.ones(4, np.float32), "m": np.array([1, 0, 1], np.bool_)}, path)
    begin = nnx_save.read_header(path).tensors["m"].begin
    with open(path, "r+b") as f:
        f.seek(begin + 2)
        f.write(b"\x07")
    with counting() as placed, pytest.raises(ChecksumError, match=r"tensor 'm' \(BOOL\): element \[2\]"):
        nnx_save.load_file(path, {"a": np.zeros(4, np.float32), "m": np.zeros(3, np.bool_)})
    assert placed["n"] == 2


def test_a_changed_byte_fails_its_checksum_on_the_batch_path(tmp_path):
    path, abstract = _small_file(tmp_path, 8)
    begin = nnx_save.read_header(path).tensors["t005"].begin
    with open(path, "r+b") as f:
        f.seek(begin + 40)
        f.write(b"\x01")
    with counting() as placed, pytest.raises(ChecksumError, match="tensor 't005': checksum mismatch"):
        nnx_save.load_file(path, abstract, verify=True)
    assert placed["n"] == 8


def test_plan_runs_cuts_at_gaps_and_sizes():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(1, 50, rng.integers(1, 40))
        gaps = rng.integers(0, 2, len(sizes)) * rng.integers(1, 9, len(sizes))
        begin = np.cumsum(np.concatenate([[0], (sizes + gaps)[:-1]]))
        end = begin + sizes
        cap = int(rng.integers(1, 200))
        starts = _batch.plan_runs(begin, end, cap).tolist()
        assert starts[0] == 0 and starts[-1] == len(sizes) and starts == sorted(set(starts))
        touching = [0, *(i for i in range(1, len(sizes)) if begin[i] != end[i - 1])]
        for a, b in itertools.pairwise(starts):
            stretch = begin[max(t for t in touching if t <= a)]  # the touching tensors' first byte
            assert all(begin[i + 1] == end[i] for i in range(a, b - 1))  # touching inside a run
            assert begin[b - 1] - begin[a] < cap  # one cap-sized window
            assert (begin[a] - stretch) // cap == (begin[b - 1] - stretch) // cap
            if b < len(sizes) and begin[b] == end[b - 1]:  # cut inside a stretch: at a window's edge
                assert (begin[b] - stretch) // cap != (begin[a] - stretch) // cap


def test_a_tensor_two_targets_want_is_read_on_the_general_path(tmp_path):
    """Two targets of one file tensor (a host copy and a device copy) and a third alone:
    the shared tensor is not batched (its runs would overlap), both copies are exact."""
    from nnx_save.load._engine import load_targets
    from nnx_save.load._target import Target

    path = tmp_path / "two.safetensors"
    a, b = np.arange(6, dtype=np.float32), np.arange(4, dtype=np.int8)
    nnx_save.save_file({"a": a, "b": b}, path)
    header = nnx_save.read_header(path)
    one = SingleDeviceSharding(DEV[2])
    targets = [
        Target("host", (6,), np.dtype(np.float32), None, ("a",)),
        Target("dev", (6,), np.dtype(np.float32), one, ("a",)),
        Target("b", (4,), np.dtype(np.int8), one, ("b",)),
    ]
    with counting() as placed:
        values, report = load_targets(header, targets, warn=False)
    assert placed["n"] == 1  # "b" alone
    np.testing.assert_array_equal(values["host"], a)
    np.testing.assert_array_equal(np.asarray(values["dev"]), a)
    assert values["dev"].sharding == one and values["b"].sharding == one
    np.testing.assert_array_equal(np.asarray(values["b"]), b)
    assert report.io.bytes_read == report.io.bytes_needed == 2 * a.nbytes + b.nbytes  # "a" once per copy
