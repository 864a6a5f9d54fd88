"""Interop with the official safetensors bindings and transformers, both ways, bit for bit.

The official package is the oracle: its numpy, torch and flax loaders read our files,
its low-level ``deserialize`` (which knows every dtype code, F4/F6 included, as raw
bytes) checks the rest, and its writers' files load with ``nnx_save.load_file``.
"""

import json
import math
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.flax
import safetensors.numpy
import torch
from safetensors import TensorSpec

import nnx_save
from nnx_save.format import _dtypes

NUMPY_CODES = ["BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "F32", "F64", "C64"]
TORCH_LOADS = [*NUMPY_CODES, "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"]
# safetensors.torch can write these two but its loader has no entry for them.
TORCH_WRITES_ONLY = ["F8_E8M0", "F4"]
# jax without x64 truncates 64-bit types; the flax loader has no float8 mapping.
FLAX_CODES = ["BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "F16", "BF16", "F32", "C64"]
TORCH_NAME = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn_x2",
}
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3), (2, 2, 4)]


def random_raw(code, shape, rng):
    """Random bit patterns (NaNs, infinities, subnormals included) as raw file bytes."""
    row = _dtypes.DTYPES[code]
    nbytes = _dtypes.nbytes_for(row, math.prod(shape))
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    if code == "BOOL":
        raw &= 1
    return raw


def as_numpy(code, shape, raw):
    row = _dtypes.DTYPES[code]
    if row.byte_aligned:
        return raw.view(row.numpy).reshape(shape)
    return _dtypes.unpack_subbyte(raw, row, math.prod(shape)).reshape(shape)


def tree_of(codes, seed=0):
    """``{key: (code, shape, raw bytes, numpy array)}`` over every code and shape."""
    rng, out = np.random.default_rng(seed), {}
    for code in codes:
        for j, shape in enumerate(SHAPES):
            if math.prod(shape) * _dtypes.DTYPES[code].bits % 8:
                continue  # a lone F4 element is not a whole byte
            if code == "F4" and shape and shape[-1] % 2:
                continue  # torch's float4_e2m1fn_x2 packs pairs along the last axis
            raw = random_raw(code, shape, rng)
            out[f"{code.lower()}_{j}"] = (code, shape, raw, as_numpy(code, shape, raw))
    return out


def split(path):
    raw = path.read_bytes() if hasattr(path, "read_bytes") else path
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n], raw[8 + n :]


