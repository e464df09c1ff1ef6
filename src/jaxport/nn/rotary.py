"""Rotary position embedding with the rotate-half (not interleaved) convention."""

import jax
import jax.numpy as jnp


def rotary_cos_sin(head_dim: int, positions: jax.Array, theta: float = 10000.0):
    """cos, sin of shape `positions.shape + [head_dim]`, in float32.

    The frequencies are computed as upstream does in float32 and duplicated over
    both halves of the head dimension.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    # cos and sin of each frequency once, then duplicated: the same values as of the duplicated angles
    return tuple(jnp.concatenate([f, f], axis=-1) for f in (jnp.cos(freqs), jnp.sin(freqs)))


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x_BSHD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x: [B, S, H, D]` by `cos, sin: [S, D]` or `[B, S, D]`.

    The product is computed in `cos.dtype` and returned in `x.dtype`: TRM passes
    float32 tables (it upcasts q and k); Hugging Face Qwen2/Dream pass tables
    already cast to the activation dtype.
    """
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    x = x_BSHD.astype(cos.dtype)
    return (x * cos + rotate_half(x) * sin).astype(x_BSHD.dtype)
