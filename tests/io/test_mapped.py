"""Gathers of scattered runs out of a map the process never loads from
(``nnx_save.io._mapped``), and the lazy slices that use them: the runs equal the file's
bytes (hypothesis), a truncated file is a refusal the caller reads again (then a typed
error), never a signal; single runs (``quick_run``) equal numpy's slicing."""

import os
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nnx_save
from nnx_save import errors
from nnx_save.io._mapped import MappedFile, can_map
from nnx_save.load._direct import one_run, quick_run
from nnx_save.load._slices import normalize_index

pytestmark = pytest.mark.skipif(not can_map(), reason="no process_vm_readv in this sandbox")

DATA = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()  # three blocks' worth


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mapped") / "data.bin"
    path.write_bytes(DATA)
    return path


def _mapped(path) -> MappedFile:
    fd = os.open(path, os.O_RDONLY)
    try:
        return MappedFile(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@given(
    starts=st.lists(st.integers(0, len(DATA) - 4097), min_size=1, max_size=3000),
    length=st.integers(1, 4096),
    release=st.booleans(),
)
def test_gathered_runs_are_the_files_bytes(data_file, starts, length, release):
    offsets = np.array(sorted(starts), np.int64)
    out = np.zeros(len(offsets) * length, np.uint8)
    mapped = _mapped(data_file)
    try:
        assert mapped.gather(out.ctypes.data, offsets, length, release=release)
    finally:
        mapped.close()
    want = b"".join(DATA[o : o + length] for o in offsets.tolist())
    assert out.tobytes() == want


def test_a_truncated_file_is_a_refusal_not_a_signal(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(DATA)
    mapped = _mapped(path)
    out = np.zeros(2 * 100, np.uint8)
    os.truncate(path, 1 << 20)  # the map's pages past 1 MiB are gone
    assert not mapped.gather(out.ctypes.data, np.array([0, 2 << 20]), 100)
    assert mapped.gather(out.ctypes.data, np.array([0, 4096]), 100)  # within the file: still read
    assert out.tobytes() == DATA[:100] + DATA[4096:4196]
    mapped.close()
    assert not mapped.gather(out.ctypes.data, np.array([0, 4096]), 100)  # closed: refused, not read


def test_column_slices_are_gathered_from_the_map_then_refused_when_truncated(tmp_path):
    path = tmp_path / "w.safetensors"
    w = np.arange(512 * 2048, dtype=np.float32).reshape(512, 2048)
    nnx_save.save_file({"w": w}, path)
    with nnx_save.safe_open(path) as f:
        for _ in range(3):  # the first gather drops its pages, later ones keep them
            np.testing.assert_array_equal(f.get_slice("w")[:, 100:164], w[:, 100:164])
        assert [m for m in f._state.direct._maps.values() if m is not None], "no map was used"
        os.truncate(path, os.path.getsize(path) - (1 << 20))
        with pytest.raises(errors.TruncatedFileError, match=re.escape("tensor 'w' needs bytes up to")):
            f.get_slice("w")[:, 100:164]


SHAPES = st.lists(st.integers(1, 5), min_size=0, max_size=4)


@st.composite
def _indexed(draw):
    shape = tuple(draw(SHAPES))
    items = []
    for size in shape[: draw(st.integers(0, len(shape)))]:
        if draw(st.booleans()):
            items.append(draw(st.integers(-size - 1, size)))
        else:
            bounds = st.one_of(st.none(), st.integers(-size - 1, size + 1))
            items.append(slice(draw(bounds), draw(bounds), draw(st.sampled_from([None, 1, 2]))))
    return shape, tuple(items) if draw(st.booleans()) or len(items) != 1 else items[0]


@given(_indexed())
def test_one_run_and_quick_run_select_what_numpy_does(case):
    shape, index = case
    array = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    quick = quick_run(index, shape)
    try:
        items = normalize_index(index, shape)
    except errors.SliceError:
        assert quick is None  # the general path refuses it, naming why
        return
    runs = [r for r in (quick, one_run(items, shape) if items is not None else None) if r is not None]
    if quick is not None:
        assert one_run(items, shape) == quick
    for first, out in runs:
        want = array[items]
        assert list(want.shape) == out
        np.testing.assert_array_equal(array.reshape(-1)[first : first + want.size].reshape(out), want)
