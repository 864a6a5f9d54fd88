"""Port tiny HuggingFace GPT-2 (tied head; plain and scanned with separate q / k / v),
Llama (plain and scanned), BERT and ViT checkpoints into the example NNX models with
rules only, and compare the logits with torch's; export them back, compare the
tensors, and load the export into torch with ``load_state_dict(strict=True)``.

Each HF model is built offline from a config with a fixed seed and written with
``save_pretrained`` twice: as one file and as several files with an index.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from _errors import raises_rule
from flax import nnx
from porting_support import abstract, fill, max_abs_diff, model_arrays, model_shapes, read_checkpoint, save_hf

import nnx_save
import nnx_save.porting
from examples.models import bert, gpt2, llama, vit
from nnx_save.porting import Rules, TieRule, coverage, shapes_of

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |ours - torch| <= TOLERANCE * max |torch logits|, fp32
INIT = 0.2  # initializer_range: large enough that a subtly wrong port (RoPE base x2) fails


FORWARD = nnx.jit(lambda model, x: model(x))  # one compile per family and input shape


def _perturbed(model: Any) -> Any:
    """Every param nudged off its init, so that norm weights (all ones) and biases
    (all zeros) tell apart and a swapped or skipped one shows in the logits."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


@dataclass(frozen=True)
class Family:
    """One model family: how to build both sides and feed them."""

    name: str
    hf: Callable[[], Any]  # builds the transformers model (seeded by the caller)
    nnx_model: Callable[[Any], nnx.Module]  # HF config -> NNX model (abstract-safe)
    rules: Rules
    inputs: Callable[[np.random.Generator], np.ndarray]
    to_torch: Callable[[Any, np.ndarray], Any]  # (hf model, inputs) -> logits
    to_jax: Callable[[np.ndarray], np.ndarray]  # inputs in the NNX model's layout


def _ids(vocab: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.integers(0, vocab, size=(2, 12)).astype(np.int32)


def _lm_logits(hf: Any, ids: np.ndarray) -> Any:
    return hf(input_ids=torch.from_numpy(ids.astype(np.int64))).logits


def _gpt2() -> Any:
    cfg = transformers.GPT2Config(
        vocab_size=96,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=INIT,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        initializer_range=INIT,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg)


def _bert() -> Any:
    cfg = transformers.BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        num_labels=3,
        initializer_range=INIT,
        attn_implementation="eager",
    )
    return transformers.BertForSequenceClassification(cfg)


def _vit() -> Any:
    cfg = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        num_labels=5,
        initializer_range=INIT,
        attn_implementation="eager",
    )
    return transformers.ViTForImageClassification(cfg)


FAMILIES = {
    "gpt2": Family(
        "gpt2",
        _gpt2,
        lambda c: gpt2.GPT2(gpt2.GPT2Config.from_hf(c), rngs=nnx.Rngs(0)),
        gpt2.RULES,
        _ids(96),
        _lm_logits,
        lambda x: x,
    ),
    "llama": Family(
        "llama",
        _llama,
        lambda c: llama.Llama(llama.LlamaConfig.from_hf(c), rngs=nnx.Rngs(0)),
        llama.RULES,
        _ids(96),
        _lm_logits,
        lambda x: x,
    ),
    "gpt2_scanned": Family(
        "gpt2_scanned",
        _gpt2,
        lambda c: gpt2.ScannedGPT2(gpt2.GPT2Config.from_hf(c), rngs=nnx.Rngs(0)),
        gpt2.SCANNED_RULES,
        _ids(96),
        _lm_logits,
        lambda x: x,
    ),
    "llama_scanned": Family(
        "llama_scanned",
        _llama,
        lambda c: llama.ScannedLlama(llama.LlamaConfig.from_hf(c), rngs=nnx.Rngs(0)),
        llama.SCANNED_RULES,
        _ids(96),
        _lm_logits,
        lambda x: x,
    ),
    "bert": Family(
        "bert",
        _bert,
        lambda c: bert.Bert(bert.BertConfig.from_hf(c), rngs=nnx.Rngs(0)),
        bert.RULES,
        _ids(96),
        _lm_logits,
        lambda x: x,
    ),
    "vit": Family(
        "vit",
        _vit,
        lambda c: vit.ViT(vit.ViTConfig.from_hf(c), rngs=nnx.Rngs(0)),
        vit.RULES,
        lambda rng: rng.standard_normal((2, 3, 16, 16)).astype(np.float32),
        lambda hf, x: hf(pixel_values=torch.from_numpy(x)).logits,
        lambda x: np.transpose(x, (0, 2, 3, 1)),
    ),
}


