"""Functional dropout: the caller's PRNG key decides whether it is training."""

import jax
import jax.numpy as jnp


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Zero each element with probability `rate` and scale the rest by 1 / (1 - rate), as
    PyTorch's `nn.Dropout` in train mode. Without `rng` (evaluation) or at rate 0, `x` as is."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
