"""Masked-diffusion generation (upstream `DreamGenerationMixin.diffusion_generate`), compiled whole.

The prompt is extended with `max_new_tokens` mask tokens; each of `steps` denoising steps runs
the model on the full canvas, shifts the logits by one position, scores every masked position
and unmasks the most confident ones. The step loop is a `lax.fori_loop` inside one `jit`.

Work avoided without changing any result: the vocabulary projection and the sampler only run at
positions that still hold a mask token (packed into a few static sizes), since no other logits are
ever read; the canvas window starts at the first position that can hold one.

Block-wise generation (`block_length`, `cache`, `threshold`: Fast-dLLM's fast decoding) lives in
`jaxport.dream.fast` and shares this module's sampler and unmasking rule.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport.compile_time import compiler_options, jit_with_options
from jaxport.errors import JaxportError

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclasses.dataclass
class GenerationOutput:
    """`sequences [B, N]`; with `output_history`, `history [steps, B, N]` (x after each step); with
    `output_scores`, per step: `confidence [steps, B, N]` (-inf off mask positions), `x0` (candidate
    token at mask positions, -1 elsewhere) and `n_transfer [steps, B]` (positions unmasked)."""

    sequences: jax.Array
    history: jax.Array | None = None
    confidence: jax.Array | None = None
    x0: jax.Array | None = None
    n_transfer: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    steps: int
    alg: str
    temperature: float
    top_p: float | None
    top_k: int | None
    alg_temp: float | None
    eps: float
    mask_token_id: int
    first: int  # first canvas position that can hold a mask token (static)
    output_history: bool
    output_scores: bool
    tokens_hook: Callable | None
    logits_hook: Callable | None
    progress: Callable | None
    block_length: int | None = None  # None: the exact path; else block-wise (jaxport.dream.fast)
    cache: str | None = None
    threshold: float | None = None
    refresh_cache_every_step: bool = False


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


def padding_inputs(attention_mask: jax.Array | None, batch: int, length: int):
    """Boolean attention mask and position ids as upstream's sampler derives them from a 2-D mask.

    Pad queries see no key at all (`m[i, j] = valid[i] & valid[j]`; their attention output is
    zero, as torch SDPA gives) and positions count real tokens only (`cumsum(valid) - 1`, pads
    at 1). With no mask this is full attention over positions `0..N-1`.
    """
    if attention_mask is None:
        return None, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    valid_BN = attention_mask.astype(bool)
    position_ids = jnp.where(valid_BN, jnp.cumsum(valid_BN, axis=-1, dtype=jnp.int32) - 1, 1)
    return valid_BN[:, None, :, None] & valid_BN[:, None, None, :], position_ids


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
    reduction is about seven times slower (14.4 against 1.9 ms on [256, 32000], 2026-11-26, 2-core AMX host)."""
    top = jnp.max(a_RV, axis=-1)
    index = jax.lax.broadcasted_iota(jnp.int32, a_RV.shape, 1)
    return top, jnp.min(jnp.where(a_RV == top[:, None], index, a_RV.shape[-1]), axis=-1)


def sample_tokens(logits: jax.Array, key, cfg: SamplingConfig):
    """Upstream `sample_tokens`: (confidence, token, the token's probability) per position from logits `[..., V]`.

    Confidence: maskgit_plus/origin the chosen token's probability, topk_margin top-1 minus top-2
    probability, entropy the negative entropy. Computed in float32, returned in the logits dtype
    (the probability, which `threshold` compares, stays float32).
    """
    dtype, lead = logits.dtype, logits.shape[:-1]
    # [rows, V]: XLA:CPU runs vocabulary reductions several times slower on a 3-D array
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)
    if cfg.temperature > 0:
        logits = logits / cfg.temperature
    if cfg.top_p is not None and cfg.top_p < 1:
        logits = top_p_filter(logits, cfg.top_p)
    if cfg.top_k is not None:
        logits = top_k_filter(logits, cfg.top_k)
    probs = jax.nn.softmax(logits, axis=-1)
    top1, first_top = _max_and_argmax(probs)
    if cfg.temperature > 0:
        x0 = jax.random.categorical(key, logits, axis=-1)
        confidence = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    else:
        x0, confidence = first_top, top1
    probability = confidence
    if cfg.alg == "topk_margin":
        # top-1 minus top-2 probability; a tied maximum gives 0 as the sorted pair does
        vocab = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
        second = jnp.max(jnp.where(vocab == first_top[..., None], -jnp.inf, probs), axis=-1)
        confidence = top1 - second
    elif cfg.alg == "entropy":
        confidence = jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
    return confidence.astype(dtype).reshape(lead), x0.astype(jnp.int32).reshape(lead), probability.reshape(lead)


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


