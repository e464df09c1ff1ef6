"""Feed-forward activations and the gated SiLU feed-forward (SwiGLU)."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxport.nn.linear import Linear


def find_multiple(a: int, b: int) -> int:
    return -(a // -b) * b


def swiglu_intermediate_size(hidden_size: int, expansion: float) -> int:
    """TRM/HRM rounding: 2/3 of `expansion * hidden`, Python-rounded, up to a multiple of 256."""
    return find_multiple(round(expansion * hidden_size * 2 / 3), 256)


def silu(x: jax.Array) -> jax.Array:
    """`x * sigmoid(x)` computed in float32 and rounded once to `x`'s dtype, forward and backward, as PyTorch's
    bfloat16/float16 kernels do. Applied to bfloat16 directly, XLA rounds after each of its steps, and the fusion
    runs slower (docs/performance.md, "Activations in float32")."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU as PyTorch's `nn.GELU()` computes it, `x/2 * (1 + erf(x/sqrt(2)))`, in float32 and rounded once
    to `x`'s dtype. `jax.nn.gelu(approximate=False)` goes through `erfc`, whose XLA:CPU expansion (two branches,
    each with an `exp`) is the slower one (docs/performance.md, "Activations in float32")."""
    x32 = x.astype(jnp.float32)
    return (0.5 * x32 * (1 + jax.lax.erf(x32 * (1 / math.sqrt(2))))).astype(x.dtype)


class SwiGLU(nnx.Module):
    """`down(silu(gate(x)) * up(x))`, no biases.

    `fused=True` keeps TRM's single `gate_up_proj` whose output is `[gate | up]`;
    `fused=False` gives Qwen2/Dream's `gate_proj`, `up_proj`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, fused: bool = True, rngs: nnx.Rngs):
        self.fused = fused
        if fused:
            self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, rngs=rngs)
        else:
            self.gate_proj = Linear(hidden_size, intermediate_size, bias=False, rngs=rngs)
            self.up_proj = Linear(hidden_size, intermediate_size, bias=False, rngs=rngs)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, axis: int = -1) -> jax.Array:
        """Applied to `x`'s last axis, or with `axis=0` to its leading one (see `Linear`)."""
        if self.fused:  # each half rounded to x's dtype on its own, inside the fusion that uses it
            gate_up = self.gate_up_proj(x, rounded=False, axis=axis)
            gate, up = (h.astype(x.dtype) for h in jax.numpy.split(gate_up, 2, axis=axis))
        else:
            gate, up = self.gate_proj(x, axis=axis), self.up_proj(x, axis=axis)
        return self.down_proj(silu(gate) * up, axis=axis)
