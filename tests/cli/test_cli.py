"""The ``nnx-save`` command line on real files: a transformers ``save_pretrained``
checkpoint, nnx_save files, corrupted copies. A few runs go through the installed
console script and ``python -m nnx_save`` as subprocesses; the rest call
``nnx_save.cli.main`` in-process (same code, without paying jax's import per case)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _errors import raises_check

import nnx_save
from nnx_save.cli import main

SCRIPT = Path(sys.executable).with_name("nnx-save")


def run_script(*args, module=False):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    cmd = [sys.executable, "-m", "nnx_save", *map(str, args)] if module else [str(SCRIPT), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny GPT-2 written by transformers (random init, offline), and its state dict as .bin."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("hf")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(root / "gpt2")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["extra.bf16"] = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16)
    torch.save(state, root / "pytorch_model.bin")
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        logits = model(ids).logits.numpy()
    return {
        "dir": root / "gpt2",
        "file": root / "gpt2" / "model.safetensors",
        "bin": root / "pytorch_model.bin",
        "state": {k: v.float().numpy() for k, v in state.items()},
        "logits": logits,
        "ids": ids,
    }


@pytest.fixture
def ours(tmp_path):
    path = tmp_path / "ours.safetensors"
    nnx_save.save_file(
        {
            "a": np.arange(12, dtype=np.float32).reshape(3, 4),
            "b": np.arange(5, dtype=np.int32),
            "c": np.ones(4, ml_dtypes.bfloat16),
        },
        path,
        metadata={"note": "hi"},
    )
    return path


def _flip(path, key, at=0):
    info = nnx_save.read_header(path)[key]
    data = bytearray(Path(info.file).read_bytes())
    data[info.begin + at] ^= 0x80
    Path(info.file).write_bytes(bytes(data))


# --------------------------------------------------------------------------- subprocesses


@pytest.mark.slow  # a subprocess importing jax, or torch + transformers
def test_console_script_inspects_a_transformers_checkpoint(hf):
    r = run_script("inspect", hf["file"])
    assert r.returncode == 0, r.stderr
    header = nnx_save.read_header(hf["file"])
    params = sum(t.numel for t in header.tensors.values())
    assert f"{hf['file']}: file, 1 file(s), {len(header)} tensors" in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("transformer.h.0.attn.c_attn.weight "))
    info = header["transformer.h.0.attn.c_attn.weight"]
    assert line.split()[1:4] == ["F32", "[32,", "96]"] and f"[{info.begin}, {info.end})" in line
    assert f"parameters: {params:,}" in r.stdout
    assert re.search(rf"^  F32 +{len(header)} tensors +{params:,} parameters", r.stdout, re.M)
    assert "metadata:\n  format: pt" in r.stdout


@pytest.mark.slow  # a subprocess importing jax, or torch + transformers
def test_python_m_verify_names_file_and_tensor_of_a_flipped_byte(ours):
    _flip(ours, "b", at=2)
    r = run_script("verify", ours, module=True)
    assert r.returncode == 1
    assert f"FAIL {ours}: tensor 'b': checksum mismatch (xxh3_64 recorded " in r.stdout
    assert f"FAIL {ours}: header valid, 3 tensors, 2 checksums verified" in r.stdout
    assert "3 tensors, 2 verified, 0 without a checksum, 1 problem(s)" in r.stdout


@pytest.mark.slow  # a subprocess importing jax, or torch + transformers
def test_console_script_converts_a_torch_bin(hf, tmp_path):
    out = tmp_path / "from_bin.safetensors"
    r = run_script("convert", hf["bin"], out)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"convert: {hf['bin']} -> {out}: {len(hf['state'])} tensors\n"
    loaded = nnx_save.load_file(out, verify=True)
    assert loaded["extra.bf16"].dtype == ml_dtypes.bfloat16
    for k, v in hf["state"].items():
        np.testing.assert_array_equal(loaded[k].astype(np.float32), v)
    assert nnx_save.read_header(out).metadata["format"] == "pt"


# ------------------------------------------------------------------------------ inspect


@pytest.mark.slow  # a subprocess importing jax, or torch + transformers
def test_inspect_json_with_filter(capsys, hf):
    code, out, _ = cli(capsys, "inspect", hf["file"], "--json", "--filter", "*attn.c_attn*")
    assert code == 0
    doc = json.loads(out)
    names = [t["name"] for t in doc["tensors"]]
    assert names and all("attn.c_attn" in n for n in names) and len(names) == 4  # weight+bias x 2 layers
    assert doc["parameters"] == sum(t["numel"] for t in doc["tensors"]) == doc["totals"]["F32"]["parameters"]
    assert doc["kind"] == "file" and doc["metadata"] == {"format": "pt"}


@pytest.mark.slow  # a subprocess importing jax, or torch + transformers
def test_inspect_multifile_names_each_file(capsys, hf, tmp_path):
    code, out, _ = cli(capsys, "convert", hf["file"], tmp_path / "sharded", "--max-shard-size", "40KB")
    assert code == 0
    code, out, _ = cli(capsys, "inspect", tmp_path / "sharded")
    assert code == 0 and re.search(r": index, (\d+) file\(s\)", out)
    assert "model-00001-of-" in out and "nnx_save.checksums: <" in out


# ------------------------------------------------------------------------------- verify


@pytest.mark.slow  # a subprocess importing jax, or torch + transformers
def test_verify_ok_and_files_without_checksums(capsys, ours, hf):
    code, out, _ = cli(capsys, "verify", ours)
    assert code == 0 and f"OK   {ours}: header valid, 3 tensors, 3 checksums verified\n" in out
    code, out, _ = cli(capsys, "verify", hf["file"])
    n = len(nnx_save.read_header(hf["file"]))
    assert code == 0 and f"0 checksums verified, {n} without a checksum" in out
    code, out, _ = cli(capsys, "verify", hf["file"], "--require-checksums")
    assert code == 1 and f"FAIL {n} tensors have no checksum (--require-checksums)" in out


def test_verify_truncated_file(capsys, ours):
    data = ours.read_bytes()
    ours.write_bytes(data[:-3])
    code, out, _ = cli(capsys, "verify", ours)
    assert code == 1
    assert f"FAIL {ours}: tensor data ends at byte " in out and f"verify: {ours}: header check failed" in out


def test_verify_index_naming_a_missing_tensor(capsys, ours, tmp_path):
    code, _, _ = cli(capsys, "convert", ours, tmp_path / "multi", "--max-shard-size", "16")
    assert code == 0
    index = tmp_path / "multi" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["ghost"] = doc["weight_map"]["a"]
    index.write_text(json.dumps(doc))
    code, out, _ = cli(capsys, "verify", tmp_path / "multi")
    assert code == 1
    assert f"FAIL {index}: names tensor 'ghost' in {doc['weight_map']['a']}, which does not hold it" in out


def test_verify_flipped_byte_in_one_shard(capsys, ours, tmp_path):
    cli(capsys, "convert", ours, tmp_path / "multi", "--max-shard-size", "16")
    info = nnx_save.read_header(tmp_path / "multi")["a"]
    _flip(info.file, "a", at=7)
    code, out, _ = cli(capsys, "verify", tmp_path / "multi")
    assert code == 1 and f"FAIL {info.file}: tensor 'a': checksum mismatch" in out
    assert out.count("OK   ") == 2
    code, _, err = cli(capsys, "convert", tmp_path / "multi", tmp_path / "merged.safetensors")
    assert code == 2 and err.startswith(f"nnx-save: error: {info.file}: tensor 'a': checksum mismatch")
    assert not (tmp_path / "merged.safetensors").exists()  # no file with fresh checksums over bad bytes


def test_verify_malformed_checksum_record(capsys, tmp_path):
    import safetensors.numpy

    path = tmp_path / "odd.safetensors"
    safetensors.numpy.save_file(
        {"x": np.ones(2, np.float32), "y": np.ones(2, np.float32)}, str(path), metadata={"nnx_save.checksums": "{oops"}
    )
    code, out, _ = cli(capsys, "verify", path)
    assert code == 1 and out.startswith(
        f"FAIL {path}: header valid, 2 tensors, 0 checksums verified\n"
        f"FAIL {path}: __metadata__['nnx_save.checksums'] is not valid JSON: "
    )
    assert out.endswith("2 tensors, 0 verified, 0 without a checksum, 1 problem(s)\n")


# --------------------------------------------------------------------------------- diff


def test_diff_reports_every_kind_of_difference(capsys, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    base = np.arange(6, dtype=np.float32)
    nnx_save.save_file({"same": base, "vals": base, "shape": base, "dtype": base, "gone": base}, a)
    nnx_save.save_file(
        {
            "same": base,
            "vals": base + np.float32(0.25),
            "shape": base.reshape(2, 3),
            "dtype": base.astype(np.float16),
            "new": base,
        },
        b,
    )
    code, out, _ = cli(capsys, "diff", a, b)
    assert code == 1
    assert out.splitlines() == [
        "only in A: gone",
        "only in B: new",
        "dtype: dtype: F32 vs F16",
        "shape: shape: [6] vs [2, 3]",
        "values: vals: max |a - b| = 0.25, 6 of 6 elements differ",
        "diff: 5 tensors in A, 5 in B, 1 equal, 5 differ",
    ]
    code, out, _ = cli(capsys, "diff", a, a)
    assert code == 0 and out == "diff: 5 tensors in A, 5 in B, 5 equal, 0 differ\n"


@pytest.mark.parametrize(
    ("a", "b", "line"),
    [
        (np.array([1 + 1j], np.complex64), np.array([1 + 2j], np.complex64), "max |a - b| = 1, 1 of 1 elements"),
        (np.array([2**60, 7], np.int64), np.array([2**60 + 1, 7], np.int64), "max |a - b| = 1, 1 of 2 elements"),
        (np.array([2**64 - 1], np.uint64), np.array([2**64 - 2], np.uint64), "max |a - b| = 1, 1 of 1 elements"),
        (np.array([-(2**63)], np.int64), np.array([2**63 - 1], np.int64), f"max |a - b| = {2**64 - 1}, 1 of 1"),
    ],
)
def test_diff_compares_integers_and_complex_numbers_exactly(capsys, tmp_path, a, b, line):
    nnx_save.save_file({"t": a}, tmp_path / "a.safetensors")
    nnx_save.save_file({"t": b}, tmp_path / "b.safetensors")
    code, out, _ = cli(capsys, "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert code == 1
    assert out.splitlines()[0].startswith(f"values: t: {line}")
    assert out.splitlines()[1] == "diff: 1 tensors in A, 1 in B, 0 equal, 1 differ"


def test_diff_counts_tensors_not_lines(capsys, tmp_path):
    base = np.arange(4, dtype=np.float32)
    nnx_save.save_file({"w": base}, tmp_path / "a.safetensors")
    nnx_save.save_file({"w": (base + 1).astype(np.float16)}, tmp_path / "b.safetensors")  # dtype and values differ
    code, out, _ = cli(capsys, "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert code == 1
    assert out.splitlines() == [
        "dtype: w: F32 vs F16",
        "values: w: max |a - b| = 1, 4 of 4 elements differ",
        "diff: 1 tensors in A, 1 in B, 0 equal, 1 differ",
    ]


def _diff_values(capsys, tmp_path, a, b, *options) -> str:
    """The line ``nnx-save diff`` prints for the values of one tensor ``t`` (``""`` if none)."""
    nnx_save.save_file({"t": a}, tmp_path / "a.safetensors")
    nnx_save.save_file({"t": b}, tmp_path / "b.safetensors")
    _, out, _ = cli(capsys, "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", *options)
    return next((line for line in out.splitlines() if line.startswith("values: ")), "")


def test_diff_atol_and_nan(capsys, tmp_path):
    """Equal NaNs and infinities are equal; a NaN against a number is the worst difference;
    the worst difference and the count run across the chunks a large tensor is compared in."""
    x, y = np.array([1.0, np.nan, np.inf]), np.array([1.5, np.nan, np.inf])
    assert _diff_values(capsys, tmp_path, x, y) == "values: t: max |a - b| = 0.5, 1 of 3 elements differ"
    assert _diff_values(capsys, tmp_path, x, y, "--atol", 0.5) == ""
    nan = _diff_values(capsys, tmp_path, np.array([1.0, np.nan]), np.array([1.0, 2.0]))
    assert nan == "values: t: max |a - b| = nan, 1 of 2 elements differ"
    chunk = 1 << 22  # the elements diff compares at once
    a = np.zeros(chunk + 10, np.int8)
    b = a.copy()
    b[0] = 3  # in the first chunk
    b[chunk:] = np.arange(10)  # the worst, in the second
    size = chunk + 10
    assert _diff_values(capsys, tmp_path, a, b) == f"values: t: max |a - b| = 9, 10 of {size} elements differ"
    assert (
        _diff_values(capsys, tmp_path, a, b, "--atol", 5) == f"values: t: max |a - b| = 9, 4 of {size} elements differ"
    )


# ------------------------------------------------------------------------------ convert


@pytest.mark.slow  # a subprocess importing jax, or torch + transformers
def test_convert_resplit_loads_in_transformers_and_back(capsys, hf, tmp_path):
    import torch
    import transformers

    out = tmp_path / "resplit"
    code, text, _ = cli(capsys, "convert", hf["file"], out, "--max-shard-size", "30KiB")
    assert code == 0 and text.endswith("+ model.safetensors.index.json\n")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    shutil.copy(hf["dir"] / "config.json", out / "config.json")
    model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(model(hf["ids"]).logits.numpy(), hf["logits"])
    back = tmp_path / "back.safetensors"
    assert cli(capsys, "convert", out, back)[0] == 0
    code, text, _ = cli(capsys, "diff", hf["file"], back)
    assert code == 0 and text.endswith(", 0 differ\n")


def test_convert_orbax_checkpoint(capsys, tmp_path):
    import orbax.checkpoint as ocp

    tree = {"layers": [{"w": np.arange(6, dtype=np.float32).reshape(2, 3)}], "step": np.asarray(7, np.int64)}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", tree)
    checkpointer.wait_until_finished()
    checkpointer.close()
    code, text, _ = cli(capsys, "convert", tmp_path / "ckpt", tmp_path / "o.safetensors")
    assert code == 0 and text.endswith(": 2 tensors\n")
    loaded = nnx_save.load_file(tmp_path / "o.safetensors", verify=True)
    np.testing.assert_array_equal(loaded["layers/0/w"], tree["layers"][0]["w"])
    assert loaded["step"] == 7


def test_convert_a_pod_directory(capsys, tmp_path):
    # A pod tensor's file is its manifest; its bytes are in the shard files (this was a KeyError).
    tree = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.int32)}
    nnx_save.save_pod(tree, tmp_path / "pod")
    code, text, _ = cli(capsys, "convert", tmp_path / "pod", tmp_path / "o.safetensors")
    assert code == 0 and text.endswith(": 2 tensors\n")
    loaded = nnx_save.load_file(tmp_path / "o.safetensors", verify=True)
    assert sorted(loaded) == ["a", "b"] and all(np.array_equal(loaded[k], tree[k]) for k in tree)


# --------------------------------------------------------------------------- error paths


def test_error_paths(capsys, tmp_path, ours):
    code, _, err = cli(capsys, "inspect", tmp_path / "nope.safetensors")
    assert (
        code == 2 and err == f"nnx-save: error: {tmp_path / 'nope.safetensors'}: no such checkpoint file or directory\n"
    )
    (tmp_path / "w.npz").write_bytes(b"x")
    code, _, err = cli(capsys, "convert", tmp_path / "w.npz", tmp_path / "o.safetensors")
    assert code == 2 and "cannot tell the format from the name; expected a .safetensors file" in err
    code, _, err = cli(capsys, "convert", tmp_path / "missing.bin", tmp_path / "o.safetensors")
    assert code == 2 and err == f"nnx-save: error: {tmp_path / 'missing.bin'}: no such file or directory\n"
    code, _, err = cli(capsys, "convert", ours, tmp_path / "o.safetensors", "--max-shard-size", "1MB")
    assert code == 2 and "--max-shard-size writes a directory" in err
    code, _, err = cli(capsys, "convert", ours, tmp_path)
    assert code == 2 and f"nnx-save: error: {tmp_path}: is a directory" in err
    (tmp_path / "plain").write_text("x")  # a file where the output directory goes
    code, _, err = cli(capsys, "convert", ours, tmp_path / "plain", "--max-shard-size", "1MB")
    assert code == 2 and err.startswith(f"nnx-save: error: {tmp_path / 'plain'}: exists and is not a directory")
    (tmp_path / "bad.safetensors").write_bytes(b"\x04" + bytes(7) + b"[]  ")
    code, _, err = cli(capsys, "diff", ours, tmp_path / "bad.safetensors")
    assert code == 2 and err == (
        f"nnx-save: error: {tmp_path / 'bad.safetensors'}: header must be a JSON object, found a JSON list\n"
    )
    with pytest.raises(SystemExit) as e:
        main(["convert", str(ours), str(tmp_path / "d"), "--max-shard-size", "lots"])
    assert e.value.code == 2 and "'lots' is not a size (examples: 5GB, 200MiB, 1000000)" in capsys.readouterr().err


@pytest.mark.slow  # a subprocess importing jax, or torch + transformers
def test_convert_refuses_a_pickle_with_non_tensors(capsys, tmp_path):
    import torch

    torch.save({"w": torch.ones(2), "epoch": 3}, tmp_path / "ckpt.pt")
    code, _, err = cli(capsys, "convert", tmp_path / "ckpt.pt", tmp_path / "o.safetensors")
    assert code == 2 and err == (
        f"nnx-save: error: {tmp_path / 'ckpt.pt'}: epoch is a int, not a tensor; convert takes a "
        "state dict of tensors (nested dicts are joined with '.')\n"
    )
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.slow  # imports torch
def test_convert_refuses_two_tensors_that_become_one_key(capsys, tmp_path):
    """``{"a": {"b": t}, "a.b": u}`` would convert to one tensor silently; it is a
    HeaderError (check "duplicate_key", exit 2) and nothing is written."""
    import torch

    torch.save({"a": {"b": torch.ones(2)}, "a.b": torch.zeros(3)}, tmp_path / "clash.pt")
    code, _, err = cli(capsys, "convert", tmp_path / "clash.pt", tmp_path / "o.safetensors")
    assert code == 2 and err == (
        f"nnx-save: error: {tmp_path / 'clash.pt'}: two tensors become the key 'a.b' (nested keys are joined "
        "with '.'); rename one of them before converting\n"
    )
    assert not (tmp_path / "o.safetensors").exists()
    with raises_check("duplicate_key", match=re.escape("two tensors become the key 'a.b'")):
        nnx_save.convert(tmp_path / "clash.pt", tmp_path / "o.safetensors")


def test_convert_refuses_a_fifo_without_blocking(capsys, tmp_path):
    """``nnx-save convert fifo out`` must not open the FIFO to read its magic bytes:
    that would block forever."""
    os.mkfifo(tmp_path / "x.bin")

    def blocked(signum, frame):
        raise TimeoutError("nnx-save convert blocked on the FIFO")

    previous = signal.signal(signal.SIGALRM, blocked)  # a blocked open fails the test instead of hanging it
    signal.alarm(10)
    try:
        code, _, err = cli(capsys, "convert", tmp_path / "x.bin", tmp_path / "o.safetensors")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 2 and err == f"nnx-save: error: {tmp_path / 'x.bin'}: not a regular file or directory\n"


# ---------------------------------------------------------------------------------- URLs


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    from nginx_server import start_nginx  # tests/nginx_server.py: a real nginx on a loopback port

    yield from start_nginx(tmp_path_factory)


def test_inspect_and_verify_a_url(capsys, web, ours):
    shutil.copy(ours, web.root / "ours.safetensors")
    url = f"{web.url}/ours.safetensors"
    code, out, _ = cli(capsys, "inspect", url, "--json")
    assert code == 0 and [t["name"] for t in json.loads(out)["tensors"]] == ["a", "b", "c"]
    code, out, _ = cli(capsys, "verify", url)
    assert code == 0 and "3 tensors, 3 verified, 0 without a checksum, 0 problem(s)" in out
    _flip(web.root / "ours.safetensors", "c", at=1)
    code, out, _ = cli(capsys, "verify", url)
    assert code == 1 and "tensor 'c': checksum mismatch" in out
