"""The training step every family builds from: the loss's gradients summed over micro-batches, clipped by their global
norm, and the optimizer's update (`GradientStep`), jitted at one place under the runtime policy (`jit_train_step`).

A family brings its loss, its optimizer and its state; the pieces here are what they share:

    update = GradientStep(loss, optimizer, max_grad_norm=1.0, compute_dtype=jnp.bfloat16)

    def step(state, micro_batches, learning_rate, draw):
        params, opt_state, loss_scale, metrics = update(state.params, state.opt_state, micro_batches,
                                                       micro_keys(seed, draw, steps), learning_rate)
        return new_state, metrics

    train_step = jit_train_step(step, runtime.for_devices(mesh).for_program(dtype, rows), state_shardings=...)

Master weights and optimizer moments stay float32; the forward and backward pass may run in a reduced precision
(`compute_dtype`, or a model that casts its weights where it uses them), with float16's dynamic loss scaling
(`LossScale`) as PyTorch's GradScaler does it.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxport import runtime

# torch.amp.GradScaler's defaults
LOSS_SCALE_INIT, LOSS_SCALE_GROWTH_INTERVAL = 2.0**16, 2000


def decay_mask(params):
    """Which weights decay: matrices and embedding tables, not biases or norm scales (nanoGPT's two AdamW groups)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def micro_keys(seed: int, draw, count: int) -> jax.Array:
    """`count` random keys, one per micro-batch of draw `draw` (the iteration). Made inside the step: a key made on the
    host waits for the step before it."""
    return jax.random.split(jax.random.fold_in(jax.random.key(seed), draw), count)


def initial_loss_scale(loss_scaling: bool) -> tuple:
    """(scale, finite steps in a row): GradScaler's starting scale with float16 compute, else 1 (no scaling)."""
    return jnp.float32(LOSS_SCALE_INIT if loss_scaling else 1.0), jnp.int32(0)


def next_loss_scale(loss_scale: tuple, finite) -> tuple:
    """GradScaler's update: halve the scale after a step whose gradients overflowed, double it after
    `LOSS_SCALE_GROWTH_INTERVAL` finite steps in a row."""
    scale, good_steps = loss_scale
    grown = good_steps + 1 == LOSS_SCALE_GROWTH_INTERVAL
    scale = jnp.where(finite, jnp.where(grown, scale * 2, scale), scale / 2)
    return scale, jnp.where(finite & ~grown, good_steps + 1, 0)


def accumulate_gradients(loss, params, micro_batches, keys, scale=None) -> tuple:
    """(gradients, losses [steps]): the gradients of the mean loss over micro-batches, summed one micro-batch at a time
    as nanoGPT's repeated backward of `loss / steps` sums them (times `scale`, a loss scale, when given).
    `micro_batches` is a tree of arrays whose leading axis is the micro-step; `keys` holds one random key per
    micro-step; `loss(params, micro_batch, key)` is a scalar."""
    steps = keys.shape[0]

    def micro(grads, inputs):
        batch, key = inputs

        def scaled_loss(p):
            value = loss(p, batch, key)
            scaled = value / steps
            return (scaled if scale is None else scaled * scale), value

        (_, value), g = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        return jax.tree.map(jnp.add, grads, g), value

    grads0 = jax.tree.map(jnp.zeros_like, params)
    return jax.lax.scan(micro, grads0, (micro_batches, keys))


def clip_by_global_norm(grads, max_norm: float) -> tuple:
    """(gradients, their global norm before clipping), scaled by min(1, max_norm / (norm + 1e-6)) as PyTorch's
    `clip_grad_norm_` does; `max_norm` 0 leaves them as they are."""
    norm = optax.tree.norm(grads)
    if max_norm != 0.0:
        clip = jnp.minimum(1.0, max_norm / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * clip, grads)
    return grads, norm


def apply_optimizer(optimizer: optax.GradientTransformation, grads, opt_state, params, learning_rate=None) -> tuple:
    """(params, opt_state) after `optimizer`'s update. `learning_rate` sets this step's rate of an optimizer made with
    `optax.inject_hyperparams` (the host computes the schedule, as upstream does); None keeps the optimizer's own."""
    if learning_rate is not None:
        opt_state.hyperparams["learning_rate"] = learning_rate
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@dataclasses.dataclass(frozen=True)
class GradientStep:
    """loss -> gradients accumulated over micro-batches -> clipped -> the optimizer's update, inside a jitted step.

    `loss(params, micro_batch, key)` is the family's objective on one micro-batch. With `compute_dtype`, it sees the
    weights cast to that dtype inside the differentiated function, so the forward and backward pass run in it while
    the gradients, the optimizer and the weights stay float32. With `loss_scaling` (float16 compute) the loss is
    scaled by `loss_scale`, the gradients unscaled before clipping, and a step whose gradients overflowed changes
    nothing but the scale."""

    loss: Callable
    optimizer: optax.GradientTransformation
    max_grad_norm: float = 0.0
    loss_scaling: bool = False
    compute_dtype: Any = None

    def __call__(self, params, opt_state, micro_batches, keys, learning_rate=None, loss_scale=None) -> tuple:
        """(params, opt_state, loss_scale, {"losses": [steps], "grad_norm": before clipping})."""
        scale = None if loss_scale is None else loss_scale[0]
        grads, losses = accumulate_gradients(self._loss, params, micro_batches, keys, scale)
        if self.loss_scaling:
            grads = jax.tree.map(lambda g: g / scale, grads)
        grads, norm = clip_by_global_norm(grads, self.max_grad_norm)
        new_params, new_opt_state = apply_optimizer(self.optimizer, grads, opt_state, params, learning_rate)
        if self.loss_scaling:  # GradScaler skips a step with inf/nan gradients
            finite = jnp.isfinite(norm)
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
            new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
            loss_scale = next_loss_scale(loss_scale, finite)
        return new_params, new_opt_state, loss_scale, {"losses": losses, "grad_norm": norm}

    def _loss(self, params, batch, key):
        if self.compute_dtype is not None:
            params = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
        return self.loss(params, batch, key)


def jit_train_step(step: Callable, step_runtime: runtime.Runtime, *, state_shardings=None, donate_argnums=0):
    """`step(state, ...) -> (state, outputs)` jitted under `step_runtime` (its XLA options, and the decisions the
    layers read while it is traced): the one place each family's training step meets the runtime policy. The state
    (`donate_argnums`) is donated; with `state_shardings` the new state keeps them, so the next call reuses this
    compilation."""
    out_shardings = {} if state_shardings is None else {"out_shardings": (state_shardings, None)}
    return runtime.jit_training_step(step, step_runtime, donate_argnums=donate_argnums, **out_shardings)
