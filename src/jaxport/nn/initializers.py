"""Initialisers matching the upstream PyTorch projects."""

import math

import jax
import jax.numpy as jnp


def _truncated_std_factor(lower: float, upper: float) -> float:
    """Standard deviation of a unit normal truncated to [lower, upper]."""
    sqrt2 = math.sqrt(2.0)
    z = (math.erf(upper / sqrt2) - math.erf(lower / sqrt2)) / 2
    pdf = lambda x: math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # noqa: E731
    variance = 1 - (upper * pdf(upper) - lower * pdf(lower)) / z - ((pdf(upper) - pdf(lower)) / z) ** 2
    return math.sqrt(variance)


def truncated_normal(std: float, lower: float = -2.0, upper: float = 2.0):
    """Truncated normal whose std *after* truncation is `std` (TRM's `trunc_normal_init_`).

    `jax.nn.initializers.truncated_normal` scales the untruncated distribution, so the
    correction factor is applied here. `std == 0` gives zeros, as upstream.
    """

    def init(key, shape, dtype=jnp.float32):
        if std == 0:
            return jnp.zeros(shape, dtype)
        scale = std / _truncated_std_factor(lower, upper)
        return (jax.random.truncated_normal(key, lower, upper, shape, jnp.float32) * scale).astype(dtype)

    return init
