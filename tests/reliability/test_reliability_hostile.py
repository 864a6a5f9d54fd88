"""Corrupt and hostile files through the public entry points ``load_file`` and
``load_model``: each is refused with its typed error, naming the file, before any
tensor byte is read, and nothing is allocated in proportion to a size the file
declares.

The header parser's own checks are pinned one by one in tests/format/test_header.py
(``parse_header``) and through ``read_header`` in tests/layouts/test_sources.py; this module
proves the same refusals reach the user through both loaders, adds the memory bound
for each, and covers a file truncated or rewritten *after* its header was read.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from _errors import raises_check
from flax import nnx

import nnx_save

E = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def raw_file(path: Path, header: bytes | dict | list, data: bytes = b"", *, size: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if size is None else size) + body + data)
    return path


def builder() -> nnx.Module:
    return nnx.Linear(2, 3, rngs=nnx.Rngs(0))


# name -> (header, data bytes, error class, message after "<file>: ")
CASES = {
    "truncated data": (
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        bytes(10),
        "file_size",
        "tensor data ends at byte 16 of the data section, but the file holds 10",
    ),
    "offsets past the end": (
        {"w": {"dtype": "F32", "shape": [2**20], "data_offsets": [0, 4 << 20]}},
        bytes(8),
        "file_size",
        "tensor data ends at byte 4194304 of the data section",
    ),
    "overlapping ranges": (
        {"a": E, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
        bytes(12),
        "offsets",
        "tensor 'b' at [4, 12] overlaps tensor 'a' (ends at 8)",
    ),
    "gap between ranges": (
        {"a": E, "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}},
        bytes(20),
        "offsets",
        "tensor 'b' at [12, 20] leaves a hole after tensor 'a' (ends at 8)",
    ),
    "bytes disagree with shape": (
        {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
        bytes(8),
        "byte_length",
        "tensor 'w': shape [3] of F32 needs 12 bytes",
    ),
    "duplicate keys": (
        b'{"w":' + json.dumps(E).encode() + b',"w":' + json.dumps(E).encode() + b"}",
        bytes(8),
        "duplicate_key",
        "key 'w' appears more than once in the header JSON",
    ),
    "10^12 elements, small offsets": (
        {"w": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 8]}},
        bytes(8),
        "byte_length",
        "tensor 'w': shape [1000000, 1000000] of F32 needs 4000000000000 bytes",
    ),
    "10^12 elements, honest offsets": (
        {"w": {"dtype": "F32", "shape": [10**12], "data_offsets": [0, 4 * 10**12]}},
        bytes(8),
        "file_size",
        "tensor data ends at byte 4000000000000",
    ),
    "2^80 elements": (
        {"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 0]}},
        b"",
        "byte_length",
        "has more than 2**63 elements",
    ),
    "negative dim": (
        {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
        bytes(8),
        "tensor_entry",
        "shape must be a list of non-negative integers, found [-2]",
    ),
    "float dim": (
        {"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}},
        bytes(8),
        "tensor_entry",
        "shape must be a list of non-negative integers, found [2.0]",
    ),
    "string dim": (
        {"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}},
        bytes(8),
        "tensor_entry",
        "found ['2']",
    ),
    "bool dim": (
        {"w": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}},
        bytes(8),
        "tensor_entry",
        "found [True, 2]",
    ),
    "negative offset": (
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
        bytes(8),
        "tensor_entry",
        "data_offsets must be two non-negative integers",
    ),
    "not UTF-8": (b'{"\xff\xfe":1}', b"", "encoding", "header is not valid UTF-8 (byte 10"),
    "JSON array at top level": (
        [E],
        bytes(8),
        "json",
        "header must be a JSON object, found a JSON list",
    ),
    "not JSON": (b"{'w': 1}", b"", "json", "header is not valid JSON"),
    "non-string metadata": (
        {"__metadata__": {"epoch": 3}, "w": E},
        bytes(8),
        "metadata",
        "__metadata__['epoch'] must be a string, found int 3",
    ),
    "metadata not an object": (
        {"__metadata__": ["a"], "w": E},
        bytes(8),
        "metadata",
        "__metadata__ must be an object of strings, found list",
    ),
    "unknown dtype": (
        {"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}},
        bytes(8),
        "dtype",
        "'F33'",
    ),
    "entry missing a field": (
        {"w": {"dtype": "F32", "shape": [2]}},
        bytes(8),
        "tensor_entry",
        "tensor 'w': fields missing ['data_offsets']",
    ),
}
SIZED = {  # the 8-byte prefix lies
    "header size larger than the file": (
        4096,
        "too_large",
        "header size 4096 at byte 0 runs past the end of the file",
    ),
    "header size of 2^63": (2**63, "too_large", "header size 9223372036854775808 exceeds the cap"),
}

LOADERS = {
    "load_file": nnx_save.load_file,
    "load_model": lambda source: nnx_save.load_model(builder, source),
}


def peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def refused(fn, cls, message: str) -> None:
    with raises_check(cls, match=re.escape(message)):
        fn()


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Trace the builder once, so jax's one-time caches do not count as allocations."""
    nnx.eval_shape(builder)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", CASES)
