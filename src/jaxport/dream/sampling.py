"""What one denoising step does with the logits: score the masks, pick the ones to unmask, write them.

Upstream's `sample_tokens` (a candidate token and a confidence per position), the unmasking schedule
(`timesteps`, `transfer_ratios`) and the unmask rule (`unmask`: the best-scored masks, a random share for
`origin`, a probability threshold). The exact loop (`jaxport.dream.exact`) and the block loop
(`jaxport.dream.fast`) both use these; only these functions read the per-row settings (`RowSettings`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxport.dream.settings import RowSettings


class Scores(NamedTuple):
    """Per position of a window: `confidence` (the ranking score, in the model dtype), the candidate token `x0`
    and its `probability` (float32, what `threshold` compares)."""

    confidence: jax.Array
    x0: jax.Array
    probability: jax.Array


def timesteps(steps: int, eps: float) -> np.ndarray:
    """`torch.linspace(1, eps, steps + 1)` in float32, bit for bit.

    torch fills the first half as `start + step * i` and the second as `end - step * (n - 1 - i)`
    with one rounding (fused multiply-add); float64 arithmetic rounded once reproduces that."""
    n = steps + 1
    start, end = np.float32(1.0), np.float32(eps)
    step = np.float64((end - start) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    values = np.where(i < n // 2, np.float64(start) + step * i, np.float64(end) - step * (n - 1 - i))
    return values.astype(np.float32)


def transfer_ratios(steps: int, eps: float) -> np.ndarray:
    """Per step, the fraction of remaining masks to unmask: `1 - s/t` in float32, 1 at the last step."""
    ts = timesteps(steps, eps)
    ratios = np.float32(1.0) - ts[1:] / ts[:-1]
    ratios[-1] = 1.0
    return ratios.astype(np.float32)


def top_p_filter(logits: jax.Array, top_p: float) -> jax.Array:
    """Keep the most likely tokens whose cumulative probability first exceeds `top_p`."""
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    remove_sorted = cumulative > top_p
    # shift right: the token that crosses the threshold stays
    remove_sorted = jnp.concatenate([jnp.zeros_like(remove_sorted[..., :1]), remove_sorted[..., :-1]], axis=-1)
    remove = jnp.put_along_axis(jnp.zeros_like(remove_sorted), order, remove_sorted, axis=-1, inplace=False)
    return jnp.where(remove, jnp.finfo(logits.dtype).min, logits)


def top_k_filter(logits: jax.Array, top_k: int) -> jax.Array:
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
    return jnp.where(logits < kth, jnp.finfo(logits.dtype).min, logits)


def _max_and_argmax(a_RV: jax.Array):
    """Max and first index of the max over the vocabulary, as two plain reductions: XLA:CPU's fused argmax
    reduction is several times slower (docs/performance.md, "Plain reductions")."""
    top = jnp.max(a_RV, axis=-1)
    index = jax.lax.broadcasted_iota(jnp.int32, a_RV.shape, 1)
    return top, jnp.min(jnp.where(a_RV == top[:, None], index, a_RV.shape[-1]), axis=-1)


def sample_tokens(logits: jax.Array, key, alg: str, row: RowSettings) -> Scores:
    """Upstream `sample_tokens` from logits `[..., V]`: per position the candidate token, its probability and the
    confidence `alg` ranks by: maskgit_plus/origin the candidate's probability, topk_margin top-1 minus top-2
    probability, entropy the negative entropy. Computed in float32; the confidence is returned in the logits dtype.
    """
    dtype, lead = logits.dtype, logits.shape[:-1]
    # [rows, V]: XLA:CPU runs vocabulary reductions several times slower on a 3-D array
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)
    if row.temperature > 0:
        logits = logits / row.temperature
    if row.top_p is not None and row.top_p < 1:
        logits = top_p_filter(logits, row.top_p)
    if row.top_k is not None:
        logits = top_k_filter(logits, row.top_k)
    probs = jax.nn.softmax(logits, axis=-1)
    top1, first_top = _max_and_argmax(probs)
    if row.temperature > 0:
        x0 = jax.random.categorical(key, logits, axis=-1)
        confidence = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    else:
        x0, confidence = first_top, top1
    probability = confidence
    if alg == "topk_margin":
        # top-1 minus top-2 probability; a tied maximum gives 0 as the sorted pair does
        vocab = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
        second = jnp.max(jnp.where(vocab == first_top[..., None], -jnp.inf, probs), axis=-1)
        confidence = top1 - second
    elif alg == "entropy":
        confidence = jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
    return Scores(confidence.astype(dtype).reshape(lead), x0.astype(jnp.int32).reshape(lead), probability.reshape(lead))


def _rank_desc(scores_BW: jax.Array) -> jax.Array:
    """Rank of every entry in its row when sorted descending; exactly equal scores rank by position,
    the leftmost first (a stable sort: the same on every device, mesh and batch size)."""
    B, W = scores_BW.shape
    order = jnp.argsort(-scores_BW.astype(jnp.float32), axis=-1, stable=True)
    return jnp.zeros((B, W), jnp.int32).at[jnp.arange(B)[:, None], order].set(jnp.arange(W, dtype=jnp.int32))


def bucket_sizes(width: int, buckets: int = 4) -> list[int]:
    """Static sizes the masked positions of a step are packed into (the last is the whole window)."""
    unit = -(-width // buckets)
    return sorted({min(width, unit * k) for k in range(1, buckets + 1)})


def masked_scores(head, hidden_at, is_mask_BW, key, alg: str, row: RowSettings) -> Scores:
    """`sample_tokens` at every mask position of the window, computing the vocabulary projection `head` and the
    sampler only there: the masks are packed to the front into the smallest static bucket that holds every row's
    count (`lax.switch`), then scattered back (-inf, 0 and 0 elsewhere). `hidden_at(index_BS)` gives the final
    hidden states `[B, S, D]` that score the window positions `index_BS`, computed there too if it can."""
    B, W = is_mask_BW.shape
    sizes = bucket_sizes(W)
    most = jnp.max(jnp.sum(is_mask_BW, axis=-1))
    branch = jnp.searchsorted(jnp.asarray(sizes), most)
    order_BW = jnp.argsort(~is_mask_BW, axis=-1, stable=True)  # mask positions first, in order
    rows = jnp.arange(B)[:, None]

    def packed(size):
        def run(_):
            index_BS = order_BW[:, :size]
            confidence, x0, probability = sample_tokens(head(hidden_at(index_BS)), key, alg, row)
            return Scores(
                jnp.full((B, W), -jnp.inf, confidence.dtype).at[rows, index_BS].set(confidence),
                jnp.zeros((B, W), jnp.int32).at[rows, index_BS].set(x0),
                jnp.zeros((B, W), jnp.float32).at[rows, index_BS].set(probability),
            )

        return run

    return Scores(*jax.lax.switch(branch, [packed(size) for size in sizes], None))


def unmask(window_BW, scores: Scores, select_key, n, p_transfer, *, alg: str, row: RowSettings, mask_token_id: int):
    """Unmask part of a canvas window given each position's scores.

    The ranking algorithms unmask the `n` best-scored masks of each row (`n` broadcasts against `[B, 1]`: one
    count for the batch, or one per row); `origin` unmasks each mask with probability `p_transfer`. Ties: among
    exactly equal scores the leftmost position is unmasked first. With `row.threshold`, every mask whose
    candidate's probability reaches it is unmasked too, and while a row has masks at least one (its best-scored)
    is. A chosen slot that holds no mask (`n` above a row's masks) gets the mask token, as upstream writes it.
    Returns the new window, the confidence (-inf off masks), the candidates (-1 off masks) and the count unmasked
    per row.
    """
    is_mask = window_BW == mask_token_id
    confidence = jnp.where(is_mask, scores.confidence, -jnp.inf)
    if row.alg_temp and alg != "origin":
        # Multinomial without replacement over softmax(confidence / alg_temp) = Gumbel top-n.
        ranked = confidence.astype(jnp.float32) / row.alg_temp + jax.random.gumbel(select_key, window_BW.shape)
    else:
        ranked = confidence
    if alg == "origin":
        transfer = is_mask & (jax.random.uniform(select_key, window_BW.shape) < p_transfer)
    else:
        transfer = _rank_desc(ranked) < n
    if row.threshold is not None:
        transfer = transfer | (is_mask & (scores.probability >= row.threshold))
        none_yet = ~jnp.any(transfer & is_mask, axis=-1, keepdims=True)
        transfer = transfer | (none_yet & is_mask & (_rank_desc(ranked) == 0))
    new_window = jnp.where(transfer, jnp.where(is_mask, scores.x0, mask_token_id), window_BW)
    transfer = transfer & is_mask
    return new_window, confidence, jnp.where(is_mask, scores.x0, -1), jnp.sum(transfer, axis=-1, dtype=jnp.int32)
