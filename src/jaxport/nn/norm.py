"""RMSNorm computed in float32 and cast back, with or without a learned weight."""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """Weightless RMSNorm over `axis`, computed in float32, returned in `x.dtype`."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axis, keepdims=True) + eps)
    return x32.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Qwen2/LLaMA RMSNorm: `weight * rms_norm(x)` with the weight applied after the cast back."""

    def __init__(self, dim: int, eps: float = 1e-6, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight[...] * rms_norm(x, self.eps)
