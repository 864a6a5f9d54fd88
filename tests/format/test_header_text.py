"""Every string of a header is Unicode text: a JSON escape of a lone UTF-16 surrogate in
a tensor name or in metadata (which the safetensors reference refuses) is a
``HeaderError`` (check ``"encoding"``) naming the byte and the string, on every reader
and from the command line (exit 2, no traceback); escaped pairs (an emoji) and escaped
backslashes stay text. Generated against an oracle: ``json.loads`` and a UTF-8 encode
of every string it returns."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.format._header import encode_header, lone_surrogate, parse_header

SRC = Path(__file__).resolve().parents[2] / "src"

# pieces of JSON string text: plain, an escaped backslash, a high / low surrogate escape
PIECES = st.sampled_from(["a", "é", "\\\\", "\\ud83d", "\\ude00", "\\uD800", "\\uDFFF", "\\u0041", "/", "\\\\u"])


def _oracle(text: str) -> bool:
    """Whether every string ``json.loads`` makes of ``text`` is Unicode text."""

    def strings(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield k
                yield from strings(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from strings(v)
        elif isinstance(obj, str):
            yield obj

    try:
        for s in strings(json.loads(text)):
            s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _file(name: str, meta: str | None) -> bytes:
    """A one-tensor file whose header writes ``name`` (and metadata value ``meta``) as raw JSON string text."""
    head = '{"__metadata__":{"m":"' + meta + '"},' if meta is not None else "{"
    head += '"' + name + '":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    raw = head.encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + np.arange(2, dtype=np.float32).tobytes()


@settings(max_examples=300)
@given(name=st.lists(PIECES, max_size=5).map("".join), meta=st.none() | st.lists(PIECES, max_size=4).map("".join))
def test_the_parser_refuses_exactly_the_lone_surrogates(name, meta):
    data = _file(name, meta)
    n = struct.unpack("<Q", data[:8])[0]
    text = data[8 : 8 + n].decode()
    try:
        header = parse_header(data[8 : 8 + n], len(data), file="f.safetensors")
    except nnx_save.HeaderError as e:
        assert not _oracle(text), f"refused text the oracle accepts: {e}"
        assert e.check == "encoding" and "lone UTF-16 surrogate" in str(e) and "at byte" in str(e)
        at = lone_surrogate(text)
        assert at is not None and f"at byte {8 + len(text[:at].encode())} of the file" in str(e)
        return
    assert _oracle(text), f"accepted {text!r}"
    for s in [*header.tensors, *header.metadata, *header.metadata.values()]:
        s.encode("utf-8")


READERS = {
    "load_file": nnx_save.load_file,
    "read_header": nnx_save.read_header,
    "safe_open": lambda p: nnx_save.safe_open(p).__enter__().keys(),
    "iter_tensors": lambda p: list(nnx_save.iter_tensors(p)),
}


@pytest.mark.parametrize("where", ["name", "metadata"])
@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_refuses_a_lone_surrogate(tmp_path, reader, where):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_file("a\\ud800b", None) if where == "name" else _file("a", "v\\udc00"))
    at = "byte 11" if where == "name" else "byte 31"
    with pytest.raises(nnx_save.HeaderError, match=rf"lone UTF-16 surrogate escape \\u[dD][8c]00 at {at} of the file"):
        READERS[reader](str(path))


def test_an_index_naming_a_lone_surrogate_is_refused(tmp_path):
    nnx_save.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "m.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a\\ud800": "m.safetensors"}}')
    with pytest.raises(nnx_save.HeaderError, match="lone UTF-16 surrogate"):
        nnx_save.load_file(tmp_path)


@pytest.mark.parametrize("command", ["inspect", "convert", "verify"])
def test_the_command_line_says_so_and_exits_2(tmp_path, command):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_file("a\\ud800b", None))
    args = [str(path), str(tmp_path / "out.safetensors")] if command == "convert" else [str(path)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "nnx_save", command, *args], capture_output=True, text=True, env=env)
    said = done.stdout + done.stderr
    assert done.returncode == (1 if command == "verify" else 2), said  # verify: 1, the file failed its checks
    assert "Traceback" not in said and "lone UTF-16 surrogate" in said
    assert not (tmp_path / "out.safetensors").exists()


def test_the_writer_refuses_names_that_are_no_text():
    with pytest.raises(nnx_save.KeyPathError, match=r"'a\\ud800': a tensor name must be Unicode text"):
        encode_header([("a\ud800", "F32", (2,))])
    with pytest.raises(nnx_save.OptionError, match=r"metadata 'k': keys and values must be Unicode text"):
        encode_header([("a", "F32", (2,))], {"k": "\udc00"})
