"""``nnx_save.safe_open`` / ``iter_tensors``: slices equal numpy's (hypothesis) and
``safetensors.safe_open``'s, over a file, an HF index directory, a list and a pod
directory; the bytes each slice reads are counted at the reader and equal the byte
runs of the slice merged across sub-page gaps, nothing more; iteration holds one
batch at a time."""

import contextlib
import os
import re
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nnx_save
from nnx_save.bridges import _lazy
from nnx_save.load._plan import PAGE_GAP

RNG = np.random.default_rng(0)
ARRAYS = {
    "a": RNG.standard_normal((6, 5, 4)).astype(np.float32),
    "b": np.arange(7, dtype=np.int64),
    "c": RNG.standard_normal((3, 8)).astype(ml_dtypes.bfloat16),
    "d": np.array(3.5, np.float64),
    "e": np.zeros((0, 3), np.float32),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy")
    nnx_save.save_file(ARRAYS, root / "one.safetensors", metadata={"note": "hi"})
    (root / "hf").mkdir()
    nnx_save.save_file({k: ARRAYS[k] for k in "ab"}, root / "hf" / "model-00001-of-00002.safetensors")
    nnx_save.save_file({k: ARRAYS[k] for k in "cde"}, root / "hf" / "model-00002-of-00002.safetensors")
    (root / "hf" / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", '
        '"b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors", '
        '"d": "model-00002-of-00002.safetensors", "e": "model-00002-of-00002.safetensors"}}'
    )
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    spec = jax.sharding.PartitionSpec("x", None, "y")
    sharded = jax.device_put(ARRAYS["a"], jax.sharding.NamedSharding(mesh, spec))
    nnx_save.save_pod({"a": sharded, "b": ARRAYS["b"]}, root / "pod")
    return {
        "file": root / "one.safetensors",
        "index": root / "hf",
        "list": [root / "hf" / "model-00001-of-00002.safetensors", root / "hf" / "model-00002-of-00002.safetensors"],
        "pod": root / "pod",
    }


def _index(draw, shape):
    items = []
    for d in shape:
        kind = draw(st.sampled_from(["int", "slice", "full"]))
        if kind == "int":
            items.append(draw(st.integers(-d, d - 1)))
        elif kind == "slice":
            bound = st.one_of(st.none(), st.integers(-d - 2, d + 2))
            step = draw(st.one_of(st.none(), st.sampled_from([1, 2, 3, -1, -2])))
            items.append(slice(draw(bound), draw(bound), step))
        else:
            items.append(slice(None))
    cut = draw(st.integers(0, len(items)))  # fewer indices than dimensions, or an Ellipsis
    if draw(st.booleans()) and cut < len(items):
        return (*items[:cut], Ellipsis)
    return tuple(items[:cut]) if cut else items[0] if items else ()


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    return shape, _index(draw, shape)


def _positive(index, shape):
    """``index`` with negative slice bounds made non-negative as numpy reads them."""
    items = index if isinstance(index, tuple) else (index,)
    at = [n for n, i in enumerate(items) if i is Ellipsis]
    dims = list(shape) if not at else [*list(shape[: at[0]]), None, *list(shape[len(shape) - len(items) + at[0] + 1 :])]

    def fix(i, d):
        if not isinstance(i, slice) or d is None:
            return i
        return slice(*(b if b is None or b >= 0 else max(b + d, 0) for b in (i.start, i.stop)), i.step)

    out = tuple(fix(i, d) for i, d in zip(items, dims, strict=False))
    return out if isinstance(index, tuple) else out[0]


def _emptied(index):
    """``index`` (bounds non-negative) with every slice whose start is past its stop made
    the empty slice numpy reads it as: ``slice(stop, stop)``."""
    items = index if isinstance(index, tuple) else (index,)

    def fix(i):
        if not isinstance(i, slice) or None in (i.start, i.stop) or (i.step or 1) < 1 or i.start <= i.stop:
            return i
        return slice(i.stop, i.stop, i.step)

    out = tuple(fix(i) for i in items)
    return out if isinstance(index, tuple) else out[0]


def _theirs(path, index, shape, value):
    """What ``safetensors.safe_open`` gives for ``index``: its array, or None where it
    refuses (SafetensorError). Where it crashes instead (OverflowError on a negative
    bound; SystemError, ValueError or a Rust panic on start > stop) the rule we follow
    is numpy's meaning of the bound, asked of safetensors again, so that its refusals
    (a negative step, an out-of-range bound elsewhere) stay refusals."""
    import safetensors

    with safetensors.safe_open(str(path), "np") as theirs:
        try:
            return theirs.get_slice("t")[index]
        except safetensors.SafetensorError:
            return None
        except BaseException as e:  # OverflowError, SystemError, ValueError, pyo3's PanicException
            if not isinstance(e, (OverflowError, SystemError, ValueError)) and type(e).__name__ != "PanicException":
                raise
            numpy_meaning = _emptied(_positive(index, shape))
            if numpy_meaning == index:
                raise
            return _theirs(path, numpy_meaning, shape, value)


@given(cases())
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_slices_equal_safetensors_and_numpy(tmp_path_factory, backend, case):
    """Mirrors safetensors' slicing rules: where ``safetensors.safe_open`` slices, we give
    its values (numpy's); where it refuses (SafetensorError: out-of-range bounds, steps
    below 1), we raise SliceError; where it crashes instead (OverflowError on negative
    bounds; SystemError, ValueError or a panic on start > stop) we follow numpy (docs/lazy.md)."""

    shape, index = case
    root = tmp_path_factory.mktemp("h")
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    nnx_save.save_file({"t": value}, root / "t.safetensors")
    expected = _theirs(root / "t.safetensors", index, shape, value)
    with nnx_save.safe_open(root / "t.safetensors", backend=backend) as f:
        if expected is None:
            with pytest.raises(nnx_save.SliceError, match=re.escape("t: cannot slice a tensor of shape")):
                f.get_slice("t")[index]
            return
        got = f.get_slice("t")[index]
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, value[index])
    assert got.shape == value[index].shape and got.dtype == value.dtype and got.flags.c_contiguous