def test_hostile_headers_are_refused_by_both_loaders_without_allocating(tmp_path, case, loader):
    header, data, cls, message = CASES[case]
    path = raw_file(tmp_path / "m.safetensors", header, data)
    peak = peak_bytes(lambda: refused(lambda: LOADERS[loader](path), cls, f"{path}: "))
    refused(lambda: LOADERS[loader](path), cls, message)
    assert peak < 2 << 20, (case, loader, peak)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", SIZED)
def test_lying_size_prefixes_are_refused_without_allocating(tmp_path, case, loader):
    size, cls, message = SIZED[case]
    path = raw_file(tmp_path / "m.safetensors", {"w": E}, bytes(8), size=size)
    peak = peak_bytes(lambda: refused(lambda: LOADERS[loader](path), cls, f"{path}: {message}"))
    assert peak < 2 << 20, (case, loader, peak)


def good_pair(directory: Path) -> Path:
    directory.mkdir()
    nnx_save.save_file({"kernel": np.ones((2, 3), np.float32)}, directory / "a.safetensors")
    nnx_save.save_file({"bias": np.ones(3, np.float32)}, directory / "b.safetensors")
    return directory


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "../outside.safetensors", "sub/../../x"])
def test_an_index_naming_a_file_outside_its_directory_is_refused(tmp_path, name, loader):
    directory = good_pair(tmp_path / "ckpt")
    (tmp_path / "outside.safetensors").write_bytes((directory / "a.safetensors").read_bytes())
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"kernel": name, "bias": "b.safetensors"}}))
    refused(
        lambda: LOADERS[loader](directory),
        "index",
        f"{index}: file {name!r} points outside the checkpoint directory {directory}",
    )


@pytest.mark.parametrize("loader", LOADERS)
def test_an_index_naming_a_missing_file_is_refused(tmp_path, loader):
    directory = good_pair(tmp_path / "ckpt")
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"kernel": "a.safetensors", "bias": "gone.safetensors"}}))
    refused(
        lambda: LOADERS[loader](directory),
        "index",
        f"{index}: names file 'gone.safetensors', which does not exist in {directory}",
    )


@pytest.mark.parametrize("loader", LOADERS)
def test_a_missing_source_is_file_not_found(tmp_path, loader):
    refused(
        lambda: LOADERS[loader](tmp_path / "nope.safetensors"),
        FileNotFoundError,
        f"{tmp_path / 'nope.safetensors'}: no such checkpoint file or directory",
    )


# --- the file changes after its header was read -------------------------------------------------


def saved_linear(path: Path) -> Path:
    nnx_save.save_model(nnx.Linear(64, 256, rngs=nnx.Rngs(3)), path)
    return path


@pytest.mark.parametrize("loader", LOADERS)
def test_a_file_truncated_after_its_header_was_read_is_a_typed_error(tmp_path, loader):
    path = saved_linear(tmp_path / "m.safetensors")
    header = nnx_save.read_header(path)
    end = header.files[0].file_size
    os.truncate(path, end - 1000)  # in place: the same file, now shorter
    fn = (
        (lambda: nnx_save.load_file(header))
        if loader == "load_file"
        else (lambda: nnx_save.load_model(lambda: nnx.Linear(64, 256, rngs=nnx.Rngs(0)), header))
    )
    with pytest.raises(nnx_save.NnxSaveError, match=re.escape(f"{path}: file ended at byte ")) as info:
        fn()
    assert "(was it truncated while loading?)" in str(info.value)
    assert not isinstance(info.value, nnx_save.ChecksumError)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("loader", LOADERS)
def test_a_file_rewritten_in_place_after_its_header_was_read_fails_verification(tmp_path, loader, verify):
    """Same size, same header, other bytes: the reader sees the file's modification time
    differ from its header's and refuses before any checksum is needed."""
    path = saved_linear(tmp_path / "m.safetensors")
    header = nnx_save.read_header(path)
    kernel = header["kernel"]
    with open(path, "r+b") as f:  # same size, same header, other bytes
        f.seek(kernel.begin + 100)
        f.write(b"\x7f" * 8)
    os.utime(path, ns=(0, 1))  # a modification time of its own, whatever the clock's tick
    fn = (
        (lambda: nnx_save.load_file(header, verify=verify))
        if loader == "load_file"
        else (lambda: nnx_save.load_model(lambda: nnx.Linear(64, 256, rngs=nnx.Rngs(0)), header, verify=verify))
    )
    with pytest.raises(nnx_save.errors.SourceError, match=re.escape(f"{path}: changed while open")):
        fn()