def masked_scores(model, hidden_at, is_mask_BW, key, cfg: SamplingConfig):
    """`sample_tokens` at every mask position of the window, computing the vocabulary projection and
    the sampler only there: the masks are packed to the front into the smallest static bucket that
    holds every row's count (`lax.switch`), then scattered back. `hidden_at(index_BS)` gives the final
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
            logits = model.head(hidden_at(index_BS))
            confidence, x0, probability = sample_tokens(logits, key, cfg)
            return (
                jnp.full((B, W), -jnp.inf, confidence.dtype).at[rows, index_BS].set(confidence),
                jnp.zeros((B, W), jnp.int32).at[rows, index_BS].set(x0),
                jnp.zeros((B, W), jnp.float32).at[rows, index_BS].set(probability),
            )

        return run

    return jax.lax.switch(branch, [packed(size) for size in sizes], None)


def unmask(window_BW, confidence_BW, x0_BW, probability_BW, select_key, n, p_transfer, cfg: SamplingConfig):
    """Unmask part of a canvas window given each position's confidence, candidate and its probability.

    The ranking algorithms unmask the `n` best-scored masks of each row (`n` is shared by the batch
    on the exact path, `[B, 1]` per row block-wise); `origin` unmasks each mask with probability
    `p_transfer`. Ties: among exactly equal scores the leftmost position is unmasked first. With
    `cfg.threshold`, every mask whose candidate's probability reaches it is unmasked too, and while
    a row has masks at least one (its best-scored) is. Returns the new window, the confidence (-inf
    off masks), the candidates (-1 off masks) and the count unmasked per row.
    """
    is_mask = window_BW == cfg.mask_token_id
    confidence = jnp.where(is_mask, confidence_BW, -jnp.inf)
    if cfg.alg_temp and cfg.alg != "origin":
        # Multinomial without replacement over softmax(confidence / alg_temp) = Gumbel top-n.
        scores = confidence.astype(jnp.float32) / cfg.alg_temp + jax.random.gumbel(select_key, window_BW.shape)
    else:
        scores = confidence
    if cfg.alg == "origin":
        transfer = is_mask & (jax.random.uniform(select_key, window_BW.shape) < p_transfer)
    else:
        transfer = _rank_desc(scores) < n
    if cfg.threshold is not None:
        transfer = transfer | (is_mask & (probability_BW >= cfg.threshold))
        none_yet = ~jnp.any(transfer & is_mask, axis=-1, keepdims=True)
        transfer = transfer | (none_yet & is_mask & (_rank_desc(scores) == 0))
    # Upstream writes x0 at mask positions and the mask token elsewhere in the chosen slots.
    new_window = jnp.where(transfer, jnp.where(is_mask, x0_BW, cfg.mask_token_id), window_BW)
    transfer = transfer & is_mask
    return new_window, confidence, jnp.where(is_mask, x0_BW, -1), jnp.sum(transfer, axis=-1, dtype=jnp.int32)


def decoding_compiler_options(model, x_BN) -> dict | None:
    """The compiler options for decoding the canvas `x_BN` on its devices (see `compile_time.compiler_options`)."""
    devices = x_BN.sharding.device_set
    return compiler_options(x_BN.size // len(devices), model.dtype, next(iter(devices)).platform)


def decoding_program(function, model, x_BN, **jit_kwargs):
    """`function` jitted with `decoding_compiler_options`. jax.jit over (graphdef, state) rather than nnx.jit:
    nnx.jit's state bookkeeping tripled the cost of a small forward here."""
    return jit_with_options(function, decoding_compiler_options(model, x_BN), **jit_kwargs)


