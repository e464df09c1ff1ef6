"""Linear and embedding layers that keep float32 parameters and cast at use.

Weights are stored in PyTorch's layout (`[out, in]` for linear layers) so that
checkpoint names and shapes map one-to-one onto the upstream state dicts.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxport import runtime
from jaxport.nn.initializers import truncated_normal

_CONTRACT_IN = (((1,), (1,)), ((), ()))


@jax.custom_vjp
def matmul_t_f32(x_2d: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` for `x: [N, in]`, `w: [out, in]` of one dtype, accumulated and returned in float32, for the caller
    to round once to that dtype, as PyTorch's reduced-precision GEMMs do. The backward pass keeps the same
    contract (low-precision operands, float32 accumulation) where autodiff would produce mixed float32 x bfloat16
    products, which XLA:CPU widens (docs/performance.md, "Operand layouts")."""
    return jax.lax.dot_general(x_2d, w, _CONTRACT_IN, preferred_element_type=jnp.float32)


def _matmul_t_fwd(x_2d, w):
    return matmul_t_f32(x_2d, w), (x_2d, w)


def _matmul_t_bwd(residuals, g_2d):
    x_2d, w = residuals
    g_2d = g_2d.astype(x_2d.dtype)
    dx = jax.lax.dot_general(g_2d, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(x_2d.dtype), _weight_gradient(x_2d, g_2d).astype(w.dtype)


def _weight_gradient(x_2d, g_2d):
    """`g^T x`, `[out, in]`, contracted over the rows, accumulated in float32: one product over the rows, or, where
    the runtime asks for row-major operands (XLA:CPU, docs/performance.md, "Operand layouts"), the orientation with
    the wider operand's dimension last (a result `[in, out]` transposed behind a barrier, which keeps XLA's
    simplifier from folding the transpose back into the product) and, in reduced precision, the narrower operand
    first copied transposed and row-major, so that the product runs in that precision as `[narrow, rows] x [rows,
    wide]` instead of being widened to float32. The sums run in another order (float rounding)."""
    if not runtime.current().row_major_operands:
        return jax.lax.dot_general(g_2d, x_2d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    def product(a_2d, b_2d):  # a^T b over the rows
        if a_2d.dtype == jnp.float32:
            return jax.lax.dot_general(a_2d, b_2d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        nn = (((1,), (0,)), ((), ()))
        return jax.lax.dot_general(row_major_transpose(a_2d), b_2d, nn, preferred_element_type=jnp.float32)

    if g_2d.shape[1] <= x_2d.shape[1]:
        return product(g_2d, x_2d)
    return jax.lax.optimization_barrier(product(x_2d, g_2d)).T


def row_major(a):
    """`a` as a row-major array where the runtime asks for row-major operands (XLA:CPU, which widens a
    reduced-precision product of permuted operands to float32: see `_weight_gradient`). XLA gives a transpose a
    permuted layout (a relabelling of the same memory) and carries it through elementwise ops and barriers;
    flattened behind a barrier, a transposed array must be written out. Elsewhere `a` stays as it is, free to fuse."""
    if not runtime.current().row_major_operands:
        return a
    return jax.lax.optimization_barrier(a.reshape(-1)).reshape(a.shape)


def row_major_transpose(a):
    """`a` with its last two dimensions swapped, as a row-major copy."""
    return row_major(jnp.swapaxes(a, -1, -2))


matmul_t_f32.defvjp(_matmul_t_fwd, _matmul_t_bwd)


@jax.custom_vjp
def matmul_f32(w: jax.Array, x_2d: jax.Array) -> jax.Array:
    """`w @ x` for `w: [out, in]`, `x: [in, N]` (features in the columns), with `matmul_t_f32`'s contract: one
    dtype in, float32 accumulation and result, and the same contract in the backward pass."""
    return jax.lax.dot_general(w, x_2d, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _matmul_fwd(w, x_2d):
    return matmul_f32(w, x_2d), (w, x_2d)


def _matmul_bwd(residuals, g_2d):
    w, x_2d = residuals
    g_2d = g_2d.astype(x_2d.dtype)
    # w^T g from a row-major copy of the (small) weight: a product contracting both operands' leading dimension
    # is one that XLA:CPU widens to float32 in bfloat16 (see `_weight_gradient`); g x^T contracts both last ones.
    dx = jax.lax.dot_general(row_major_transpose(w), g_2d, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    dw = jax.lax.dot_general(g_2d, x_2d, _CONTRACT_IN, preferred_element_type=jnp.float32)
    return dw.astype(w.dtype), dx.astype(x_2d.dtype)


matmul_f32.defvjp(_matmul_fwd, _matmul_bwd)


class Linear(nnx.Module):
    """`y = x @ W.T + b` with `W: [out, in]` cast to the input dtype (upstream's CastedLinear)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        rngs: nnx.Rngs,
        init_std: float | None = None,
        param_dtype=jnp.float32,
    ):
        std = 1.0 / math.sqrt(in_features) if init_std is None else init_std
        self.in_features, self.out_features = in_features, out_features
        self.weight = nnx.Param(truncated_normal(std)(rngs.params(), (out_features, in_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None

    def __call__(self, x: jax.Array, rounded: bool = True, axis: int = -1) -> jax.Array:
        """The layer applied to `x`'s last axis, or with `axis=0` to its leading one (`W @ x`, for activations
        that keep the features first). `rounded=False` returns the float32 product (no bias) for a caller that
        rounds its pieces to `x.dtype` itself: XLA:CPU fuses a rounding into one consumer, not into two."""
        w = self.weight[...].astype(x.dtype)
        # Contract on 2-D operands: for [B, S, D] inputs XLA:CPU otherwise emits slow
        # transposes in the weight gradient.
        if axis == 0:
            y_2d = matmul_f32(w, x.reshape(self.in_features, -1))
            shape, bias_shape = (self.out_features, *x.shape[1:]), (self.out_features, 1)
        elif axis in (-1, x.ndim - 1):
            y_2d = matmul_t_f32(x.reshape(-1, self.in_features), w)
            shape, bias_shape = (*x.shape[:-1], self.out_features), (self.out_features,)
        else:
            raise ValueError(f"a linear layer applies to the first or last axis of its input, not axis {axis}")
        if rounded:
            y_2d = y_2d.astype(x.dtype)
            if self.bias is not None:
                y_2d = y_2d + self.bias[...].astype(x.dtype).reshape(bias_shape)
        elif self.bias is not None:
            raise ValueError("rounded=False is for linear layers without a bias")
        return y_2d.reshape(shape)


@jax.custom_vjp
def add_positions(x_BTC: jax.Array, pos_TC: jax.Array) -> jax.Array:
    """`x + pos`, the position embedding broadcast over the batch. The position gradient is the batch sum of
    `x`'s gradient, computed as a product with ones: as a sum, XLA:CPU fused the whole chain that produces
    `x`'s gradient into it and ran that chain a second time, on one thread (docs/performance.md, "Position
    gradient"). The product adds the rows in another order (float rounding, not semantics)."""
    return x_BTC + pos_TC


def _add_positions_fwd(x_BTC, pos_TC):
    return add_positions(x_BTC, pos_TC), None


def _add_positions_bwd(_, g_BTC):
    B = g_BTC.shape[0]
    ones_B = jnp.ones((B,), g_BTC.dtype)
    pos_grad = jax.lax.dot_general(ones_B, g_BTC.reshape(B, -1), (((0,), (0,)), ((), ())))
    return g_BTC, pos_grad.reshape(g_BTC.shape[1:])


add_positions.defvjp(_add_positions_fwd, _add_positions_bwd)


class Embedding(nnx.Module):
    """Token embedding table `[num, dim]`, looked up and cast to `dtype` (upstream's CastedEmbedding)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_std: float,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        self.dtype = dtype
        self.embedding_weight = nnx.Param(
            truncated_normal(init_std)(rngs.params(), (num_embeddings, embedding_dim), param_dtype)
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding_weight[...].astype(self.dtype), ids, axis=0)
