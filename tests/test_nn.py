"""Shared layers against PyTorch's own operators."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx

from jaxport import runtime
from jaxport.nn import (
    Attention,
    Linear,
    RMSNorm,
    SwiGLU,
    add_positions,
    apply_rotary,
    dot_product_attention,
    dropout,
    label_entries,
    rms_norm,
    rotary_cos_sin,
    softmax_cross_entropy,
    swiglu_intermediate_size,
    truncated_normal,
)
from jaxport.nn.linear import matmul_f32, matmul_t_f32
from jaxport.nn.mlp import gelu, silu

rng = np.random.default_rng(0)
GPU = runtime.Runtime(platform="gpu", attention="cudnn", row_major_operands=False, split_rows=False)


def test_truncated_normal_has_the_requested_std_after_truncation():
    x = np.asarray(truncated_normal(0.5)(jax.random.key(0), (200_000,)))
    # Upstream truncates at +-2 standard deviations of the *untruncated* normal: 2 * 0.5 / 0.8796.
    assert abs(x.std() - 0.5) < 0.005 and 1.13 < np.abs(x).max() <= 2 * 0.5 / 0.87962566 + 1e-6
    assert not truncated_normal(0.0)(jax.random.key(0), (3,)).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_in_float32(dtype):
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    got = rms_norm(jnp.asarray(x, dtype), 1e-5)
    assert got.dtype == dtype
    t = torch.tensor(x).to(torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32).float()
    want = (t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-5)).numpy()
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    if dtype == jnp.bfloat16:
        return
    weighted = RMSNorm(16, eps=1e-5)
    weighted.weight[...] = jnp.arange(16.0)
    np.testing.assert_allclose(weighted(jnp.asarray(x)), want * np.arange(16.0), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_rotary_rotates_halves():
    B, S, H, D = 2, 7, 3, 8
    q = rng.normal(size=(B, S, H, D)).astype(np.float32)
    cos, sin = rotary_cos_sin(D, jnp.arange(S), 10000.0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    tq = torch.tensor(q)
    rot = torch.cat([-tq[..., D // 2 :], tq[..., : D // 2]], -1)
    want = tq * emb.cos()[:, None] + rot * emb.sin()[:, None]
    np.testing.assert_allclose(apply_rotary(jnp.asarray(q), cos, sin), want.numpy(), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_torch_sdpa_with_gqa_and_padding(causal):
    B, S, H, K, D = 2, 6, 4, 2, 8
    q, k, v = (rng.normal(size=(B, S, n, D)).astype(np.float32) for n in (H, K, K))
    keep = np.ones((B, S), bool)
    keep[0, :2] = False  # left padding in row 0
    got = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=causal, mask=jnp.asarray(keep))
    tq, tk, tv = (torch.tensor(a).transpose(1, 2) for a in (q, k, v))
    tk, tv = tk.repeat_interleave(H // K, 1), tv.repeat_interleave(H // K, 1)
    allowed = torch.tensor(keep)[:, None, None, :].expand(B, 1, S, S)
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=allowed).transpose(1, 2)
    fully_masked = ~allowed.any(-1)[:, 0]  # [B, S] query rows with no key
    want = torch.where(fully_masked[..., None, None], 0.0, want)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads_first", [False, True])
@pytest.mark.parametrize("mask_kind", ["keys", "queries_and_keys", "per_head"])
def test_masked_attention_and_its_gradients_match_torch(kv_heads_first, mask_kind):
    """Non-causal attention with each mask shape, grouped KV heads laid out either way: values and gradients as
    PyTorch computes the masked softmax, a query row with no allowed key giving zeros."""
    B, S, H, K, D = 2, 6, 4, 2, 8
    q, k, v, g = (rng.normal(size=(B, S, n, D)).astype(np.float32) for n in (H, K, K, H))
    keep = np.ones((B, S), bool)
    keep[0, :2] = False  # left padding in row 0
    mask = {
        "keys": keep,
        "queries_and_keys": keep[:, :, None] & keep[:, None, :],
        "per_head": rng.random((B, H, S, S)) < 0.6,
    }[mask_kind]
    if mask_kind == "per_head":
        mask[1, 2, 3] = False  # a query row of one head with no key
    allowed = np.broadcast_to({2: mask[:, None, None, :], 3: mask[:, None]}.get(mask.ndim, mask), (B, H, S, S))
    layout = (lambda a: a.transpose(0, 2, 1, 3)) if kv_heads_first else (lambda a: a)

    def attend(q, k, v):
        return dot_product_attention(q, layout(k), layout(v), mask=jnp.asarray(mask), kv_heads_first=kv_heads_first)

    out, vjp = jax.vjp(attend, *(jnp.asarray(a) for a in (q, k, v)))
    got = (out, *jax.jit(vjp)(jnp.asarray(g)))
    tq, tk, tv = (torch.tensor(a).transpose(1, 2).requires_grad_(True) for a in (q, k, v))
    t_allowed = torch.tensor(np.ascontiguousarray(allowed))
    scores = (tq @ tk.repeat_interleave(H // K, 1).transpose(-1, -2)) / D**0.5
    probs = torch.softmax(scores.masked_fill(~t_allowed, torch.finfo(torch.float32).min), -1)
    want_out = (probs * t_allowed.any(-1, keepdim=True)) @ tv.repeat_interleave(H // K, 1)
    want = (want_out, *torch.autograd.grad(want_out, (tq, tk, tv), torch.tensor(g).transpose(1, 2)))
    assert mask_kind == "keys" or not allowed.any(-1).all()  # some query row has no key
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(a), b.transpose(1, 2).detach().numpy(), atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unmasked_attention_and_its_gradients_match_torch_sdpa(dtype):
    """TRM's attention (no mask, no dropout, its own backward pass) against PyTorch's SDPA on the same
    rounded inputs, value and all three gradients: float32 to float32 rounding, bfloat16 to a few of its
    ulps (PyTorch rounds other intermediates to bfloat16 than jaxport does)."""
    B, S, H, D = 2, 9, 3, 8
    q, k, v, g = (jnp.asarray(rng.normal(size=(B, S, H, D)), dtype) for _ in range(4))
    out, vjp = jax.vjp(dot_product_attention, q, k, v)
    got = (out, *jax.jit(vjp)(g))
    tq, tk, tv, tg = (torch.tensor(np.asarray(a.astype(jnp.float32))).transpose(1, 2) for a in (q, k, v, g))
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    want_out = F.scaled_dot_product_attention(tq, tk, tv)
    want = (want_out, *torch.autograd.grad(want_out, (tq, tk, tv), tg))
    atol = 1e-5 if dtype == jnp.float32 else 0.05  # values up to ~3: a bfloat16 ulp is 2^-7 of them
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and a.shape == (B, S, H, D), name
        np.testing.assert_allclose(
            np.asarray(a.astype(jnp.float32)), b.transpose(1, 2).detach().numpy(), atol=atol, err_msg=name
        )


@pytest.mark.slow
def test_unmasked_bfloat16_attention_rounds_where_torch_s_cpu_kernel_does():
    """In bfloat16 on both sides, against the kernel SDPA runs on a CPU (flash attention): the output and `dQ`
    round where PyTorch's do, so they equal its bits on most values (measured with torch 2.13: 9% and 25%
    differ, by one ulp, where rounding the normalised probabilities and keeping `dS` in float32 gave 48% and
    42%); no value is further than one ulp of the largest."""
    B, H, S, D = 4, 8, 97, 64
    generator = torch.Generator().manual_seed(0)
    tq, tk, tv, tg = (torch.randn(B, H, S, D, generator=generator).bfloat16() for _ in range(4))
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    want_out = F.scaled_dot_product_attention(tq, tk, tv)
    want = (want_out, *torch.autograd.grad(want_out, (tq, tk, tv), tg))
    q, k, v, g = (jnp.asarray(t.detach().float().transpose(1, 2).numpy(), jnp.bfloat16) for t in (tq, tk, tv, tg))
    out, vjp = jax.vjp(dot_product_attention, q, k, v)
    got = (out, *jax.jit(vjp)(g))
    for name, a, b, most_differing in zip(("out", "dq", "dk", "dv"), got, want, (0.15, 0.35, 0.55, 0.5)):
        a, b = np.asarray(a.astype(jnp.float32)), b.detach().float().transpose(1, 2).numpy()
        assert (a != b).mean() <= most_differing, (name, (a != b).mean())
        np.testing.assert_allclose(a, b, rtol=0, atol=np.abs(b).max() * 2.0**-7, err_msg=name)


@pytest.mark.slow
def test_attention_dropout_drops_probabilities_with_inverted_scaling():
    """Values are one-hot per key, so the output rows are the (dropped) attention probabilities."""
    B, S, H, D = 1, 4, 2, 4
    q, k = (jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32) for _ in range(2))
    v = jnp.broadcast_to(jnp.eye(S, D)[None, :, None, :], (B, S, H, D))
    probs = dot_product_attention(q, k, v, causal=True)
    key = jax.random.key(3)
    dropped = dot_product_attention(q, k, v, causal=True, dropout_rate=0.5, dropout_rng=key)
    np.testing.assert_allclose(dropped, dropout(probs.transpose(0, 2, 1, 3), 0.5, key).transpose(0, 2, 1, 3), atol=1e-6)
    assert set(np.unique(np.round(np.asarray(dropped / probs.clip(1e-30)), 5))) <= {0.0, 2.0}
    assert (dropped == 0).sum() > (probs == 0).sum()  # some allowed keys were dropped
    np.testing.assert_array_equal(dot_product_attention(q, k, v, causal=True, dropout_rate=0.5), probs)  # no key: eval


@pytest.mark.slow
def test_dropout_rate_and_scale():
    x = jnp.ones((100_000,))
    y = np.asarray(dropout(x, 0.25, jax.random.key(0)))
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.01
    assert dropout(x, 0.25, None) is x and dropout(x, 0.0, jax.random.key(0)) is x


@pytest.mark.slow
def test_attention_module_fused_and_separate_projections_agree():
    fused = Attention(16, 4, num_kv_heads=2, qkv_bias=True, rngs=nnx.Rngs(0))
    split = Attention(16, 4, num_kv_heads=2, qkv_bias=True, fused_qkv=False, rngs=nnx.Rngs(1))
    w, b = fused.qkv_proj.weight[...], fused.qkv_proj.bias[...]
    for proj, rows in ((split.q_proj, slice(0, 16)), (split.k_proj, slice(16, 24)), (split.v_proj, slice(24, 32))):
        proj.weight[...], proj.bias[...] = w[rows], b[rows]
    split.o_proj.weight[...] = fused.o_proj.weight[...]
    x = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    np.testing.assert_allclose(fused(x), split(x), atol=1e-6)


@pytest.mark.slow
def test_swiglu_matches_torch_and_rounds_like_upstream():
    assert swiglu_intermediate_size(512, 4) == 1536
    assert swiglu_intermediate_size(64, 4) == 256
    assert swiglu_intermediate_size(26, 4) == 256
    mlp = SwiGLU(16, 32, rngs=nnx.Rngs(0))
    x = rng.normal(size=(3, 16)).astype(np.float32)
    gate_up = torch.tensor(x) @ torch.tensor(np.asarray(mlp.gate_up_proj.weight[...])).T
    gate, up = gate_up.chunk(2, -1)
    want = (F.silu(gate) * up) @ torch.tensor(np.asarray(mlp.down_proj.weight[...])).T
    np.testing.assert_allclose(mlp(jnp.asarray(x)), want.numpy(), atol=1e-5)
    np.testing.assert_allclose(mlp(jnp.asarray(x.T), axis=0), want.numpy().T, atol=1e-5)  # features first


def test_silu_in_bfloat16_is_torch_s_bit_for_bit():
    """PyTorch computes a bfloat16 silu in float32 and rounds once; rounding after every step instead
    differs on about a third of these values."""
    x = rng.normal(size=100_000).astype(np.float32) * 4
    got = silu(jnp.asarray(x, jnp.bfloat16))
    want = F.silu(torch.tensor(x).bfloat16())
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want.float().numpy())


@pytest.mark.slow
def test_gelu_is_torch_s_exact_gelu_forward_and_backward():
    """nanoGPT's `nn.GELU()`: the erf form in float32, and in bfloat16 computed in float32 and rounded once, as
    PyTorch's kernel does. Below x = -3, `1 + erf` cancels: PyTorch's kernel and this one each stay ~1e-6 from
    the float64 value there, not from each other's bits."""
    x = np.concatenate([rng.normal(size=20_000) * 3, np.linspace(-12, 12, 2001)]).astype(np.float32)
    got, vjp = jax.vjp(gelu, jnp.asarray(x))
    want = torch.tensor(x, requires_grad=True)
    y = F.gelu(want)
    y.backward(torch.ones_like(y))
    np.testing.assert_allclose(got, y.detach().numpy(), rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(vjp(jnp.ones_like(got))[0], want.grad.numpy(), rtol=1e-6, atol=2e-6)
    got16 = gelu(jnp.asarray(x, jnp.bfloat16))
    want16 = F.gelu(torch.tensor(x).bfloat16())
    assert got16.dtype == jnp.bfloat16
    got16, want16 = np.asarray(got16.astype(jnp.float32)), want16.float().numpy()
    head = x > -3  # in the cancelling tail the ~1e-6 float32 difference can round one bfloat16 ulp apart
    np.testing.assert_array_equal(got16[head], want16[head])
    np.testing.assert_allclose(got16, want16, rtol=2**-7, atol=2e-6)  # one bfloat16 ulp, or the float32 error


@pytest.mark.slow
def test_linear_keeps_float32_params_and_casts_at_use():
    layer = Linear(8, 4, bias=True, rngs=nnx.Rngs(0))
    y = layer(jnp.ones((2, 3, 8), jnp.bfloat16))
    assert layer.weight[...].dtype == jnp.float32 and y.dtype == jnp.bfloat16 and y.shape == (2, 3, 4)


def test_linear_applies_to_the_leading_axis_as_to_the_last_one():
    layer = Linear(8, 4, bias=True, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.arange(4.0)
    x_NMI = jnp.asarray(rng.normal(size=(5, 3, 8)), jnp.float32)
    y_IMN = layer(x_NMI.transpose(2, 1, 0), axis=0)
    assert y_IMN.shape == (4, 3, 5)
    np.testing.assert_allclose(y_IMN.transpose(2, 1, 0), layer(x_NMI), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="first or last axis of its input, not axis 1"):
        layer(x_NMI, axis=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("in_out", [(24, 80), (80, 24)])  # the narrower operand is the input, then the gradient
@pytest.mark.parametrize("features", ["last", "first"])
def test_linear_gradients_are_the_products_of_the_rounded_operands(dtype, in_out, features):
    """Input and weight gradients of `x @ W.T` for `x: [N, in]` (features last) and of `W @ x` for `x: [in, N]`
    (features first), `W: [out, in]`, against float64 products of the same (rounded) operands: float32
    accumulation, one rounding to the dtype at the end."""
    (n_in, n_out), rows = in_out, 300
    x, w, g = (jnp.asarray(rng.normal(size=s), dtype) for s in ((rows, n_in), (n_out, n_in), (rows, n_out)))
    if features == "first":
        x, g = x.T, g.T
    product = matmul_t_f32 if features == "last" else lambda x, w: matmul_f32(w, x)
    _, vjp = jax.vjp(lambda x, w: product(x, w).astype(dtype), x, w)
    dx, dw = jax.jit(vjp)(g)
    assert dx.shape == x.shape and dw.shape == w.shape and dx.dtype == dw.dtype == dtype
    x64, w64, g64 = (np.asarray(a).astype(np.float64) for a in (x, w, g))
    want_dw, want_dx = (g64.T @ x64, g64 @ w64) if features == "last" else (g64 @ x64.T, w64.T @ g64)
    # float32: sums of 300 unit products (about 17) to float32 rounding; bfloat16 keeps 8 significant bits
    rtol, atol = (1e-5, 1e-4) if dtype == jnp.float32 else (2.0**-8, 2.0**-8)
    np.testing.assert_allclose(np.asarray(dw).astype(np.float64), want_dw, rtol=rtol, atol=atol)
    np.testing.assert_allclose(np.asarray(dx).astype(np.float64), want_dx, rtol=rtol, atol=atol)


def test_add_positions_is_the_broadcast_add_with_its_gradients():
    """GPT's `x + pos`: the value and `x`'s gradient are the plain broadcast add's bit for bit; the position
    gradient, a product with ones over the batch, is its batch sum up to float rounding (another order)."""
    x, pos, g = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((12, 64, 128), (64, 128), (12, 64, 128)))

    def value_and_grads(add):
        out, vjp = jax.vjp(add, x, pos)
        return (out, *vjp(g))

    out, dx, dpos = jax.jit(lambda: value_and_grads(add_positions))()
    plain_out, plain_dx, plain_dpos = jax.jit(lambda: value_and_grads(lambda a, b: a + b))()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain_out))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(plain_dx))
    np.testing.assert_allclose(np.asarray(dpos), np.asarray(plain_dpos), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dpos), np.asarray(g).astype(np.float64).sum(0), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_causal_attention_in_blocks_equals_the_full_product(rate, monkeypatch):
    """GPT's causal self-attention skips fully masked key blocks; the result (dropout mask included) is the
    full [S, S] computation's bit for bit."""
    from jaxport.nn import attention

    q, k, v = (jnp.asarray(rng.normal(size=(2, 256, 3, 16)), jnp.float32) for _ in range(3))
    key = jax.random.key(5) if rate else None
    blocked = dot_product_attention(q, k, v, causal=True, dropout_rate=rate, dropout_rng=key)
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", 1024)  # one block: the full product
    full = dot_product_attention(q, k, v, causal=True, dropout_rate=rate, dropout_rng=key)
    np.testing.assert_array_equal(np.asarray(blocked), np.asarray(full))