def _generate(graphdef, state, x_BN, attention_mask_BN, key, cfg: SamplingConfig):
    model = nnx.merge(graphdef, state)
    B, N = x_BN.shape
    mask, position_ids = padding_inputs(attention_mask_BN, B, N)
    ratios = jnp.asarray(transfer_ratios(cfg.steps, cfg.eps))
    hooks = cfg.tokens_hook is not None or cfg.logits_hook is not None
    if cfg.tokens_hook is not None:
        x_BN = cfg.tokens_hook(None, x_BN, None)

    def body(step, carry):
        x_BN, records = carry
        hidden_at_rows = model.hidden_states_at(x_BN, mask, position_ids)

        # Window position j is predicted from the hidden state at canvas position first + j - 1 (0 from itself).
        def hidden_at(index_BW):
            return hidden_at_rows(jnp.maximum(index_BW + cfg.first - 1, 0))

        sample_key, select_key = jax.random.split(jax.random.fold_in(key, step))
        logits = None
        if hooks:
            logits = model.head(hidden_at(jnp.broadcast_to(jnp.arange(N - cfg.first), (B, N - cfg.first))))
            if cfg.logits_hook is not None:
                logits = cfg.logits_hook(step, x_BN, logits)
            confidence, x0, probability = sample_tokens(logits, sample_key, cfg)
        else:
            confidence, x0, probability = masked_scores(
                model, hidden_at, x_BN[:, cfg.first :] == cfg.mask_token_id, sample_key, cfg
            )
        # The count is shared by the batch: masks per row on average, truncated as int() does.
        num_mask = jnp.sum(x_BN == cfg.mask_token_id).astype(jnp.float32) / jnp.float32(B)
        n = jnp.floor(num_mask * ratios[step]).astype(jnp.int32)
        window, confidence, x0, n_transfer = unmask(
            x_BN[:, cfg.first :], confidence, x0, probability, select_key, n, ratios[step], cfg
        )
        x_BN = jax.lax.dynamic_update_slice_in_dim(x_BN, window, cfg.first, axis=1)
        if cfg.tokens_hook is not None:
            x_BN = cfg.tokens_hook(step, x_BN, logits)
        if cfg.progress is not None:
            jax.debug.callback(cfg.progress, step, x_BN, ordered=True)
        pad = cfg.first
        updates = {
            "history": x_BN,
            "confidence": jnp.pad(confidence, ((0, 0), (pad, 0)), constant_values=-jnp.inf),
            "x0": jnp.pad(x0, ((0, 0), (pad, 0)), constant_values=-1),
            "n_transfer": n_transfer,
        }
        records = {k: v.at[step].set(updates[k].astype(v.dtype)) for k, v in records.items()}
        return x_BN, records

    records = {}
    if cfg.output_history:
        records["history"] = jnp.zeros((cfg.steps, B, N), jnp.int32)
    if cfg.output_scores:
        records["confidence"] = jnp.zeros((cfg.steps, B, N), model.dtype)
        records["x0"] = jnp.zeros((cfg.steps, B, N), jnp.int32)
        records["n_transfer"] = jnp.zeros((cfg.steps, B), jnp.int32)
    return jax.lax.fori_loop(0, cfg.steps, body, (x_BN, records))


def _check(name: str, ok: bool, message: str):
    if not ok:
        raise JaxportError(f"{name}: {message}")


CACHES = ("prefix", "dual")


