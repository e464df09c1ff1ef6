"""The pieces of a training step that the families share: gradients accumulated over micro-batches in one scan,
which weights decay, PyTorch's global-norm clip and float16 loss scaling as PyTorch's GradScaler does it.

A family brings its objective, its optimizer and its state, and jits its step `step(state, batch, hyper) ->
(state, metrics)` at one place under the runtime policy (`jaxport.runtime.jit_training_step`); the loop that
runs it is `jaxport.training.loop.fit`:

    def objective(params, micro_batch, key):             # (value differentiated, what the step reports)
        loss = family_loss(params, micro_batch, key)
        return loss / steps, loss
    grads, losses = accumulate_gradients(objective, params, micro_batches, keys)
    params, opt_state, loss_scale, norm = apply_gradients(optimizer, grads, opt_state, params, lr=hyper.lr,
                                                          grad_clip=max_norm, loss_scale=loss_scale)
"""

import jax
import jax.numpy as jnp
import optax

# torch.amp.GradScaler's defaults
LOSS_SCALE_INIT, LOSS_SCALE_GROWTH_INTERVAL = 2.0**16, 2000


def decay_mask(params):
    """Which weights decay: matrices and embedding tables, not biases or norm scales (nanoGPT's two AdamW groups)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def accumulate_gradients(objective, params, micro_batches, keys) -> tuple:
    """(gradients summed over the micro-batches, the objective's reports stacked [steps, ...]).

    `objective(params, micro_batch, key)` returns (the value to differentiate, what to report); `micro_batches` is a
    tree of arrays whose leading axis is the micro-step, `keys` one random key per micro-step. One micro-batch's
    activations live at a time: the scan sums its gradients into the carry."""

    def micro(grads, inputs):
        batch, key = inputs
        (_, report), g = jax.value_and_grad(objective, has_aux=True)(params, batch, key)
        return jax.tree.map(jnp.add, grads, g), report

    return jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), (micro_batches, keys))


def clip_by_global_norm(grads, max_norm: float) -> tuple:
    """(gradients, their global norm before clipping), scaled by min(1, max_norm / (norm + 1e-6)) as PyTorch's
    `clip_grad_norm_` does; `max_norm` 0 leaves them as they are."""
    norm = optax.tree.norm(grads)
    if max_norm != 0.0:
        clip = jnp.minimum(1.0, max_norm / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * clip, grads)
    return grads, norm


def apply_gradients(optimizer, grads, opt_state, params, *, lr, grad_clip: float, loss_scale=None) -> tuple:
    """(params, opt_state, loss_scale, gradient norm before clipping) after one optimizer update.

    The gradients are unscaled by `loss_scale` (scale, finite steps in a row: float16's GradScaler; None: no
    scaling), clipped (`clip_by_global_norm`, 0: off) and applied with the learning rate `lr` (an
    `optax.inject_hyperparams` optimizer's); with `loss_scale` a step whose gradients overflowed leaves the
    parameters and moments as they were and the scale is updated."""
    if loss_scale is not None:
        grads = jax.tree.map(lambda g: g / loss_scale[0], grads)
    grads, norm = clip_by_global_norm(grads, grad_clip)
    opt_state.hyperparams["learning_rate"] = lr
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if loss_scale is not None:  # GradScaler: skip steps with inf/nan gradients, halve or grow the scale
        finite = jnp.isfinite(norm)
        new_params = skip_unless_finite(finite, new_params, params)
        new_opt_state = skip_unless_finite(finite, new_opt_state, opt_state)
        loss_scale = next_loss_scale(loss_scale, finite)
    return new_params, new_opt_state, loss_scale, norm


def initial_loss_scale(loss_scaling: bool) -> tuple:
    """(scale, finite steps in a row): GradScaler's starting scale with float16 compute, else 1 (no scaling)."""
    return jnp.float32(LOSS_SCALE_INIT if loss_scaling else 1.0), jnp.int32(0)


def skip_unless_finite(finite, new, old):
    """`new` where the step's gradients were finite, else `old`: GradScaler skips a step that overflowed."""
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)


def next_loss_scale(loss_scale: tuple, finite) -> tuple:
    """GradScaler's update: halve the scale after a step whose gradients overflowed, double it after
    `LOSS_SCALE_GROWTH_INTERVAL` finite steps in a row."""
    scale, good_steps = loss_scale
    grown = good_steps + 1 == LOSS_SCALE_GROWTH_INTERVAL
    scale = jnp.where(finite, jnp.where(grown, scale * 2, scale), scale / 2)
    return scale, jnp.where(finite & ~grown, good_steps + 1, 0)
