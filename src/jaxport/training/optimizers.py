"""Optimizers TRM trains with: Adam-atan2 for the dense weights, sign-SGD for the sparse
puzzle-embedding table.

Adam-atan2 (Everett et al. 2024) replaces Adam's `m / (sqrt(v) + eps)` by
`a * atan2(m, b * sqrt(v))`, which needs no epsilon. Optax has no such transform, so it is
written here; weight decay is decoupled (`p *= 1 - lr * wd` before the step), as in the
PyTorch packages upstream uses.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByAdamAtan2State(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_adam_atan2(
    b1: float = 0.9, b2: float = 0.95, a: float = 1.0, b: float = 1.0
) -> optax.GradientTransformation:
    """`a * atan2(m_hat, b * sqrt(v_hat))` with bias-corrected first and second moments."""

    def init_fn(params):
        zeros = lambda p: jnp.zeros_like(p, dtype=jnp.float32)  # noqa: E731
        return ScaleByAdamAtan2State(
            count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params)
        )

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        t = count.astype(jnp.float32)
        correct1 = 1.0 - b1**t
        correct2 = 1.0 - b2**t
        mu = jax.tree.map(lambda m, g: m + (1.0 - b1) * (g.astype(jnp.float32) - m), state.mu, updates)
        nu = jax.tree.map(lambda v, g: v + (1.0 - b2) * (jnp.square(g.astype(jnp.float32)) - v), state.nu, updates)
        new_updates = jax.tree.map(
            lambda m, v, g: (a * jnp.arctan2(m / correct1, b * jnp.sqrt(v / correct2))).astype(g.dtype), mu, nu, updates
        )
        return new_updates, ScaleByAdamAtan2State(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def adam_atan2(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    weight_decay: float = 0.0,
    a: float = 1.0,
    b: float = 1.0,
) -> optax.GradientTransformation:
    """Adam-atan2 with decoupled weight decay: `p <- p * (1 - lr * wd) - lr * a * atan2(...)`.

    `learning_rate` is a scalar or an optax schedule of the 0-based update count (see
    `schedules.warmup_cosine_schedule`); wrap with `optax.inject_hyperparams` to set the
    rate from Python each step as upstream does. Upstream's defaults: a = b = 1,
    betas (0.9, 0.95).
    """
    return optax.chain(
        scale_by_adam_atan2(b1=b1, b2=b2, a=a, b=b),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def sparse_sign_sgd_update(weights_ND: jax.Array, ids_B: jax.Array, grads_BD: jax.Array, lr, weight_decay) -> jax.Array:
    """Sign-SGD on the rows of an embedding table that a batch used.

    Rows whose id occurs in `ids_B` become `w * (1 - lr * wd) - lr * sign(g)`, with `g` the
    sum of the gradients of every batch row holding that id; all other rows are untouched
    (no decay). Shapes are fixed, so it jits; `ids_B`/`grads_BD` are the global batch (under
    a data-parallel mesh this is upstream's all-gather across ranks).
    """
    weights_ND, ids_B = jnp.asarray(weights_ND), jnp.asarray(ids_B)
    # Each row points at the first row holding its id; summing per first row merges duplicates
    # (exact float adds, unlike a matmul on reduced-precision hardware).
    first_B = jnp.argmax(ids_B[:, None] == ids_B[None, :], axis=1)
    summed_BD = jax.ops.segment_sum(grads_BD.astype(jnp.float32), first_B, num_segments=ids_B.shape[0])[first_B]
    rows_BD = weights_ND[ids_B].astype(jnp.float32)
    new_rows_BD = rows_BD * (1.0 - lr * weight_decay) - lr * jnp.sign(summed_BD)
    return weights_ND.at[ids_B].set(new_rows_BD.astype(weights_ND.dtype))


def moment_shardings(optimizer: optax.GradientTransformation, opt_state, param_shardings, mesh):
    """Shardings for `optimizer`'s state: every per-parameter leaf (moments) as its parameter, the rest (counts,
    hyperparameters) replicated over `mesh`."""
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, opt_state, param_shardings, transform_non_params=lambda _: replicated
    )
