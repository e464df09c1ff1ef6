"""Early stop at end-of-text: a batch stops decoding once every row's text has ended, and each text is the full
decoding's cut at its first end-of-text, on the task model (it writes a few tokens, then end-of-text), alone and
batched, exact and block-wise, through the token API, the text API, the CLI and the server's static batches."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxport import dream
from jaxport.dream.cli import _generation_args, _parser
from jaxport.dream.exact import exact_loop
from jaxport.dream.program import (
    EarlyStop,
    JitPrograms,
    decoding_program,
    prepare_generation,
    row_keys,
    text_ended,
)
from jaxport.dream.serving.batches import generate_canvases
from jaxport.dream.serving.output import RowText
from jaxport.dream.serving.programs import BatchKey
from jaxport.dream.settings import GenerationSettings
from jaxport.errors import JaxportError

TASK_MODEL = Path(__file__).parent / "fixtures" / "dream" / "task_model"
NEW = 128
# (a)'s decoding (blocks of 32, dual cache, threshold 0.9) under jaxport's default schedule
FAST = dict(max_new_tokens=NEW, steps=NEW, alg="maskgit_plus", block_length=32, cache="dual", threshold=0.9)
# a random order: the answer is decided before the end (32 new tokens: every program compiles the same at any length)
EXACT = dict(max_new_tokens=32, steps=32, alg="origin")
# `tasks.demo_test_problems(4)`'s prompts, written out: drawing them draws the preset's training problems (11 s)
PROMPTS = ["sort 026148=", "sort dog hat goat bird cat egg=", "sort 61942=", "sort apple dog bird jar egg hat="]


@pytest.fixture(scope="module")
def task_model():
    return dream.load(TASK_MODEL)


def _first_ends(sequences, prompt_len: int, stop_ids) -> list[int]:
    """Each row's first end-of-text among its new tokens (of a full decoding: it has one)."""
    return [int(np.flatnonzero(np.isin(row, list(stop_ids)))[0]) for row in np.asarray(sequences)[:, prompt_len:]]


def _same_up_to_the_first_end(stopped, full, prompt_len: int, tokenizer):
    """The texts are equal, and so are the tokens up to each row's first end-of-text (both canvases' own)."""
    stopped, full = np.asarray(stopped), np.asarray(full)
    assert tokenizer.decode_generation(stopped, prompt_len) == tokenizer.decode_generation(full, prompt_len)
    for row, end in enumerate(_first_ends(full, prompt_len, tokenizer.stop_ids)):
        np.testing.assert_array_equal(stopped[row, : prompt_len + end + 1], full[row, : prompt_len + end + 1])


@pytest.mark.slow
def test_text_ended_is_the_first_end_or_mask_being_an_end():
    mask, stop = 9, [0, 7]
    span = np.array([[1, 0, 9], [1, 9, 0], [9, 9, 9], [1, 2, 3], [7, 9, 9]])
    ended = text_ended(span, np.isin(span, stop), mask)
    np.testing.assert_array_equal(ended, [True, False, False, False, True])
    np.testing.assert_array_equal(
        np.asarray(text_ended(jnp.asarray(span), jnp.isin(span, jnp.asarray(stop)), mask)), ended
    )
    # as the exact loop reads it, the end-of-text ids a vocabulary mask and the start traced: a prompt of end-of-text
    # ids before the text is not read
    ends_V = jnp.isin(jnp.arange(10), jnp.asarray(stop))
    for start in (0, 2):
        canvas = jnp.asarray(np.concatenate([np.full((5, start), 7), span], axis=1))
        np.testing.assert_array_equal(np.asarray(text_ended(canvas, ends_V[canvas], mask, jnp.int32(start))), ended)
    assert not np.asarray(text_ended(jnp.asarray(span), jnp.zeros(10, bool)[span], mask, jnp.int32(0))).any()


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 4], ids=["alone", "batched"])
def test_block_wise_stops_after_the_block_where_every_text_ended(task_model, rows):
    model, tokenizer = task_model
    ids, mask = tokenizer(PROMPTS[:rows])
    full = list(dream.generate_blocks(model, ids, mask, **FAST))
    stopped = list(dream.generate_blocks(model, ids, mask, stop_token_ids=tokenizer.stop_ids, **FAST))
    assert len(full) == NEW // 32 and [b.last for b in full] == [False] * 3 + [True]
    # every answer ends in the first block: no block is called after it
    assert len(stopped) == 1 and stopped[0].last
    assert (np.asarray(stopped[-1].output.sequences)[:, ids.shape[1] + 32 :] == model.config.mask_token_id).all()
    _same_up_to_the_first_end(stopped[-1].output.sequences, full[-1].output.sequences, ids.shape[1], tokenizer)
    off = dream.generate_blocks(model, ids, mask, stop_token_ids=tokenizer.stop_ids, early_stop=False, **FAST)
    assert len(list(off)) == NEW // 32
    # the text API stops early by default, and gives the full decoding's text
    texts = tokenizer.decode_generation(np.asarray(full[-1].output.sequences), ids.shape[1])
    assert dream.generate(model, tokenizer, PROMPTS[:rows], **FAST) == texts


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 4], ids=["alone", "batched"])
def test_exact_path_stops_after_the_step_where_every_text_ended(task_model, rows):
    model, tokenizer = task_model
    ids, mask = tokenizer(PROMPTS[:rows])
    canvas = prepare_generation(model, ids, mask, **EXACT).x_BN
    jitted = decoding_program(exact_loop, model, canvas, static_argnames=("graphdef", "program"))
    compiled = jitted._cache_size()
    full = model.diffusion_generate(ids, mask, return_dict_in_generate=False, **EXACT)
    stopped = model.diffusion_generate(
        ids, mask, return_dict_in_generate=False, stop_token_ids=tokenizer.stop_ids, **EXACT
    )
    assert jitted._cache_size() == compiled + 1  # the end-of-text ids are inputs: one program decodes both
    assert not (np.asarray(full) == model.config.mask_token_id).any()
    # it stopped before the last step, once every row's text had ended
    assert (np.asarray(stopped) == model.config.mask_token_id).any()
    text = np.asarray(stopped)[:, ids.shape[1] :]
    assert text_ended(text, np.isin(text, list(tokenizer.stop_ids)), model.config.mask_token_id).all()
    _same_up_to_the_first_end(stopped, full, ids.shape[1], tokenizer)
    assert dream.generate(model, tokenizer, PROMPTS[:rows], **EXACT) == tokenizer.decode_generation(
        np.asarray(full), ids.shape[1]
    )


