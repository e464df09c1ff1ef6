"""Block-wise decoding with an approximate KV cache and confidence-threshold unmasking (Fast-dLLM, Wu et al. 2025,
arXiv 2505.22618), batched.

The new tokens are generated in blocks of `block_length`, left to right. A block's first step runs the whole
canvas (keeping every layer's keys/values with a cache); its later steps score only the block's masks:

* `cache=None`: every step runs the whole canvas.
* `cache="prefix"`: the later steps run the block and everything after it, attending over the kept prefix.
* `cache="dual"`: the later steps run only the block, attending over the kept prefix and suffix.

The window's fresh keys/values replace the kept ones at its positions; every other position keeps the states of
the block's first step (the approximation). Two schedules say what each step unmasks (`schedule`):

* `"fastdllm"`, Fast-dLLM's `generation_utils_block._sample` token for token: the first step fixes the block's
  first position only; the windows start at the block (its first position is scored from its own hidden state,
  the others from the position before). Without `threshold`, steps 1 .. steps_per_block - 1 unmask the
  best-ranked masks, as many as the schedule's share (`transfer_ratios`) of the batch's average number of masks
  in the block (one count for every row; a row with fewer masks has the mask token written into the extra
  slots, as Fast-dLLM writes it). Fast-dLLM ranks by negative entropy (`alg="entropy"`). With `threshold`
  (Fast-dLLM's `confidence_threshold`: `alg="maskgit_plus"`), each step unmasks every mask whose candidate has
  at least that probability, and the best-ranked one if none has; there is no step budget, the block runs until
  it has no mask. Position ids are jaxport's (padding ignored), which are Fast-dLLM's plain range on the
  unpadded, equal-length prompts Fast-dLLM decodes.
* `"jaxport"` (the default): every step, the first included, unmasks the schedule's share of each row's own
  masks in the block (so a row's tokens do not depend on the other rows), plus, with `threshold`, every mask
  whose candidate has at least that probability and at least one per row; each block has `steps / blocks`
  steps, its last forcing what is left. The windows start one position before the block, so every position is
  scored from a freshly computed predecessor.

Both schedules are extended beyond what Fast-dLLM runs: the threshold, the dual cache and padded prompts
work batched (per-row decisions, jaxport's padding rule), and a block ends as soon as no row has a mask in it.
Ties among exactly equal scores go to the leftmost position (`sampling.unmask`).

The steps of a block are one compiled `while_loop`. Blocks are calls of that program: compiled once for all
blocks, or once per block index for the prefix cache (its window shrinks from block to block), so a caller can
stream each finished block (`generate_blocks`).
"""

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport.dream.program import (
    RECORDS,
    GenerationOutput,
    Prepared,
    Program,
    decoding_program,
    padding_inputs,
    prepare_generation,
    record,
)
from jaxport.dream.sampling import Scores, masked_scores, sample_tokens, transfer_ratios, unmask
from jaxport.nn import take_rows


@dataclasses.dataclass
class FinishedBlock:
    """One finished block: canvas positions `start .. end - 1` are final. `output.sequences` is the
    canvas so far (later blocks still masked); its records cover this block's steps."""

    index: int
    start: int
    end: int
    output: GenerationOutput

    @property
    def tokens(self) -> jax.Array:
        """The block's tokens `[B, block_length]`."""
        return self.output.sequences[:, self.start : self.end]


