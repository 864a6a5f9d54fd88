"""Two porting requirements through the engine (``nnx_save.load_model(rules=...)``):

1. a bf16 model loaded from an fp32 HF checkpoint gives torch's fp32 logits within
   a stated tolerance, and the report lists the fp32 -> bf16 cast of every param;
2. fine-tuning start: a ViT trunk loaded under a new classification head with a
   different number of classes, clean only when the caller declares the new head
   (``allow_missing``) and the file's old head (``allow_unexpected``), and loud
   (missing or shape mismatches, ``LoadError`` under ``strict=True``) otherwise.

The example configs take no dtype, so the bf16 model is the example model with its
params cast to bf16 inside the builder (``nnx.state`` / ``jax.tree.map`` /
``nnx.update``): under ``nnx.eval_shape`` that costs nothing and the engine sees
bf16 targets, so it is the engine that casts the file's fp32 tensors (and reports it).
The other layers compute in their inputs' and params' dtype, but ``nnx.Embed``
defaults to ``dtype=float32``: the builder sets it to bf16 so that the whole forward
runs in bf16 (asserted on the logits' dtype), not fp32 activations over bf16 weights.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from porting_support import max_abs_diff, model_arrays, model_shapes, read_checkpoint, save_hf
from test_porting_families import FAMILIES, FORWARD, _perturbed

import nnx_save
from examples.models import vit
from nnx_save.porting import Rules, shapes_of

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# bf16 keeps 8 bits of mantissa (relative rounding 2**-9 ~ 2e-3 per op), and here the
# whole forward runs in bf16: weights, activations and the residual stream (softmax
# and norm statistics in fp32, as flax does). Through two layers of these tiny models,
# with deliberately large weights (INIT 0.2 + perturbation), the logits drift by about
# 1e-2 of their scale, the worst element by a few 1e-2. Stated, against torch fp32:
#   max |ours - torch| <= BF16_TOLERANCE * max |torch|     (worst element)
#   ||ours - torch||_2 <= BF16_RMS_TOLERANCE * ||torch||_2 (overall)
# Measured on CPU (print with -s), max-relative / rms-relative: gpt2 1.6e-2 / 1.4e-2,
# llama 4.6e-2 / 2.2e-2 (RoPE and GQA in bf16), vit 6.8e-3 / 1.1e-2. About 2x margin.
# The fp32 port's correctness is test_porting_families' job (1e-4); this proves bf16.
BF16_TOLERANCE = 1e-1
BF16_RMS_TOLERANCE = 5e-2
NEW_LABELS = 7  # the fine-tuning head; the checkpoint's has 5


def _bf16(build: Callable[[], nnx.Module]) -> Callable[[], nnx.Module]:
    """``build``, with every float param cast to bf16 (the examples take no dtype)."""

    def builder() -> nnx.Module:
        model = build()
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
        for _, module in nnx.iter_modules(model):
            if isinstance(module, nnx.Embed):
                module.dtype = jnp.bfloat16  # nnx.Embed computes in float32 by default
        return model

    return builder


def _hf_side(name: str, root) -> tuple[Any, dict, np.ndarray, np.ndarray]:
    family = FAMILIES[name]
    torch.manual_seed(0)
    hf = _perturbed(family.hf())
    dirs = save_hf(hf, root)
    inputs = family.inputs(np.random.default_rng(0))
    with torch.no_grad():
        logits = family.to_torch(hf, inputs).numpy()
    return hf.config, dirs, inputs, logits


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_family(request, tmp_path_factory):
    return request.param, *_hf_side(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_bf16_load_matches_torch_fp32_logits_and_reports_the_cast(hf_family, layout: str) -> None:
    name, config, dirs, inputs, torch_logits = hf_family
    family = FAMILIES[name]
    builder = _bf16(lambda: family.nnx_model(config))
    with pytest.warns(nnx_save.LoadWarning, match="dtype casts"):
        model, report = nnx_save.load_model(builder, dirs[layout], rules=family.rules)
    # The engine reports the cast of every param (float32 in the file -> bfloat16), and
    # nothing else: the load is otherwise complete.
    expected = model_shapes(nnx.eval_shape(builder))
    assert all(dtype == jnp.bfloat16 for _, dtype in expected.values())
    assert not (report.missing or report.unexpected or report.shape_mismatches)
    assert sorted(report.loaded) == sorted(expected)
    assert sorted((c.path, c.file_dtype, c.model_dtype) for c in report.dtype_casts) == [
        (path, "float32", "bfloat16") for path in sorted(expected)
    ]
    assert not report.clean
    loaded = model_arrays(model)
    assert all(v.dtype == jnp.bfloat16 for v in loaded.values())
    # The values are the fp32 port rounded to bf16, exactly.
    tensors = read_checkpoint(dirs["single"])
    ported = family.rules.mapping(shapes_of(tensors)).apply(tensors)
    assert all(np.array_equal(loaded[k], ported[k].astype(jnp.bfloat16)) for k in ported)
    # bf16 inputs too for ViT (images are floats), so that the forward runs in bf16.
    x = family.to_jax(inputs)
    x = x.astype(jnp.bfloat16) if np.issubdtype(x.dtype, np.floating) else x
    out = FORWARD(model, x)
    assert out.dtype == jnp.bfloat16  # the forward really ran in bf16
    ours = np.asarray(out.astype(jnp.float32))
    assert ours.shape == torch_logits.shape
    diff, scale = max_abs_diff(ours, torch_logits)
    rms = float(np.linalg.norm(ours - torch_logits) / np.linalg.norm(torch_logits))
    print(
        f"{name}/{layout} bf16: max abs diff {diff:.3g}, max |logits| {scale:.3g}, relative {diff / scale:.3g}, rms {rms:.3g}"
    )
    assert diff <= BF16_TOLERANCE * scale
    assert rms <= BF16_RMS_TOLERANCE


def test_bf16_strict_load_refuses_the_cast(hf_family) -> None:
    """``strict=True`` treats the cast as a mismatch, like the engine does for any file."""
    name, config, dirs, *_ = hf_family
    family = FAMILIES[name]
    with pytest.raises(nnx_save.LoadError, match="float32 in the file -> bfloat16 in the model"):
        nnx_save.load_model(_bf16(lambda: family.nnx_model(config)), dirs["single"], rules=family.rules, strict=True)


# --- fine-tuning start: the ViT trunk under a new head ------------------------------

HEAD = ["head/bias", "head/kernel"]
OLD_HEAD = ["classifier.bias", "classifier.weight"]
# The trunk's rules: the example's, less those for the classifier (file side) / head.
TRUNK_RULES = Rules(*(r for r in vit.RULES if not re.match(r"classifier|head", r.pattern)))


@pytest.fixture(scope="module")
def vit_checkpoint(tmp_path_factory):
    config, dirs, *_ = _hf_side("vit", tmp_path_factory.mktemp("vit_finetune"))
    assert config.num_labels != NEW_LABELS
    assert len(vit.RULES) - len(TRUNK_RULES) == 3  # classifier weight, its transpose, bias
    return config, dirs["sharded"], read_checkpoint(dirs["single"])


def _new_head_builder(config: Any) -> Callable[[], nnx.Module]:
    cfg = dataclasses.replace(vit.ViTConfig.from_hf(config), num_labels=NEW_LABELS)
    return lambda: vit.ViT(cfg, rngs=nnx.Rngs(0))


def _assert_trunk_loaded(model: nnx.Module, tensors: dict) -> None:
    ported = vit.RULES.mapping(shapes_of(tensors)).apply(tensors)
    loaded = model_arrays(model)
    trunk = sorted(k for k in ported if k not in HEAD)
    assert sorted(k for k in loaded if k not in HEAD) == trunk
    assert all(loaded[k].dtype == ported[k].dtype and np.array_equal(loaded[k], ported[k]) for k in trunk)
    assert loaded["head/kernel"].shape == (_hidden(tensors), NEW_LABELS)
    assert loaded["head/bias"].shape == (NEW_LABELS,)


def _hidden(tensors: dict) -> int:
    return tensors["vit.layernorm.weight"].shape[0]


def test_finetune_trunk_with_a_new_head_is_clean_when_declared(vit_checkpoint) -> None:
    config, path, tensors = vit_checkpoint
    model, report = nnx_save.load_model(
        _new_head_builder(config),
        path,
        rules=TRUNK_RULES,
        strict=True,
        allow_missing=["head/*"],
        allow_unexpected=[r"classifier\..*"],
    )
    assert report.clean
    assert report.problems() == []
    assert report.allowed_missing == HEAD
    assert sorted(report.allowed_unexpected) == OLD_HEAD
    assert sorted(report.loaded) == sorted(k for k in model_arrays(model) if k not in HEAD)
    _assert_trunk_loaded(model, tensors)
    # The new head is the builder's initialisation (a fresh Linear: zero bias), not the file's.
    head = model_arrays(model)
    assert np.all(head["head/bias"] == 0) and np.all(np.isfinite(head["head/kernel"]))


def test_finetune_without_allow_missing_lists_the_head_as_missing(vit_checkpoint) -> None:
    config, path, tensors = vit_checkpoint
    kwargs = {"rules": TRUNK_RULES, "allow_unexpected": [r"classifier\..*"]}
    with pytest.raises(nnx_save.LoadError) as raised:
        nnx_save.load_model(_new_head_builder(config), path, strict=True, **kwargs)
    assert all(f"missing: {p}" in str(raised.value) for p in HEAD)
    with pytest.warns(nnx_save.LoadWarning, match="2 missing"):
        model, report = nnx_save.load_model(_new_head_builder(config), path, **kwargs)
    assert report.missing == HEAD
    assert report.allowed_missing == [] and report.unexpected == [] and report.shape_mismatches == []
    assert sorted(report.allowed_unexpected) == OLD_HEAD
    assert not report.clean
    _assert_trunk_loaded(model, tensors)


def test_finetune_with_the_full_rules_reports_the_old_head_as_shape_mismatches(vit_checkpoint) -> None:
    """With the example's full RULES the old head *does* map onto ``head/*``, with the
    wrong class count: shape mismatches, which ``allow_missing`` does not excuse."""
    config, path, tensors = vit_checkpoint
    hidden, old = _hidden(tensors), config.num_labels
    expected = [
        ("head/bias", (NEW_LABELS,), (old,), "classifier.bias"),
        ("head/kernel", (hidden, NEW_LABELS), (hidden, old), "classifier.weight"),
    ]
    kwargs = {"rules": vit.RULES, "allow_missing": ["head/*"]}
    with pytest.raises(nnx_save.LoadError) as raised:
        nnx_save.load_model(_new_head_builder(config), path, strict=True, **kwargs)
    assert all(f"shape: {p}" in str(raised.value) for p in HEAD)
    with pytest.warns(nnx_save.LoadWarning, match="2 shape mismatches"):
        model, report = nnx_save.load_model(_new_head_builder(config), path, **kwargs)
    got = sorted((m.path, m.model_shape, m.file_shape, m.file_key) for m in report.shape_mismatches)
    assert got == expected
    assert report.missing == [] and report.allowed_missing == [] and report.unexpected == []
    assert not report.clean
    _assert_trunk_loaded(model, tensors)


def test_finetune_with_the_full_rules_and_allow_shape_mismatch(vit_checkpoint) -> None:
    """Fine-tuning onto a new head: the full RULES map the old head onto ``head/*`` with 10 classes;
    ``allow_shape_mismatch`` accepts it under strict, the new head keeps the builder's
    initialisation, and the refusal without it names that option."""
    config, path, tensors = vit_checkpoint
    with pytest.raises(nnx_save.LoadError, match=re.escape("allow_shape_mismatch=['head/bias', 'head/kernel']")):
        nnx_save.load_model(_new_head_builder(config), path, rules=vit.RULES, strict=True, allow_missing=["head/*"])
    model, report = nnx_save.load_model(
        _new_head_builder(config), path, rules=vit.RULES, strict=True, allow_shape_mismatch=["head/*"]
    )
    assert report.clean and sorted(m.path for m in report.allowed_shape_mismatches) == HEAD
    _assert_trunk_loaded(model, tensors)
    head = model_arrays(model)
    assert np.all(head["head/bias"] == 0) and head["head/kernel"].shape == (_hidden(tensors), NEW_LABELS)
