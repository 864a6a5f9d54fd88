"""``nnx-save convert ckpt.pt out --key model`` of a training checkpoint keeps what
rebuilds the model: its JSON entries (a config dict, the step) in the output's metadata,
one key each, and names what it drops (optimizer state, values that are not JSON)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nnx_save
from nnx_save.cli import main

torch = pytest.importorskip("torch")


def _checkpoint(path):
    torch.manual_seed(0)
    model = {"fc.weight": torch.randn(3, 2), "fc.bias": torch.randn(3)}
    config = {"hidden": 3, "layers": [1, 2], "name": "pitch", "dropout": 0.1, "tied": False, "extra": None}
    torch.save(
        {
            "model": model,
            "config_dict": config,
            "global_step": 1234,
            "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}},
            "loss": float("nan"),
            "shape": (4, 5),
        },
        path,
    )
    return model, config


def test_convert_key_keeps_json_entries_in_the_metadata_and_names_what_it_dropped(capsys, tmp_path):
    model, config = _checkpoint(tmp_path / "ckpt.pt")
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(tmp_path / "ckpt.pt"), str(out), "--key", "model"]) == 0
    printed = capsys.readouterr().out
    assert "2 tensors" in printed
    assert "kept in the metadata (JSON): config_dict, global_step, shape" in printed
    assert "dropped: optimizer: holds a Tensor, not JSON" in printed
    assert "dropped: loss: holds the float nan, not JSON" in printed
    meta = nnx_save.read_header(out).files[0].metadata
    assert json.loads(meta["config_dict"]) == config
    assert json.loads(meta["global_step"]) == 1234
    assert json.loads(meta["shape"]) == [4, 5]
    assert meta["format"] == "pt" and "optimizer" not in meta and "loss" not in meta
    loaded = nnx_save.load_file(out)
    for key, value in model.items():
        np.testing.assert_array_equal(loaded[key], value.numpy())


def test_convert_key_through_a_nested_dict_keeps_the_siblings_on_the_way(tmp_path):
    torch.save({"model": {"ema": {"w": torch.ones(2)}, "step": 9}, "format": "x", "epoch": 3}, tmp_path / "c.pt")
    done = nnx_save.convert(tmp_path / "c.pt", tmp_path / "o.safetensors", key="model.ema")
    assert done.tensors == 1
    assert done.kept == ("epoch", "model.step")
    assert done.dropped == ("format: the metadata name 'format' is reserved",)
    meta = nnx_save.read_header(tmp_path / "o.safetensors").files[0].metadata
    assert meta["model.step"] == "9" and meta["epoch"] == "3" and meta["format"] == "pt"


def test_convert_without_key_keeps_nothing_extra(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "sd.pt")
    done = nnx_save.convert(tmp_path / "sd.pt", tmp_path / "o.safetensors")
    assert done.kept == () and done.dropped == ()
    assert {
        k for k in nnx_save.read_header(tmp_path / "o.safetensors").files[0].metadata if not k.startswith("nnx_save.")
    } == {"format"}


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=25)
@given(extra=st.dictionaries(st.text(st.sampled_from("abc_"), min_size=1, max_size=4), json_values, max_size=4))
def test_every_json_entry_is_kept_and_reads_back_equal(extra, tmp_path_factory):
    d = tmp_path_factory.mktemp("extras")
    torch.save({"model": {"w": torch.ones(1)}, **extra}, d / "c.pt")
    done = nnx_save.convert(d / "c.pt", d / "o.safetensors", key="model")
    assert done.dropped == () and set(done.kept) == set(extra)
    meta = nnx_save.read_header(d / "o.safetensors").files[0].metadata
    assert {k: json.loads(meta[k]) for k in extra} == extra
