"""A BERT encoder with a sequence-classification head in Flax NNX, and the rules that
port HuggingFace ``BertForSequenceClassification``.

Post-norm layers (the layer norm after each residual sum), exact GELU, learned
absolute positions and token-type embeddings (all type 0 here), a tanh pooler over
the first token. Every projection is a torch ``nn.Linear``: transposed.

Examples:
    >>> from flax import nnx
    >>> cfg = BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...                  intermediate_size=12, max_position_embeddings=8, num_labels=3)
    >>> Bert(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32)).shape
    (1, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_save.porting import Rules, torch_embedding, torch_layer_norm, torch_linear

from ._common import attention, heads, merge_heads

__all__ = ["RULES", "Bert", "BertConfig"]


@dataclass(frozen=True)
class BertConfig:
    """BERT sizes (defaults: tiny)."""

    vocab_size: int = 96
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 48
    max_position_embeddings: int = 32
    type_vocab_size: int = 2
    num_labels: int = 3
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_hf(cls, hf: Any) -> BertConfig:
        """Read a ``transformers.BertConfig`` (by attribute; absolute positions, exact GELU)."""
        if hf.hidden_act != "gelu" or getattr(hf, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported BERT variant: {hf.hidden_act=}")
        return cls(**{n: getattr(hf, n) for n in cls.__dataclass_fields__})


def _layer_norm(cfg: BertConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, use_fast_variance=False, rngs=rngs)


class Layer(nnx.Module):
    """Post-norm encoder layer: self-attention, then the MLP, each added and normed."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.n_head = cfg.num_attention_heads
        self.q, self.k, self.v, self.out = (nnx.Linear(d, d, rngs=rngs) for _ in range(4))
        self.attn_norm = _layer_norm(cfg, rngs)
        self.fc, self.proj = nnx.Linear(d, f, rngs=rngs), nnx.Linear(f, d, rngs=rngs)
        self.mlp_norm = _layer_norm(cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (heads(f(x), self.n_head) for f in (self.q, self.k, self.v))
        x = self.attn_norm(x + self.out(merge_heads(attention(q, k, v, causal=False))))
        return self.mlp_norm(x + self.proj(jax.nn.gelu(self.fc(x), approximate=False)))


class Bert(nnx.Module):
    """BERT classifier: token ids ``(batch, time)`` -> logits ``(batch, labels)``."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs) -> None:
        d = cfg.hidden_size
        self.words = nnx.Embed(cfg.vocab_size, d, rngs=rngs)
        self.positions = nnx.Embed(cfg.max_position_embeddings, d, rngs=rngs)
        self.types = nnx.Embed(cfg.type_vocab_size, d, rngs=rngs)
        self.embed_norm = _layer_norm(cfg, rngs)
        self.layers = nnx.List([Layer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.pooler = nnx.Linear(d, d, rngs=rngs)
        self.head = nnx.Linear(d, cfg.num_labels, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.words(ids) + self.positions(jnp.arange(ids.shape[-1])) + self.types(jnp.zeros_like(ids))
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(jnp.tanh(self.pooler(x[:, 0])))


_E = r"bert\.encoder\.layer\.(\d+)\."
_EMB = r"bert\.embeddings\."

RULES = Rules(
    torch_embedding(_EMB + r"word_embeddings", "words"),
    torch_embedding(_EMB + r"position_embeddings", "positions"),
    torch_embedding(_EMB + r"token_type_embeddings", "types"),
    torch_layer_norm(_EMB + r"LayerNorm", "embed_norm"),
    *(torch_linear(_E + rf"attention\.self\.{n}", rf"layers/\1/{n[0]}") for n in ("query", "key", "value")),
    torch_linear(_E + r"attention\.output\.dense", r"layers/\1/out"),
    torch_layer_norm(_E + r"attention\.output\.LayerNorm", r"layers/\1/attn_norm"),
    torch_linear(_E + r"intermediate\.dense", r"layers/\1/fc"),
    torch_linear(_E + r"output\.dense", r"layers/\1/proj"),
    torch_layer_norm(_E + r"output\.LayerNorm", r"layers/\1/mlp_norm"),
    torch_linear(r"bert\.pooler\.dense", "pooler"),
    torch_linear(r"classifier", "head"),
)
"""HF ``BertForSequenceClassification`` keys -> :class:`Bert` state paths."""