@pytest.mark.slow
def test_a_static_batch_ends_with_the_block_where_every_text_ended(task_model):
    """The server's static batch (`generate_canvases`): its last canvas is final, and each row's text (`RowText`,
    which a continuous batch reads too) is the full decoding's, finished by end-of-text."""
    model, tokenizer = task_model
    ids, mask = tokenizer(PROMPTS)
    full = tokenizer.decode_generation(np.asarray(model.diffusion_generate(ids, mask, **FAST).sequences), ids.shape[1])
    key = BatchKey.of(ids.shape[1], NEW, **{k: v for k, v in FAST.items() if k not in ("max_new_tokens", "threshold")})
    rows = {"threshold": [FAST["threshold"]] * len(PROMPTS)}
    programs = JitPrograms(model)
    canvases = list(generate_canvases(model, key, ids, mask, rows, row_keys(None, 4), programs, tokenizer.stop_ids))
    assert [final for _, final, _ in canvases] == [True]
    texts = [RowText(tokenizer, NEW, []) for _ in PROMPTS]
    assert [text.update(canvases[-1][0][row, ids.shape[1] :], True) for row, text in enumerate(texts)] == full
    assert {text.finish_reason for text in texts} == {"stop"}


def test_the_cli_flag_no_early_stop_turns_it_off():
    """`--no-early-stop` is the setting off (the CLI passes the tokenizer's end-of-text ids: tests/test_dream_cli.py
    holds its early-stopped completions to upstream's recorded full decoding)."""
    args = [
        "generate",
        "--model",
        str(TASK_MODEL),
        "--prompt",
        "sort 82=",
        *(f"--{k.replace('_', '-')}={v}" for k, v in FAST.items()),
    ]
    assert "early_stop" not in _generation_args(_parser().parse_args(args))
    assert _generation_args(_parser().parse_args([*args, "--no-early-stop"]))["early_stop"] is False


@pytest.mark.slow
def test_where_early_stop_is_off(task_model):
    """Off without end-of-text ids, with `early_stop=False`, under `schedule="fastdllm"` (Fast-dLLM decodes every
    block), with per-step records and with a tokens hook; bad ids and settings are named."""
    model, tokenizer = task_model
    ids, mask = tokenizer(PROMPTS)
    stop = tokenizer.stop_ids

    def early_stop(**kwargs):
        return prepare_generation(model, ids, mask, **{**FAST, **kwargs}).program.early_stop

    assert early_stop(stop_token_ids=stop) == EarlyStop(tuple(sorted(stop)), ids.shape[1])
    assert early_stop() is None
    assert early_stop(stop_token_ids=stop, early_stop=False) is None
    assert early_stop(stop_token_ids=stop, schedule="fastdllm", top_k=50) is None
    assert early_stop(stop_token_ids=stop, output_scores=True) is None
    assert early_stop(stop_token_ids=stop, generation_tokens_hook_func=lambda step, x, logits: x) is None
    assert not GenerationSettings.of(schedule="fastdllm").stops_early
    with pytest.raises(JaxportError, match=r"early_stop: Input should be a valid boolean.*got 'maybe'"):
        early_stop(stop_token_ids=stop, early_stop="maybe")
    vocab = model.config.vocab_size
    with pytest.raises(
        JaxportError, match=rf"stop_token_ids: expected a non-empty list of token ids in \[0, {vocab}\)"
    ):
        early_stop(stop_token_ids=[vocab])
