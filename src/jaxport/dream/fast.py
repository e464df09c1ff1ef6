"""Block-wise diffusion generation with an approximate KV cache and confidence-threshold unmasking.

Fast-dLLM's fast decoding (Wu et al. 2025, arXiv 2505.22618), written for jaxport and batched. The new
tokens are generated in blocks of `block_length`, left to right, `steps / blocks` steps per block; a
block ends as soon as no row has a mask left in it. Each step scores only the current block's masks:

* `cache=None`: every step runs the whole canvas. With one block and no threshold this is the exact path.
* `cache="prefix"`: a block's first step runs the whole canvas and keeps every layer's keys/values;
  the later steps run the block and everything after it (the masked suffix), attending over the kept
  prefix.
* `cache="dual"`: the later steps run only the block, attending over the kept prefix and suffix.

The cache is approximate: kept positions keep the states they had at the block's first step. Position
`j` is predicted from the hidden state at `j - 1`, so the windows start one position before the block.
`threshold` additionally unmasks every mask of the block whose candidate token has at least that
probability (whatever `alg` is), and at least one per row while the block has masks (see `unmask`).
Unmask counts are per row here, so a row's tokens do not depend on the other rows of the batch; the exact
path shares upstream's batch-average count, which is the same when every row holds as many masks.

The steps of a block are one compiled `while_loop`. Blocks are calls of that program: compiled once
for all blocks, or once per block index for the prefix cache (its window shrinks from block to block),
so a caller can stream each finished block (`generate_blocks`).
"""

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from jaxport.dream.generate import (
    GenerationOutput,
    SamplingConfig,
    decoding_program,
    masked_scores,
    padding_inputs,
    prepare_generation,
    transfer_ratios,
    unmask,
)
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


def _block(graphdef, state, x_BN, valid_BN, key, block, cfg: SamplingConfig):
    """Run the steps of block `block` (static for the prefix cache, traced otherwise) on the canvas."""
    model = nnx.merge(graphdef, state)
    B, N = x_BN.shape
    width, mask_id = cfg.block_length, cfg.mask_token_id
    steps = cfg.steps // ((N - cfg.first) // width)  # per block
    start = cfg.first + block * width
    mask, position_ids = padding_inputs(valid_BN, B, N)
    ratios = jnp.asarray(transfer_ratios(steps, cfg.eps))

    def full_forward(x_BN):
        """(hidden states predicting the block, the cache) from the whole canvas."""
        h_BND, cache = model.hidden_states_cached(x_BN, mask, position_ids)
        return jax.lax.dynamic_slice_in_dim(h_BND, start - 1, width, axis=1), cache

    def cached_forward(x_BN, cache):
        if cfg.refresh_cache_every_step:
            cache = full_forward(x_BN)[1]
        # from the position before the block to its end (dual) or to the canvas's end (prefix)
        size = width + 1 if cfg.cache == "dual" else N - start + 1
        ids_BS, positions_BS = (jax.lax.dynamic_slice_in_dim(a, start - 1, size, axis=1) for a in (x_BN, position_ids))
        h_BSD, _ = model.hidden_states_cached(ids_BS, valid_BN, positions_BS, cache, start - 1)
        return h_BSD[:, :width], cache

    def forward(x_BN, cache, step):
        """(`hidden_at`: block positions -> the hidden states that score them, the cache). Without a cache, as the
        exact path: the last layer's queries and MLP run at the positions scored only."""
        if cfg.cache is None:
            hidden_at_rows = model.hidden_states_at(x_BN, mask, position_ids)
            return (lambda index_BW: hidden_at_rows(index_BW + start - 1)), None
        h_BWD, cache = jax.lax.cond(step == 0, lambda: full_forward(x_BN), lambda: cached_forward(x_BN, cache))
        return functools.partial(take_rows, h_BWD), cache

    def in_block(a_BN):
        return jax.lax.dynamic_slice_in_dim(a_BN, start, width, axis=1)

    def on_canvas(values_BW, fill):
        return jax.lax.dynamic_update_slice_in_dim(jnp.full((B, N), fill, values_BW.dtype), values_BW, start, axis=1)

    def body(carry):
        step, x_BN, cache, records = carry
        sample_key, select_key = jax.random.split(jax.random.fold_in(key, block * steps + step))
        hidden_at, cache = forward(x_BN, cache, step)
        window = in_block(x_BN)
        is_mask = window == mask_id
        confidence, x0, probability = masked_scores(model, hidden_at, is_mask, sample_key, cfg)
        # per row: the same share of the row's remaining masks as the exact path's schedule
        n = jnp.floor(jnp.sum(is_mask, axis=-1, keepdims=True).astype(jnp.float32) * ratios[step]).astype(jnp.int32)
        window, confidence, x0, n_transfer = unmask(
            window, confidence, x0, probability, select_key, n, ratios[step], cfg
        )
        x_BN = jax.lax.dynamic_update_slice_in_dim(x_BN, window, start, axis=1)
        if cfg.tokens_hook is not None:
            x_BN = cfg.tokens_hook(block * steps + step, x_BN, None)
        if cfg.progress is not None:
            jax.debug.callback(cfg.progress, block * steps + step, x_BN, ordered=True)
        updates = {
            "history": x_BN,
            "confidence": on_canvas(confidence, -jnp.inf),
            "x0": on_canvas(x0, -1),
            "n_transfer": n_transfer,
        }
        records = {k: v.at[step].set(updates[k].astype(v.dtype)) for k, v in records.items()}
        return step + 1, x_BN, cache, records

    if cfg.tokens_hook is not None:
        x_BN = jax.lax.cond(block == 0, lambda x: cfg.tokens_hook(None, x, None), lambda x: x, x_BN)
    cache = None
    if cfg.cache is not None:
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(lambda x: full_forward(x)[1], x_BN))
    records = {}
    if cfg.output_history:
        records["history"] = jnp.zeros((steps, B, N), jnp.int32)
    if cfg.output_scores:
        records["confidence"] = jnp.full((steps, B, N), -jnp.inf, model.dtype)
        records["x0"] = jnp.full((steps, B, N), -1, jnp.int32)
        records["n_transfer"] = jnp.zeros((steps, B), jnp.int32)
    done, x_BN, _, records = jax.lax.while_loop(
        lambda carry: (carry[0] < steps) & jnp.any(in_block(carry[1]) == mask_id), body, (0, x_BN, cache, records)
    )
    if cfg.output_history:  # the steps a block did not need leave the canvas as it is
        records["history"] = jnp.where((jnp.arange(steps) < done)[:, None, None], records["history"], x_BN)
    return x_BN, records


