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
stream each finished block (`generate_blocks`). With an early stop (`Program.early_stop`: end-of-text ids given,
`early_stop` on, not `schedule="fastdllm"`) no block is called after one at whose end every row's text has ended;
the positions after it keep their masks. Without the prefix cache every row may be at a block of its own
(`block` one index per row): a continuous batch (`jaxport.dream.serving.batches`) runs rows that joined at
different times.
"""

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport import runtime
from jaxport.dream.exact import step_keys
from jaxport.dream.program import (
    RECORDS,
    GenerationOutput,
    JitPrograms,
    Prepared,
    Program,
    decoding_program,
    merged,
    padding_inputs,
    prepare_generation,
    record,
)
from jaxport.dream.sampling import Rows, Scores, masked_scores, sample_tokens, transfer_ratios, unmask
from jaxport.nn import take_rows, window_at, write_at


@dataclasses.dataclass
class FinishedBlock:
    """One finished block: canvas positions `start .. end - 1` are final. `output.sequences` is the
    canvas so far (later blocks still masked); its records cover this block's steps."""

    index: int
    start: int
    end: int
    output: GenerationOutput
    steps: jax.Array | None = None  # the denoising steps the block took (a block ends once no row has a mask)
    last: bool = False  # no block follows: the canvas's last, or every row's text has ended (`Program.early_stop`)

    @property
    def tokens(self) -> jax.Array:
        """The block's tokens `[B, block_length]`."""
        return self.output.sequences[:, self.start : self.end]