@pytest.mark.slow
def test_attention_on_a_gpu_takes_cudnns_fused_kernel_where_it_applies(monkeypatch):
    """On a GPU, 16-bit attention without mask or dropout goes to cuDNN's flash kernel (as SDPA on CUDA); the
    rest, and a cuDNN that refuses, get XLA's ops with one masked product, not the CPU's 64-query blocks."""
    from jaxport.nn import attention

    calls, real = [], jax.nn.dot_product_attention

    def cudnn_as_xla(*args, implementation=None, **kwargs):  # records the request; computes with XLA's ops here
        calls.append((implementation, kwargs["is_causal"]))
        return real(*args, implementation="xla", **kwargs)

    q, k, v = (jnp.asarray(rng.normal(size=(2, 256, 4, 16)), jnp.bfloat16) for _ in range(3))
    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_as_xla)
    with runtime.use(GPU):
        fused = dot_product_attention(q, k, v, causal=True)
        np.testing.assert_array_equal(np.asarray(fused), np.asarray(real(q, k, v, is_causal=True)))
        dot_product_attention(q, k[:, :64, :2], v[:, :64, :2])  # grouped KV heads, 256 queries over 64 keys
        assert calls == [("cudnn", True), ("cudnn", False)]
        dot_product_attention(q, k, v, causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0))
        dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), causal=True)
        dot_product_attention(q, k, v, mask=jnp.ones((2, 256), bool))
        assert len(calls) == 2  # dropout, float32 and a mask are XLA's

        monkeypatch.setattr(jax.nn, "dot_product_attention", real)  # this CPU's cuDNN refuses: "not detected"
        fallback = dot_product_attention(q, k, v, causal=True)
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", 1024)  # the full masked product, as on a CPU with one block
    with runtime.use(runtime.Runtime(platform="cpu")):
        np.testing.assert_array_equal(np.asarray(fallback), np.asarray(dot_product_attention(q, k, v, causal=True)))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["causal", "padding mask", "unmasked"])
