"""A decoding prepared for compilation: the checked canvas, the program's static description, and the one place a
Dream decoding loop is jitted (`decoding_program`).

`prepare_generation` turns `diffusion_generate`'s arguments into a `Prepared` (canvas, attention mask, per-row keys
and sampling settings, `Program`); the exact loop (`jaxport.dream.exact`) and the block loop (`jaxport.dream.fast`)
run it through a `Programs`: `JitPrograms` (jax.jit's own cache, the library's) or a server's own registry of
compiled programs (`jaxport.dream.serving.programs.CompiledPrograms`).
"""

import dataclasses
import functools
from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxport import runtime
from jaxport.dream.sampling import Branches, Rows
from jaxport.dream.settings import GenerationSettings, ProgramSettings, count
from jaxport.errors import JaxportError


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


RECORDS = ("history", "confidence", "x0", "n_transfer")


def text_ended(x_BN, stop_BN, mask_token_id: int, text_start=0):
    """Whether each row's text `x_BN[:, text_start:]` has ended, `[B]`: its first end-of-text (`stop_BN`, where
    `x_BN` holds one) or mask token is an end-of-text, so every position before it is decided and its text, cut
    there, is final (a continuous batch lets such a row leave; a static batch whose rows have all ended stops).
    numpy on the host, jnp traced; `text_start` may be traced."""
    xp = np if isinstance(x_BN, np.ndarray) else jnp
    in_text_N = xp.arange(x_BN.shape[1]) >= text_start
    stop_BN = stop_BN & in_text_N
    first_B = xp.argmax(stop_BN | ((x_BN == mask_token_id) & in_text_N), axis=-1)
    return xp.take_along_axis(stop_BN, first_B[:, None], axis=-1)[:, 0]


@dataclasses.dataclass(frozen=True)
class EarlyStop:
    """A decoding that stops once every row's text has ended (`text_ended`): the end-of-text ids, and the canvas
    position where the new tokens (the text) begin."""

    stop_ids: tuple[int, ...]
    start: int

    def ended(self, x_BN, mask_token_id: int):
        return text_ended(x_BN, jnp.isin(x_BN, jnp.asarray(sorted(self.stop_ids))), mask_token_id, self.start)


@dataclasses.dataclass(frozen=True)
class Program:
    """What a compiled decoding depends on besides array shapes (hashable: jit's static argument)."""

    settings: ProgramSettings
    mask_token_id: int
    first: int  # the first canvas position that can hold a mask token
    branches: Branches = Branches()  # the sampler's vocabulary-sized branches: all, or those its rows need
    output_history: bool = False
    output_scores: bool = False
    tokens_hook: Callable | None = None
    logits_hook: Callable | None = None
    progress: Callable | None = None
    early_stop: EarlyStop | None = None  # None: the decoding runs to its last step (block-wise, its last block)

    @property
    def blockwise(self) -> bool:
        return self.settings.block_length is not None

    def steps_per_block(self, new_tokens: int) -> int:
        """The schedule's steps of one block: `steps` shared by the blocks."""
        return self.settings.steps // (new_tokens // self.settings.block_length)

    def block_steps(self, new_tokens: int) -> int:
        """The most steps one block takes: `steps_per_block`; under `schedule="fastdllm"`, one per position (a row
        with Fast-dLLM's threshold has no step budget; each step unmasks at least one). Rows without a threshold
        end their block within the schedule's steps, and the block ends when no row has a mask."""
        if self.settings.schedule == "fastdllm":
            return self.settings.block_length
        return self.steps_per_block(new_tokens)

    def empty_records(self, steps: int, B: int, N: int, dtype) -> dict:
        """Per-step records, filled by the loop: what `output_history` / `output_scores` ask for."""
        records = {}
        if self.output_history:
            records["history"] = jnp.zeros((steps, B, N), jnp.int32)
        if self.output_scores:
            records["confidence"] = jnp.full((steps, B, N), -jnp.inf, dtype)
            records["x0"] = jnp.full((steps, B, N), -1, jnp.int32)
            records["n_transfer"] = jnp.zeros((steps, B), jnp.int32)
        return records


def record(records: dict, step, **updates) -> dict:
    return {k: v.at[step].set(updates[k].astype(v.dtype)) for k, v in records.items()}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A checked generation: the canvas `x_BN` (prompt, then mask tokens) and the boolean attention mask (None:
    every position attends everywhere), each row's random key `keys_B` and sampling settings `rows`, all on the
    model's mesh, and the static `Program`."""

    x_BN: jax.Array
    valid_BN: jax.Array | None
    keys_B: jax.Array
    rows: Rows
    program: Program
    head_DV: jax.Array | None = None  # the vocabulary projection's weight as [D, V], where the runtime reads it so

    @property
    def new_tokens(self) -> int:
        return self.x_BN.shape[1] - self.program.first


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


