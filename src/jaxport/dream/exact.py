"""Exact decoding (upstream `DreamGenerationMixin._sample`): every step runs the model on the whole canvas.

Each of `steps` denoising steps shifts the logits by one position, scores every masked position and unmasks the
most confident ones (a count shared by the batch: its average number of masks times the schedule's ratio); the
step loop is a `lax.while_loop` inside one compiled program, which also ends once every row's text has ended
where the decoding stops early (`Program.early_stop`: no later step changes a decided token). The end-of-text ids
are an input of the program, so the decoding with early stop and without it run one program. Work avoided
without changing any result: the vocabulary projection, the sampler and the last layer's queries and MLP run only
at positions that still hold a mask token (packed into a few static sizes), and the scored window starts at the
first position that can hold one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport import runtime
from jaxport.dream.program import (
    GenerationOutput,
    JitPrograms,
    Prepared,
    Program,
    decoding_program,
    merged,
    padding_inputs,
    record,
    text_ended,
)
from jaxport.dream.sampling import Rows, masked_scores, sample_tokens, transfer_ratios, unmask


def step_keys(keys_B, index):
    """Each row's (sampling, selection) keys of one step: `split(fold_in(key, index))` of its own key (`index`
    one for the batch, or one per row)."""
    index_B = jnp.broadcast_to(index, keys_B.shape)
    both = jax.vmap(lambda key, i: jax.random.split(jax.random.fold_in(key, i)))(keys_B, index_B)
    return both[:, 0], both[:, 1]


def exact_loop(graphdef, state, x_BN, valid_BN, keys_B, rows: Rows, ends_text_V, text_start, program: Program):
    """The whole decoding: `(sequences, records)`; it ends early once every row's text has ended
    (`text_ended`)."""
    model = merged(graphdef, state)
    settings, first, mask_id = program.settings, program.first, program.mask_token_id
    B, N = x_BN.shape
    mask, position_ids = padding_inputs(valid_BN, B, N)
    cos_sin = model.rotary_tables(position_ids)
    ratios = jnp.asarray(transfer_ratios(settings.steps, settings.eps))
    hooks = program.tokens_hook is not None or program.logits_hook is not None
    packed = runtime.packs_masks(model.config.vocab_size, model.config.hidden_size)
    if program.tokens_hook is not None:
        x_BN = program.tokens_hook(None, x_BN, None)

    def body(step, carry):
        x_BN, records = carry
        hidden_at_rows = model.hidden_states_at(x_BN, mask, cos_sin=cos_sin)

        # Window position j is predicted from the hidden state at canvas position first + j - 1 (0 from itself).
        def hidden_at(index_BW):
            return hidden_at_rows(jnp.maximum(index_BW + first - 1, 0))

        sample_keys, select_keys = step_keys(keys_B, step)
        logits = None
        if hooks:
            window_BW = jnp.broadcast_to(jnp.arange(N - first), (B, N - first))
            logits = model.head(hidden_at(window_BW))
            if program.logits_hook is not None:
                logits = program.logits_hook(step, x_BN, logits)
            scores = sample_tokens(logits, sample_keys, window_BW, settings.alg, rows, program.branches)
        else:
            is_mask_BW = x_BN[:, first:] == mask_id
            scores = masked_scores(
                model.head, hidden_at, is_mask_BW, sample_keys, settings.alg, rows, program.branches, packed=packed
            )
        # The count is shared by the batch: masks per row on average, truncated as int() does.
        num_mask = jnp.sum(x_BN == mask_id).astype(jnp.float32) / jnp.float32(B)
        n = jnp.floor(num_mask * ratios[step]).astype(jnp.int32)
        window, confidence, x0, n_transfer = unmask(
            x_BN[:, first:], scores, select_keys, n, ratios[step], alg=settings.alg, rows=rows, mask_token_id=mask_id
        )
        x_BN = jax.lax.dynamic_update_slice_in_dim(x_BN, window, first, axis=1)
        if program.tokens_hook is not None:
            x_BN = program.tokens_hook(step, x_BN, logits)
        if program.progress is not None:
            jax.debug.callback(program.progress, step, x_BN, ordered=True)
        records = record(
            records,
            step,
            history=x_BN,
            confidence=jnp.pad(confidence, ((0, 0), (first, 0)), constant_values=-jnp.inf),
            x0=jnp.pad(x0, ((0, 0), (first, 0)), constant_values=-1),
            n_transfer=n_transfer,
        )
        return x_BN, records

    records = program.empty_records(settings.steps, B, N, model.dtype)

    def running(state):  # steps left, and a row whose text has not ended
        step, (x_BN, _) = state
        return (step < settings.steps) & ~jnp.all(text_ended(x_BN, ends_text_V[x_BN], mask_id, text_start))

    return jax.lax.while_loop(running, lambda state: (state[0] + 1, body(*state)), (jnp.int32(0), (x_BN, records)))[1]


def early_stop_inputs(model, program: Program) -> tuple:
    """`(program without its early stop, ends_text_V, text_start)`: the early stop as inputs of the exact loop, so
    that one compiled program decodes with it and without it (`ends_text_V` all false: no text ends)."""
    ends_text_V = np.zeros(model.config.vocab_size, bool)
    stop = program.early_stop
    if stop is not None:
        ends_text_V[list(stop.stop_ids)] = True
    return dataclasses.replace(program, early_stop=None), ends_text_V, np.int32(0 if stop is None else stop.start)


def exact_target(model, prepared: Prepared) -> tuple:
    """`(jitted program, arguments)` of the exact path's whole loop (also what `--compile-for` compiles)."""
    jitted = decoding_program(exact_loop, model, prepared.x_BN, static_argnames=("graphdef", "program"))
    p = prepared
    program, ends_text_V, text_start = early_stop_inputs(model, p.program)
    return jitted, (*nnx.split(model), p.x_BN, p.valid_BN, p.keys_B, p.rows, ends_text_V, text_start, program)


def run_exact(model, prepared: Prepared, programs=None) -> GenerationOutput:
    """The exact decoding of `prepared`, compiled and run by `programs` (default `JitPrograms`)."""
    programs = JitPrograms(model) if programs is None else programs
    p = prepared
    program, ends_text_V, text_start = early_stop_inputs(model, p.program)
    dynamic = (p.x_BN, p.valid_BN, p.keys_B, p.rows, ends_text_V, text_start)
    sequences, records = programs(exact_loop, {"program": program}, *dynamic)
    return GenerationOutput(sequences=sequences, **records)