def prepare_generation(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    steps: int = 512,
    alg: str = "origin",
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    alg_temp: float | None = None,
    eps: float = 1e-3,
    output_history: bool = False,
    rng: jax.Array | None = None,
    generation_tokens_hook_func: Callable | None = None,
    generation_logits_hook_func: Callable | None = None,
    output_scores: bool = False,
    mask_token_id: int | None = None,
    progress: Callable | None = None,
    block_length: int | None = None,
    cache: str | None = None,
    threshold: float | None = None,
    blockwise: bool = False,
    refresh_cache_every_step: bool = False,
):
    """Check the arguments of `diffusion_generate` (documented there) and return `(canvas, attention mask
    or None, key, SamplingConfig)`, the canvas and mask placed on the model's mesh.

    `blockwise` generates block-wise even without `block_length`/`cache`/`threshold` (then one block);
    `refresh_cache_every_step` (for tests) rebuilds the cache before every step, so the cached path
    must give the tokens of the cache-free one.
    """
    input_ids = np.asarray(input_ids)
    _check(
        "input_ids",
        input_ids.ndim == 2 and np.issubdtype(input_ids.dtype, np.integer),
        f"expected an integer array [batch, length], got {input_ids.dtype} {list(input_ids.shape)}",
    )
    B, L = input_ids.shape
    _check("input_ids", L > 0 and B > 0, "empty prompt batch")
    _check(
        "input_ids",
        int(input_ids.min()) >= 0 and int(input_ids.max()) < model.config.vocab_size,
        f"token ids must lie in [0, {model.config.vocab_size}) (vocab_size)",
    )
    if max_new_tokens is not None:
        max_length = L + max_new_tokens
    elif max_length is None:
        max_length = 20  # upstream DreamGenerationConfig default
    _check(
        "max_length",
        L < max_length,
        f"the prompt has {L} tokens but max_length is {max_length}; raise max_length or max_new_tokens",
    )
    new_tokens = max_length - L
    _check(
        "max_length",
        max_length <= model.config.max_position_embeddings,
        f"the prompt ({L} tokens) and {new_tokens} new tokens need {max_length} positions, more than the model's "
        f"max_position_embeddings ({model.config.max_position_embeddings}, config.json); shorten the prompt or "
        f"generate fewer tokens",
    )
    _check("alg", alg in ALGORITHMS, f"unknown alg {alg!r}; choose one of {', '.join(ALGORITHMS)}")
    _check(
        "steps",
        isinstance(steps, (int, np.integer)) and 1 <= steps <= new_tokens,
        f"steps={steps} must be between 1 and the number of new tokens ({new_tokens})",
    )
    _check("temperature", temperature is not None and temperature >= 0, f"must be >= 0, got {temperature}")
    _check("top_p", top_p is None or 0 < top_p <= 1, f"must be in (0, 1], got {top_p}")
    _check(
        "top_k",
        top_k is None or (isinstance(top_k, (int, np.integer)) and top_k > 0),
        f"must be a positive integer, got {top_k}",
    )
    _check("alg_temp", alg_temp is None or alg_temp >= 0, f"must be >= 0, got {alg_temp}")
    _check("eps", 0 < eps < 1, f"must be in (0, 1), got {eps}")
    mask_token_id = model.config.mask_token_id if mask_token_id is None else mask_token_id
    prompt_masks = np.nonzero((input_ids == mask_token_id).any(axis=0))[0]
    hooks = generation_tokens_hook_func is not None or generation_logits_hook_func is not None
    # Hooks see every position, as upstream's do; otherwise start at the first possible mask.
    first = 0 if hooks else int(prompt_masks[0]) if len(prompt_masks) else L
    if blockwise or block_length is not None or cache is not None or threshold is not None:
        _check("cache", cache is None or cache in CACHES, f"must be None, 'prefix' or 'dual', got {cache!r}")
        _check("threshold", threshold is None or 0 < threshold <= 1, f"must be in (0, 1], got {threshold}")
        block_length = new_tokens if block_length is None else block_length
        _check(
            "block_length",
            isinstance(block_length, (int, np.integer))
            and 0 < block_length <= new_tokens
            and new_tokens % block_length == 0,
            f"block_length={block_length} must divide the number of new tokens ({new_tokens})",
        )
        blocks = new_tokens // block_length
        _check(
            "steps",
            steps % blocks == 0,
            f"steps={steps} must be divisible by the number of blocks ({blocks} = "
            f"{new_tokens} new tokens / block_length {block_length})",
        )
        _check(
            "input_ids",
            not len(prompt_masks),
            "the prompt holds mask tokens, and block-wise generation fills "
            "only the new tokens; fill them with the exact path (no block_length, cache or threshold)",
        )
        _check(
            "generation_logits_hook_func",
            generation_logits_hook_func is None,
            "not available block-wise (the steps score only the current block); use the exact path",
        )
        first = L

    if attention_mask is not None:
        attention_mask = np.asarray(attention_mask)
        _check(
            "attention_mask",
            attention_mask.shape == input_ids.shape,
            f"shape {list(attention_mask.shape)} differs from input_ids {list(input_ids.shape)}",
        )
        # Upstream passes no mask at all when nothing is padded; the result is the same.
        attention_mask = (
            None
            if attention_mask.all()
            else np.pad(attention_mask.astype(bool), ((0, 0), (0, new_tokens)), constant_values=True)
        )
    x = np.concatenate([input_ids.astype(np.int32), np.full((B, new_tokens), mask_token_id, np.int32)], axis=1)
    cfg = SamplingConfig(
        steps=int(steps),
        alg=alg,
        temperature=float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=None if top_k is None else int(top_k),
        alg_temp=None if not alg_temp else float(alg_temp),
        eps=float(eps),
        mask_token_id=int(mask_token_id),
        first=first,
        output_history=bool(output_history),
        output_scores=bool(output_scores),
        tokens_hook=generation_tokens_hook_func,
        logits_hook=generation_logits_hook_func,
        progress=progress,
        block_length=None if block_length is None else int(block_length),
        cache=cache,
        threshold=None if threshold is None else float(threshold),
        refresh_cache_every_step=bool(refresh_cache_every_step),
    )
    x, attention_mask = model.place_batch(x, attention_mask)
    return x, attention_mask, jax.random.key(0) if rng is None else rng, cfg