@pytest.mark.parametrize("layout", ["file", "index", "list", "pod"])
def test_every_layout(layouts, layout):
    with nnx_save.safe_open(layouts[layout]) as f:
        keys = f.keys()
        assert keys == (["a", "b"] if layout == "pod" else sorted(ARRAYS))
        for key in keys:
            np.testing.assert_array_equal(f.get_tensor(key), ARRAYS[key])
        for index in [(slice(1, 5), slice(None), 2), (-1, slice(None, None, 2)), (Ellipsis, slice(1, 3))]:
            np.testing.assert_array_equal(f.get_slice("a")[index], ARRAYS["a"][index])
        assert f.get_slice("a").get_shape() == [6, 5, 4] and f.get_slice("a").get_dtype() == "F32"


def test_matches_safetensors_safe_open(layouts):
    import safetensors

    path = layouts["file"]
    with nnx_save.safe_open(path) as ours, safetensors.safe_open(str(path), "np") as theirs:
        assert ours.keys() == sorted(theirs.keys())
        assert ours.metadata() == theirs.metadata()
        for key in ["a", "b", "d", "e"]:  # numpy has no bfloat16 in safetensors' np framework
            np.testing.assert_array_equal(ours.get_tensor(key), theirs.get_tensor(key))
            assert ours.get_slice(key).get_shape() == theirs.get_slice(key).get_shape()
            assert ours.get_slice(key).get_dtype() == theirs.get_slice(key).get_dtype()
        for index in [(slice(2, 4),), (slice(None), slice(1, 4), slice(0, 2)), (slice(0, 6), slice(0, 5), slice(3, 4))]:
            np.testing.assert_array_equal(ours.get_slice("a")[index], theirs.get_slice("a")[index])


