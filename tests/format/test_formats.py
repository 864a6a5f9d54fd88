"""PyTorch files and Orbax / TensorStore directories are told apart from safetensors by
their magic bytes and entries (nothing unpickled), in every entry point a user would
try first, with the command that converts them; the data-only pickle reader behind
`convert`."""

import re
from pathlib import Path

import numpy as np
import pytest
from _errors import raises_check
from flax import nnx

import nnx_save
from nnx_save.cli import main
from nnx_save.format import _formats, _torch_pickle

LEGACY_PICKLE = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19." + bytes(40)  # torch's legacy magic, then junk


@pytest.fixture(scope="module")
def torch_files(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("torch")
    torch.save({"fc.weight": torch.ones(3, 2)}, root / "pytorch_model.bin")
    torch.save(
        {"model": {"fc.weight": torch.arange(6.0).reshape(3, 2)}, "optimizer": {"m": torch.zeros(1)}, "epoch": 3},
        root / "train.pt",
    )
    (root / "legacy.bin").write_bytes(LEGACY_PICKLE)
    return root


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_zip_and_pickle_are_named_by_every_loader(torch_files):
    path = torch_files / "pytorch_model.bin"
    expected = (
        f"{path}: this is a PyTorch checkpoint (torch.save zip archive, pytorch_model/data.pkl), not a "
        "safetensors file (told by its first bytes; nothing was unpickled); convert it first: "
        f"nnx-save convert {path} pytorch_model.safetensors"
    )
    for load in (nnx_save.read_header, nnx_save.load_file):
        with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape(expected)) as e:
            load(path)
        assert e.value.format.startswith("a PyTorch checkpoint")
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape(expected)):
        nnx_save.load_model(model, path)
    legacy = torch_files / "legacy.bin"
    with pytest.raises(nnx_save.HeaderError, match=re.escape("this is a Python pickle (protocol 2: the legacy")):
        nnx_save.read_header(legacy)
    with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape("not a safetensors file")):
        nnx_save.read_header([legacy])  # a list of files goes through the same check


def test_cli_inspect_and_diff_name_the_format(capsys, torch_files, tmp_path):
    ours = tmp_path / "ours.safetensors"
    nnx_save.save_file({"w": np.zeros(2, np.float32)}, ours)
    path = torch_files / "pytorch_model.bin"
    for args in (("inspect", path), ("diff", ours, path)):
        code, _, err = cli(capsys, *args)
        assert code == 2 and err.startswith(f"nnx-save: error: {path}: this is a PyTorch checkpoint")
        assert f"nnx-save convert {path} pytorch_model.safetensors" in err


def test_convert_a_training_checkpoint_with_key(capsys, torch_files, tmp_path):
    src, out = torch_files / "train.pt", tmp_path / "model.safetensors"
    code, _, err = cli(capsys, "convert", src, out)
    assert code == 2 and err == (
        f"nnx-save: error: {src}: epoch is a int, not a tensor; convert takes a state dict of tensors (nested "
        "dicts are joined with '.'). The top level is a training checkpoint holding state dicts of tensors "
        "under ['model', 'optimizer']: pick one with --key model\n"
    )
    assert not out.exists()
    code, text, _ = cli(capsys, "convert", src, out, "--key", "model")
    assert code == 0 and text.endswith(
        ": 1 tensors\n  kept in the metadata (JSON): epoch\n  dropped: optimizer: holds a Tensor, not JSON\n"
    )
    np.testing.assert_array_equal(nnx_save.load_file(out)["fc.weight"], np.arange(6.0, dtype=np.float32).reshape(3, 2))
    code, _, err = cli(capsys, "convert", src, out, "--key", "ema")
    assert (
        code == 2
        and err
        == f"nnx-save: error: {src}: --key 'ema': no 'ema' here; the dict holds ['epoch', 'model', 'optimizer']\n"
    )
    code, _, err = cli(capsys, "convert", src, out, "--key", "epoch")
    assert code == 2 and err == f"nnx-save: error: {src}: --key 'epoch' is a int, not a dict of tensors\n"


def test_convert_tells_torch_by_bytes_not_by_name(capsys, torch_files, tmp_path):
    renamed = tmp_path / "weights.ckpt"  # no .bin / .pt suffix
    renamed.write_bytes((torch_files / "pytorch_model.bin").read_bytes())
    code, text, _ = cli(capsys, "convert", renamed, tmp_path / "o.safetensors")
    assert code == 0 and text.endswith(": 1 tensors\n")


def test_orbax_directories(tmp_path):
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"w": np.ones(3, np.float32)})
    checkpointer.wait_until_finished()
    checkpointer.close()
    what = _formats.foreign_directory(tmp_path / "ckpt")
    assert what is not None and what.startswith("an Orbax checkpoint directory (it holds ")
    with pytest.raises(
        nnx_save.NotSafetensorsError,
        match=re.escape(f"{tmp_path / 'ckpt'}: this is {what}, not a safetensors checkpoint; convert it first: "),
    ):
        nnx_save.load_file(tmp_path / "ckpt")
    steps = tmp_path / "steps"
    (steps / "10" / "state").mkdir(parents=True)
    (steps / "10" / "state" / "_METADATA").write_text("{}")
    with pytest.raises(
        nnx_save.NotSafetensorsError, match=re.escape("a directory of Orbax checkpoint steps (latest 10)")
    ):
        nnx_save.read_header(steps)
    (tmp_path / "zarr").mkdir()
    (tmp_path / "zarr" / ".zarray").write_text("{}")
    with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape("a TensorStore / zarr array directory")):
        nnx_save.read_header(tmp_path / "zarr")


