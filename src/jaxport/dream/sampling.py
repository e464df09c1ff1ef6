"""What one denoising step does with the logits: score the masks, pick the ones to unmask, write them.

Upstream's `sample_tokens` (a candidate token and a confidence per position), the unmasking schedule
(`timesteps`, `transfer_ratios`) and the unmask rule (`unmask`: the best-scored masks, a random share for
`origin`, a probability threshold). The exact loop (`jaxport.dream.exact`) and the block loop
(`jaxport.dream.fast`) both use these; only these functions read the per-row settings (`Rows`).

The sampling settings are data: every row has its own temperature, top-p, top-k, `alg_temp`, threshold and random
key (`[B]` arrays), so one compiled program serves every value. What only some settings need (the filters' sorts,
the categorical draw, the Gumbel noise of `alg_temp`) runs under `lax.cond` on whether any row needs it. The
vocabulary-sized branches are also part of the program's shape (`Branches`): a program holds those its rows can
need, so a greedy generation compiles and runs without their buffers, while a server's programs hold them all (any
request runs without compiling). A row's draws come from its own key, per position of its window, so they do not
depend on the other rows of the batch.
"""

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxport.dream.settings import RowSettings

# The filters read a row's nucleus off its PARTIAL_SORT largest logits (a partial sort) when they hold it, and its
# top-k off them or, in a batch with a larger top-k, off its TOP_K_SORT largest; beyond those the vocabulary is
# searched (docs/performance.md, "Sampling filters": XLA:CPU's TopK costs several times more above 32)
PARTIAL_SORT, TOP_K_SORT = 32, 64
# A partial sort of a vocabulary of at least K * CHUNK logits runs on the largest logit of each CHUNK and then on
# the chunks that hold the K largest; below that, a top-k above PARTIAL_SORT is found by bisection (the TopK kernel
# costs more than 32 halvings there; docs/performance.md, "Sampling filters")
CHUNK = 16


class Scores(NamedTuple):
    """Per position of a window: `confidence` (the ranking score, in the model dtype), the candidate token `x0`
    and its `probability` (float32, what `threshold` compares)."""

    confidence: jax.Array
    x0: jax.Array
    probability: jax.Array


class Rows(NamedTuple):
    """The sampling settings of each row, `[B]` arrays (runtime inputs of the compiled programs); the neutral
    values leave a row as upstream leaves it without the setting: `temperature` 0 (greedy), `top_p` 1 (no
    filter), `top_k` 0 (no filter), `alg_temp` 0 (ranked order), `threshold` inf (none)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    alg_temp: jax.Array
    threshold: jax.Array

    @classmethod
    def of(cls, rows: Sequence[RowSettings]) -> "Rows":
        """Host arrays of per-row settings (each `RowSettings` holding one value per field)."""

        def column(name, off, dtype):
            return np.array([off if getattr(r, name) is None else getattr(r, name) for r in rows], dtype)

        return cls(
            column("temperature", 0.0, np.float32),
            column("top_p", 1.0, np.float32),
            column("top_k", 0, np.int32),
            column("alg_temp", 0.0, np.float32),
            column("threshold", np.inf, np.float32),
        )


class Branches(NamedTuple):
    """Which vocabulary-sized branches of `sample_tokens` a program contains (static): the categorical draw of a
    temperature, and the filters up to `filters` (0 none, 1 the partial sort that serves top-k up to
    `TOP_K_SORT`, 2 also the whole vocabulary's bisection that a wide top-p nucleus or a larger top-k needs). The
    default holds them all; a row needing a branch the program lacks is a caller's error (`needed` gives what rows
    need)."""

    draw: bool = True
    filters: int = 2

    @classmethod
    def needed(cls, rows: Rows) -> "Branches":
        """What the host arrays `rows` need (top-p may need all the vocabulary: its survivors depend on the logits)."""
        top_p, top_k = np.asarray(rows.top_p), np.asarray(rows.top_k)
        filters = 2 if (top_p < 1).any() or (top_k > TOP_K_SORT).any() else 1 if (top_k > 0).any() else 0
        return cls(draw=bool((np.asarray(rows.temperature) > 0).any()), filters=filters)


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


def _removed(logits_RV: jax.Array, remove_RV: jax.Array) -> jax.Array:
    return jnp.where(remove_RV, jnp.finfo(logits_RV.dtype).min, logits_RV)


def _kth(values_RK: jax.Array, top_k_R: jax.Array) -> jax.Array:
    """Each row's `top_k`-th value of its descending `values`, `[R, 1]` (the last one where top_k exceeds them)."""
    return jnp.take_along_axis(values_RK, jnp.clip(top_k_R - 1, 0, values_RK.shape[-1] - 1)[:, None], axis=-1)


