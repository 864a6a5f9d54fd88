"""``nnx-save convert DIR OUT`` of a HuggingFace PyTorch checkpoint in several files
(``pytorch_model-0000i-of-0000n.bin`` and ``pytorch_model.bin.index.json``, what older
hub repositories ship): an HF safetensors directory that ``from_pretrained`` loads with
the source's logits, read one tensor at a time; and ``nnx-save --version``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnx_save
from nnx_save.cli import main
from nnx_save.errors import ConvertError, HeaderError

ROOT = Path(__file__).resolve().parents[2]


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def save_sharded_bin(state: dict, directory: Path, per_shard: int) -> list[str]:
    """Write ``state`` as transformers 4's ``save_pretrained(safe_serialization=False,
    max_shard_size=...)`` did: ``per_shard`` tensors per ``pytorch_model-0000i-of-0000n.bin``
    and ``pytorch_model.bin.index.json`` (metadata.total_size, weight_map)."""
    import torch

    keys = list(state)
    groups = [keys[i : i + per_shard] for i in range(0, len(keys), per_shard)]
    names = [f"pytorch_model-{i + 1:05d}-of-{len(groups):05d}.bin" for i in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups, strict=True):
        torch.save({k: state[k].clone() for k in group}, directory / name)
        weight_map.update(dict.fromkeys(group, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    return names


@pytest.fixture(scope="module")
def llama_bin(tmp_path_factory):
    import torch
    import transformers

    directory = tmp_path_factory.mktemp("llama_bin")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    config.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    state = model.state_dict()
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.bfloat16).float()  # exact in bf16 below
    shards = save_sharded_bin(state, directory, per_shard=5)
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        logits = model(ids).logits.numpy()
    return {"dir": directory, "shards": shards, "ids": ids, "logits": logits, "state": state}


def test_convert_writes_an_hf_safetensors_directory_from_pretrained_loads(capsys, llama_bin, tmp_path):
    import torch
    import transformers

    out = tmp_path / "safetensors"
    code, text, err = cli(capsys, "convert", llama_bin["dir"], out)
    assert code == 0, err
    names = sorted(os.listdir(out))
    n = len([x for x in names if x.endswith(".safetensors")])
    assert text == (
        f"convert: {llama_bin['dir']} -> {out}: {len(llama_bin['state'])} tensors in {n} file(s) "
        "+ model.safetensors.index.json\n"
    )
    assert [x for x in names if x.endswith(".safetensors")] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    largest = max((llama_bin["dir"] / s).stat().st_size for s in llama_bin["shards"])  # the default shard size
    header = nnx_save.read_header(out)
    for f in header.files:
        assert sum(t.nbytes for t in f.tensors.values()) <= largest
    assert {"config.json", "tokenizer_config.json", "model.safetensors.index.json"} <= set(names)
    assert not [x for x in names if x.endswith(".bin") or x.startswith(".")]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(llama_bin["state"])
    header = nnx_save.read_header(out)
    for key, tensor in llama_bin["state"].items():
        assert header[key].shape == tuple(tensor.shape) and header[key].dtype.code == "F32"
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(model(llama_bin["ids"]).logits.numpy(), llama_bin["logits"])


def test_convert_keeps_dtypes_and_splits_as_asked(llama_bin, tmp_path):
    import torch

    source = tmp_path / "bf16"
    source.mkdir()
    state = {k: v.to(torch.bfloat16) for k, v in llama_bin["state"].items()}
    state["ids"] = torch.arange(7, dtype=torch.int64)
    save_sharded_bin(state, source, per_shard=4)
    done = nnx_save.convert(source, tmp_path / "one.safetensors")  # a .safetensors path: one file
    assert done.index is None and done.tensors == len(state)
    loaded = nnx_save.load_file(tmp_path / "one.safetensors")
    for key, tensor in state.items():
        want = tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        got = loaded[key].view(np.int16) if tensor.dtype == torch.bfloat16 else loaded[key]
        np.testing.assert_array_equal(np.asarray(got), want)
    split = nnx_save.convert(source, tmp_path / "split", max_shard_size="8KiB")
    assert len(split.files) > len(list(source.glob("*.bin")))
    for f in nnx_save.read_header(tmp_path / "split").files:  # a tensor larger than the limit has a file of its own
        assert len(f.tensors) == 1 or sum(t.nbytes for t in f.tensors.values()) <= 8 * 1024


def test_an_index_that_disagrees_with_its_shards_is_refused_naming_both(llama_bin, tmp_path):
    import shutil

    source = tmp_path / "bad"
    shutil.copytree(llama_bin["dir"], source)
    index = json.loads((source / "pytorch_model.bin.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = llama_bin["shards"][-1]  # not where it is
    (source / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    disagree = f"and {llama_bin['shards'][0]} disagree: it holds ['{key}'], which the index does not put there"
    with pytest.raises(ConvertError, match=re.escape(disagree)):
        nnx_save.convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    index["weight_map"][key] = "../escape.bin"
    (source / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(HeaderError, match=re.escape("the weight_map names '../escape.bin', not a file of")):
        nnx_save.convert(source, tmp_path / "out")


def test_loading_the_bin_directory_names_the_conversion(llama_bin):
    with pytest.raises(HeaderError, match=re.escape("nnx-save convert")):
        nnx_save.read_header(llama_bin["dir"])


_PEAK = """
import json, sys
source, out, tiny, tiny_out, shard = sys.argv[1:6]
import nnx_save
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
nnx_save.convert(tiny, tiny_out)  # a tiny one first: what it imports is not the conversion's memory
open("/proc/self/clear_refs", "w").write("5")
before = hwm()
nnx_save.convert(source, out, max_shard_size=int(shard))
print(json.dumps({"peak": hwm() - before}))
"""


def _peak(source: Path, out: Path, tiny: Path, shard: int) -> int:
    """The peak memory growth of ``convert(source, out)`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}
    args = [str(source), str(out), str(tiny), str(out) + "_tiny", str(shard)]
    done = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.slow
def test_convert_memory_stays_near_two_shards(tmp_path):
    """Sixteen shards of 12 MiB (192 MiB): converting them costs at most two mapped shards
    more than the writer's own memory (measured converting the same tensors from
    safetensors, read one tensor at a time), far from the whole checkpoint."""
    import torch

    source = tmp_path / "big"
    source.mkdir()
    torch.manual_seed(0)
    state = {f"layer{i}.w": torch.randn(1536, 1024) for i in range(32)}  # 6 MiB each, 2 per shard
    save_sharded_bin(state, source, per_shard=2)
    shard = max(p.stat().st_size for p in source.glob("*.bin"))
    total = sum(p.stat().st_size for p in source.glob("*.bin"))
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    save_sharded_bin({"a": torch.ones(2), "b": torch.zeros(3)}, tiny, per_shard=1)
    from_bin = _peak(source, tmp_path / "from_bin", tiny, shard)
    writer = _peak(tmp_path / "from_bin", tmp_path / "from_safetensors", tiny, shard)  # the writer's own memory
    assert from_bin < writer + 2 * shard, (from_bin, writer, shard)
    assert from_bin < total / 3, (from_bin, total)


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"nnx-save {nnx_save.__version__}\n"


def test_without_torch_the_conversion_says_what_to_install(llama_bin, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as in an environment without torch: import fails
    with pytest.raises(ConvertError, match=re.escape("converting PyTorch .bin files needs torch: pip install torch")):
        nnx_save.convert(llama_bin["dir"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