def _counting(monkeypatch):
    """Count the bytes every reader the handle opens is asked for, at the reader."""
    counted = [0]
    real = _lazy.reader_factory

    def factory(header):
        open_reader = real(header)

        def counting_open(file):
            reader = open_reader(file)
            for name in ("readv", "readv_table"):
                inner = getattr(reader, name, None)
                if inner is not None:

                    def wrapped(buffers, offset, inner=inner, table=name == "readv_table"):
                        counted[0] += int(buffers[:, 1].sum()) if table else sum(len(b) for b in buffers)
                        return inner(buffers, offset)

                    setattr(reader, name, wrapped)
            inner_runs = getattr(reader, "read_runs", None)
            if inner_runs is not None:  # batches of small chunks (local files)

                def runs(addr, length, offset, inner=inner_runs):
                    counted[0] += sum(length)
                    return inner(addr, length, offset)

                reader.read_runs = runs
            return reader

        return counting_open

    monkeypatch.setattr(_lazy, "reader_factory", factory)
    return counted


def _expected_read(value: np.ndarray, index) -> tuple[int, int]:
    """(bytes needed, bytes the page-gap rule reads) for ``value[index]``, from numpy:
    the byte offsets of the elements the index's bounding box touches."""
    box, _ = _lazy.slice_box(index, value.shape)
    offsets = np.arange(value.size).reshape(value.shape)[tuple(slice(lo, hi) for lo, hi in box)].ravel()
    starts = np.sort(offsets) * value.itemsize
    needed = len(starts) * value.itemsize
    breaks = np.flatnonzero(np.diff(starts) - value.itemsize >= PAGE_GAP)
    first = np.concatenate([[0], breaks + 1])
    last = np.append(breaks, len(starts) - 1)
    return needed, int((starts[last] + value.itemsize - starts[first]).sum())


@pytest.mark.parametrize(
    "index",
    [
        (slice(None), slice(0, 16)),  # last-dim slice: rows 8 KiB apart, so exact reads
        (slice(100, 104),),  # rows: one contiguous run
        (slice(None, None, 64), slice(500, 600)),  # strided rows, a window of each
        (7, slice(2040, 2048)),
        (slice(None), slice(1000, 1001)),  # one column: 4-byte runs 8 KiB apart
        (slice(0, 8), slice(0, 1000, 3)),  # a stepped last dim reads its bounding box
    ],
)
def test_only_the_needed_bytes_are_read(tmp_path, monkeypatch, index):
    value = RNG.standard_normal((256, 2048)).astype(np.float32)
    nnx_save.save_file({"pad": np.zeros(1000, np.float32), "w": value}, tmp_path / "w.safetensors")
    counted = _counting(monkeypatch)
    with nnx_save.safe_open(tmp_path / "w.safetensors", backend="pread") as f:  # the engine's readers
        np.testing.assert_array_equal(f.get_slice("w")[index], value[index])
        needed, expected = _expected_read(value, index)
        assert (f.io.bytes_needed, f.io.bytes_read, counted[0]) == (needed, expected, expected)
    assert expected < value.nbytes / 4
    if index == (slice(None), slice(0, 16)):
        assert expected == needed == 256 * 64  # nothing but the slice


def test_iter_tensors_streams_in_bounded_memory(tmp_path):
    tensors = {f"t{i:02d}": np.full((256, 1024), i, np.float32) for i in range(24)}  # 1 MiB each
    nnx_save.save_file(tensors, tmp_path / "big.safetensors")
    seen = []
    tracemalloc.start()
    try:
        for key, value in nnx_save.iter_tensors(tmp_path / "big.safetensors", max_batch_bytes=2 << 20):
            seen.append((key, float(value[0, 0]), value.dtype))
            del value
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == [(k, float(i), np.dtype(np.float32)) for i, k in enumerate(sorted(tensors))]
    assert peak < 6 << 20, f"peak {peak / 2**20:.1f} MiB for a 24 MiB checkpoint read in 2 MiB batches"