def torch_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def torch_tensor(code, shape, raw):
    dtype = getattr(torch, TORCH_NAME[code])
    if code == "F4":  # two elements per byte, the last axis halved
        shape = (*shape[:-1], shape[-1] // 2)
    if raw.size == 0:  # torch cannot view an empty byte tensor as a wider type
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def assert_same_layout(ours: bytes, ref: bytes):
    """Identical tensors, offsets, order, padding and data; ``__metadata__`` equal as a
    mapping (the reference keeps it in a HashMap, so its key order is arbitrary)."""
    (oh, od), (rh, rd) = split(ours), split(ref)
    assert od == rd
    assert len(oh) == len(rh)
    o, r = json.loads(oh), json.loads(rh)
    assert o == r
    assert [k for k in o if k != "__metadata__"] == [k for k in r if k != "__metadata__"]
    first = next((k for k in o if k != "__metadata__"), None)
    if first is not None:  # the tensor part of the header text, byte for byte
        marker = json.dumps(first, ensure_ascii=False).encode() + b':{"dtype"'
        assert oh[oh.index(marker) :] == rh[rh.index(marker) :]
    if "__metadata__" not in o:
        assert ours == ref


# --- nnx_save writes, the official bindings read -----------------------------------------------


def test_numpy_binding_reads_our_files(tmp_path):
    tree = tree_of(NUMPY_CODES)
    nnx_save.save_file({k: v[3] for k, v in tree.items()}, tmp_path / "o.safetensors")
    out = safetensors.numpy.load_file(tmp_path / "o.safetensors")
    assert set(out) == set(tree)
    for k, (_code, shape, raw, arr) in tree.items():
        assert out[k].dtype == arr.dtype and out[k].shape == shape and out[k].tobytes() == raw.tobytes(), k


def test_torch_binding_reads_our_files(tmp_path):
    from safetensors.torch import load_file

    tree = tree_of(TORCH_LOADS)
    nnx_save.save_file({k: v[3] for k, v in tree.items()}, tmp_path / "o.safetensors")
    out = load_file(tmp_path / "o.safetensors")
    assert set(out) == set(tree)
    for k, (code, shape, raw, _) in tree.items():
        assert out[k].dtype == getattr(torch, TORCH_NAME[code]) and tuple(out[k].shape) == shape, k
        assert torch_bytes(out[k]) == raw.tobytes(), k


def test_flax_binding_reads_our_files(tmp_path):
    tree = tree_of(FLAX_CODES)
    nnx_save.save_file({k: v[3] for k, v in tree.items()}, tmp_path / "o.safetensors")
    out = safetensors.flax.load_file(tmp_path / "o.safetensors")
    assert set(out) == set(tree)
    for k, (_code, shape, raw, arr) in tree.items():
        got = np.asarray(out[k])
        assert got.dtype == arr.dtype and got.shape == shape and got.tobytes() == raw.tobytes(), k


def test_reference_parser_reads_every_code_raw(tmp_path):
    tree = tree_of(list(_dtypes.DTYPES))
    nnx_save.save_file({k: v[3] for k, v in tree.items()}, tmp_path / "o.safetensors")
    got = dict(safetensors.deserialize((tmp_path / "o.safetensors").read_bytes()))
    assert set(got) == set(tree)
    for k, (code, shape, raw, _) in tree.items():
        assert (got[k]["dtype"], tuple(got[k]["shape"]), bytes(got[k]["data"])) == (code, shape, raw.tobytes()), k


# --- byte-identical files ------------------------------------------------------------------------


def test_byte_identical_to_safetensors_numpy(tmp_path):
    tree = tree_of(NUMPY_CODES, seed=1)
    arrays = {k: v[3] for k, v in tree.items()}
    nested = {
        "layers": [{"w": np.ones((2, 2), np.float32)}, {"w": np.zeros((2, 2), np.float32)}],
        "é": np.arange(3, dtype=np.int16),
    }
    flat = {**arrays, "layers/0/w": nested["layers"][0]["w"], "layers/1/w": nested["layers"][1]["w"], "é": nested["é"]}
    nnx_save.save_file({**arrays, **nested}, tmp_path / "o.safetensors", metadata={"format": "np"})
    ours = (tmp_path / "o.safetensors").read_bytes()
    meta = nnx_save.read_header(tmp_path / "o.safetensors").metadata
    assert_same_layout(ours, safetensors.numpy.save(flat, metadata=dict(meta)))


def test_byte_identical_to_safetensors_torch_for_bf16_and_f8(tmp_path):
    from safetensors.torch import save

    tree = tree_of(TORCH_LOADS + TORCH_WRITES_ONLY, seed=2)
    nnx_save.save_file({k: v[3] for k, v in tree.items()}, tmp_path / "o.safetensors")
    ours = (tmp_path / "o.safetensors").read_bytes()
    meta = nnx_save.read_header(tmp_path / "o.safetensors").metadata
    ref = save({k: torch_tensor(c, s, r) for k, (c, s, r, _) in tree.items()}, metadata=dict(meta) or None)
    assert_same_layout(ours, ref)


def test_byte_identical_to_reference_serializer_for_every_shared_code(tmp_path):
    tree = tree_of([c for c in _dtypes.DTYPES if not c.startswith("F6")], seed=3)
    nnx_save.save_file({k: v[3] for k, v in tree.items()}, tmp_path / "o.safetensors", metadata={"k": "v"})
    ours = (tmp_path / "o.safetensors").read_bytes()
    meta = nnx_save.read_header(tmp_path / "o.safetensors").metadata
    specs = {}
    for k, (code, shape, raw, _) in tree.items():
        stored = (*shape[:-1], shape[-1] // 2) if code == "F4" else shape
        specs[k] = TensorSpec(dtype=TORCH_NAME[code], shape=list(stored), data_ptr=raw.ctypes.data, data_len=raw.nbytes)
    assert_same_layout(ours, safetensors.serialize(specs, metadata=dict(meta)))


# --- the official writers write, nnx_save reads --------------------------------------------------


def test_files_from_safetensors_numpy_load(tmp_path):
    tree = tree_of(NUMPY_CODES, seed=4)
    safetensors.numpy.save_file(
        {k: v[3] for k, v in tree.items()}, tmp_path / "r.safetensors", metadata={"format": "np", "b": "2"}
    )
    h = nnx_save.read_header(tmp_path / "r.safetensors")
    assert h.metadata == {"format": "np", "b": "2"}
    out = nnx_save.load_file(tmp_path / "r.safetensors")
    assert set(out) == set(tree)
    for k, (_code, shape, raw, arr) in tree.items():
        assert out[k].dtype == arr.dtype and out[k].shape == shape and out[k].tobytes() == raw.tobytes(), k


def test_files_from_safetensors_torch_load_bf16_f8_f4(tmp_path):
    from safetensors.torch import save_file

    tree = tree_of(TORCH_LOADS + TORCH_WRITES_ONLY, seed=5)
    save_file(
        {k: torch_tensor(c, s, r) for k, (c, s, r, _) in tree.items()},
        tmp_path / "r.safetensors",
        metadata={"format": "pt"},
    )
    h = nnx_save.read_header(tmp_path / "r.safetensors")
    assert {k: (t.dtype.code, t.shape) for k, t in h.tensors.items()} == {k: (v[0], v[1]) for k, v in tree.items()}
    out = nnx_save.load_file(tmp_path / "r.safetensors")
    for k, (code, shape, raw, _arr) in tree.items():
        assert out[k].dtype == _dtypes.DTYPES[code].numpy and out[k].shape == shape, k
        row = _dtypes.DTYPES[code]
        got = out[k].tobytes() if row.byte_aligned else _dtypes.pack_subbyte(out[k], row)
        assert got == raw.tobytes(), k
    assert out["bf16_3"].dtype == ml_dtypes.bfloat16


def test_files_from_safetensors_flax_load(tmp_path):
    import jax.numpy as jnp

    arrays = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.bfloat16).reshape(3, 4), "i": jnp.arange(5, dtype=jnp.int32)}
    safetensors.flax.save_file(dict(arrays), tmp_path / "r.safetensors")
    out = nnx_save.load_file(tmp_path / "r.safetensors")
    for k, v in arrays.items():
        assert out[k].dtype == v.dtype and out[k].tobytes() == np.asarray(v).tobytes()


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.slow  # importing transformers' Llama takes 15-25 s here
def test_transformers_save_pretrained_sharded_bf16(tmp_path, tiny_llama):
    model = tiny_llama.to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    h = nnx_save.read_header(tmp_path)
    assert h.kind == "index" and len(h.files) > 1
    state = model.state_dict()
    out = nnx_save.load_file(tmp_path)
    assert set(out) == set(state)
    for k, t in state.items():
        assert out[k].dtype == ml_dtypes.bfloat16 and out[k].shape == tuple(t.shape), k
        assert out[k].tobytes() == torch_bytes(t), k


@pytest.mark.slow
def test_transformers_save_pretrained_single_file_f32(tmp_path, tiny_llama):
    model = tiny_llama.to(torch.float32)
    model.save_pretrained(tmp_path)
    h = nnx_save.read_header(tmp_path / "model.safetensors")
    assert h.metadata.get("format") == "pt"
    out = nnx_save.load_file(tmp_path / "model.safetensors")
    state = model.state_dict()
    assert set(out) == set(state)
    for k, t in state.items():
        assert out[k].dtype == np.float32 and out[k].tobytes() == torch_bytes(t), k
