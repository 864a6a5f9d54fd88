"""save/_sink: the bytes land exactly, whichever way they are written (direct I/O in whole
chunks, buffered with write-back started per chunk, or direct refused midway), and a
failed write raises."""

import errno
import fcntl
import os
import re
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.io._atomic import TMP_MARKER
from nnx_save.save import _sink

SMALL_CHUNK = 16 << 10  # a multiple of any block size direct I/O asks for here


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(_sink, "CHUNK_BYTES", SMALL_CHUNK)


def direct_flag(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def write_through(directory: str, pieces: list[bytes]) -> tuple[bytes, bool]:
    """The file a sink makes of ``pieces``, and whether it wrote directly at first."""
    path = os.path.join(directory, "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with _sink.Sink(fd, _sink.chunk_memory(sum(map(len, pieces)), 1 << 30)) as sink:
            direct = sink.direct
            for p in pieces:
                sink.write(memoryview(p))
            sink.finish()
            assert not direct_flag(fd)  # the caller gets a buffered descriptor back
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        return f.read(), direct


@pytest.mark.usefixtures("small_chunks")
@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * SMALL_CHUNK), max_size=8),
    direct=st.booleans(),
)
def test_the_file_is_the_pieces_in_order(sizes, direct):
    rng = np.random.default_rng(len(sizes))
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    os.environ["NNX_SAVE_DIRECT_IO"] = "1" if direct else "0"
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
            data, used = write_through(d, pieces)
    finally:
        del os.environ["NNX_SAVE_DIRECT_IO"]
    assert data == b"".join(pieces)
    assert not used or direct


def test_direct_io_is_used_for_a_file_of_a_chunk_or_more_within_half_the_budget(tmp_path, small_chunks):
    held = _sink.DEPTH * SMALL_CHUNK
    assert _sink.chunk_memory(SMALL_CHUNK - 1, 1 << 30) == 0  # smaller than a chunk
    assert _sink.chunk_memory(SMALL_CHUNK, 2 * held - 1) == 0  # the chunks would take over half the budget
    assert _sink.chunk_memory(SMALL_CHUNK, 2 * held) == held
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with _sink.Sink(fd, 0) as small:
            assert not small.direct and not direct_flag(fd)
        with _sink.Sink(fd, held) as big:
            if not big.direct:
                pytest.skip(f"{tmp_path}: this filesystem refuses O_DIRECT")
            assert direct_flag(fd)
        assert not direct_flag(fd)  # leaving the sink, even unfinished, turns it off
    finally:
        os.close(fd)


def test_buffered_writes_start_write_back_chunk_by_chunk(tmp_path, small_chunks, monkeypatch):
    started = []
    monkeypatch.setenv("NNX_SAVE_DIRECT_IO", "0")
    monkeypatch.setattr(_sink, "_range_starter", lambda: lambda fd, offset, length: started.append((offset, length)))
    data, direct = write_through(str(tmp_path), [b"a" * 100, b"b" * SMALL_CHUNK, b"c" * (2 * SMALL_CHUNK), b"d" * 5])
    assert not direct and len(data) == 3 * SMALL_CHUNK + 105
    assert started == [(0, SMALL_CHUNK + 100), (SMALL_CHUNK + 100, 2 * SMALL_CHUNK), (3 * SMALL_CHUNK + 100, 5)]


def test_a_direct_write_refused_midway_is_written_through_the_page_cache(tmp_path, small_chunks, monkeypatch):
    real, refused = _sink.pwrite_all, []

    def picky(fd, data, offset):
        if direct_flag(fd) and offset == SMALL_CHUNK:  # the second chunk: as a filesystem wanting larger blocks
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(_sink, "pwrite_all", picky)
    pieces = [bytes([i]) * (SMALL_CHUNK // 2 + 7) for i in range(9)]
    data, direct = write_through(str(tmp_path), pieces)
    if not direct:
        pytest.skip(f"{tmp_path}: this filesystem refuses O_DIRECT")
    assert refused == [SMALL_CHUNK] and data == b"".join(pieces)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_failed_data_write_fails_the_save_and_keeps_the_previous_file(tmp_path, small_chunks, monkeypatch, direct):
    path = tmp_path / "m.safetensors"
    nnx_save.save_file({"w": np.arange(4, dtype=np.float32)}, path)
    before = path.read_bytes()
    real = _sink.pwrite_all

    def full(fd, data, offset):
        if offset + len(data) > 2 * SMALL_CHUNK:  # the disk fills up after two chunks
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setenv("NNX_SAVE_DIRECT_IO", direct)
    monkeypatch.setattr(_sink, "pwrite_all", full)
    with pytest.raises(
        nnx_save.SaveError,
        match=re.escape(f"{path}: save failed (no space left on the device); the previous file, if any, is intact"),
    ):
        nnx_save.save_file({"a": np.ones(SMALL_CHUNK, np.float32)}, path)  # 4 chunks
    assert path.read_bytes() == before
    assert [p for p in os.listdir(tmp_path) if TMP_MARKER in p] == []


@pytest.mark.parametrize("direct", ["1", "0"])
def test_saves_of_many_chunks_are_the_reference_bytes(tmp_path, small_chunks, monkeypatch, direct):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    monkeypatch.setenv("NNX_SAVE_DIRECT_IO", direct)
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.random((int(rng.integers(1, 900)), 37), dtype=np.float32) for i in range(12)}
    nnx_save.save_file(arrays, tmp_path / "m.safetensors")
    back = safetensors_numpy.load_file(tmp_path / "m.safetensors")
    assert back.keys() == arrays.keys() and all(back[k].tobytes() == arrays[k].tobytes() for k in arrays)
    loaded = nnx_save.load_file(tmp_path / "m.safetensors", verify=True)  # the recorded checksums hold
    assert all(np.asarray(loaded[k]).tobytes() == arrays[k].tobytes() for k in arrays)