def _below_kth(logits_RV, sorted_RK, top_k_R) -> jax.Array:
    """Which logits fall below their row's `top_k`-th largest (read off its descending `sorted_RK`), `[R, V]`."""
    return (top_k_R > 0)[:, None] & (logits_RV < _kth(sorted_RK, top_k_R))


def _first_marked(marked_RV: jax.Array, count_R1: jax.Array) -> jax.Array:
    """The first `count` marked tokens of each row in vocabulary order; the running count (a slow scan of the
    vocabulary on XLA:CPU) runs only when some row has more marked tokens than it keeps (equal logits at a cut)."""
    return jax.lax.cond(
        jnp.any(jnp.sum(marked_RV, axis=-1, keepdims=True) > count_R1),
        lambda: marked_RV & (jnp.cumsum(marked_RV, axis=-1, dtype=jnp.int32) <= count_R1),
        lambda: marked_RV,
    )


def _filtered_out(logits_RV, sorted_RK, normalizer_R1, top_p_R, top_k_R):
    """Which tokens top-p, then top-k, remove `[R, V]`, from each row's `K` largest logits in descending order
    (`sorted_RK`) and its softmax normalizer; and whether the row's survivors lie among them (`[R]`: its top-k
    among the `K`, its nucleus among the first `PARTIAL_SORT`).

    Top-p keeps the most likely tokens whose cumulative probability first exceeds `top_p` (the token that crosses
    it stays; at equal logits the lowest ids first, a stable order); a row with `top_p` 1 keeps all, whatever the
    rounding of its cumulative sum. Top-k then keeps the survivors at or above their `top_k`-th value. The
    survivors are found in vocabulary order by value, and at the cut's value by a running count of equal logits:
    no permutation is scattered back (a slow scatter over the vocabulary on XLA:CPU)."""
    K, has_p = sorted_RK.shape[-1], top_p_R < 1
    probabilities = jnp.exp(sorted_RK - sorted_RK[:, :1]) / normalizer_R1
    cumulative = jnp.cumsum(probabilities, axis=-1)  # a running sum: the first entries' do not depend on K
    kept = jnp.where(has_p, 1 + jnp.sum(cumulative[:, :-1] <= top_p_R[:, None], axis=-1), logits_RV.shape[-1])
    # a nucleus fits within the first PARTIAL_SORT whatever K is, so a row's path does not depend on its batch
    fits = (~has_p | (cumulative[:, min(K, PARTIAL_SORT) - 1] > top_p_R)) & (top_k_R <= K)
    kept_R1 = kept[:, None]
    cut = jnp.take_along_axis(sorted_RK, jnp.minimum(kept_R1, K) - 1, axis=-1)
    above, at_cut = logits_RV > cut, logits_RV == cut
    remove = has_p[:, None] & ~(above | _first_marked(at_cut, kept_R1 - jnp.sum(above, -1, keepdims=True)))
    survivors = jnp.where(jnp.arange(K) < kept_R1, sorted_RK, jnp.finfo(sorted_RK.dtype).min)
    return remove | ((top_k_R > 0)[:, None] & (_removed(logits_RV, remove) < _kth(survivors, top_k_R))), fits


