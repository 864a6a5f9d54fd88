"""A Llama-style decoder in Flax NNX, and the rules that port ``LlamaForCausalLM``.

RMSNorm, rotary position embeddings (HF's half-split "rotate_half" layout),
grouped-query attention, a SwiGLU MLP and an untied head. Every projection is a torch
``nn.Linear`` (out, in) in the file and an NNX ``Linear`` kernel (in, out) in the
model: the rules transpose them. :class:`ScannedLlama` stacks the layers' params on a
leading axis (``nnx.scan``); ``SCANNED_RULES`` port the same checkpoint into it.

Examples:
    >>> from flax import nnx
    >>> cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
    ...                   num_attention_heads=2, num_key_value_heads=1)
    >>> Llama(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32)).shape
    (1, 4, 16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_save.porting import Rules, torch_embedding, torch_linear, torch_rms_norm

from ._common import attention, heads, merge_heads, scan_layers, stacked

__all__ = ["RULES", "SCANNED_RULES", "Llama", "LlamaConfig", "ScannedLlama"]


@dataclass(frozen=True)
class LlamaConfig:
    """Llama sizes (defaults: tiny)."""

    vocab_size: int = 96
    hidden_size: int = 32
    intermediate_size: int = 48
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf: Any) -> LlamaConfig:
        """Read a ``transformers.LlamaConfig`` (by attribute; default RoPE only)."""
        rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf.rope_theta}
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if rope.get("rope_type", "default") != "default" or hf.tie_word_embeddings or hf.attention_bias or hf.mlp_bias:
            raise ValueError(f"unsupported Llama variant: {rope=}, {hf.tie_word_embeddings=}, {hf.attention_bias=}")
        if head_dim * hf.num_attention_heads != hf.hidden_size or hf.hidden_act != "silu":
            raise ValueError(f"unsupported Llama variant: {head_dim=}, {hf.hidden_act=}")
        names = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
        )
        return cls(**{n: getattr(hf, n) for n in names}, rope_theta=float(rope["rope_theta"]))


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotate ``(batch, time, heads, head_dim)`` by position, HF's half-split layout."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, x.shape[-1], 2, dtype=jnp.float32) / x.shape[-1]))
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query attention with rotary embeddings."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_head, self.n_kv, self.theta = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_theta
        self.q = nnx.Linear(d, self.n_head * hd, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(d, self.n_kv * hd, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(d, self.n_kv * hd, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(self.n_head * hd, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q = rotary(heads(self.q(x), self.n_head), self.theta)
        k = rotary(heads(self.k(x), self.n_kv), self.theta)
        v = heads(self.v(x), self.n_kv)
        repeat = self.n_head // self.n_kv  # query head h reads key/value head h // repeat
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        return self.o(merge_heads(attention(q, k, v, causal=True)))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(f, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Layer(nnx.Module):
    """Pre-norm decoder layer."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """Llama causal LM: token ids ``(batch, time)`` -> logits ``(batch, time, vocab)``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = self._make_layers(cfg, rngs)
        self.norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs)

    def _make_layers(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.Module:
        return nnx.List([Layer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])

    def _run_layers(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.lm_head(self.norm(self._run_layers(self.embed(ids))))


class ScannedLlama(Llama):
    """:class:`Llama` with every layer param stacked: ``layers/attn/q/kernel`` is
    ``(layers, hidden, heads * head_dim)``."""

    def _make_layers(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.Module:
        return stacked(lambda r: Layer(cfg, rngs=r), cfg.num_hidden_layers, rngs)

    def _run_layers(self, x: jax.Array) -> jax.Array:
        return scan_layers(self.layers, x)


_L = r"model\.layers\.(\d+)\."


def _linear(source: str, target: str) -> tuple:
    return torch_linear(_L + source, rf"layers/\1/{target}", bias=False)


RULES = Rules(
    torch_embedding(r"model\.embed_tokens", "embed"),
    *(_linear(rf"self_attn\.{n}_proj", f"attn/{n}") for n in "qkvo"),
    *(_linear(rf"mlp\.{n}_proj", f"mlp/{n}") for n in ("gate", "up", "down")),
    torch_rms_norm(_L + r"input_layernorm", r"layers/\1/attn_norm"),
    torch_rms_norm(_L + r"post_attention_layernorm", r"layers/\1/mlp_norm"),
    torch_rms_norm(r"model\.norm", "norm"),
    torch_linear(r"lm_head", "lm_head", bias=False),
)
"""HF ``LlamaForCausalLM`` keys -> :class:`Llama` state paths."""

_S = r"model\.layers\.(?P<layer>\d+)\."  # a layer pattern: the helpers stack it

SCANNED_RULES = Rules(
    torch_embedding(r"model\.embed_tokens", "embed"),
    *(torch_linear(_S + rf"self_attn\.{n}_proj", f"layers/attn/{n}", bias=False) for n in "qkvo"),
    *(torch_linear(_S + rf"mlp\.{n}_proj", f"layers/mlp/{n}", bias=False) for n in ("gate", "up", "down")),
    torch_rms_norm(_S + r"input_layernorm", "layers/attn_norm"),
    torch_rms_norm(_S + r"post_attention_layernorm", "layers/mlp_norm"),
    torch_rms_norm(r"model\.norm", "norm"),
    torch_linear(r"lm_head", "lm_head", bias=False),
)
"""HF ``LlamaForCausalLM`` keys -> :class:`ScannedLlama` state paths."""
