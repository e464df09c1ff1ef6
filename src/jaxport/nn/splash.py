"""Attention through Pallas's splash-attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`), a
Mosaic kernel for TPUs v4 and later (docs/tpu.md, "Attention on TPUs"); elsewhere Pallas's interpreter runs it (tests).
`dot_product_attention` calls it where the runtime chooses `splash`.

The kernel reads sequences in blocks of 128 positions: queries and keys are padded to a block multiple, padded keys
and a key-padding mask become segment ids (a query attends the keys of its own segment), and the padded rows are
dropped from the result."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from jaxport import runtime

LANES = 128  # the kernel's sequence blocks are multiples of this
BLOCKS = (512, 256, 128)  # block sizes tried, largest first, for each padded sequence


def splash_applies(q_BSHD, k, *, causal: bool, mask, kv_heads_first: bool) -> bool:
    """Whether the kernel computes this attention (`splash_attention`'s arguments, no dropout). Not for a causal
    band over other than as many keys as queries or with a mask (a row may then have no key, which XLA's ops give
    zeros), a mask other than key padding `[B, T]`, or a program on several devices with no mesh to run it on
    (`runtime.runs_per_device`): XLA's ops compute those."""
    T = k.shape[2 if kv_heads_first else 1]
    if causal and (q_BSHD.shape[1] != T or mask is not None):
        return False
    return (mask is None or mask.ndim == 2) and runtime.runs_per_device()


def splash_attention(q_BSHD, k, v, *, causal: bool, mask, scale: float, kv_heads_first: bool) -> jax.Array:
    """`dot_product_attention` (no dropout) through the splash kernel where it applies (`splash_applies`):
    `[B, S, H, D]` from queries `[B, S, H, D]` and keys/values `[B, T, K, D]` (`[B, K, T, D]` with
    `kv_heads_first`), on each device's rows and heads (`runtime.per_device`)."""
    B, S, H, D = q_BSHD.shape
    k_BKTD, v_BKTD = (k, v) if kv_heads_first else (x.transpose(0, 2, 1, 3) for x in (k, v))
    T = k_BKTD.shape[2]
    padded_S, padded_T = _padded(S), _padded(T)
    q_BHSD = jnp.pad((q_BSHD * scale).astype(q_BSHD.dtype).transpose(0, 2, 1, 3), _rows(padded_S - S))
    k_BKTD, v_BKTD = (jnp.pad(x, _rows(padded_T - T)) for x in (k_BKTD, v_BKTD))
    args, axes = (q_BHSD, k_BKTD, v_BKTD), (("batch", "heads", None, None), *[("batch", "kv_heads", None, None)] * 2)
    has_key_B = None
    if not causal and (mask is not None or padded_T != T):  # causal rows never reach the padded keys after them
        keys_BT = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
        keys_BT = jnp.pad(keys_BT, ((0, 0), (0, padded_T - T)))
        has_key_B = jnp.any(keys_BT, axis=-1)
        # a row with no key to attend: its queries take the other segment (a valid softmax), zeroed below
        queries_BS = jnp.broadcast_to(has_key_B[:, None], (B, padded_S))
        args += (queries_BS.astype(jnp.int32), keys_BT.astype(jnp.int32))
        axes += (("batch", None), ("batch", None))
    interpret = runtime.current().platform != "tpu"
    per_shard = functools.partial(_attention_per_shard, causal=causal, interpret=interpret)
    out_BSHD = runtime.per_device(per_shard, args, axes)[:, :, :S].transpose(0, 2, 1, 3)
    if has_key_B is not None and mask is not None:
        out_BSHD = jnp.where(has_key_B[:, None, None, None], out_BSHD, 0).astype(out_BSHD.dtype)
    return out_BSHD


def _padded(n: int) -> int:
    return -(-n // LANES) * LANES


def _rows(extra: int):
    """`jnp.pad`'s widths adding `extra` rows to the sequence axis of a `[B, H, S, D]` array."""
    return ((0, 0), (0, 0), (0, extra), (0, 0))


def _attention_per_shard(q_BHSD, k_BKTD, v_BKTD, queries_BS=None, keys_BT=None, *, causal: bool, interpret: bool):
    """The kernel on one device's rows and heads (shapes static here: the kernel is made for them)."""
    H, S, _ = q_BHSD.shape[1:]
    kernel = _kernel(H, S, k_BKTD.shape[2], causal, interpret)
    if queries_BS is None:
        return jax.vmap(kernel)(q_BHSD, k_BKTD, v_BKTD)
    segments = kernel_lib.SegmentIds(queries_BS, keys_BT)
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s))(q_BHSD, k_BKTD, v_BKTD, segments)


@functools.cache
def _kernel(heads: int, S: int, T: int, causal: bool, interpret: bool):
    """The splash kernel for `heads` query heads over `S` queries and `T` keys (block multiples), made once: making
    it lays out the mask's blocks (as constants: concrete arrays, whatever program is being traced)."""
    shape = (S, T)
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask(shape) if causal else mask_lib.FullMask(shape)] * heads)
    block_q, block_kv = (next(b for b in BLOCKS if n % b == 0) for n in shape)
    blocks = kernel_lib.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)