def diffusion_generate(
    model, input_ids, attention_mask=None, *, return_dict_in_generate: bool = True, **generation_args
):
    """Generate with upstream's semantics: the canvas is `input_ids` followed by mask tokens up to
    `max_length` (or `max_new_tokens` more). No eos handling: every position is filled.

    Upstream's arguments and defaults: `max_length` (20) or `max_new_tokens`, `steps` (512), `alg`
    (origin, maskgit_plus, topk_margin, entropy), `temperature` (0), `top_p`, `top_k`, `alg_temp`,
    `eps` (1e-3), `output_history`, `output_scores`, `mask_token_id` (the config's).

    Ties: when the unmasking count cuts through exactly equal confidences (common with `top_k=1` or
    a tight `top_p`, where confidences saturate), the leftmost positions are unmasked first, on every
    device, mesh and batch size and block-wise too (upstream's `torch.topk` order is unspecified).

    Hooks are traced JAX functions: `generation_tokens_hook_func(step, x, logits) -> x` runs once
    before the loop (step and logits None) and after every step; `generation_logits_hook_func(step,
    x, logits) -> logits` sees the shifted logits `[B, N, V]` before sampling. `progress(step, x)` is
    called on the host after each step. `rng` seeds the random draws (origin, temperature > 0,
    alg_temp > 0); the default is `jax.random.key(0)`.

    Fast decoding (Fast-dLLM; see `jaxport.dream.fast`): `block_length` generates the new tokens in
    blocks of that many, left to right, `steps / blocks` steps each; `cache` ("prefix" or "dual") keeps
    an approximate KV cache refreshed at each block's first step; `threshold` in (0, 1] also unmasks
    every mask of the block whose candidate has at least that probability. Any of them selects the
    block-wise path (`block_length` defaults to all new tokens); without them this is the exact path.
    Block-wise, the logits hook is not available, the tokens hook gets `logits=None`, and a block whose
    masks are all filled ends early (its remaining steps are recorded as unchanged).
    """
    x, attention_mask, rng, cfg = prepare_generation(model, input_ids, attention_mask, **generation_args)
    if cfg.block_length is None:
        program = decoding_program(_generate, model, x, static_argnames=("graphdef", "cfg"))
        sequences, records = program(*nnx.split(model), x, attention_mask, rng, cfg)
    else:
        from jaxport.dream.fast import run_blocks  # fast.py builds on this module

        outputs = [block.output for block in run_blocks(model, x, attention_mask, rng, cfg)]
        sequences = outputs[-1].sequences
        records = {
            name: jnp.concatenate([getattr(out, name) for out in outputs])
            for name in ("history", "confidence", "x0", "n_transfer")
            if getattr(outputs[0], name) is not None
        }
    if not return_dict_in_generate:
        return sequences
    return GenerationOutput(sequences=sequences, **records)


def decoding_target(model, x_BN, attention_mask_BN, key, cfg: SamplingConfig) -> tuple:
    """`(jitted program, arguments)` of the decoding `diffusion_generate` runs on arguments `prepare_generation`
    prepared: the exact path's whole loop, or block-wise the first block's steps (for `--compile-for`)."""
    if cfg.block_length is not None:
        from jaxport.dream.fast import block_target

        return block_target(model, x_BN, attention_mask_BN, key, cfg)
    program = decoding_program(_generate, model, x_BN, static_argnames=("graphdef", "cfg"))
    return program, (*nnx.split(model), x_BN, attention_mask_BN, key, cfg)