@dataclass
class Ported:
    """A family's HF side, computed once per module."""

    family: Family
    dirs: dict
    files: dict  # layout -> {file key: array}
    inputs: np.ndarray
    torch_logits: np.ndarray
    abstract: nnx.Module
    forward: Callable
    hf_type: type


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ported(request, tmp_path_factory) -> Ported:
    family = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = _perturbed(family.hf())
    dirs = save_hf(hf, tmp_path_factory.mktemp(family.name))
    inputs = family.inputs(np.random.default_rng(0))
    with torch.no_grad():
        logits = family.to_torch(hf, inputs).numpy()
    files = {layout: read_checkpoint(d) for layout, d in dirs.items()}
    model = abstract(lambda: family.nnx_model(hf.config))
    return Ported(family, dirs, files, inputs, logits, model, FORWARD, type(hf))


def _port(p: Ported, tensors: dict) -> tuple[nnx.Module, Any]:
    mapping = p.family.rules.mapping(shapes_of(tensors))
    coverage(mapping, {k: s for k, (s, _) in model_shapes(p.abstract).items()}).check()
    return fill(p.abstract, mapping.apply(tensors)), mapping


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_port_matches_torch_logits(ported: Ported, layout: str) -> None:
    tensors = ported.files[layout]
    model, _ = _port(ported, tensors)
    ours = np.asarray(ported.forward(model, ported.family.to_jax(ported.inputs)))
    diff, scale = max_abs_diff(ours, ported.torch_logits)
    print(f"{ported.family.name}/{layout}: max abs diff {diff:.3g}, max |logits| {scale:.3g}")
    assert diff <= TOLERANCE * scale


def test_both_layouts_hold_the_same_tensors(ported: Ported) -> None:
    single, sharded = ported.files["single"], ported.files["sharded"]
    assert sorted(single) == sorted(sharded)
    assert all(np.array_equal(single[k], sharded[k]) for k in single)


def test_every_file_tensor_lands_and_every_param_is_filled_once(ported: Ported) -> None:
    tensors = ported.files["single"]
    mapping = ported.family.rules.mapping(shapes_of(tensors))
    expected = model_shapes(ported.abstract)
    assert mapping.unused == ()
    assert sorted(mapping.assignments) == sorted(expected)
    for key, targets in mapping.landed.items():
        assert targets and set(targets) <= set(expected), key
    fed = [key for a in mapping.assignments.values() for key in a.sources]
    assert sorted(set(fed)) == sorted(tensors)
    owners = {key: {a.target for a in mapping.assignments.values() if key in a.sources} for key in tensors}
    assert all(owners[k] == set(mapping.landed[k]) for k in tensors)


def _with_tied_copies(rules: Rules, tensors: dict) -> dict:
    """The file's tensors plus every copy the rules' ``tie`` declares (``save_pretrained``
    drops a tied head; the export writes it, as ``load_state_dict(strict=True)`` wants)."""
    ties = [r for r in rules if isinstance(r, TieRule)]
    return {**tensors, **{c: tensors[k] for t in ties for k in tensors for c in t.copies_of(k)}}


def test_export_gives_back_the_file_tensors_exactly(ported: Ported) -> None:
    tensors = ported.files["sharded"]
    model, _ = _port(ported, tensors)
    state = model_arrays(model)
    exported = ported.family.rules.inverse().mapping(shapes_of(state)).apply(state)
    expected = _with_tied_copies(ported.family.rules, tensors)
    assert sorted(exported) == sorted(expected)
    for key, value in expected.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key


# transformers 5 holds ViT's weights under other names than save_pretrained writes
# (q_proj for attention.query ...) and renames them on load: its own loader is the
# strict check there (no missing, unexpected or mismatched key).
RENAMED_ON_LOAD = {"vit"}


def _from_pretrained_strictly(p: Ported, exported: dict, root) -> Any:
    nnx_save.save_file(exported, root / "model.safetensors")
    shutil.copy(p.dirs["single"] / "config.json", root / "config.json")
    hf, info = p.hf_type.from_pretrained(root, attn_implementation="eager", output_loading_info=True)
    problems = {k: v for k, v in info.items() if k != "error_msgs" and v}
    assert not problems and not info.get("error_msgs"), problems
    return hf.eval()


