"""Multi-head attention: bidirectional or causal, grouped KV heads, boolean padding mask."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxport import runtime
from jaxport.nn.dropout import dropout
from jaxport.nn.linear import Linear, row_major, row_major_transpose
from jaxport.nn.rotary import apply_rotary
from jaxport.nn.splash import splash_applies, splash_attention


def dot_product_attention(
    q_BSHD: jax.Array,
    k_BTKD: jax.Array,
    v_BTKD: jax.Array,
    *,
    causal: bool = False,
    mask: jax.Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    kv_heads_first: bool = False,
) -> jax.Array:
    """Softmax attention with `H` query heads sharing `K` key/value heads (H % K == 0).

    `q` is `[B, S, H, D]` and the output too; `k` and `v` are `[B, T, K, D]`, or `[B, K, T, D]` with
    `kv_heads_first` (a KV cache kept in the layout the products read, so that no step transposes it).

    `mask` is boolean, True where a query may attend: `[B, T]` (key padding),
    `[B, S, T]` or `[B, 1|H, S, T]`. Scores and softmax are float32. A query row
    with no allowed key returns zeros, as PyTorch's SDPA does for fully masked rows.
    With `dropout_rng`, the attention probabilities are dropped at `dropout_rate` (SDPA's
    `dropout_p`, i.e. training); without it there is no dropout.

    The kernel is the runtime's choice (`runtime.current().attention`) where it applies: Pallas's splash kernel
    (`nn.splash`), cuDNN's fused kernel, causal self-attention in blocks of queries, or XLA's ops. With
    `runtime.current().remat` "attention_scores", the backward pass of the last two computes their scores again
    instead of keeping them.
    """
    B, S, H, D = q_BSHD.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    implementation, remat = runtime.current().attention, runtime.current().remat
    if implementation == "splash" and (dropout_rng is None or dropout_rate == 0.0):  # the kernel has no dropout
        fused = functools.partial(
            splash_attention, causal=causal, mask=mask, scale=scale, kv_heads_first=kv_heads_first
        )
        if splash_applies(q_BSHD, k_BTKD, causal=causal, mask=mask, kv_heads_first=kv_heads_first):
            if remat == "attention_scores":  # keeps q, k, v alone, not the kernel's layouts of them and its output
                fused = jax.checkpoint(fused, policy=jax.checkpoint_policies.nothing_saveable)
            return fused(q_BSHD, k_BTKD, v_BTKD)
    if kv_heads_first and (causal or implementation == "cudnn"):  # these kernels read keys by position
        k_BTKD, v_BTKD, kv_heads_first = k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3), False
    if implementation == "cudnn" and mask is None and (dropout_rng is None or dropout_rate == 0.0):
        fused = _cudnn_attention(q_BSHD, k_BTKD, v_BTKD, causal, scale)
        if fused is not None:
            return fused
    K = k_BTKD.shape[1 if kv_heads_first else 2]
    if K != H and not kv_heads_first:
        # Grouped KV heads: each KV head serves H // K consecutive query heads. Repeating them keeps
        # the plain 4-D contraction, which XLA:CPU runs faster than a 5-D grouped one. (Heads first, the
        # queries are grouped by KV head instead: `_queries_by_kv_head`.)
        k_BTKD, v_BTKD = jnp.repeat(k_BTKD, H // K, axis=2), jnp.repeat(v_BTKD, H // K, axis=2)
    T = k_BTKD.shape[2 if kv_heads_first else 1]
    in_blocks = causal and mask is None and S == T and T % CAUSAL_BLOCK == 0 and T > CAUSAL_BLOCK
    if implementation == "causal_blocks" and in_blocks:
        attention = functools.partial(_causal_attention_in_blocks, scale=scale, dropout_rate=dropout_rate)
        if remat == "attention_scores":
            attention = jax.checkpoint(attention, policy=jax.checkpoint_policies.nothing_saveable)
        return attention(q_BSHD, k_BTKD, v_BTKD, dropout_rng=dropout_rng)
    if not causal and dropout_rng is None:
        attention = functools.partial(_heads_first_attention, scale=scale, kv_heads_first=kv_heads_first)
    else:
        attention = functools.partial(
            _masked_attention, causal=causal, scale=scale, dropout_rate=dropout_rate, kv_heads_first=kv_heads_first
        )
    if remat == "attention_scores":  # the backward pass keeps q, k, v and recomputes the [B, H, S, T] scores
        attention = jax.checkpoint(attention, policy=jax.checkpoint_policies.nothing_saveable)
    return attention(q_BSHD, k_BTKD, v_BTKD, mask, dropout_rng)


def _queries_by_kv_head(q_BSHD, K: int):
    """`[B, K, G * S, D]`: the queries of the `G = H / K` heads that share each KV head, one after the other, so
    that each KV head's keys are one operand of one product (no copy of them per query head)."""
    B, S, H, D = q_BSHD.shape
    return q_BSHD.reshape(B, S, K, H // K, D).transpose(0, 2, 3, 1, 4).reshape(B, K, H // K * S, D)


def _heads_last(out_BKQD, S: int):
    """`[B, S, H, D]` from `[B, K, G * S, D]` (the inverse of `_queries_by_kv_head`)."""
    B, K, Q, D = out_BKQD.shape
    return out_BKQD.reshape(B, K, Q // S, S, D).transpose(0, 3, 1, 2, 4).reshape(B, S, K * (Q // S), D)


def _mask_4d(mask):
    """`[B, 1|H, 1|S, T]` from a mask of `dot_product_attention`'s shapes."""
    return {2: lambda m: m[:, None, None, :], 3: lambda m: m[:, None]}.get(mask.ndim, lambda m: m)(mask)


def _heads_first_attention(q_BSHD, k, v, mask, dropout_rng, *, scale: float, kv_heads_first: bool):
    """`_full_attention` on heads-first operands (no dropout), or with a `mask` `_allowed_keys_attention`."""
    S, H = q_BSHD.shape[1:3]
    mask = None if mask is None else _mask_4d(mask)
    if kv_heads_first:
        K = k.shape[1]
        q_BKQD, k_BKTD, v_BKTD = (_row_major_unless_f32(x) for x in (_queries_by_kv_head(q_BSHD, K), k, v))
        if mask is None:
            out_BKQD = _full_attention(q_BKQD, k_BKTD, v_BKTD, scale)
        else:  # the mask's rows in the queries' order: KV head, then the query heads it serves, then position
            B, M, _, T = mask.shape
            if M == 1:  # one mask for every head: repeated for the G query heads of a KV head
                grouped = jnp.tile(mask, (1, 1, H // K, 1)) if mask.shape[2] > 1 else mask
            else:
                grouped = jnp.broadcast_to(mask, (B, H, S, T)).reshape(B, K, -1, T)
            out_BKQD = _allowed_keys_attention(q_BKQD, k_BKTD, v_BKTD, grouped, scale)
        return _row_major_unless_f32(_heads_last(out_BKQD, S))
    heads_first = lambda x: _row_major_unless_f32(x.transpose(0, 2, 1, 3))  # noqa: E731
    q_BHSD, k_BHTD, v_BHTD = heads_first(q_BSHD), heads_first(k), heads_first(v)
    if mask is None:
        return heads_first(_full_attention(q_BHSD, k_BHTD, v_BHTD, scale))
    return heads_first(_allowed_keys_attention(q_BHSD, k_BHTD, v_BHTD, mask, scale))


def _masked_attention(
    q_BSHD, k, v, mask, dropout_rng, *, causal: bool, scale: float, dropout_rate: float, kv_heads_first: bool
):
    """XLA's ops: one product for the scores, a causal band and/or `mask`, softmax, dropout, one product with `v`."""
    B, S, H, _ = q_BSHD.shape
    if kv_heads_first:
        K, T = k.shape[1], k.shape[2]
        scores = jnp.einsum("bkqd,bktd->bkqt", _queries_by_kv_head(q_BSHD, K), k, preferred_element_type=jnp.float32)
        scores = scores.reshape(B, H, S, T) * scale
    else:
        T = k.shape[1]
        scores = jnp.einsum("bshd,bthd->bhst", q_BSHD, k, preferred_element_type=jnp.float32) * scale
    allowed = None
    if causal:
        allowed = jnp.tril(jnp.ones((S, T), dtype=bool), k=T - S)
    if mask is not None:
        mask = _mask_4d(mask)
        allowed = mask if allowed is None else allowed & mask
    if allowed is not None:
        scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    if mask is not None or (causal and S > T):  # a causal band alone leaves every row a key when S <= T
        probs = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), probs, 0.0)
    probs = dropout(probs, dropout_rate, dropout_rng).astype(v.dtype)
    if kv_heads_first:
        return _heads_last(jnp.einsum("bkqt,bktd->bkqd", probs.reshape(B, K, H // K * S, T), v), S)
    return jnp.einsum("bhst,bthd->bshd", probs, v)


def _cudnn_attention(q_BSHD, k_BTKD, v_BTKD, causal: bool, scale: float):
    """cuDNN's fused (flash) attention, the kernel PyTorch's SDPA runs on CUDA where it may: for 16-bit operands
    whose head dim cuDNN takes (a multiple of 8, at most 128), causal only over as many keys as queries. None where it
    does not apply or this cuDNN refuses the shape, and XLA's ops compute the attention instead."""
    S, D = q_BSHD.shape[1], q_BSHD.shape[-1]
    if (causal and S != k_BTKD.shape[1]) or q_BSHD.dtype not in (jnp.bfloat16, jnp.float16) or D % 8 or D > 128:
        return None
    try:
        return jax.nn.dot_product_attention(
            q_BSHD, k_BTKD, v_BTKD, scale=scale, is_causal=causal, implementation="cudnn"
        )
    except (NotImplementedError, RuntimeError, ValueError):  # cuDNN missing, too old, or refusing this shape
        return None  # the caller's XLA ops then compute it


def _heads_dot(a, b, contract_a: int, contract_b: int):
    """Products over the `[B, H]` batch dimensions, accumulated in float32."""
    return jax.lax.dot_general(
        a, b, (((contract_a,), (contract_b,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _full_attention(q_BHSD, k_BHTD, v_BHTD, scale: float):
    """Attention with neither mask nor dropout (TRM's, Dream's decoding), rounded where PyTorch's CPU flash-attention
    kernel (what SDPA runs there) rounds: float32 scores and softmax; the unnormalised exponentials rounded to `v`'s
    dtype for the product with `v` and the float32 result divided by their sums; in the backward pass, the float32
    `dS` rounded to the dtype for the `dQ`/`dK` products and the probabilities for `dV`. Every product has operands
    of one dtype, accumulates in float32, and is one plain batched GEMM of row-major operands, which XLA:CPU runs
    without widening bfloat16 to float32 (see `row_major`). In bfloat16 this is closer to PyTorch's output and `dQ`
    than the plain formula (docs/performance.md, "Attention on the CPU"); in float32 the only change from the plain
    formula is the order of the division (float rounding)."""
    return _full_attention_fwd(q_BHSD, k_BHTD, v_BHTD, scale)[0]


def _row_major_unless_f32(x):
    """Heads-first operands written out row-major where XLA:CPU would otherwise widen a reduced-precision product to
    float32; float32 products take any layout, and there the copy only costs time."""
    return x if x.dtype == jnp.float32 else row_major(x)


def _full_attention_fwd(q_BHSD, k_BHTD, v_BHTD, scale):
    out_BHSD, exps_BHST, sums_BHS1 = _softmax_weighted_values(_heads_dot(q_BHSD, k_BHTD, 3, 3) * scale, v_BHTD)
    return out_BHSD.astype(v_BHTD.dtype), (q_BHSD, k_BHTD, v_BHTD, exps_BHST / sums_BHS1)


def _softmax_weighted_values(scores_BHST, v_BHTD):
    """`(softmax(scores) v in float32, the exponentials, their sums)`: the unnormalised exponentials, rounded to `v`'s
    dtype, are multiplied with `v` and the result divided by their sums (divisions over `[S, D]`, not `[S, T]`)."""
    exps_BHST = jnp.exp(scores_BHST - jnp.max(scores_BHST, axis=-1, keepdims=True))
    sums_BHS1 = jnp.sum(exps_BHST, axis=-1, keepdims=True)
    return _heads_dot(exps_BHST.astype(v_BHTD.dtype), v_BHTD, 3, 2) / sums_BHS1, exps_BHST, sums_BHS1


def _allowed_keys_attention(q_BHSD, k_BHTD, v_BHTD, allowed, scale: float):
    """`_full_attention`'s forward formula over the keys `allowed` (boolean, broadcast to the `[B, H, S, T]` scores;
    differentiated by JAX). A query row with no allowed key gives zeros."""
    scores_BHST = jnp.where(allowed, _heads_dot(q_BHSD, k_BHTD, 3, 3) * scale, jnp.finfo(jnp.float32).min)
    out_BHSD = _softmax_weighted_values(scores_BHST, v_BHTD)[0]
    return jnp.where(jnp.any(allowed, axis=-1, keepdims=True), out_BHSD, 0.0).astype(v_BHTD.dtype)


def _heads_dot_over_rows(a_BHSX, b_BHSY):
    """`aᵀ b` per head, `[B, H, X, Y]`, summed over the rows `S`. Float32 contracts over the rows in place; a
    reduced-precision `a` is first written out transposed and row-major (`row_major_transpose`), which keeps
    the product in that precision on XLA:CPU. In float32 that copy only costs time (docs/performance.md, "Operand
    layouts"), and the result is the same bits."""
    if a_BHSX.dtype == jnp.float32:
        return _heads_dot(a_BHSX, b_BHSY, 2, 2)
    return _heads_dot(row_major_transpose(a_BHSX), b_BHSY, 3, 2)


def _full_attention_bwd(scale, residuals, dout_BHSD):
    q_BHSD, k_BHTD, v_BHTD, probs_BHST = residuals
    dtype = v_BHTD.dtype
    dout_BHSD = _row_major_unless_f32(dout_BHSD)  # the cotangent of a heads-first transpose
    dv = _heads_dot_over_rows(probs_BHST.astype(dtype), dout_BHSD).astype(dtype)
    dprobs_BHST = _heads_dot(dout_BHSD, v_BHTD, 3, 3)
    dscores_BHST = (
        probs_BHST * (dprobs_BHST - jnp.sum(dprobs_BHST * probs_BHST, axis=-1, keepdims=True)) * scale
    ).astype(dtype)
    dq = _heads_dot(dscores_BHST, k_BHTD, 3, 2).astype(q_BHSD.dtype)
    dk = _heads_dot_over_rows(dscores_BHST, q_BHSD).astype(k_BHTD.dtype)
    return dq, dk, dv


_full_attention.defvjp(_full_attention_fwd, _full_attention_bwd)


CAUSAL_BLOCK = 64  # query rows per block of causal attention


def _causal_attention_in_blocks(q_BSHD, k_BSHD, v_BSHD, scale, dropout_rate, dropout_rng):
    """Causal self-attention computed one block of `CAUSAL_BLOCK` queries at a time, each against the keys
    up to its own end: key blocks that are entirely masked are never computed and each block's scores stay in
    cache. The result is the full computation's bit for bit (a masked score adds an exact 0 to the softmax),
    dropout included (see `dropout`). The runtime chooses it on a CPU (docs/performance.md, "Attention on the
    CPU"); an accelerator gets one masked product, or cuDNN's fused kernel."""
    B, S, H, D = q_BSHD.shape
    outputs = []
    for start in range(0, S, CAUSAL_BLOCK):
        end = start + CAUSAL_BLOCK
        scores = (
            jnp.einsum("bshd,bthd->bhst", q_BSHD[:, start:end], k_BSHD[:, :end], preferred_element_type=jnp.float32)
            * scale
        )
        allowed = jnp.tril(jnp.ones((CAUSAL_BLOCK, end), dtype=bool), k=start)
        probs = jax.nn.softmax(jnp.where(allowed, scores, jnp.finfo(jnp.float32).min), axis=-1)
        if dropout_rng is not None:  # each probability keeps its place in the full [B, H, S, S] matrix
            rows = (
                (
                    jax.lax.broadcasted_iota(jnp.uint32, (B, H, CAUSAL_BLOCK, 1), 0) * H
                    + jax.lax.broadcasted_iota(jnp.uint32, (B, H, CAUSAL_BLOCK, 1), 1)
                )
                * S
                + jax.lax.broadcasted_iota(jnp.uint32, (B, H, CAUSAL_BLOCK, 1), 2)
                + start
            )
            probs = dropout(probs, dropout_rate, dropout_rng, rows=rows)
        outputs.append(jnp.einsum("bhst,bthd->bshd", probs.astype(v_BSHD.dtype), v_BSHD[:, :end]))
    return jnp.concatenate(outputs, axis=1)


def take_rows(a_BS: jax.Array, rows_BQ: jax.Array) -> jax.Array:
    """`a[b, rows[b, q]]`: for each batch row `b`, the rows `rows_BQ[b]` of `a: [B, S, ...]`, as `[B, Q, ...]`."""
    return jnp.take_along_axis(a_BS, rows_BQ.reshape(rows_BQ.shape + (1,) * (a_BS.ndim - 2)), axis=1)


def window_at(a_BN: jax.Array, start, size: int) -> jax.Array:
    """`a[:, start : start + size]` along axis 1: one `start` for the batch (a scalar), or one per row (`[B]`)."""
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_slice_in_dim(a_BN, start, size, axis=1)
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, size, axis=0))(a_BN, start)


def write_at(a_BN: jax.Array, values_BW: jax.Array, start, axis: int = 1) -> jax.Array:
    """`a` with `values` written along `axis` (not the batch's) from `start`: one for the batch (a scalar), or one
    per row (`[B]`)."""
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_update_slice_in_dim(a_BN, values_BW, start, axis=axis)
    write_row = lambda row, v, s: jax.lax.dynamic_update_slice_in_dim(row, v, s, axis=axis - 1)  # noqa: E731
    return jax.vmap(write_row)(a_BN, values_BW, start)


def _table_rows(table, rows_BQ):
    """The rows `rows_BQ` of a rotary table, `[S, D]` (shared by the batch) or `[B, S, D]`."""
    return table[rows_BQ] if table.ndim == 2 else take_rows(table, rows_BQ)


class Attention(nnx.Module):
    """Self-attention with either a fused `qkv_proj` (TRM) or separate `q_proj/k_proj/v_proj` (Qwen2/Dream).

    Heads are laid out as `[q heads | k heads | v heads]` along the projection output,
    each `head_dim` wide, which is also nanoGPT's `c_attn` layout.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        causal: bool = False,
        qkv_bias: bool = False,
        out_bias: bool = False,
        fused_qkv: bool = True,
        rngs: nnx.Rngs,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = hidden_size // num_heads if head_dim is None else head_dim
        self.causal = causal
        self.fused_qkv = fused_qkv
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if fused_qkv:
            self.qkv_proj = Linear(hidden_size, q_out + 2 * kv_out, bias=qkv_bias, rngs=rngs)
        else:
            self.q_proj = Linear(hidden_size, q_out, bias=qkv_bias, rngs=rngs)
            self.k_proj = Linear(hidden_size, kv_out, bias=qkv_bias, rngs=rngs)
            self.v_proj = Linear(hidden_size, kv_out, bias=qkv_bias, rngs=rngs)
        self.o_proj = Linear(q_out, hidden_size, bias=out_bias, rngs=rngs)

    def project_qkv(self, x_BSD: jax.Array, query_rows_BQ: jax.Array | None = None):
        """Queries of the rows `query_rows_BQ` of `x` (of every row without them), keys and values of every row."""
        B, S, _ = x_BSD.shape
        if self.fused_qkv:
            qkv = self.qkv_proj(x_BSD).reshape(B, S, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            q, k, v = jnp.split(qkv, [self.num_heads, self.num_heads + self.num_kv_heads], axis=2)
            return (q if query_rows_BQ is None else take_rows(q, query_rows_BQ)), k, v
        x_BQD = x_BSD if query_rows_BQ is None else take_rows(x_BSD, query_rows_BQ)
        return (
            self.q_proj(x_BQD).reshape(B, x_BQD.shape[1], self.num_heads, self.head_dim),
            self.k_proj(x_BSD).reshape(B, S, self.num_kv_heads, self.head_dim),
            self.v_proj(x_BSD).reshape(B, S, self.num_kv_heads, self.head_dim),
        )

    def __call__(self, x_BSD: jax.Array, cos_sin=None, mask: jax.Array | None = None) -> jax.Array:
        return self.attend(x_BSD, cos_sin, mask)[0]

    def attend(
        self,
        x_BSD: jax.Array,
        cos_sin=None,
        mask: jax.Array | None = None,
        *,
        kv_cache: tuple[jax.Array, jax.Array] | None = None,
        cache_index=0,
        query_rows: jax.Array | None = None,
    ):
        """`(output, (k_BKTD, v_BKTD))`: the output and the (rotated) keys/values attended over, heads first (the
        layout the attention's products read, so a cache of them is never transposed).

        With `kv_cache = (k, v)` of a longer sequence `[B, K, T, D]`, the `S` rows of `x` are its
        positions `cache_index .. cache_index + S - 1` (one index for the batch, or one per row `[B]`): their
        fresh keys/values replace the cached ones there and the queries attend over all `T` positions (`mask`
        then covers `[.., S, T]`).
        With `query_rows` (`[B, Q]` indices into the rows of `x`), only those rows query and get an
        output, `[B, Q, D]`, over the keys and values of every row (`mask` covers all `S` rows).
        Bidirectional attention only: a causal band would assume the rows are the last `S` positions.
        """
        if self.causal and (kv_cache is not None or query_rows is not None):
            raise ValueError("a KV cache or query rows need bidirectional attention (causal=False)")
        if kv_cache is not None and query_rows is not None:
            raise ValueError("give a KV cache or query rows, not both")
        B = x_BSD.shape[0]
        q, k, v = self.project_qkv(x_BSD, query_rows)
        if cos_sin is not None:
            q_cos_sin = cos_sin if query_rows is None else [_table_rows(t, query_rows) for t in cos_sin]
            q, k = apply_rotary(q, *q_cos_sin), apply_rotary(k, *cos_sin)
        if query_rows is not None and mask is not None and mask.ndim > 2:  # the queries' rows of the mask
            mask = (
                take_rows(mask, query_rows)
                if mask.ndim == 3
                else take_rows(mask.swapaxes(1, 2), query_rows).swapaxes(1, 2)
            )
        k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))
        if kv_cache is not None:
            k, v = (write_at(old, new.astype(old.dtype), cache_index, axis=2) for old, new in zip(kv_cache, (k, v)))
        out = dot_product_attention(q, k, v, causal=self.causal, mask=mask, kv_heads_first=True)
        return self.o_proj(out.reshape(B, q.shape[1], self.num_heads * self.head_dim)), (k, v)
