"""GPT-2 in Flax NNX, and the rules that port HuggingFace ``GPT2LMHeadModel``.

The file's fused ``c_attn`` (HF ``Conv1D``, stored (in, 3 * out)) is split into
separate q / k / v kernels; the other ``Conv1D`` weights are already (in, out), as
NNX kernels are, so they are only renamed. The language-model head is tied to the
token embedding: the model has one param for both (``wte/embedding``); a
``lm_head.weight`` in the file (``save_pretrained`` drops it; older checkpoints keep
it) is checked equal to the embedding, and the export writes it, as torch's
``load_state_dict(strict=True)`` expects.

:class:`ScannedGPT2` is the same model with its blocks' params stacked on a leading
layer axis (run with ``nnx.scan``); ``SCANNED_RULES`` port the same checkpoint into it.

Examples:
    >>> from flax import nnx
    >>> model = GPT2(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((1, 4), jnp.int32)).shape
    (1, 4, 16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_save.porting import Rules, hf_conv1d, ignore, rename, split, tie, torch_layer_norm

from ._common import attention, heads, merge_heads, scan_layers, stacked

__all__ = ["GPT2", "RULES", "SCANNED_RULES", "GPT2Config", "ScannedGPT2"]


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 sizes (defaults: tiny)."""

    vocab_size: int = 96
    n_positions: int = 32
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5

    @classmethod
    def from_hf(cls, hf: Any) -> GPT2Config:
        """Read a ``transformers.GPT2Config`` (by attribute)."""
        if hf.activation_function != "gelu_new" or hf.scale_attn_by_inverse_layer_idx:
            raise ValueError(
                f"unsupported GPT-2 variant: {hf.activation_function=}, {hf.scale_attn_by_inverse_layer_idx=}"
            )
        names = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon")
        return cls(**{n: getattr(hf, n) for n in names})


class Attention(nnx.Module):
    """Causal multi-head self-attention with separate q / k / v projections."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs) -> None:
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.q, self.k, self.v = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (heads(f(x), self.n_head) for f in (self.q, self.k, self.v))
        return self.proj(merge_heads(attention(q, k, v, causal=True)))


class MLP(nnx.Module):
    """``proj(gelu_tanh(fc(x)))``."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs) -> None:
        self.fc = nnx.Linear(cfg.n_embd, 4 * cfg.n_embd, rngs=rngs)
        self.proj = nnx.Linear(4 * cfg.n_embd, cfg.n_embd, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x), approximate=True))


def _layer_norm(cfg: GPT2Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, use_fast_variance=False, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs) -> None:
        self.ln_1, self.ln_2 = _layer_norm(cfg, rngs), _layer_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
    """GPT-2 language model: token ids ``(batch, time)`` -> logits ``(batch, time, vocab)``."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs) -> None:
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(cfg.n_positions, cfg.n_embd, rngs=rngs)
        self.blocks = self._make_blocks(cfg, rngs)
        self.ln_f = _layer_norm(cfg, rngs)

    def _make_blocks(self, cfg: GPT2Config, rngs: nnx.Rngs) -> nnx.Module:
        return nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])

    def _run_blocks(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[-1]))
        return self.wte.attend(self.ln_f(self._run_blocks(x)))  # the head is tied to the embedding


class ScannedGPT2(GPT2):
    """:class:`GPT2` with every block param stacked: ``blocks/attn/q/kernel`` is
    ``(n_layer, n_embd, n_embd)``."""

    def _make_blocks(self, cfg: GPT2Config, rngs: nnx.Rngs) -> nnx.Module:
        return stacked(lambda r: Block(cfg, rngs=r), cfg.n_layer, rngs)

    def _run_blocks(self, x: jax.Array) -> jax.Array:
        return scan_layers(self.blocks, x)


_H = r"transformer\.h\.(\d+)\."
_QKV = tuple(rf"blocks/\1/attn/{n}" for n in "qkv")

RULES = Rules(
    rename(r"transformer\.wte\.weight", "wte/embedding"),
    rename(r"transformer\.wpe\.weight", "wpe/embedding"),
    split(_H + r"attn\.c_attn\.weight", [f"{t}/kernel" for t in _QKV], axis=1),
    split(_H + r"attn\.c_attn\.bias", [f"{t}/bias" for t in _QKV], axis=0),
    hf_conv1d(_H + r"attn\.c_proj", r"blocks/\1/attn/proj"),
    hf_conv1d(_H + r"mlp\.c_fc", r"blocks/\1/mlp/fc"),
    hf_conv1d(_H + r"mlp\.c_proj", r"blocks/\1/mlp/proj"),
    torch_layer_norm(_H + r"ln_1", r"blocks/\1/ln_1"),
    torch_layer_norm(_H + r"ln_2", r"blocks/\1/ln_2"),
    torch_layer_norm(r"transformer\.ln_f", "ln_f"),
    # The head is tied to the embedding: one param, read from wte; lm_head.weight is
    # checked equal when the file has it, and written back on export.
    tie(r"transformer\.wte\.weight", "lm_head.weight"),
    # Causal-mask buffers that older transformers versions wrote into checkpoints.
    ignore(r"transformer\.h\.\d+\.attn\.(?:masked_)?bias"),
)
"""HF ``GPT2LMHeadModel`` keys -> :class:`GPT2` state paths."""

_S = r"transformer\.h\.(?P<layer>\d+)\."  # a layer pattern: the helpers stack it

SCANNED_RULES = Rules(
    rename(r"transformer\.wte\.weight", "wte/embedding"),
    rename(r"transformer\.wpe\.weight", "wpe/embedding"),
    split(_S + r"attn\.c_attn\.weight", [f"blocks/attn/{n}/kernel" for n in "qkv"], axis=1, stacked=True),
    split(_S + r"attn\.c_attn\.bias", [f"blocks/attn/{n}/bias" for n in "qkv"], axis=0, stacked=True),
    hf_conv1d(_S + r"attn\.c_proj", "blocks/attn/proj"),
    hf_conv1d(_S + r"mlp\.c_fc", "blocks/mlp/fc"),
    hf_conv1d(_S + r"mlp\.c_proj", "blocks/mlp/proj"),
    torch_layer_norm(_S + r"ln_1", "blocks/ln_1"),
    torch_layer_norm(_S + r"ln_2", "blocks/ln_2"),
    torch_layer_norm(r"transformer\.ln_f", "ln_f"),
    tie(r"transformer\.wte\.weight", "lm_head.weight"),
    ignore(r"transformer\.h\.\d+\.attn\.(?:masked_)?bias"),
)
"""HF ``GPT2LMHeadModel`` keys -> :class:`ScannedGPT2` state paths."""