def _largest(logits_RV: jax.Array, K: int) -> jax.Array:
    """Each row's `K` largest logits in descending order, `[R, K]`. On a large vocabulary the K largest of the
    chunks' largest logits pick K chunks, which hold the row's K largest values: every logit above the K-th chunk
    maximum lies in a picked chunk, and each picked chunk adds at least its maximum."""
    # the barriers keep XLA:CPU's TopK kernel: slices of its result merged into it turn it into a whole sort
    R, V = logits_RV.shape
    if V < K * CHUNK:
        return jax.lax.optimization_barrier(jax.lax.top_k(logits_RV, min(K, V))[0])
    padded = jnp.pad(logits_RV, ((0, 0), (0, -V % CHUNK)), constant_values=jnp.finfo(logits_RV.dtype).min)
    chunks_RCW = padded.reshape(R, -1, CHUNK)
    picked_RK = jax.lax.optimization_barrier(jax.lax.top_k(jnp.max(chunks_RCW, axis=-1), K)[1])
    candidates = jnp.take_along_axis(chunks_RCW, picked_RK[:, :, None], axis=1).reshape(R, K * CHUNK)
    return jax.lax.optimization_barrier(jax.lax.top_k(candidates, K)[0])


def _ordered_keys(x_RV: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values (-0 as +0): comparisons of keys are comparisons of values."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x_RV == 0, 0.0, x_RV).astype(jnp.float32), jnp.uint32)
    return bits ^ jnp.where(bits >> 31 == 1, jnp.uint32(0xFFFFFFFF), jnp.uint32(0x80000000))


def _largest_key(keys_RV: jax.Array, candidates_RV: jax.Array, holds) -> jax.Array:
    """Per row, the largest of its candidates' keys `m` for which `holds(keys_RV >= m)` (`[R, V]` -> `[R]`, true
    at the smallest candidate, false once it is false) is true, `[R, 1]`: a bisection over the 32 bits of a key,
    no sort."""
    lo = jnp.min(jnp.where(candidates_RV, keys_RV, jnp.uint32(0xFFFFFFFF)), axis=-1, keepdims=True)
    hi = jnp.max(jnp.where(candidates_RV, keys_RV, jnp.uint32(0)), axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2  # > lo while hi > lo; keys of finite floats span less than 2**32 - 1
        ok = holds(keys_RV >= mid)[:, None]
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, halve, (lo, jnp.maximum(hi, lo)))[0]


def _below_kth_key(keys_RV: jax.Array, kept_RV: jax.Array, top_k_R: jax.Array) -> jax.Array:
    """Which tokens have keys below the `top_k`-th largest of their row's kept ones (bisection), `[R, V]`."""
    kth = _largest_key(keys_RV, kept_RV, lambda selected: jnp.sum(selected & kept_RV, axis=-1) >= top_k_R)
    return (top_k_R > 0)[:, None] & (keys_RV < kth)


def _filtered_out_by_bisection(logits_RV, normalizer_R1, top_p_R, top_k_R):
    """`_filtered_out`'s tokens for rows whose survivors lie beyond a partial sort, from the whole vocabulary without
    sorting it: top-p's cut is the largest logit whose tokens at or above it hold more than `top_p` of the
    probability, found by bisection (as are top-k's `top_k`-th value and the count of equal logits the cut keeps).
    The sums run in vocabulary order, where a sort sums in sorted order, so the last bit of a cumulative sum that
    lands on `top_p` itself may round the other way."""
    keys = _ordered_keys(logits_RV)
    probabilities = jnp.exp(logits_RV - jnp.max(logits_RV, axis=-1, keepdims=True)) / normalizer_R1
    top_p_R1 = top_p_R[:, None]

    def mass(selected_RV):
        return jnp.sum(jnp.where(selected_RV, probabilities, 0), axis=-1)

    everything = jnp.ones_like(keys, bool)
    cut = _largest_key(keys, everything, lambda selected: mass(selected) > top_p_R)
    above, at_cut = keys > cut, keys == cut
    # equal logits at the cut are kept in id order while the cumulative sum before each stays within top_p
    mass_above = mass(above)[:, None]
    cut_probability = jnp.max(jnp.where(at_cut, probabilities, 0), axis=-1, keepdims=True)
    room = jnp.floor((top_p_R1 - mass_above) / cut_probability)
    kept_at_cut = jnp.clip(1 + room, 1, jnp.sum(at_cut, axis=-1, keepdims=True)).astype(jnp.int32)
    within = above | _first_marked(at_cut, kept_at_cut)
    cuts = (top_p_R < 1) & (mass(everything) > top_p_R)  # a nucleus that holds every token removes nothing
    remove = cuts[:, None] & ~within

    def top_k_removes():
        return remove | _below_kth_key(keys, ~remove, top_k_R)

    return jax.lax.cond(jnp.any(top_k_R > 0), top_k_removes, lambda: remove)


def filters(logits_RV: jax.Array, top_p_R: jax.Array, top_k_R: jax.Array, sort: bool = True) -> jax.Array:
    """Each row's logits with top-p, then top-k, applied (`_filtered_out`); `top_p` 1 and `top_k` 0 filter nothing.

    The survivors are read off a partial sort of `PARTIAL_SORT` logits, or `TOP_K_SORT` in a batch with a larger
    top-k; when some row's lie beyond it (a nucleus wider than `PARTIAL_SORT`, a top-k above `TOP_K_SORT`) they are
    found by bisection over the whole vocabulary (`_filtered_out_by_bisection`: XLA:CPU sorts a vocabulary slowly),
    which a program built with `sort=False` leaves out (its rows must have no top-p and top-k up to `TOP_K_SORT`;
    on a vocabulary below `TOP_K_SORT * CHUNK` its top-k above `PARTIAL_SORT` is found by bisection).
    When every filtered row's nucleus is certainly wider than `PARTIAL_SORT` (its largest probability times that
    stays below its top-p) the partial sort is skipped. A row's result is the same in any batch."""
    V = logits_RV.shape[-1]

    def by_partial_sort(read_off):
        """`read_off(K largest logits of each row)`, with K the smaller partial sort that holds every row's top-k."""

        def sorted_by(K):
            return lambda: read_off(_largest(logits_RV, K))

        if V <= PARTIAL_SORT:
            return sorted_by(V)()
        return jax.lax.cond(jnp.max(top_k_R) <= PARTIAL_SORT, sorted_by(PARTIAL_SORT), sorted_by(TOP_K_SORT))

    if not sort:  # no row has a top-p: top-k alone

        def below_kth(sorted_RK):
            return _below_kth(logits_RV, sorted_RK, top_k_R)

        if not PARTIAL_SORT < V < TOP_K_SORT * CHUNK:
            return _removed(logits_RV, by_partial_sort(below_kth))
        keys, everything = _ordered_keys(logits_RV), jnp.ones(logits_RV.shape, bool)
        remove = jax.lax.cond(
            jnp.max(top_k_R) <= PARTIAL_SORT,
            lambda: below_kth(_largest(logits_RV, PARTIAL_SORT)),
            lambda: _below_kth_key(keys, everything, top_k_R),  # cheaper than a TopK of 64 on a small vocabulary
        )
        return _removed(logits_RV, remove)
    normalizer = jnp.sum(jnp.exp(logits_RV - jnp.max(logits_RV, axis=-1, keepdims=True)), axis=-1, keepdims=True)
    if V <= PARTIAL_SORT:
        return _removed(
            logits_RV, by_partial_sort(lambda s: _filtered_out(logits_RV, s, normalizer, top_p_R, top_k_R)[0])
        )

    def whole_vocabulary():
        return _filtered_out_by_bisection(logits_RV, normalizer, top_p_R, top_k_R)

    def read_off(sorted_RK):
        remove, fits = _filtered_out(logits_RV, sorted_RK, normalizer, top_p_R, top_k_R)
        return jax.lax.cond(jnp.all(fits), lambda: remove, lambda: jnp.where(fits[:, None], remove, whole_vocabulary()))

    # the PARTIAL_SORT largest of a row's probabilities sum to at most that many times its largest (1.001: rounding)
    wide = (top_p_R < 1) & (PARTIAL_SORT * 1.001 / normalizer[:, 0] <= top_p_R)
    unfiltered = (top_p_R >= 1) & (top_k_R <= 0)
    return _removed(
        logits_RV, jax.lax.cond(jnp.all(wide | unfiltered), whole_vocabulary, lambda: by_partial_sort(read_off))
    )


def _max_and_argmax(a_RV: jax.Array):
    """Max and first index of the max over the vocabulary, as two plain reductions: XLA:CPU's fused argmax
    reduction is several times slower (docs/performance.md, "Plain reductions")."""
    top = jnp.max(a_RV, axis=-1)
    index = jax.lax.broadcasted_iota(jnp.int32, a_RV.shape, 1)
    return top, jnp.min(jnp.where(a_RV == top[:, None], index, a_RV.shape[-1]), axis=-1)


def _categorical(keys_R, probs_RV: jax.Array) -> jax.Array:
    """One token per row drawn from its probabilities with its key, by the inverse of the cumulative distribution:
    one uniform number per row where a Gumbel draw takes one per token (docs/performance.md, "Sampling filters"). A
    token of probability 0 is never drawn: its interval of the cumulative sum is empty."""
    cumulative_RV = jnp.cumsum(probs_RV, axis=-1)
    u_R1 = jax.vmap(jax.random.uniform)(keys_R)[:, None] * cumulative_RV[:, -1:]
    drawn_R = jnp.sum(cumulative_RV <= u_R1, axis=-1)
    # the last token of positive probability bounds a draw that rounds up to the whole sum
    last_R = jnp.max(jnp.where(probs_RV > 0, jax.lax.broadcasted_iota(jnp.int32, probs_RV.shape, 1), 0), axis=-1)
    return jnp.minimum(drawn_R, last_R).astype(jnp.int32)


def _per_position(value_B: jax.Array, S: int) -> jax.Array:
    return jnp.repeat(value_B, S, axis=0)


def sample_tokens(
    logits_BSV: jax.Array, keys_B, positions_BS: jax.Array, alg: str, rows: Rows, branches: Branches = Branches()
) -> Scores:
    """Upstream `sample_tokens` from logits `[B, S, V]`: per position the candidate token, its probability and the
    confidence `alg` ranks by: maskgit_plus/origin the candidate's probability, topk_margin top-1 minus top-2
    probability, entropy the negative entropy. Computed in float32; the confidence is returned in the logits dtype.
    A row with a temperature draws its candidates from `fold_in(keys_B[b], positions_BS[b, s])`."""
    dtype, (B, S, V) = logits_BSV.dtype, logits_BSV.shape
    # [rows, V]: XLA:CPU runs vocabulary reductions several times slower on a 3-D array
    logits = logits_BSV.reshape(B * S, V).astype(jnp.float32)
    temperature, top_p, top_k = (_per_position(v, S) for v in (rows.temperature, rows.top_p, rows.top_k))
    logits = logits / jnp.where(temperature > 0, temperature, 1)[:, None]  # x / 1 is x, bit for bit
    if branches.filters:
        logits = jax.lax.cond(
            jnp.any(top_p < 1) | jnp.any(top_k > 0),
            lambda lg: filters(lg, top_p, top_k, sort=branches.filters > 1),
            lambda lg: lg,
            logits,
        )
    probs = jax.nn.softmax(logits, axis=-1)
    top1, first_top = _max_and_argmax(probs)

    def drawn():
        keys = jax.vmap(jax.random.fold_in)(_per_position(keys_B, S), positions_BS.reshape(-1))
        x0 = jnp.where(temperature > 0, _categorical(keys, probs), first_top)
        return x0, jnp.take_along_axis(probs, x0[:, None], axis=-1)[:, 0]

    x0, confidence = first_top, top1
    if branches.draw:
        x0, confidence = jax.lax.cond(jnp.any(temperature > 0), drawn, lambda: (first_top, top1))
    probability = confidence
    if alg == "topk_margin":
        # top-1 minus top-2 probability; a tied maximum gives 0 as the sorted pair does
        vocab = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
        second = jnp.max(jnp.where(vocab == first_top[..., None], -jnp.inf, probs), axis=-1)
        confidence = top1 - second
    elif alg == "entropy":
        confidence = jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
    return Scores(confidence.astype(dtype).reshape(B, S), x0.astype(jnp.int32).reshape(B, S), probability.reshape(B, S))


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


def masked_scores(
    head, hidden_at, is_mask_BW, keys_B, alg: str, rows: Rows, branches: Branches = Branches(), *, packed: bool
) -> Scores:
    """`sample_tokens` at every mask position of the window (elsewhere anything: `unmask` reads the masks alone).
    `hidden_at(index_BS)` gives the final hidden states `[B, S, D]` that score the window positions `index_BS`,
    computed there too if it can.
    `packed` (`runtime.packs_masks`): the vocabulary projection `head` and the sampler run at the masks alone, packed
    to the front into the smallest static bucket that holds every row's count (`lax.switch`) and scattered back;
    else at the whole window, in one copy of the sampler."""
    B, W = is_mask_BW.shape
    if not packed:
        window_BW = jnp.broadcast_to(jnp.arange(W), (B, W))
        confidence, x0, probability = sample_tokens(head(hidden_at(window_BW)), keys_B, window_BW, alg, rows, branches)
        return Scores(confidence, x0, probability.astype(jnp.float32))
    sizes = bucket_sizes(W)
    most = jnp.max(jnp.sum(is_mask_BW, axis=-1))
    branch = jnp.searchsorted(jnp.asarray(sizes), most)
    order_BW = jnp.argsort(~is_mask_BW, axis=-1, stable=True)  # mask positions first, in order
    batch = jnp.arange(B)[:, None]

    def packed_into(size):
        def run(_):
            index_BS = order_BW[:, :size]
            confidence, x0, probability = sample_tokens(
                head(hidden_at(index_BS)), keys_B, index_BS, alg, rows, branches
            )
            return Scores(
                jnp.full((B, W), -jnp.inf, confidence.dtype).at[batch, index_BS].set(confidence),
                jnp.zeros((B, W), jnp.int32).at[batch, index_BS].set(x0),
                jnp.zeros((B, W), jnp.float32).at[batch, index_BS].set(probability),
            )

        return run

    return Scores(*jax.lax.switch(branch, [packed_into(size) for size in sizes], None))


def _row_draws(draw, keys_B, W: int) -> jax.Array:
    """`draw(key, (W,))` for each row with its own key, `[B, W]`."""
    return jax.vmap(lambda key: draw(key, (W,)))(keys_B)


def unmask(window_BW, scores: Scores, keys_B, n, p_transfer, *, alg: str, rows: Rows, mask_token_id: int):
    """Unmask part of a canvas window given each position's scores.

    The ranking algorithms unmask the `n` best-scored masks of each row (`n` broadcasts against `[B, 1]`: one
    count for the batch, or one per row); `origin` unmasks each mask with probability `p_transfer`. Ties: among
    exactly equal scores the leftmost position is unmasked first. A row with an `alg_temp` ranks by its
    confidences sampled with Gumbel noise from its key in `keys_B`. With a threshold, every mask of the row whose
    candidate's probability reaches it is unmasked too, and while the row has masks at least one (its best-scored)
    is. A chosen slot that holds no mask (`n` above a row's masks) gets the mask token, as upstream writes it.
    Returns the new window, the confidence (-inf off masks), the candidates (-1 off masks) and the count unmasked
    per row.
    """
    B, W = window_BW.shape
    is_mask = window_BW == mask_token_id
    confidence = jnp.where(is_mask, scores.confidence, -jnp.inf)
    ranked = confidence.astype(jnp.float32)
    if alg != "origin":
        # Multinomial without replacement over softmax(confidence / alg_temp) = Gumbel top-n.
        alg_temp = rows.alg_temp[:, None]
        ranked = jax.lax.cond(
            jnp.any(alg_temp > 0),
            lambda: jnp.where(
                alg_temp > 0,
                ranked / jnp.where(alg_temp > 0, alg_temp, 1) + _row_draws(jax.random.gumbel, keys_B, W),
                ranked,
            ),
            lambda: ranked,
        )
        transfer = _rank_desc(ranked) < n
    else:
        transfer = is_mask & (_row_draws(jax.random.uniform, keys_B, W) < p_transfer)
    threshold = rows.threshold[:, None]
    transfer = transfer | (is_mask & (scores.probability >= threshold))
    none_yet = jnp.isfinite(threshold) & ~jnp.any(transfer & is_mask, axis=-1, keepdims=True)
    transfer = transfer | (none_yet & is_mask & (_rank_desc(ranked) == 0))
    new_window = jnp.where(transfer, jnp.where(is_mask, scores.x0, mask_token_id), window_BW)
    transfer = transfer & is_mask
    return new_window, confidence, jnp.where(is_mask, scores.x0, -1), jnp.sum(transfer, axis=-1, dtype=jnp.int32)
