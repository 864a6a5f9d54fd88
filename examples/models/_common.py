"""Pieces the example models share: attention and the causal mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool) -> jax.Array:
    """Scaled dot-product attention on ``(batch, time, heads, head_dim)`` arrays."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if causal:
        t = q.shape[1]
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def heads(x: jax.Array, count: int) -> jax.Array:
    """``(batch, time, count * head_dim)`` -> ``(batch, time, count, head_dim)``."""
    return x.reshape(*x.shape[:-1], count, x.shape[-1] // count)


def merge_heads(x: jax.Array) -> jax.Array:
    """``(batch, time, heads, head_dim)`` -> ``(batch, time, heads * head_dim)``."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
