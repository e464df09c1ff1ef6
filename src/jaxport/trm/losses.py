"""ACT loss head: stablemax/softmax cross-entropy, halting BCE, and upstream's metrics."""

import jax
import jax.numpy as jnp
import optax

from jaxport import nn

IGNORE_LABEL_ID = -100


def log_stablemax(x: jax.Array, axis: int = -1) -> jax.Array:
    """log of s(x) / sum s(x) with s(x) = x + 1 for x >= 0 and 1 / (1 - x) below."""
    # Feed the 1/(1-x) branch only negative x: evaluated at x ~ 1 its float32 gradient overflows,
    # and jnp.where turns that unused inf into a NaN gradient (upstream escapes this in float64).
    x_neg = jnp.where(x < 0, x, 0.0)
    s_x = jnp.where(x < 0, 1 / (1 - x_neg + 1e-30), x + 1)
    return jnp.log(s_x / jnp.sum(s_x, axis=axis, keepdims=True))


def stablemax_cross_entropy(logits, labels, valid_mask):
    # Upstream runs this in float64; float32 stays within the recorded tolerances.
    logprobs = log_stablemax(logits.astype(jnp.float32))
    picked = nn.label_entries(logprobs, jnp.where(valid_mask, labels, 0))
    return -jnp.where(valid_mask, picked, 0)


def softmax_cross_entropy(logits, labels, valid_mask):
    losses = nn.softmax_cross_entropy(logits.astype(jnp.float32), jnp.where(valid_mask, labels, 0))
    return jnp.where(valid_mask, losses, 0)


LOSS_FUNCTIONS = {"stablemax_cross_entropy": stablemax_cross_entropy, "softmax_cross_entropy": softmax_cross_entropy}


def act_loss_and_metrics(carry, outputs: dict, loss_type: str):
    """Loss summed over every row (halted or not); metrics summed over halted rows that have labels.

    Returns (loss, metrics, outputs) with `preds` added to outputs.
    """
    labels = carry.current_data["labels"]
    logits = outputs["logits"]
    q_halt = outputs["q_halt_logits"]
    preds = jnp.argmax(logits, axis=-1)
    mask = labels != IGNORE_LABEL_ID
    loss_counts = mask.sum(-1)
    loss_divisor = jnp.maximum(loss_counts, 1)[:, None]
    is_correct = mask & (preds == labels)
    seq_is_correct = is_correct.sum(-1) == loss_counts
    valid = carry.halted & (loss_counts > 0)
    metrics = {
        "count": valid.sum(),
        "accuracy": jnp.where(valid, (is_correct.astype(jnp.float32) / loss_divisor).sum(-1), 0).sum(),
        "exact_accuracy": (valid & seq_is_correct).sum(),
        "q_halt_accuracy": (valid & ((q_halt >= 0) == seq_is_correct)).sum(),
        "steps": jnp.where(valid, carry.steps, 0).sum(),
    }
    metrics = jax.lax.stop_gradient(metrics)
    lm_loss = (LOSS_FUNCTIONS[loss_type](logits, labels, mask) / loss_divisor).sum()
    q_halt_loss = optax.sigmoid_binary_cross_entropy(q_halt, seq_is_correct.astype(q_halt.dtype)).sum()
    metrics["lm_loss"] = jax.lax.stop_gradient(lm_loss)
    metrics["q_halt_loss"] = jax.lax.stop_gradient(q_halt_loss)
    q_continue_loss = 0.0
    if "target_q_continue" in outputs:
        q_continue_loss = optax.sigmoid_binary_cross_entropy(
            outputs["q_continue_logits"], outputs["target_q_continue"]
        ).sum()
        metrics["q_continue_loss"] = jax.lax.stop_gradient(q_continue_loss)
    loss = lm_loss + 0.5 * (q_halt_loss + q_continue_loss)
    outputs = {**jax.lax.stop_gradient(outputs), "preds": preds}
    return loss, metrics, outputs