class _BlockLoop:
    """The parts of one block's step loop (`_block`), built while it is traced: what every step reads (the block's
    place, the canvas's attention inputs, the schedule), the forward passes that give the hidden states scoring the
    block (the whole canvas, or the window over the cache), the unmask rules, and the commit of a step to the
    canvas."""

    def __init__(self, model, x_BN, valid_BN, keys_B, rows: Rows, head_DV, block, program: Program, refresh: bool):
        settings = program.settings
        self.model, self.valid_BN, self.keys_B, self.rows, self.block = model, valid_BN, keys_B, rows, block
        self.program, self.refresh, self.settings, self.mask_id = program, refresh, settings, program.mask_token_id
        self.B, self.N = B, N = x_BN.shape
        self.width, self.cache_kind = settings.block_length, settings.cache_kind
        self.fastdllm = settings.schedule == "fastdllm"
        self.steps = program.block_steps(N - program.first)
        self.schedule_steps = program.steps_per_block(N - program.first)
        self.start = program.first + block * self.width  # one canvas position, or one per row
        self.start_B1 = jnp.reshape(self.start, (-1, 1))
        self.mask, position_ids = padding_inputs(valid_BN, B, N)
        self.cos_sin = model.rotary_tables(position_ids)
        self.ratios = jnp.asarray(transfer_ratios(self.schedule_steps, settings.eps))
        self.lead = 0 if self.fastdllm else 1  # the cached windows start this many positions before the block
        # block position j is scored from window row j + lead - 1 (Fast-dLLM: the first from itself)
        self.scoring_rows = np.maximum(np.arange(self.width) + self.lead - 1, 0)
        self.with_threshold_B1 = jnp.isfinite(rows.threshold)[:, None]
        self.head = functools.partial(model.head, table_DV=head_DV)
        self.packed = runtime.packs_masks(model.config.vocab_size, model.config.hidden_size)

    def full_forward(self, x_BN):
        """(hidden states predicting the block `[B, W, D]`, the cache) from the whole canvas. Fast-dLLM's first step
        scores the block's first position only: the other rows are zeros, not computed."""
        # the last layer's queries and MLP run at the rows scored only: every other row of it is a key and value
        scored = 1 if self.fastdllm else self.width
        rows_BS = jnp.broadcast_to(self.start_B1 - 1 + jnp.arange(scored), (self.B, scored))
        h_BSD, cache = self.model.hidden_states_cached(x_BN, self.mask, rows=rows_BS, cos_sin=self.cos_sin)
        return jnp.pad(h_BSD, ((0, 0), (0, self.width - scored), (0, 0))), cache

    def empty_cache(self, x_BN):
        """Zeros in the shape of the cache the whole-canvas forward keeps (the loop's initial carry)."""
        shapes = jax.eval_shape(lambda x: self.full_forward(x)[1], x_BN)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def cached_forward(self, x_BN, cache):
        """(hidden states predicting the block `[B, W, D]`, the cache) from the window alone, over the kept cache."""
        if self.refresh:
            cache = self.full_forward(x_BN)[1]
        begin = self.start - self.lead
        size = self.cache_kind.window(begin, self.width, self.lead, self.N)
        ids_BS, *cos_sin_BS = (window_at(a, begin, size) for a in (x_BN, *self.cos_sin))
        # every cached step of a block writes the same window, so the cache carries it on (updated in place)
        h_BSD, cache = self.model.hidden_states_cached(
            ids_BS, self.valid_BN, None, cache, begin, cos_sin=tuple(cos_sin_BS)
        )
        return h_BSD[:, self.scoring_rows], cache

    def forward(self, x_BN, cache, step):
        """(`hidden_at`: block positions -> the hidden states that score them, the cache). Without a cache, as the
        exact path: the last layer's queries and MLP run at the positions scored only."""
        if not self.cache_kind.keeps:
            hidden_at_rows = self.model.hidden_states_at(x_BN, self.mask, cos_sin=self.cos_sin)
            return (lambda index_BW: hidden_at_rows(index_BW + self.start_B1 - 1)), None
        h_BWD, cache = jax.lax.cond(
            step == 0, lambda: self.full_forward(x_BN), lambda: self.cached_forward(x_BN, cache)
        )
        return functools.partial(take_rows, h_BWD), cache

    def in_block(self, a_BN):
        return window_at(a_BN, self.start, self.width)

    def on_canvas(self, values_BW, fill):
        return write_at(jnp.full((self.B, self.N), fill, values_BW.dtype), values_BW, self.start)

    def transfer_count(self, is_mask_BW, step, active_B1):
        """How many of each row's masks the ranking unmasks at this step, `[B, 1]`."""
        masks_B1 = jnp.sum(is_mask_BW, axis=-1, keepdims=True).astype(jnp.float32)
        ratio = self.ratios[jnp.minimum(step, self.schedule_steps - 1)]
        if self.fastdllm:
            # Fast-dLLM's threshold rule alone decides for a row with a threshold; the others share one count, the
            # schedule's share of their average number of masks in the block (rows with a block to decode)
            sharing = active_B1 & ~self.with_threshold_B1
            average = jnp.sum(jnp.where(sharing, masks_B1, 0)) / jnp.maximum(jnp.sum(sharing), 1).astype(jnp.float32)
            return jnp.where(self.with_threshold_B1, 0, jnp.floor(average * ratio).astype(jnp.int32))
        return jnp.floor(masks_B1 * ratio).astype(jnp.int32)

    def unmask_ranked(self, window_BW, hidden_at, step, sample_keys, select_keys, active_B1):
        """The schedule's step on the block: its best-ranked masks (and those over the threshold) unmasked."""
        settings, rows = self.settings, self.rows
        is_mask = window_BW == self.mask_id
        scores = masked_scores(
            self.head, hidden_at, is_mask, sample_keys, settings.alg, rows, self.program.branches, packed=self.packed
        )
        n = self.transfer_count(is_mask, step, active_B1)
        p_transfer = self.ratios[jnp.minimum(step, self.schedule_steps - 1)]
        return unmask(
            window_BW, scores, select_keys, n, p_transfer, alg=settings.alg, rows=rows, mask_token_id=self.mask_id
        )

    def fix_first_position(self, window_BW, hidden_at, sample_keys):
        """Fast-dLLM's first step of a block: the candidate at the block's first position, written there."""
        first_BS = jnp.zeros((self.B, 1), jnp.int32)
        candidates = sample_tokens(
            self.head(hidden_at(first_BS)), sample_keys, first_BS, self.settings.alg, self.rows, self.program.branches
        )
        scores = Scores(*(a[:, 0] for a in candidates))
        was_mask = window_BW[:, 0] == self.mask_id
        window_BW = window_BW.at[:, 0].set(jnp.where(was_mask, scores.x0, window_BW[:, 0]))
        first_only = jnp.arange(self.width) == 0
        confidence = jnp.where(first_only & was_mask[:, None], scores.confidence[:, None], -jnp.inf)
        x0 = jnp.where(first_only & was_mask[:, None], scores.x0[:, None], -1)
        return window_BW, confidence.astype(scores.confidence.dtype), x0, was_mask.astype(jnp.int32)

    def running(self, carry):
        """The loop's condition: steps left, and a mask in some row's block."""
        return (carry[0] < self.steps) & jnp.any(self.in_block(carry[1]) == self.mask_id)

    def body(self, carry):
        """One denoising step of the block: score it, unmask, commit the window to the canvas."""
        step, x_BN, cache, records, active_B1 = carry
        sample_keys, select_keys = step_keys(self.keys_B, self.block * self.steps + step)
        hidden_at, cache = self.forward(x_BN, cache, step)
        window = self.in_block(x_BN)
        if self.fastdllm:
            window, confidence, x0, n_transfer = jax.lax.cond(
                step == 0,
                lambda: self.fix_first_position(window, hidden_at, sample_keys),
                lambda: self.unmask_ranked(window, hidden_at, step, sample_keys, select_keys, active_B1),
            )
        else:
            window, confidence, x0, n_transfer = self.unmask_ranked(
                window, hidden_at, step, sample_keys, select_keys, active_B1
            )
        x_BN, records = self.commit(step, x_BN, window, records, confidence, x0, n_transfer)
        return step + 1, x_BN, cache, records, active_B1

    def commit(self, step, x_BN, window_BW, records, confidence_BW, x0_BW, n_transfer):
        """The step's window written to the canvas, the tokens hook and progress called, the step recorded."""
        program, block, steps = self.program, self.block, self.steps
        x_BN = write_at(x_BN, window_BW, self.start)
        if program.tokens_hook is not None:
            x_BN = program.tokens_hook(block * steps + step, x_BN, None)
        if program.progress is not None:
            jax.debug.callback(program.progress, block * steps + step, x_BN, ordered=True)
        records = record(
            records,
            step,
            history=x_BN,
            confidence=self.on_canvas(confidence_BW, -jnp.inf),
            x0=self.on_canvas(x0_BW, -1),
            n_transfer=n_transfer,
        )
        return x_BN, records