def _check(name: str, ok: bool, message: str):
    if not ok:
        raise JaxportError(f"{name}: {message}")


def _new_tokens(model, input_ids, max_length: int | None, max_new_tokens: int | None) -> int:
    """How many positions the canvas adds to the checked prompt batch `input_ids` (`max_new_tokens`, else
    `max_length` less the prompt)."""
    _check(
        "input_ids",
        input_ids.ndim == 2 and np.issubdtype(input_ids.dtype, np.integer),
        f"expected an integer array [batch, length], got {input_ids.dtype} {list(input_ids.shape)}",
    )
    B, L = input_ids.shape
    _check("input_ids", L > 0 and B > 0, "empty prompt batch")
    vocab = model.config.vocab_size
    _check(
        "input_ids",
        int(input_ids.min()) >= 0 and int(input_ids.max()) < vocab,
        f"token ids must lie in [0, {vocab}) (vocab_size)",
    )
    if max_new_tokens is not None:
        max_length = L + count("max_new_tokens", max_new_tokens)
    elif max_length is None:
        max_length = 20  # upstream DreamGenerationConfig default
    else:
        max_length = count("max_length", max_length)
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
    return new_tokens


def _first_position(input_ids, mask_token_id: int, blockwise: bool, tokens_hook, logits_hook) -> int:
    """The first canvas position that can hold a mask token: the new tokens' block-wise, where the prompt may
    hold none and there is no logits hook."""
    L = input_ids.shape[1]
    prompt_masks = np.nonzero((input_ids == mask_token_id).any(axis=0))[0]
    if not blockwise:
        # Hooks see every position, as upstream's do; otherwise start at the first possible mask.
        hooks = tokens_hook is not None or logits_hook is not None
        return 0 if hooks else int(prompt_masks[0]) if len(prompt_masks) else L
    _check(
        "input_ids",
        not len(prompt_masks),
        "the prompt holds mask tokens, and block-wise generation fills only the new tokens; fill them with "
        "the exact path (no block_length, cache, threshold or schedule)",
    )
    _check(
        "generation_logits_hook_func",
        logits_hook is None,
        "not available block-wise (the steps score only the current block); use the exact path",
    )
    return L


def _early_stop(model, stop_token_ids, settings: GenerationSettings, start: int, watched: bool) -> EarlyStop | None:
    """The early stop of a decoding whose new tokens begin at canvas position `start`, given the end-of-text ids
    `stop_token_ids` (checked): none without them, where the settings turn it off (`stops_early`), or where the
    steps are watched (per-step records, or a tokens hook, which may rewrite decided tokens)."""
    if stop_token_ids is None:
        return None
    ids = list(stop_token_ids) if isinstance(stop_token_ids, (list, tuple, set, frozenset, np.ndarray)) else []
    vocab = model.config.vocab_size
    _check(
        "stop_token_ids",
        bool(ids) and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < vocab for i in ids),
        f"expected a non-empty list of token ids in [0, {vocab}) (vocab_size), got {stop_token_ids!r}",
    )
    if not settings.stops_early or watched:
        return None
    return EarlyStop(tuple(sorted({int(i) for i in ids})), start)


def _padded_mask(attention_mask, input_ids, new_tokens: int):
    """The prompts' attention mask, checked, as booleans over the whole canvas (the new tokens attend), or None."""
    if attention_mask is None:
        return None
    attention_mask = np.asarray(attention_mask)
    _check(
        "attention_mask",
        attention_mask.shape == input_ids.shape,
        f"shape {list(attention_mask.shape)} differs from input_ids {list(input_ids.shape)}",
    )
    return np.pad(attention_mask.astype(bool), ((0, 0), (0, new_tokens)), constant_values=True)


