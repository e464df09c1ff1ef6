"""Learning-rate schedules the upstream trainers compute on the host, written once each; Dream's is optax's.

Upstream TRM (pretrain.py) recomputes the rate in Python before every optimizer step, after
incrementing the step counter, so optimizer update `n` (0-based) runs with the rate of step `n + 1`;
nanoGPT (train.py's `get_lr`) computes the rate of iteration `it` before it. These float64 Python
functions are the reference: a step takes their value as a float32 scalar (its `hyper`), so the
rates keep upstream's last bits. `warmup_cosine_schedule` is TRM's curve as an optax schedule for
use inside jit.
"""

import math

import jax.numpy as jnp


def cosine_schedule_with_warmup_lr_lambda(
    current_step: int,
    *,
    base_lr: float,
    num_warmup_steps: int,
    num_training_steps: int,
    min_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    """Linear warmup from 0 to `base_lr`, then a cosine down to `min_ratio * base_lr`."""
    if current_step < num_warmup_steps:
        return base_lr * float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return base_lr * (min_ratio + max(0.0, (1 - min_ratio) * cosine))


def compute_lr(base_lr: float, *, step: int, total_steps: int, lr_warmup_steps: float, lr_min_ratio: float) -> float:
    """Upstream `compute_lr(base_lr, config, train_state)`: the rate used at `step` (1-based:
    the first optimizer step has step=1)."""
    return cosine_schedule_with_warmup_lr_lambda(
        step,
        base_lr=base_lr,
        num_warmup_steps=round(lr_warmup_steps),
        num_training_steps=total_steps,
        min_ratio=lr_min_ratio,
    )


def nanogpt_lr(it: int, *, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """nanoGPT's `get_lr`: linear warmup, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def warmup_cosine_schedule(
    base_lr: float, *, num_warmup_steps: int, num_training_steps: int, min_ratio: float = 0.0, num_cycles: float = 0.5
):
    """The same curve as an optax schedule of the 0-based update count: update `count` uses
    upstream's rate for step `count + 1`."""
    warmup = max(1, num_warmup_steps)
    span = max(1, num_training_steps - num_warmup_steps)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        warm = base_lr * step / warmup
        progress = (step - num_warmup_steps) / span
        cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * num_cycles * 2.0 * progress))
        decay = base_lr * (min_ratio + jnp.maximum(0.0, (1 - min_ratio) * cosine))
        return jnp.where(step < num_warmup_steps, warm, decay)

    return schedule