def _block(graphdef, state, x_BN, valid_BN, keys_B, rows: Rows, head_DV, block, program: Program, refresh: bool):
    """Run the steps of block `block` on the canvas: `(canvas, records, steps run)`. `block` is one index for the
    batch (static for the prefix cache, traced otherwise) or one per row (`[B]`: the rows of a continuous batch,
    each at its own block; not with the prefix cache, whose window shape depends on the block). `refresh` (for
    tests) rebuilds the cache from the current canvas before every cached step. `head_DV`: the vocabulary projection's
    weight as `[D, V]` (`Prepared.head_DV`), or None."""
    model = merged(graphdef, state)
    loop = _BlockLoop(model, x_BN, valid_BN, keys_B, rows, head_DV, block, program, refresh)
    if program.tokens_hook is not None:
        x_BN = jax.lax.cond(block == 0, lambda x: program.tokens_hook(None, x, None), lambda x: x, x_BN)
    cache = loop.empty_cache(x_BN) if loop.cache_kind.keeps else None
    records = program.empty_records(loop.steps, loop.B, loop.N, model.dtype)
    active_B1 = jnp.any(loop.in_block(x_BN) == loop.mask_id, axis=-1, keepdims=True)
    done, x_BN, _, records, _ = jax.lax.while_loop(loop.running, loop.body, (0, x_BN, cache, records, active_B1))
    if program.output_history:  # the steps a block did not need leave the canvas as it is
        records["history"] = jnp.where((jnp.arange(loop.steps) < done)[:, None, None], records["history"], x_BN)
    return x_BN, records, done


def run_block(programs, prepared: Prepared, x_BN, block, refresh: bool = False):
    """One call of the block program on the canvas `x_BN` (the prepared generation's mask, keys and settings):
    `(canvas, records, steps run)`. `block` is an int, or one index per row (`[B]`, not with the prefix cache)."""
    # the host stops between blocks: the block program never reads `early_stop`, one program serves either way
    program = dataclasses.replace(prepared.program, early_stop=None)
    static = {"program": program, "refresh": refresh}
    args = (x_BN, prepared.valid_BN, prepared.keys_B, prepared.rows, prepared.head_DV)
    if program.settings.cache_kind.per_block_program:  # one program per block index
        return programs(_block, {**static, "block": int(block)}, *args)
    return programs(_block, static, *args, np.int32(block) if np.ndim(block) == 0 else block)


def block_target(model, prepared: Prepared, index: int = 0, refresh: bool = False) -> tuple:
    """`(jitted program, arguments)` of block `index` as `run_blocks` runs it (also what `--compile-for` compiles)."""
    program = prepared.program
    # a window whose shape depends on the block (the prefix cache's) compiles per block index
    static = ("graphdef", "program", "refresh") + (("block",) if program.settings.cache_kind.per_block_program else ())
    compiled = decoding_program(_block, model, prepared.x_BN, static_argnames=static)
    p = prepared
    return compiled, (*nnx.split(model), p.x_BN, p.valid_BN, p.keys_B, p.rows, p.head_DV, index, program, refresh)


def run_blocks(model, prepared: Prepared, programs=None) -> Iterator[FinishedBlock]:
    """The blocks of a prepared block-wise generation (`prepare_generation`), in order, compiled and run by
    `programs` (default `JitPrograms`)."""
    return _run_blocks(model, prepared, refresh=False, programs=programs)