def run_blocks(model, x_BN, valid_BN, key, cfg: SamplingConfig) -> Iterator[FinishedBlock]:
    """The blocks of a prepared generation (`prepare_generation` with block-wise settings), in order."""
    graphdef, state = nnx.split(model)
    # the prefix cache's window shape depends on the block, so that path compiles per block index
    static = ("graphdef", "cfg", "block") if cfg.cache == "prefix" else ("graphdef", "cfg")
    program = decoding_program(_block, model, x_BN, static_argnames=static)
    sharding = x_BN.sharding

    def run(x_BN, index):
        # each block's canvas committed to one sharding, so one compiled program serves them all
        return program(graphdef, state, jax.device_put(x_BN, sharding), valid_BN, key, index, cfg)

    blocks = (x_BN.shape[1] - cfg.first) // cfg.block_length
    x_BN, records = run(x_BN, 0)
    for index in range(blocks):
        start = cfg.first + index * cfg.block_length
        finished = FinishedBlock(index, start, start + cfg.block_length, GenerationOutput(sequences=x_BN, **records))
        if index + 1 < blocks:  # dispatched before the caller reads this block, so the device keeps busy
            x_BN, records = run(x_BN, index + 1)
        yield finished


def block_target(model, x_BN, valid_BN, key, cfg: SamplingConfig, index: int = 0) -> tuple:
    """`(jitted program, arguments)` of block `index` as `run_blocks` runs it (for `--compile-for`)."""
    static = ("graphdef", "cfg", "block") if cfg.cache == "prefix" else ("graphdef", "cfg")
    program = decoding_program(_block, model, x_BN, static_argnames=static)
    return program, (*nnx.split(model), x_BN, valid_BN, key, index, cfg)


def generate_blocks(model, input_ids, attention_mask=None, **generation_args) -> Iterator[FinishedBlock]:
    """Block-wise generation that hands over each block as soon as it is finished.

    Takes `diffusion_generate`'s arguments (`block_length` defaults to all new tokens, one block) and
    yields a `FinishedBlock` per block. Its arrays stay on the device and the next block is already
    dispatched when one is yielded, so reading `block.tokens` waits for that block only:

        for block in generate_blocks(model, ids, mask, max_new_tokens=256, steps=256, block_length=32,
                                     cache="dual", threshold=0.9, alg="entropy"):
            send(tokenizer.decode_generation(block.tokens, 0))
    """
    x_BN, valid_BN, key, cfg = prepare_generation(model, input_ids, attention_mask, blockwise=True, **generation_args)
    return run_blocks(model, x_BN, valid_BN, key, cfg)