def prepare_generation(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    rng: jax.Array | None = None,
    mask_token_id: int | None = None,
    output_history: bool = False,
    output_scores: bool = False,
    generation_tokens_hook_func: Callable | None = None,
    generation_logits_hook_func: Callable | None = None,
    progress: Callable | None = None,
    stop_token_ids: Collection[int] | None = None,
    blockwise: bool = False,
    **settings,
) -> Prepared:
    """Check `diffusion_generate`'s arguments (documented there; `settings` are `GenerationSettings`) and place
    the canvas on the model's mesh. `blockwise` decodes block-wise even without a fast-decoding setting.

    A given `attention_mask` is always applied, all ones included: a row then runs the same attention alone as
    in a batch with padded rows (a padded batch cannot drop the mask).
    """
    input_ids = np.asarray(input_ids)
    settings = GenerationSettings.of(**settings)  # each value on its own, before the rules relating them
    new_tokens = _new_tokens(model, input_ids, max_length, max_new_tokens)
    B = input_ids.shape[0]
    checked = settings.check(new_tokens, blockwise, batch=B)
    mask_token_id = model.config.mask_token_id if mask_token_id is None else int(mask_token_id)
    first = _first_position(
        input_ids,
        mask_token_id,
        checked.block_length is not None,
        generation_tokens_hook_func,
        generation_logits_hook_func,
    )
    attention_mask = _padded_mask(attention_mask, input_ids, new_tokens)
    x = np.concatenate([input_ids.astype(np.int32), np.full((B, new_tokens), mask_token_id, np.int32)], axis=1)
    rows = Rows.of(checked.row.rows(B))
    program = Program(
        settings=checked.program,
        mask_token_id=mask_token_id,
        first=first,
        output_history=bool(output_history),
        output_scores=bool(output_scores),
        tokens_hook=generation_tokens_hook_func,
        logits_hook=generation_logits_hook_func,
        progress=progress,
        branches=Branches.needed(rows),
        early_stop=_early_stop(
            model,
            stop_token_ids,
            checked,
            input_ids.shape[1],
            bool(output_history or output_scores or generation_tokens_hook_func),
        ),
    )
    x, attention_mask, keys, *rows = model.place_batch(x, attention_mask, row_keys(rng, B), *rows)
    # a block's steps apply the head many times: once per generation, its weight is laid out as they read it fastest
    head_in_out = program.blockwise and runtime.for_tokens(x, model.dtype).head_in_out
    return Prepared(x, attention_mask, keys, Rows(*rows), program, model.head_table_DV() if head_in_out else None)


def row_keys(rng: jax.Array | None, batch: int) -> jax.Array:
    """Each row's random key: `rng` (default `jax.random.key(0)`) is one key, row b drawing from
    `fold_in(rng, b)`, or one key per row."""
    if rng is None:
        return _default_row_keys(batch)
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        _check(
            "rng",
            np.dtype(rng.dtype) == np.uint32 and rng.shape[-1:] == (2,),
            f"expected a key from jax.random.key (or PRNGKey), or one per row, got {rng.dtype} {list(rng.shape)}",
        )
        rng = jax.random.wrap_key_data(rng)
    if rng.shape == ():
        return _folded_rows(rng, batch)
    _check("rng", rng.shape == (batch,), f"{rng.shape[0]} keys for a batch of {batch} rows")
    return rng


@functools.lru_cache(maxsize=64)
def _default_row_keys(batch: int) -> jax.Array:
    """The row keys of the default `rng`, `jax.random.key(0)`, made once per batch size (an array, never changed)."""
    return _folded_rows(jax.random.key(0), batch)


@functools.partial(jax.jit, static_argnums=1)
def _folded_rows(rng: jax.Array, batch: int) -> jax.Array:
    """`fold_in(rng, b)` for every row b, compiled: run eagerly, the vmap costs more than a small block call."""
    return jax.vmap(lambda b: jax.random.fold_in(rng, b))(jnp.arange(batch))


def merged(graphdef, state):
    """The model a decoding loop runs: `nnx.merge(graphdef, state)`, or `state` itself where `graphdef` is None (the
    module passed whole, as a pytree: `JitPrograms`)."""
    return state if graphdef is None else nnx.merge(graphdef, state)


def decoding_program(function, model, x_BN, **jit_kwargs):
    """`function` jitted under the runtime of a program decoding the canvas `x_BN` on its devices
    (`runtime.for_tokens`): every Dream decoding loop is compiled here. jax.jit over (graphdef, state) rather than
    nnx.jit: nnx.jit's state bookkeeping costs more than a small forward."""
    return runtime.jit_once(function, runtime.for_tokens(x_BN, model.dtype), **jit_kwargs)


class JitPrograms:
    """Runs a decoding loop `function(graphdef, state, x_BN, *dynamic, **static)` of a model, compiled by
    `decoding_program` (jax.jit's cache keeps one program per static arguments and shapes). The model goes in whole,
    as a pytree (`graphdef` None, `merged`): flattening it costs a tenth of `nnx.split`, whose graph jax.jit would
    also hash at every call, and it reads the model's current weights at every call."""

    def __init__(self, model):
        self.model = model

    def __call__(self, function, static: dict, x_BN, *dynamic):
        jitted = decoding_program(function, self.model, x_BN, static_argnames=("graphdef", *static))
        return jitted(None, self.model, x_BN, *dynamic, **static)
