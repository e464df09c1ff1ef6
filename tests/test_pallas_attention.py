"""`attention=splash` (Pallas's splash-attention kernel, run here by Pallas's interpreter) against `attention=xla`:
the same values and gradients for each family's attention.

Float32 throughout, tolerance 1e-5: the kernel adds the softmax's terms block by block, rescaling as its running
maximum grows, and scales the queries before their product with the keys, where XLA scales the scores; each reorders
float32 roundings (2^-24 relative) over sums of at most a few hundred terms (1e-6 seen), not the math."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxport import runtime
from jaxport.nn import dot_product_attention

TOLERANCE = 1e-5
rng = np.random.default_rng(0)


def runtime_with(attention: str) -> runtime.Runtime:
    return runtime.Runtime(platform="cpu", attention=attention, row_major_operands=False, split_rows=False)


def normal(*shape) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def output_and_gradients(attention: str, q, k, v, **options):
    """The attention's output and the gradients of a weighted sum of it with respect to q, k and v."""
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

    def both(q, k, v):  # one program: the interpreter's kernels are slow to compile
        out, backward = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, **options), q, k, v)
        return out, backward(weights)

    return runtime.jit(both, runtime_with(attention))(q, k, v)


def assert_as_xla(q, k, v, **options):
    kernel, xla = output_and_gradients("splash", q, k, v, **options), output_and_gradients("xla", q, k, v, **options)
    for name, a, b in zip(("output", "dq", "dk", "dv"), jax.tree.leaves(kernel), jax.tree.leaves(xla)):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE, err_msg=name)


def uses_the_kernel(q, k, v, **options) -> bool:
    with runtime.use(runtime_with("splash")):
        jaxpr = jax.make_jaxpr(lambda q, k, v: dot_product_attention(q, k, v, **options))(q, k, v)
    return "pallas_call" in str(jaxpr)


@pytest.mark.slow
def test_gpt_causal_self_attention():
    """nanoGPT's attention without dropout: causal, as many keys as queries (a block multiple)."""
    q, k, v = (normal(1, 128, 2, 32) for _ in range(3))
    assert uses_the_kernel(q, k, v, causal=True)
    assert_as_xla(q, k, v, causal=True)


@pytest.mark.slow
def test_dream_bidirectional_with_key_padding_and_grouped_kv_heads():
    """Dream's attention: 2 query heads on 1 KV head kept heads first, a key-padding mask (a row with no key at
    all gives zeros, as SDPA does), 96 positions padded to the kernel's 128."""
    q = normal(2, 96, 2, 32)
    k, v = normal(2, 1, 96, 32), normal(2, 1, 96, 32)
    mask = jnp.asarray(rng.random((2, 96)) < 0.7).at[1].set(False)
    assert uses_the_kernel(q, k, v, mask=mask, kv_heads_first=True)
    assert_as_xla(q, k, v, mask=mask, kv_heads_first=True)


@pytest.mark.slow
def test_trm_short_sequence_padded_and_masked():
    """TRM's attention: bidirectional, no mask, a short sequence (Sudoku's 81 cells and 16 puzzle positions) that
    the kernel reads padded to 128, the padded keys masked."""
    q, k, v = (normal(1, 97, 2, 32) for _ in range(3))
    assert uses_the_kernel(q, k, v)
    assert_as_xla(q, k, v)


@pytest.mark.slow
def test_fewer_queries_than_keys_forward():
    """Dream's fast decoding: a window of queries attending the whole canvas."""
    q, k, v = normal(1, 32, 2, 32), normal(1, 2, 160, 32), normal(1, 2, 160, 32)
    mask = jnp.asarray(rng.random((1, 160)) < 0.8)
    attend = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, kv_heads_first=True)  # noqa: E731
    kernel, xla = (runtime.jit(attend, runtime_with(name))(q, k, v) for name in ("splash", "xla"))
    np.testing.assert_allclose(kernel, xla, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True, "dropout_rate": 0.1, "dropout_rng": jax.random.key(0)},  # the kernel has no dropout
        {"mask": jnp.ones((2, 128, 128), bool)},  # a mask per query: not key padding
        {"causal": True, "mask": jnp.ones((2, 128), bool)},  # a causal row may have no key: XLA gives it zeros
    ],
    ids=["dropout", "mask-per-query", "causal-with-padding"],
)
def test_what_the_kernel_cannot_do_stays_with_xla(options):
    q = normal(2, 128, 2, 32)
    assert not uses_the_kernel(q, q, q, **options)
