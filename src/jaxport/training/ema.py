"""Exponential moving average of the weights, as upstream's `models.ema.EMAHelper`.

Upstream keeps a shadow copy only of parameters with `requires_grad`; evaluation uses a
copy of the model whose trainable parameters are replaced by the shadow while frozen
parameters and buffers (TRM's puzzle-embedding table is a buffer) keep their current
values. Here the shadow is a pytree like the parameters, and a `trainable` pytree of bools
(Python bools, or boolean arrays when it is passed through jit) plays the part of
`requires_grad`; frozen leaves of the shadow are never read.
"""

import jax
import jax.numpy as jnp


def _all_trainable(params):
    return jax.tree.map(lambda _: True, params)


def _choose(keep, a, b):
    return (a if keep else b) if isinstance(keep, bool) else jnp.where(keep, a, b)


def ema_init(params):
    """`EMAHelper.register`: the shadow starts as a copy of the parameters."""
    return jax.tree.map(jnp.array, params)


def ema_update(shadow, params, mu: float, trainable=None):
    """`EMAHelper.update`: shadow <- (1 - mu) * param + mu * shadow for trainable leaves."""
    trainable = _all_trainable(params) if trainable is None else trainable
    return jax.tree.map(
        lambda keep, s, p: _choose(keep, ((1.0 - mu) * p + mu * s).astype(s.dtype), s), trainable, shadow, params
    )


def ema_copy(shadow, params, trainable=None):
    """`EMAHelper.ema_copy`: the parameters to evaluate with (shadow where trainable)."""
    trainable = _all_trainable(params) if trainable is None else trainable
    return jax.tree.map(lambda keep, s, p: _choose(keep, s, p), trainable, shadow, params)
