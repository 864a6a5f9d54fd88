"""A ViT encoder with a classification head in Flax NNX, and the rules that port
HuggingFace ``ViTForImageClassification``.

Images are NHWC here (torch takes NCHW). The patch embedding is a strided conv whose
torch weight (out, in, kh, kw) becomes the NNX kernel (kh, kw, in, out); the class
token is a plain ``(hidden,)`` vector here, reshaped from the file's ``(1, 1,
hidden)``; linear layers are transposed as usual.

Examples:
    >>> from flax import nnx
    >>> cfg = ViTConfig(image_size=8, patch_size=4, hidden_size=8, num_hidden_layers=1,
    ...                 num_attention_heads=2, intermediate_size=12, num_labels=3)
    >>> ViT(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 8, 8, 3))).shape
    (1, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_save.porting import Rules, rename, reshape, torch_conv, torch_layer_norm, torch_linear

from ._common import attention, heads, merge_heads

__all__ = ["RULES", "ViT", "ViTConfig"]


@dataclass(frozen=True)
class ViTConfig:
    """ViT sizes (defaults: tiny)."""

    image_size: int = 16
    patch_size: int = 4
    num_channels: int = 3
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 48
    num_labels: int = 5
    layer_norm_eps: float = 1e-12

    @property
    def num_patches(self) -> int:
        """Patches per image."""
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, hf: Any) -> ViTConfig:
        """Read a ``transformers.ViTConfig`` (by attribute)."""
        if hf.hidden_act != "gelu" or not hf.qkv_bias:
            raise ValueError(f"unsupported ViT variant: {hf.hidden_act=}, {hf.qkv_bias=}")
        names = (
            "image_size",
            "patch_size",
            "num_channels",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "num_labels",
            "layer_norm_eps",
        )
        return cls(**{n: getattr(hf, n) for n in names})


class Attention(nnx.Module):
    """Bidirectional multi-head self-attention."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs) -> None:
        d = cfg.hidden_size
        self.n_head = cfg.num_attention_heads
        self.query, self.key, self.value, self.out = (nnx.Linear(d, d, rngs=rngs) for _ in range(4))

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (heads(f(x), self.n_head) for f in (self.query, self.key, self.value))
        return self.out(merge_heads(attention(q, k, v, causal=False)))


def _layer_norm(cfg: ViTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, use_fast_variance=False, rngs=rngs)


class Layer(nnx.Module):
    """Pre-norm encoder layer with a GELU MLP."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs) -> None:
        self.norm1, self.norm2 = _layer_norm(cfg, rngs), _layer_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.fc = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, rngs=rngs)
        self.proj = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.proj(jax.nn.gelu(self.fc(self.norm2(x)), approximate=False))


class ViT(nnx.Module):
    """ViT classifier: images ``(batch, height, width, channels)`` -> logits ``(batch, labels)``."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs) -> None:
        d, p = cfg.hidden_size, cfg.patch_size
        self.patch_embed = nnx.Conv(cfg.num_channels, d, (p, p), strides=(p, p), padding="VALID", rngs=rngs)
        self.cls_token = nnx.Param(jnp.zeros((d,)))
        self.pos_embed = nnx.Param(jax.random.normal(rngs.params(), (1, cfg.num_patches + 1, d)) * 0.02)
        self.layers = nnx.List([Layer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = _layer_norm(cfg, rngs)
        self.head = nnx.Linear(d, cfg.num_labels, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.patch_embed(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1])  # row-major patches, as torch's flatten(2)
        cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)[:, 0])


_E = r"vit\.encoder\.layer\.(\d+)\."
_EMB = r"vit\.embeddings\."

RULES = Rules(
    rename(_EMB + r"cls_token", "cls_token"),
    reshape("cls_token", (-1,), source_shape=(1, 1, -1)),
    rename(_EMB + r"position_embeddings", "pos_embed"),
    torch_conv(_EMB + r"patch_embeddings\.projection", "patch_embed"),
    *(torch_linear(_E + rf"attention\.attention\.{n}", rf"layers/\1/attn/{n}") for n in ("query", "key", "value")),
    torch_linear(_E + r"attention\.output\.dense", r"layers/\1/attn/out"),
    torch_linear(_E + r"intermediate\.dense", r"layers/\1/fc"),
    torch_linear(_E + r"output\.dense", r"layers/\1/proj"),
    torch_layer_norm(_E + r"layernorm_before", r"layers/\1/norm1"),
    torch_layer_norm(_E + r"layernorm_after", r"layers/\1/norm2"),
    torch_layer_norm(r"vit\.layernorm", "norm"),
    torch_linear(r"classifier", "head"),
)
"""HF ``ViTForImageClassification`` keys -> :class:`ViT` state paths."""
