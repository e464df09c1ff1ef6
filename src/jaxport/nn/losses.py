"""Cross-entropy pieces shared by the families' losses."""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def label_entries(x_NV: jax.Array, labels_N: jax.Array) -> jax.Array:
    """`x[..., label]`: each row's entry at its label (labels in range; callers map ignored labels to 0 first).

    The forward is the gather `take_along_axis` does; the gradient is a select against the labels, the same
    values as the gather's own gradient, which is a scatter into a zero array of x's shape: on a GPU a pass
    that writes the whole float32 `[batch, time, vocab]` array (GPT-2 at batch 8 × 1024: 1.6 GB) and another
    that reads it back, where the select fuses into the softmax's backward (docs/performance.md, "On an
    accelerator")."""
    return jnp.take_along_axis(x_NV, labels_N[..., None], axis=-1)[..., 0]


def _label_entries_fwd(x_NV, labels_N):
    return label_entries(x_NV, labels_N), (labels_N, x_NV.shape[-1])


def _label_entries_bwd(residuals, g_N):
    labels_N, vocab = residuals
    at_label_NV = jnp.arange(vocab, dtype=labels_N.dtype) == labels_N[..., None]
    return jnp.where(at_label_NV, g_N[..., None], jnp.zeros((), g_N.dtype)), None


label_entries.defvjp(_label_entries_fwd, _label_entries_bwd)


def softmax_cross_entropy(logits_NV: jax.Array, labels_N: jax.Array) -> jax.Array:
    """`optax.softmax_cross_entropy_with_integer_labels` with `label_entries` for its gather (same values)."""
    return jax.nn.logsumexp(logits_NV, axis=-1) - label_entries(logits_NV, labels_N)