def test_plain_zip_and_npz_are_named(tmp_path):
    import zipfile

    with zipfile.ZipFile(tmp_path / "a.npz", "w") as z:
        z.writestr("w.npy", b"x")
    with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape("a numpy .npz archive (first member 'w.npy')")):
        nnx_save.read_header(tmp_path / "a.npz")
    with zipfile.ZipFile(tmp_path / "b.safetensors", "w") as z:
        z.writestr("notes.txt", b"x")
    with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape("a zip archive (first member 'notes.txt')")):
        nnx_save.read_header(tmp_path / "b.safetensors")


def test_safetensors_prefixes_are_not_foreign(tmp_path):
    # header sizes whose bytes look like a pickle (80 02 ..) or a zip (PK 03 04 ..) prefix
    for n in (2, 0x80, 0x0280, 0x0580, 0x04034B50, 99_999_999):
        prefix = n.to_bytes(8, "little")
        assert _formats.foreign_file(prefix, lambda size, at: b"{"[:size] if at == 8 else b"") is None
    assert _formats.foreign_file((0x0280).to_bytes(8, "little"), lambda size, at: b"") is not None
    # a real file with a 640-byte header (80 02 00 00 ...) loads
    path = tmp_path / "w.safetensors"
    for pad in range(300):
        nnx_save.save_file({"w" * (1 + pad): np.zeros(1, np.float32)}, path, metadata={})
        if Path(path).read_bytes()[:2] == b"\x80\x02":
            break
    assert Path(path).read_bytes()[:2] == b"\x80\x02"
    assert list(nnx_save.load_file(path)) == ["w" * (1 + pad)]


@pytest.mark.parametrize("protocol", range(2, 6))
@pytest.mark.parametrize("source", ["local", "remote", "convert"])
def test_a_header_led_by_whitespace_whose_size_reads_as_a_pickle_is_safetensors(tmp_path, protocol, source):
    """A header of ``0x80 | protocol << 8`` bytes begins with a pickle's magic, and JSON led
    by whitespace puts no ``{`` at byte 8: the reference reads such a file, so must every
    reader of ours (a local file, an object, ``nnx-save convert`` telling the format)."""
    import json
    import struct

    from safetensors.numpy import load_file as reference

    from nnx_save.layouts import _file

    size = 0x80 | protocol << 8
    entry = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = struct.pack("<Q", size) + (" " + json.dumps(entry)).ljust(size).encode() + struct.pack("<2f", 1.5, -2.0)
    assert raw[:2] == bytes([0x80, protocol]) and raw[8:9] == b" "
    path = tmp_path / "w.safetensors"
    path.write_bytes(raw)
    want = reference(path)["w"]
    if source == "local":
        with nnx_save.safe_open(path) as f:
            assert np.array_equal(f.get_tensor("w"), want)
        return
    if source == "convert":
        from nnx_save.conversion import _convert

        assert _convert._kind(path) == "safetensors"
        return

    class Reader:  # an object store's reader, as _file.object_header takes it
        size, identity = len(raw), (len(raw), None)

        def read(self, offset: int, n: int) -> bytes:
            return raw[offset : offset + n]

    header, _ = _file.object_header("s3://b/w.safetensors", Reader(), raw[:16])
    info = header.tensors["w"]
    assert np.array_equal(np.frombuffer(raw[info.begin : info.end], np.float32), want)
    pickled = raw[:8] + b"\x80" + raw[9:]  # byte 8 no longer JSON: a pickle after all, and said so
    with pytest.raises(nnx_save.errors.NotSafetensorsError, match="pickle"):
        _file.object_header("s3://b/w.safetensors", Reader(), pickled[:16])


def test_module_examples():
    import doctest

    result = doctest.testmod(_formats)
    assert result.attempted >= 2 and result.failed == 0


def test_a_directory_of_separate_checkpoints_says_so(tmp_path):
    for name in ("step_100.safetensors", "step_200.safetensors"):
        nnx_save.save_file({"w": np.zeros(2, np.float32)}, tmp_path / name)
    with raises_check("index") as raised:
        nnx_save.read_header(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path}: tensor 'w' appears in two files: {tmp_path / 'step_100.safetensors'} and "
        f"{tmp_path / 'step_200.safetensors'}. {tmp_path} has no model.safetensors.index.json, so all its "
        "*.safetensors files are read as the parts of one checkpoint; files holding the same tensor names are "
        "separate checkpoints (copies, or different steps): load one file, move the others out, or write the "
        "model.safetensors.index.json of a sharded checkpoint"
    )
    assert list(nnx_save.load_file(tmp_path / "step_200.safetensors")) == ["w"]


def test_data_pickle_reader_builds_data_only():
    assert _torch_pickle.read_data_pickle(b"\x80\x02]q\x00(K\x01G?\xe0\x00\x00\x00\x00\x00\x00e.", "x") == [1, 0.5]
    with pytest.raises(nnx_save.ConvertError, match=re.escape("x: byte 2: the pickle ends inside an argument")):
        _torch_pickle.read_data_pickle(b"\x80\x02X\xff\xff\x00\x00ab", "x")
