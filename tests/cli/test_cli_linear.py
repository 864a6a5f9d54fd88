"""``nnx-save verify``, ``diff`` and ``convert`` do work linear in the tensor count, as
the library does: counted, not timed. Each command reads a checkpoint of N tensors in
about N / batch loads (each load seeing only its batch), and parses a file's checksum
record once, not once per tensor (which made 20,000 tensors take minutes)."""

from __future__ import annotations

import numpy as np
import pytest

import nnx_save
from nnx_save.cli._main import main
from nnx_save.conversion import _convert
from nnx_save.format import _checksum, _header

N = 3000


@pytest.fixture
def counted(monkeypatch):
    """Per command: loads, tensors the loads were handed, characters of JSON parsed."""
    seen = {"loads": 0, "tensors": 0, "json": 0}
    load, parse = _convert.load_file, _header.strict_json

    def counting_load(header, **kw):
        seen["loads"] += 1
        seen["tensors"] += len(header.tensors)
        return load(header, **kw)

    def counting_parse(text):
        seen["json"] += len(text)
        return parse(text)

    monkeypatch.setattr(_convert, "load_file", counting_load)
    monkeypatch.setattr(_header, "strict_json", counting_parse)
    _checksum._parsed.cache_clear()
    return seen


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    path = tmp_path_factory.mktemp("many") / "m.safetensors"
    nnx_save.save_file({f"t{i:05d}": np.full(3, i, np.float32) for i in range(N)}, path)
    return path, len(nnx_save.read_header(path).files[0].metadata[_checksum.KEY])


@pytest.mark.parametrize("command", ["verify", "diff", "convert"])
def test_each_command_is_linear_in_the_tensor_count(many, counted, tmp_path, command, capsys):
    path, record = many
    args = {"verify": [path], "diff": [path, path], "convert": [path, tmp_path / "c.safetensors"]}[command]
    assert main([command, *map(str, args)]) == 0, capsys.readouterr()
    sides = 2 if command == "diff" else 1
    assert counted["tensors"] == sides * N  # each tensor loaded once per side
    assert counted["loads"] <= 2 * sides  # one batch here (3000 small tensors), not one load per tensor
    assert counted["json"] <= 2 * sides * record, counted  # the checksum record parsed once per side
    if command == "convert":
        assert nnx_save.load_file(tmp_path / "c.safetensors", verify=True).keys() == nnx_save.load_file(path).keys()


def test_verify_still_names_every_bad_tensor_of_a_batch(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    nnx_save.save_file({f"t{i}": np.full(4, i, np.float32) for i in range(50)}, path)
    header = nnx_save.read_header(path)
    data = bytearray(path.read_bytes())
    for key in ("t7", "t31"):  # flip one byte of each
        data[header.tensors[key].begin] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "tensor 't7': checksum mismatch" in out and "tensor 't31': checksum mismatch" in out
    assert "48 checksums verified" in out and "2 problem(s)" in out