def _block(graphdef, state, x_BN, valid_BN, key, block, program: Program, refresh: bool):
    """Run the steps of block `block` (static for the prefix cache, traced otherwise) on the canvas. `refresh`
    (for tests) rebuilds the cache from the current canvas before every cached step."""
    model = nnx.merge(graphdef, state)
    settings, row, mask_id = program.settings, program.row, program.mask_token_id
    B, N = x_BN.shape
    width, cache_kind, fastdllm = settings.block_length, settings.cache, settings.schedule == "fastdllm"
    steps = program.block_steps(N - program.first)
    start = program.first + block * width
    mask, position_ids = padding_inputs(valid_BN, B, N)
    # the schedule of `steps / blocks` steps (unread under Fast-dLLM's threshold, whose budget may be longer)
    ratios = jnp.asarray(transfer_ratios(settings.steps // ((N - program.first) // width), settings.eps))
    lead = 0 if fastdllm else 1  # the cached windows start this many positions before the block
    # block position j is scored from window row j + lead - 1 (Fast-dLLM: the first from itself)
    scoring_rows = np.maximum(np.arange(width) + lead - 1, 0)

    def full_forward(x_BN):
        """(hidden states predicting the block, the cache) from the whole canvas."""
        h_BND, cache = model.hidden_states_cached(x_BN, mask, position_ids)
        return jax.lax.dynamic_slice_in_dim(h_BND, start - 1, width, axis=1), cache

    def cached_forward(x_BN, cache):
        if refresh:
            cache = full_forward(x_BN)[1]
        begin = start - lead
        size = width + lead if cache_kind == "dual" else N - begin  # the block, or the block and the suffix
        ids_BS, positions_BS = (jax.lax.dynamic_slice_in_dim(a, begin, size, axis=1) for a in (x_BN, position_ids))
        h_BSD, _ = model.hidden_states_cached(ids_BS, valid_BN, positions_BS, cache, begin)
        return h_BSD[:, scoring_rows], cache

    def forward(x_BN, cache, step):
        """(`hidden_at`: block positions -> the hidden states that score them, the cache). Without a cache, as the
        exact path: the last layer's queries and MLP run at the positions scored only."""
        if cache_kind is None:
            hidden_at_rows = model.hidden_states_at(x_BN, mask, position_ids)
            return (lambda index_BW: hidden_at_rows(index_BW + start - 1)), None
        h_BWD, cache = jax.lax.cond(step == 0, lambda: full_forward(x_BN), lambda: cached_forward(x_BN, cache))
        return functools.partial(take_rows, h_BWD), cache

    def in_block(a_BN):
        return jax.lax.dynamic_slice_in_dim(a_BN, start, width, axis=1)

    def on_canvas(values_BW, fill):
        return jax.lax.dynamic_update_slice_in_dim(jnp.full((B, N), fill, values_BW.dtype), values_BW, start, axis=1)

    def transfer_count(is_mask_BW, step):
        """How many of each row's masks the ranking unmasks at this step, `[B, 1]`."""
        masks_B1 = jnp.sum(is_mask_BW, axis=-1, keepdims=True).astype(jnp.float32)
        if fastdllm and row.threshold is not None:
            return jnp.zeros((B, 1), jnp.int32)  # the threshold rule alone decides
        if fastdllm:  # one count for the batch: its average number of masks in the block
            masks_B1 = jnp.broadcast_to(jnp.sum(masks_B1) / jnp.float32(B), (B, 1))
        return jnp.floor(masks_B1 * ratios[step]).astype(jnp.int32)

    def unmask_ranked(window_BW, hidden_at, step, sample_key, select_key):
        is_mask = window_BW == mask_id
        scores = masked_scores(model.head, hidden_at, is_mask, sample_key, settings.alg, row)
        n = transfer_count(is_mask, step)
        return unmask(window_BW, scores, select_key, n, ratios[step], alg=settings.alg, row=row, mask_token_id=mask_id)

    def fix_first_position(window_BW, hidden_at, sample_key):
        """Fast-dLLM's first step of a block: the candidate at the block's first position, written there."""
        logits = model.head(hidden_at(jnp.zeros((B, 1), jnp.int32)))
        scores = Scores(*(a[:, 0] for a in sample_tokens(logits, sample_key, settings.alg, row)))
        was_mask = window_BW[:, 0] == mask_id
        window_BW = window_BW.at[:, 0].set(jnp.where(was_mask, scores.x0, window_BW[:, 0]))
        first_only = jnp.arange(width) == 0
        confidence = jnp.where(first_only & was_mask[:, None], scores.confidence[:, None], -jnp.inf)
        x0 = jnp.where(first_only & was_mask[:, None], scores.x0[:, None], -1)
        return window_BW, confidence.astype(scores.confidence.dtype), x0, was_mask.astype(jnp.int32)

    def body(carry):
        step, x_BN, cache, records = carry
        sample_key, select_key = jax.random.split(jax.random.fold_in(key, block * steps + step))
        hidden_at, cache = forward(x_BN, cache, step)
        window = in_block(x_BN)
        if fastdllm:
            window, confidence, x0, n_transfer = jax.lax.cond(
                step == 0,
                lambda: fix_first_position(window, hidden_at, sample_key),
                lambda: unmask_ranked(window, hidden_at, step, sample_key, select_key),
            )
        else:
            window, confidence, x0, n_transfer = unmask_ranked(window, hidden_at, step, sample_key, select_key)
        x_BN = jax.lax.dynamic_update_slice_in_dim(x_BN, window, start, axis=1)
        if program.tokens_hook is not None:
            x_BN = program.tokens_hook(block * steps + step, x_BN, None)
        if program.progress is not None:
            jax.debug.callback(program.progress, block * steps + step, x_BN, ordered=True)
        records = record(
            records,
            step,
            history=x_BN,
            confidence=on_canvas(confidence, -jnp.inf),
            x0=on_canvas(x0, -1),
            n_transfer=n_transfer,
        )
        return step + 1, x_BN, cache, records

    if program.tokens_hook is not None:
        x_BN = jax.lax.cond(block == 0, lambda x: program.tokens_hook(None, x, None), lambda x: x, x_BN)
    cache = None
    if cache_kind is not None:
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(lambda x: full_forward(x)[1], x_BN))
    records = program.empty_records(steps, B, N, model.dtype)
    done, x_BN, _, records = jax.lax.while_loop(
        lambda carry: (carry[0] < steps) & jnp.any(in_block(carry[1]) == mask_id), body, (0, x_BN, cache, records)
    )
    if program.output_history:  # the steps a block did not need leave the canvas as it is
        records["history"] = jnp.where((jnp.arange(steps) < done)[:, None, None], records["history"], x_BN)
    return x_BN, records


def run_blocks(model, prepared: Prepared) -> Iterator[FinishedBlock]:
    """The blocks of a prepared block-wise generation (`prepare_generation`), in order."""
    return _run_blocks(model, prepared, refresh=False)


def block_target(model, prepared: Prepared, index: int = 0, refresh: bool = False) -> tuple:
    """`(jitted program, arguments)` of block `index` as `run_blocks` runs it (also what `--compile-for` compiles)."""
    program = prepared.program
    # the prefix cache's window shape depends on the block, so that path compiles per block index
    static = ("graphdef", "program", "refresh") + (("block",) if program.settings.cache == "prefix" else ())
    compiled = decoding_program(_block, model, prepared.x_BN, static_argnames=static)
    return compiled, (*nnx.split(model), prepared.x_BN, prepared.valid_BN, prepared.key, index, program, refresh)


def _run_blocks(model, prepared: Prepared, refresh: bool) -> Iterator[FinishedBlock]:
    compiled, (graphdef, state, _, valid_BN, key, _, program, _) = block_target(model, prepared, refresh=refresh)
    sharding = prepared.x_BN.sharding

    def run(x_BN, index):
        # each block's canvas committed to one sharding, so one compiled program serves them all
        x_BN = jax.device_put(x_BN, sharding)
        return compiled(graphdef, state, x_BN, valid_BN, key, index, program, refresh)

    width = program.settings.block_length
    blocks = prepared.new_tokens // width
    x_BN, records = run(prepared.x_BN, 0)
    for index in range(blocks):
        start = program.first + index * width
        finished = FinishedBlock(index, start, start + width, GenerationOutput(sequences=x_BN, **records))
        if index + 1 < blocks:  # dispatched before the caller reads this block, so the device keeps busy
            x_BN, records = run(x_BN, index + 1)
        yield finished


def blocks_output(blocks: Iterator[FinishedBlock]) -> GenerationOutput:
    """One `GenerationOutput` of every block: the last canvas, the records of all blocks' steps in order."""
    outputs = [block.output for block in blocks]
    records = {
        name: jnp.concatenate([getattr(out, name) for out in outputs])
        for name in RECORDS
        if getattr(outputs[0], name) is not None
    }
    return GenerationOutput(sequences=outputs[-1].sequences, **records)


def generate_blocks(model, input_ids, attention_mask=None, **generation_args) -> Iterator[FinishedBlock]:
    """Block-wise generation that hands over each block as soon as it is finished.

    Takes `diffusion_generate`'s arguments (`block_length` defaults to all new tokens, one block) and
    yields a `FinishedBlock` per block. Its arrays stay on the device and the next block is already
    dispatched when one is yielded, so reading `block.tokens` waits for that block only:

        for block in generate_blocks(model, ids, mask, max_new_tokens=256, steps=256, block_length=32,
                                     cache="dual", threshold=0.9, alg="entropy"):
            send(tokenizer.decode_generation(block.tokens, 0))
    """
    prepared = prepare_generation(model, input_ids, attention_mask, blockwise=True, **generation_args)
    return run_blocks(model, prepared)