def test_iter_tensors_keys_and_dtype(layouts):
    got = list(nnx_save.iter_tensors(layouts["index"], keys=["c", "a", "c"], dtype=np.float32))
    assert [k for k, _ in got] == ["c", "a", "c"]
    assert all(v.dtype == np.float32 for _, v in got)
    np.testing.assert_array_equal(got[0][1], ARRAYS["c"].astype(np.float32))
    with pytest.raises(nnx_save.SliceError, match=re.escape("'zz': no such tensor in the checkpoint")):
        list(nnx_save.iter_tensors(layouts["index"], keys=["a", "zz"]))


def test_errors(layouts):
    f = nnx_save.safe_open(layouts["file"])
    shape = "a: cannot slice a tensor of shape [6, 5, 4] with "
    with pytest.raises(nnx_save.SliceError, match=re.escape(shape + "[6]: index 6 is out of bounds for dimension 0")):
        f.get_slice("a")[6]
    with pytest.raises(nnx_save.SliceError, match=re.escape(shape + "[0, 0, 0, 0]: more indices (4) than dimensions")):
        f.get_slice("a")[0, 0, 0, 0]
    with pytest.raises(nnx_save.SliceError, match=re.escape(shape + "[[0, 1]]: non-empty lists are not implemented")):
        f.get_slice("a")[[0, 1]]
    with pytest.raises(nnx_save.SliceError, match=re.escape("'a.weight': no such tensor in the checkpoint")):
        f.get_tensor("a.weight")
    with pytest.raises(nnx_save.errors.SafetensorError, match=re.escape("framework 'tf' is not supported")):
        nnx_save.safe_open(layouts["file"], framework="tf")
    f.close()
    with pytest.raises(nnx_save.errors.SafetensorError, match=re.escape("File is closed: ")):
        f.keys()


def test_module_examples():
    import doctest

    result = doctest.testmod(_lazy)
    assert result.attempted >= 5 and result.failed == 0


def _fds_under(directory) -> int:
    prefix, count = f"{os.path.realpath(directory)}/", 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the descriptor listdir itself used, closed since
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
    return count


def test_iter_tensors_closes_its_files_when_done_or_abandoned(tmp_path):
    tensors = {f"t{i}": np.full(1024, i, np.float32) for i in range(6)}
    nnx_save.save_file(tensors, tmp_path / "ckpt", max_shard_size=8192)  # several files
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 2
    assert [k for k, _ in nnx_save.iter_tensors(tmp_path / "ckpt")] == sorted(tensors)
    assert _fds_under(tmp_path) == 0
    stream = nnx_save.iter_tensors(tmp_path / "ckpt", max_batch_bytes=4096)
    key, value = next(stream)
    assert (key, float(value[0])) == ("t0", 0.0) and _fds_under(tmp_path) > 0
    stream.close()  # a consumer that stops early (break, an exception) closes the generator
    assert _fds_under(tmp_path) == 0


def test_iter_tensors_streams_a_list_of_files_in_the_order_given(tmp_path):
    nnx_save.save_file({"z1": np.ones(2, np.float32), "z0": np.zeros(2, np.float32)}, tmp_path / "b.safetensors")
    nnx_save.save_file({"a": np.full(2, 7, np.float32)}, tmp_path / "a.safetensors")
    files = [tmp_path / "b.safetensors", tmp_path / "a.safetensors"]
    with nnx_save.safe_open(files) as f:
        storage = f.offset_keys()
    assert storage == ["z0", "z1", "a"]  # b.safetensors first, as given, then a.safetensors
    assert [k for k, _ in nnx_save.iter_tensors(files)] == storage
