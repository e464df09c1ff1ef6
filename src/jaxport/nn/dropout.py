"""Functional dropout: the caller's PRNG key decides whether it is training.

The keep decision of each element is a counter-based hash of its position and a 32-bit seed drawn from
the key (the idea of Philox, with murmur3's finaliser as the mixing function). Written here rather than
drawn with `jax.random.bernoulli` because threefry costs several times more than the attention it drops
on a CPU (docs/performance.md, "Dropout masks"), and because the mask depends only on each element's
position, an array processed in blocks gets the mask the whole array would.
"""

import jax
import jax.numpy as jnp


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def keep_mask(shape, rate: float, rng: jax.Array, rows=None, cols=None) -> jax.Array:
    """Boolean mask, False with probability `rate` (to 2^-32), for an array of `shape`. `rows` (an index over
    the leading axes) and `cols` (over the last axis), broadcastable to `shape`, place the array inside a
    larger one: the default is its own positions."""
    seed = jax.random.bits(rng, (2,), jnp.uint32)
    if rows is None:
        leading = shape[:-1]
        rows = jax.lax.broadcasted_iota(jnp.uint32, (*leading, 1), 0)
        for axis in range(1, len(leading)):
            rows = rows * jnp.uint32(leading[axis]) + jax.lax.broadcasted_iota(jnp.uint32, (*leading, 1), axis)
    if cols is None:
        cols = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
    h = _mix(_mix(rows.astype(jnp.uint32) ^ seed[0]) ^ (cols.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)) ^ seed[1])
    return h >= jnp.uint32(min(round(rate * 2.0**32), 2**32 - 1))


def dropout(x: jax.Array, rate: float, rng: jax.Array | None, rows=None, cols=None) -> jax.Array:
    """Zero each element with probability `rate` and scale the rest by 1 / (1 - rate), as
    PyTorch's `nn.Dropout` in train mode. Without `rng` (evaluation) or at rate 0, `x` as is.
    `rows`/`cols` place `x` inside a larger array (see `keep_mask`)."""
    if rng is None or rate == 0.0:
        return x
    return jnp.where(keep_mask(x.shape, rate, rng, rows, cols), x / (1.0 - rate), 0).astype(x.dtype)