def _run_blocks(model, prepared: Prepared, refresh: bool, programs=None) -> Iterator[FinishedBlock]:
    programs = JitPrograms(model) if programs is None else programs
    program, sharding = prepared.program, prepared.x_BN.sharding

    def run(x_BN, index):
        # each block's canvas committed to one sharding, so one compiled program serves them all
        return run_block(programs, prepared, jax.device_put(x_BN, sharding), index, refresh)

    def ended(x_BN) -> bool:  # every row's text has ended: waits for the block, so none is dispatched ahead
        stop = program.early_stop
        return stop is not None and bool(np.all(stop.ended(np.asarray(jax.device_get(x_BN)), program.mask_token_id)))

    width = program.settings.block_length
    blocks = prepared.new_tokens // width
    x_BN, records, steps = run(prepared.x_BN, 0)
    for index in range(blocks):
        start = program.first + index * width
        last = index + 1 == blocks or ended(x_BN)
        output = GenerationOutput(sequences=x_BN, **records)
        finished = FinishedBlock(index, start, start + width, output, steps, last)
        if not last:  # dispatched before the caller reads this block, so the device keeps busy
            x_BN, records, steps = run(x_BN, index + 1)
        yield finished
        if last:
            return


def blocks_output(blocks: Iterator[FinishedBlock]) -> GenerationOutput:
    """One `GenerationOutput` of every block: the last canvas, the records of all blocks' steps in order."""
    outputs = [block.output for block in blocks]
    records = {
        name: jnp.concatenate([getattr(out, name) for out in outputs])
        for name in RECORDS
        if getattr(outputs[0], name) is not None
    }
    return GenerationOutput(sequences=outputs[-1].sequences, **records)


def generate_blocks(
    model, input_ids, attention_mask=None, *, programs=None, **generation_args
) -> Iterator[FinishedBlock]:
    """Block-wise generation that hands over each block as soon as it is finished.

    Takes `diffusion_generate`'s arguments (`block_length` defaults to all new tokens, one block) and
    yields a `FinishedBlock` per block, up to the one at whose end every row's text has ended where
    `stop_token_ids` are given (`FinishedBlock.last`). Its arrays stay on the device and the next block is already
    dispatched when one is yielded, so reading `block.tokens` waits for that block only:

        for block in generate_blocks(model, ids, mask, max_new_tokens=256, steps=256, block_length=32,
                                     cache="dual", threshold=0.9, alg="entropy"):
            send(tokenizer.decode_generation(block.tokens, 0))
    """
    prepared = prepare_generation(model, input_ids, attention_mask, blockwise=True, **generation_args)
    return run_blocks(model, prepared, programs)


NEAR_TIE = 1e-5  # relative margin under which torch's and XLA's float rounding may order two scores differently


def decision_margins(out: GenerationOutput, prompt_len: int, block_length: int, threshold=None) -> np.ndarray:
    """How close each new token came to another decision: `[B, new tokens]`, for each new position the smallest
    margin of its row's decisions up to the step that decided it (inf before any choice). A decision's margin is
    the gap between the last unmasked and the first kept score at a ranked step, relative to their size, or the
    distance of a probability from `threshold` (and the best score's lead when none reaches it) at a threshold
    step; a block's first step fixes its first position, no choice. `out`: a block-wise `diffusion_generate` with
    `output_scores` of `prompt_len`-token prompts. A margin of 0 is an exact tie, under `NEAR_TIE` a near-tie."""
    confidence, n_transfer = np.asarray(out.confidence, np.float64), np.asarray(out.n_transfer)
    steps, B, N = confidence.shape
    steps_per_block = steps // ((N - prompt_len) // block_length)
    at_step = np.full((steps, B), np.inf)
    for step in range(steps):
        if step % steps_per_block == 0:
            continue
        for row in range(B):
            scores = confidence[step, row, prompt_len:]
            scores = np.sort(scores[np.isfinite(scores)])[::-1]
            n = int(n_transfer[step, row])
            if not len(scores) or n == 0:
                continue
            if threshold is not None:
                gaps = np.abs(scores - threshold)
                if scores[0] < threshold and len(scores) > 1:  # the best alone: its lead decides
                    gaps = np.append(gaps, scores[0] - scores[1])
                at_step[step, row] = gaps.min()
            elif n < len(scores):
                a, b = scores[n - 1], scores[n]
                at_step[step, row] = (a - b) / max(abs(a), abs(b), 1e-30)
    so_far = np.minimum.accumulate(at_step, axis=0)
    # a position is decided at the last step that scored it as a mask
    scored = np.isfinite(confidence[:, :, prompt_len:])
    decided = steps - 1 - np.argmax(scored[::-1], axis=0)  # [B, new]
    return np.where(scored.any(axis=0), so_far[decided, np.arange(B)[:, None]], np.inf)
