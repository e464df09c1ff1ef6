"""Masked-diffusion generation on token ids (upstream `DreamGenerationMixin.diffusion_generate`): the exact path
(`jaxport.dream.exact`) or block-wise fast decoding (`jaxport.dream.fast`), chosen by the settings."""

from jaxport.dream.exact import exact_target, run_exact
from jaxport.dream.fast import block_target, blocks_output, run_blocks
from jaxport.dream.program import Prepared, prepare_generation


def diffusion_generate(
    model, input_ids, attention_mask=None, *, return_dict_in_generate: bool = True, programs=None, **generation_args
):
    """Generate with upstream's semantics: the canvas is `input_ids` followed by mask tokens up to
    `max_length` (or `max_new_tokens` more). Every position is filled, unless `stop_token_ids` are given.

    Upstream's arguments and defaults: `max_length` (20) or `max_new_tokens`, `steps` (512), `alg`
    (origin, maskgit_plus, topk_margin, entropy), `temperature` (0), `top_p`, `top_k`, `alg_temp`,
    `eps` (1e-3), `output_history`, `output_scores`, `mask_token_id` (the config's). The decoding settings
    are validated by `jaxport.dream.settings.GenerationSettings`.

    Ties: when the unmasking count cuts through exactly equal confidences (common with `top_k=1` or
    a tight `top_p`, where confidences saturate), the leftmost positions are unmasked first, on every
    device, mesh and batch size and block-wise too (upstream's `torch.topk` order is unspecified).

    Hooks are traced JAX functions: `generation_tokens_hook_func(step, x, logits) -> x` runs once
    before the loop (step and logits None) and after every step; `generation_logits_hook_func(step,
    x, logits) -> logits` sees the shifted logits `[B, N, V]` before sampling. `progress(step, x)` is
    called on the host after each step.

    The sampling settings `temperature`, `top_p`, `top_k`, `alg_temp` and `threshold` are one value for every
    row or a list of one per row (`temperature=[0, 0.7]`); they are inputs of the compiled program, so other
    values run the same program. `rng` seeds the random draws (origin, temperature > 0, alg_temp > 0): one key
    (the default is `jax.random.key(0)`), row b drawing from `fold_in(rng, b)`, or one key per row (`[B]`). A
    row's draws depend on its key and settings only, not on the other rows of the batch.

    Fast decoding (Fast-dLLM; see `jaxport.dream.fast`): `block_length` generates the new tokens in
    blocks of that many, left to right; `cache` ("prefix" or "dual") keeps an approximate KV cache
    refreshed at each block's first step; `threshold` in (0, 1] also unmasks every mask of the block whose
    candidate has at least that probability; `schedule` is "jaxport" (the default: `steps / blocks` steps
    per block, each row's share of its masks) or "fastdllm" (Fast-dLLM's own decoding, token for token).
    Any of them selects the block-wise path (`block_length` defaults to all new tokens); without them this
    is the exact path. Block-wise, the logits hook is not available, the tokens hook gets `logits=None`,
    and a block whose masks are all filled ends early (its remaining steps are recorded as unchanged).

    Early stop: given `stop_token_ids` (end-of-text ids, e.g. `tokenizer.stop_ids`, which the text API, the CLI,
    lm-eval and the server pass), the decoding stops once every row's text has ended, its first end-of-text or
    mask token being an end-of-text: the exact path after that step, block-wise after that block. The tokens up to
    each row's first end-of-text are those of the full decoding (nothing after a decided token changes it), those
    after it may still be masks. `early_stop=False` turns it off; it is off under `schedule="fastdllm"` (Fast-dLLM
    decodes every block), with `output_history` or `output_scores` (they record every step) and with a tokens
    hook (it may rewrite decided tokens).

    `programs` compiles and runs the decoding loop: jax.jit's own cache by default (`program.JitPrograms`), or a
    server's registry of compiled programs (`jaxport.dream.serving.programs.CompiledPrograms`).
    """
    prepared = prepare_generation(model, input_ids, attention_mask, **generation_args)
    if prepared.program.blockwise:
        output = blocks_output(run_blocks(model, prepared, programs))
    else:
        output = run_exact(model, prepared, programs)
    return output if return_dict_in_generate else output.sequences


def decoding_target(model, prepared: Prepared) -> tuple:
    """`(jitted program, arguments)` of what `diffusion_generate` runs on a prepared generation: the exact path's
    whole loop, or block-wise the first block's steps (`--compile-for` compiles it for a TPU slice)."""
    return block_target(model, prepared) if prepared.program.blockwise else exact_target(model, prepared)