def test_attention_recomputed_in_the_backward_pass_gives_the_same_values_and_gradients(case):
    """`remat="attention_scores"` (TPUs) is XLA's ops under `jax.checkpoint`: the same loss and gradients as with the
    scores kept (tests/test_compile_for.py checks what it saves on a TPU)."""
    B, S, H, D = 2, 128, 4, 16
    local = np.random.default_rng(1)  # the module's generator keeps its sequence for the tests after this one
    q, k, v = (jnp.asarray(local.normal(size=(B, S, H, D)), jnp.float32) for _ in range(3))
    options = {
        "causal": dict(causal=True),
        "padding mask": dict(mask=jnp.arange(S)[None, :] < jnp.array([[S], [S // 2]])),
        "unmasked": {},
    }[case]

    def loss_and_grads(remat):
        def loss(q, k, v):
            return jnp.sum(dot_product_attention(q, k, v, **options) ** 2)

        tpu = runtime.Runtime(platform="tpu", attention="xla", remat=remat, row_major_operands=False)
        with runtime.use(tpu):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    kept_loss, kept_grads = loss_and_grads("none")
    loss, grads = loss_and_grads("attention_scores")
    np.testing.assert_allclose(np.asarray(loss), np.asarray(kept_loss), rtol=1e-6)
    for g, kept in zip(grads, kept_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(kept), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bf16_linear_gradients_off_the_cpu_are_plain_products_without_layout_copies():
    """The row-major copies and barriers that keep XLA:CPU's bf16 weight gradients fast are CPU-only: on a GPU the
    backward is two plain products (the same values up to float order)."""
    from jaxport.nn.linear import matmul_t_f32

    x = jnp.asarray(rng.normal(size=(96, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(48, 32)), jnp.bfloat16)
    grad = jax.grad(lambda x, w: jnp.sum(matmul_t_f32(x, w) ** 2), argnums=(0, 1))
    with runtime.use(runtime.Runtime(platform="cpu")):
        on_cpu = (str(jax.make_jaxpr(grad)(x, w)), grad(x, w))
    with runtime.use(GPU):  # traced again: the runtime is part of JAX's cache key
        on_gpu = (str(jax.make_jaxpr(grad)(x, w)), grad(x, w))
    assert "optimization_barrier" in on_cpu[0] and "transpose" in on_cpu[0]
    assert "optimization_barrier" not in on_gpu[0] and "transpose" not in on_gpu[0]
    assert on_gpu[0].count("dot_general") == 3  # forward, input gradient, weight gradient
    for a, b in zip(on_cpu[1], on_gpu[1]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_dropout_masks_are_independent_across_positions_and_keys():
    import importlib

    keep_mask = importlib.import_module("jaxport.nn.dropout").keep_mask
    a = np.asarray(keep_mask((1000, 1000), 0.25, jax.random.key(0)))
    b = np.asarray(keep_mask((1000, 1000), 0.25, jax.random.key(1)))
    assert abs(1 - a.mean() - 0.25) < 0.002
    for x, y in ((a[:-1], a[1:]), (a[:, :-1], a[:, 1:]), (a, b)):  # neighbours and another key: uncorrelated
        assert abs(np.corrcoef(x.ravel(), y.ravel())[0, 1]) < 0.01


@pytest.mark.slow
def test_row_chunks_compute_each_row_once_and_keep_row_order():
    from jaxport.nn.chunks import in_row_chunks

    x = jnp.arange(24.0).reshape(6, 2, 2)
    seen = []

    def rowwise(a, b):
        seen.append(a.shape)
        return a * 2 + b, a.sum(-1)

    doubled, sums = in_row_chunks(rowwise, 3, x, x[:, :1])
    assert seen == [(2, 2, 2)] * 3
    np.testing.assert_array_equal(doubled, x * 2 + x[:, :1])
    np.testing.assert_array_equal(sums, x.sum(-1))
    assert in_row_chunks(lambda a: a + 1, 1, x).shape == x.shape


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_matches_torch_and_its_gradient_needs_no_scatter(dtype):
    logits = rng.normal(size=(3, 5, 50)).astype(np.float32)
    labels = rng.integers(0, 50, size=(3, 5))
    x = jnp.asarray(logits, dtype)
    torch_x = torch.tensor(logits, dtype=torch.float32, requires_grad=True)
    F.cross_entropy(torch_x.reshape(-1, 50), torch.tensor(labels).reshape(-1), reduction="sum").backward()

    def gathered(x, labels):  # what the losses computed before: a gather, whose gradient is a scatter
        return jnp.sum(jax.nn.logsumexp(x, axis=-1) - jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0])

    def ours(x, labels):
        return jnp.sum(softmax_cross_entropy(x, labels))

    args = (x, jnp.asarray(labels))
    value, grad = jax.jit(jax.value_and_grad(ours))(*args)
    old_value, old_grad = jax.jit(jax.value_and_grad(gathered))(*args)
    assert value == old_value and grad.dtype == dtype and bool(jnp.all(grad == old_grad))  # the same bits
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(grad), torch_x.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert " scatter(" in jax.jit(jax.grad(gathered)).lower(*args).compile().as_text()
    assert " scatter(" not in jax.jit(jax.grad(ours)).lower(*args).compile().as_text()
    np.testing.assert_array_equal(
        np.asarray(label_entries(x, jnp.asarray(labels))),
        np.take_along_axis(np.asarray(x), labels[..., None], axis=-1)[..., 0],
    )
