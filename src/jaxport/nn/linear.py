"""Linear and embedding layers that keep float32 parameters and cast at use.

Weights are stored in PyTorch's layout (`[out, in]` for linear layers) so that
checkpoint names and shapes map one-to-one onto the upstream state dicts.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxport.nn.initializers import truncated_normal


class Linear(nnx.Module):
    """`y = x @ W.T + b` with `W: [out, in]` cast to the input dtype (upstream's CastedLinear)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, rngs: nnx.Rngs,
                 init_std: float | None = None, param_dtype=jnp.float32):
        std = 1.0 / math.sqrt(in_features) if init_std is None else init_std
        self.in_features, self.out_features = in_features, out_features
        self.weight = nnx.Param(truncated_normal(std)(rngs.params(), (out_features, in_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        # Contract on 2-D operands: for [B, S, D] inputs XLA:CPU otherwise emits slow
        # transposes in the weight gradient.
        x_2d = x.reshape(-1, self.in_features)
        y_2d = jax.lax.dot_general(x_2d, self.weight[...].astype(x.dtype), (((1,), (1,)), ((), ())))
        if self.bias is not None:
            y_2d = y_2d + self.bias[...].astype(x.dtype)
        return y_2d.reshape(*x.shape[:-1], self.out_features)


class Embedding(nnx.Module):
    """Token embedding table `[num, dim]`, looked up and cast to `dtype` (upstream's CastedEmbedding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        self.dtype = dtype
        self.embedding_weight = nnx.Param(
            truncated_normal(init_std)(rngs.params(), (num_embeddings, embedding_dim), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding_weight[...].astype(self.dtype), ids, axis=0)
