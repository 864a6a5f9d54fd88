"""Pieces the example models share: attention, the causal mask, scanned layers."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


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


def stacked(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """``count`` layers made by ``make`` as one module whose params carry a leading
    layer axis (what ``jax.lax.scan`` over layers wants)."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(layer_rngs: nnx.Rngs) -> nnx.Module:
        return make(layer_rngs)

    return build(rngs)


def scan_layers(layers: nnx.Module, x: jax.Array) -> jax.Array:
    """Run stacked ``layers`` (see :func:`stacked`) one after another over ``x``."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def step(carry: jax.Array, layer: nnx.Module) -> jax.Array:
        return layer(carry)

    return step(x, layers)
