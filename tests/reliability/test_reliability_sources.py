"""Sources that are not what they seem: a FIFO, a
directory named ``*.safetensors``, a device, ``/proc/self/mem``, absurd empty shapes,
a path with NUL, a long legal name, a symlinked target. Each gives a typed error
naming the path, or works, and never blocks; each test names the probe it pins."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from _errors import raises_check
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reliability_edges import temporary_name

import nnx_save

NAME_MAX = 255  # bytes in one file name (Linux, macOS, most filesystems)
TMP_MARKER = ".nnx_save-tmp-"  # in every temporary file's name (docs/reliability.md)
LOADERS = {"read_header": nnx_save.read_header, "load_file": nnx_save.load_file}


@contextlib.contextmanager
def no_hang(seconds: int = 5):
    """Turn a blocking call into a failure (SIGALRM interrupts a blocked ``open``)."""

    def fail(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(fn, cls, message: str) -> None:
    with no_hang(), raises_check(cls, match=re.escape(message)) as info:
        fn()
    return info.value


@pytest.mark.parametrize("loader", LOADERS)
def test_a_fifo_as_the_source_is_refused_without_blocking(tmp_path, loader):
    """Opening a FIFO would block forever waiting for a writer: it is refused first."""
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    e = refused(lambda: LOADERS[loader](fifo), nnx_save.SourceError, f"{fifo}: is a FIFO, not a regular file")
    assert e.file == str(fifo)


@pytest.mark.parametrize("loader", LOADERS)
def test_a_fifo_inside_a_directory_or_named_by_an_index_is_refused(tmp_path, loader):
    """A FIFO ``dir/x.safetensors`` in a directory load is refused the same way."""
    nnx_save.save_file({"a": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    os.mkfifo(tmp_path / "x.safetensors")
    message = f"{tmp_path / 'x.safetensors'}: is a FIFO, not a regular file"
    refused(lambda: LOADERS[loader](tmp_path), nnx_save.SourceError, message)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "a.safetensors", "b": "x.safetensors"}})
    )
    refused(lambda: LOADERS[loader](tmp_path), nnx_save.SourceError, message)


def test_a_fifo_named_like_the_index_is_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    nnx_save.save_file({"a": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    # not a regular file: the directory is read as a plain directory of files
    with no_hang():
        assert list(nnx_save.read_header(tmp_path)) == ["a"]


@pytest.mark.parametrize("loader", LOADERS)
def test_a_directory_named_like_a_file_is_a_typed_error_with_its_path(tmp_path, loader):
    """A directory ``b.safetensors`` in a checkpoint directory is a typed error naming
    it, not a bare ``IsADirectoryError`` without a path."""
    nnx_save.save_file({"a": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").mkdir()
    refused(
        lambda: LOADERS[loader](tmp_path),
        nnx_save.SourceError,
        f"{tmp_path / 'b.safetensors'}: is a directory, not a regular file",
    )


@pytest.mark.parametrize("loader", LOADERS)
def test_dev_zero_is_not_a_regular_file(tmp_path, loader):
    """``/dev/zero`` is refused as a device, not read as a short file ("8 bytes is
    shorter than the 8-byte header size prefix")."""
    link = tmp_path / "zero.safetensors"
    link.symlink_to("/dev/zero")
    refused(lambda: LOADERS[loader](link), nnx_save.SourceError, f"{link}: is a character device, not a regular file")


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs /proc")
@pytest.mark.parametrize("loader", LOADERS)
def test_a_symlink_to_proc_self_mem_is_a_typed_error(tmp_path, loader):
    """A symlink to ``/proc/self/mem`` is a typed error, not a bare ``OSError`` (EIO)."""
    link = tmp_path / "mem.safetensors"
    link.symlink_to("/proc/self/mem")
    refused(
        lambda: LOADERS[loader](link),
        "too_small",
        f"{link}: 0 bytes is shorter than the 8-byte header size prefix",
    )


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize(
    ("dtype", "shape"), [("F32", [0, 2**62]), ("F32", [2**61, 0]), ("U8", [0, 2**32, 2**31]), ("F64", [0, 2**60])]
)
def test_empty_tensors_with_unaddressable_dimensions_are_refused_at_the_header(tmp_path, loader, dtype, shape):
    """An empty shape like ``[0, 2**62]`` is checked in ``read_header``, before numpy
    would raise ``ValueError: array is too big``."""
    path = tmp_path / "empty.safetensors"
    body = json.dumps({"e": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    refused(
        lambda: LOADERS[loader](path),
        "byte_length",
        f"{path}: tensor 'e': shape {shape} of {dtype} cannot be addressed: its non-zero dimensions times the "
        "item size exceed 2**63 - 1 bytes",
    )


def test_the_largest_addressable_empty_tensor_still_loads(tmp_path):
    path = tmp_path / "empty.safetensors"
    body = json.dumps({"e": {"dtype": "F32", "shape": [0, 2**60], "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    assert nnx_save.load_file(path)["e"].shape == (0, 2**60)


def test_a_save_path_with_nul_is_an_option_error(tmp_path):
    """A NUL in the path would surface as ``ValueError: embedded null byte``; it is refused
    where the argument enters, naming it (an OptionError, before any write)."""
    path = f"{tmp_path}/a\x00b.safetensors"
    with pytest.raises(nnx_save.OptionError, match=re.escape("save_file: path must be a path with no NUL byte")):
        nnx_save.save_file({"w": np.ones(2, np.float32)}, path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("length", [227, NAME_MAX])
def test_a_long_legal_file_name_can_be_saved(tmp_path, length):
    """A legal 227-character name saves: a temporary suffix would push the temporary
    name past 255 bytes, so the temporary name is cut."""
    path = tmp_path / ("w" * (length - len(".safetensors")) + ".safetensors")
    assert len(path.name) == length
    nnx_save.save_file({"w": np.arange(3, dtype=np.float32)}, path)
    assert np.array_equal(nnx_save.load_file(path)["w"], np.arange(3, dtype=np.float32))
    assert os.listdir(tmp_path) == [path.name]


def test_temporary_names_of_long_multibyte_names_fit_and_are_recognised(tmp_path, monkeypatch):
    path = tmp_path / ("é" * 120 + ".safetensors")  # 252 bytes
    tmp = temporary_name(path, monkeypatch)
    assert len(tmp.encode()) <= NAME_MAX and TMP_MARKER in tmp
    tmp.encode().decode("utf-8")  # not cut inside a character


_BYTE_NAMES = st.binary(min_size=1, max_size=NAME_MAX).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b"..")
)


@settings(max_examples=40, deadline=None)
@given(raw=st.one_of(_BYTE_NAMES, st.just(b"w\xff.safetensors"), st.just(b"\xc3" * 3 + "é".encode() * 126)))
def test_any_legal_file_name_in_bytes_can_be_saved_and_loaded(raw):
    """A name that is not UTF-8 (bytes Python decodes to surrogates) must not fail with a
    bare UnicodeEncodeError from the temporary name; any bytes the kernel takes save."""
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / os.fsdecode(raw)
        for value in (1.0, 2.0):  # the second save replaces the first, through a temporary
            nnx_save.save_file({"w": np.full(3, value, np.float32)}, path)
        assert nnx_save.load_file(path)["w"].tolist() == [2.0, 2.0, 2.0]
        assert os.listdir(os.fsencode(where)) == [raw]


def test_saving_through_a_symlink_replaces_the_link_not_its_target(tmp_path):
    """A symlinked target (docs/reliability.md): the save is an atomic rename in the
    link's directory, so the link is replaced by the new file and the file it
    pointed to (a shared blob, say a HuggingFace cache entry) is left untouched."""
    target = tmp_path / "blobs" / "blob.safetensors"
    target.parent.mkdir()
    nnx_save.save_file({"w": np.zeros(2, np.float32)}, target)
    link = tmp_path / "model.safetensors"
    link.symlink_to(target)
    nnx_save.save_file({"w": np.ones(2, np.float32)}, link)
    assert not link.is_symlink()
    assert nnx_save.load_file(link)["w"].tolist() == [1.0, 1.0]
    assert nnx_save.load_file(target)["w"].tolist() == [0.0, 0.0]