def test_export_loads_into_torch_strictly_with_the_same_logits(ported: Ported, tmp_path) -> None:
    """Every key torch's module has, none it lacks (a tied head included), and torch
    computes the same logits from the exported tensors."""
    model, _ = _port(ported, ported.files["single"])
    state = model_arrays(model)
    exported = ported.family.rules.inverse().mapping(shapes_of(state)).apply(state)
    torch.manual_seed(1)
    fresh = ported.family.hf().eval()  # other random values: a no-op load would show
    if ported.family.name in RENAMED_ON_LOAD:
        fresh = _from_pretrained_strictly(ported, exported, tmp_path)
    else:
        fresh.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in exported.items()}, strict=True)
    with torch.no_grad():
        logits = ported.family.to_torch(fresh, ported.inputs).numpy()
    np.testing.assert_array_equal(logits, ported.torch_logits)


def test_load_model_and_save_model_with_rules_round_trip_through_transformers(ported: Ported, tmp_path) -> None:
    """The engine path: ``load_model(rules=RULES)`` from the multi-file checkpoint,
    ``save_model(rules=RULES.inverse())``, then transformers itself reads the export."""
    family = ported.family
    builder = lambda: family.nnx_model(_hf_config(ported))  # noqa: E731
    model, report = nnx_save.load_model(builder, ported.dirs["sharded"], rules=family.rules, strict=True)
    assert report.clean
    assert report.io.read_whole == []  # every rule of the family maps boxes: a sharded load reads its shards
    # Bit for bit the values test_port_matches_torch_logits checks against torch (no
    # second compile: the engine's arrays are committed to a device, fill's are not).
    tensors = ported.files["single"]
    expected = family.rules.mapping(shapes_of(tensors)).apply(tensors)
    loaded = model_arrays(model)
    assert sorted(loaded) == sorted(expected)
    assert all(np.array_equal(loaded[k], expected[k]) for k in expected)
    nnx_save.save_model(model, tmp_path / "model.safetensors", rules=family.rules.inverse())
    exported = read_checkpoint(tmp_path / "model.safetensors")
    original = _with_tied_copies(family.rules, ported.files["single"])
    assert sorted(exported) == sorted(original)
    assert all(np.array_equal(exported[k], original[k]) for k in original)
    shutil.copy(ported.dirs["single"] / "config.json", tmp_path / "config.json")
    hf = ported.hf_type.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        np.testing.assert_array_equal(family.to_torch(hf, ported.inputs).numpy(), ported.torch_logits)


def _hf_config(p: Ported) -> Any:
    return transformers.AutoConfig.from_pretrained(p.dirs["single"])


def test_gpt2_checks_a_tied_head_and_ignores_old_mask_buffers_in_the_file(tmp_path) -> None:
    """``save_pretrained`` drops the tied ``lm_head.weight``; older checkpoints keep it
    and the causal-mask buffers. The head is read and checked equal to the embedding;
    the buffers land nowhere, on purpose, and change nothing."""
    torch.manual_seed(1)
    hf = _perturbed(_gpt2())
    tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    assert np.array_equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])  # tied
    tensors["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.bool_))
    tensors["transformer.h.1.attn.masked_bias"] = np.array(-1e4, np.float32)
    mapping = gpt2.RULES.mapping(shapes_of(tensors))
    assert mapping.unused == ("transformer.h.0.attn.bias", "transformer.h.1.attn.masked_bias")
    assert mapping.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert mapping.assignments["wte/embedding"].sources == ("transformer.wte.weight", "lm_head.weight")
    model = abstract(lambda: gpt2.GPT2(gpt2.GPT2Config.from_hf(hf.config), rngs=nnx.Rngs(0)))
    assert coverage(mapping, {k: s for k, (s, _) in model_shapes(model).items()}).complete
    ids = np.random.default_rng(1).integers(0, 96, size=(2, 12)).astype(np.int32)
    ours = np.asarray(FORWARD(fill(model, mapping.apply(tensors)), ids))
    with torch.no_grad():
        diff, scale = max_abs_diff(ours, _lm_logits(hf, ids).numpy())
    assert diff <= TOLERANCE * scale


def test_gpt2_refuses_a_head_trained_apart_from_the_embedding(tmp_path) -> None:
    """A checkpoint whose head is not the embedding any more cannot pass as tied."""
    torch.manual_seed(1)
    hf = _perturbed(_gpt2())
    tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.25
    nnx_save.save_file(tensors, tmp_path / "model.safetensors")
    builder = lambda: gpt2.GPT2(gpt2.GPT2Config.from_hf(hf.config), rngs=nnx.Rngs(0))  # noqa: E731
    message = "`lm_head.weight` is declared tied to `transformer.wte.weight` but holds other values"
    with raises_rule("tied", match=re.escape(message)):
        nnx_save.load_model(builder, tmp_path / "model.safetensors", rules=gpt2.RULES, strict=True)
