"""Block-wise fast decoding (jaxport.dream.fast): equal to the exact path where it must be, the KV cache equal
to the cache-free path when refreshed every step, threshold and tie rules, bad combinations, the text API."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxport import cli, dream
from jaxport.dream import fast
from jaxport.dream.program import JitPrograms, padding_inputs, prepare_generation
from jaxport.dream.serving.batches import Lane, RunningBatch
from jaxport.dream.settings import GenerationSettings, RowSettings
from jaxport.errors import JaxportError

CASE = Path(__file__).parent / "fixtures" / "dream" / "tiny_sharded"
SETTINGS = json.loads((CASE / "case.json").read_text())["generation"]
RECORDS = ("sequences", "history", "x0", "n_transfer", "confidence")


@pytest.fixture(scope="module")
def loaded():
    return dream.load(CASE / "model")


@pytest.fixture(scope="module")
def model(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def inputs():
    data = np.load(CASE / "inputs.npz")
    return data["input_ids"], data["attention_mask"]


def generate(model, inputs, **kwargs):
    out = model.diffusion_generate(*inputs, output_history=True, output_scores=True, **kwargs)
    return {name: np.asarray(getattr(out, name)) for name in RECORDS}


def refreshed(model, inputs, **kwargs):
    """`generate` with the block cache rebuilt from the current canvas before every step (the private test hook)."""
    prepared = prepare_generation(model, *inputs, output_history=True, output_scores=True, blockwise=True, **kwargs)
    out = fast.blocks_output(fast._run_blocks(model, prepared, refresh=True))
    return {name: np.asarray(getattr(out, name)) for name in RECORDS}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["maskgit_plus_s5", "topk_margin_s16_topp09_topk20"])
def test_one_block_without_cache_gives_the_recorded_tokens(model, inputs, name):
    """block_length = max_new_tokens, no cache, no threshold: upstream's recorded generation, step by step."""
    s, expected = SETTINGS[name], np.load(CASE / "expected.npz")
    out = generate(
        model,
        inputs,
        max_new_tokens=s["max_new_tokens"],
        steps=s["steps"],
        alg=s["alg"],
        top_p=s["top_p"],
        top_k=s["top_k"],
        block_length=s["max_new_tokens"],
    )
    for field in ("sequences", "history", "x0", "n_transfer"):
        np.testing.assert_array_equal(out[field], expected[f"gen__{name}__{field}"], err_msg=field)


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [
        dict(alg="origin"),
        dict(alg="maskgit_plus", temperature=0.7, top_p=0.9),
        dict(alg="entropy", alg_temp=0.3, top_k=20),
    ],
    ids=lambda s: s["alg"],
)
def test_one_block_without_cache_is_the_exact_path(model, inputs, setting):
    """The same for the random draws (origin, temperature, alg_temp): equal to jaxport's exact path."""
    kwargs = dict(max_new_tokens=16, steps=8, rng=jax.random.key(3), **setting)
    exact, blocks = generate(model, inputs, **kwargs), generate(model, inputs, block_length=16, **kwargs)
    for name in RECORDS:
        np.testing.assert_array_equal(blocks[name], exact[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [
        dict(alg="entropy", steps=8, block_length=4, cache="dual"),
        dict(alg="maskgit_plus", steps=16, block_length=8, cache="prefix", top_k=5, threshold=0.3),
        dict(alg="origin", steps=16, block_length=4, cache="dual", threshold=0.3),
        dict(alg="topk_margin", steps=8, block_length=8, cache="prefix", alg_temp=0.3, temperature=0.8, top_p=0.9),
    ],
    ids=lambda s: f"{s['alg']}_{s['cache']}",
)
def test_cache_refreshed_every_step_equals_cache_free(model, inputs, setting):
    """Batch 2 with left padding: reading a freshly refreshed cache gives the cache-free block path's tokens."""
    kwargs = dict(max_new_tokens=16, rng=jax.random.key(5), **setting)
    free = generate(model, inputs, **{**kwargs, "cache": None})
    cached = refreshed(model, inputs, **kwargs)
    for name in ("sequences", "history", "n_transfer", "x0"):
        np.testing.assert_array_equal(cached[name], free[name], err_msg=name)
    assert not (free["sequences"] == model.config.mask_token_id).any()


@pytest.mark.slow
def test_cached_window_forward_equals_the_full_forward(model, inputs):
    """The KV-cache forward of a window, with a cache from the same canvas, gives the full forward's states."""
    ids = np.concatenate([inputs[0], np.full((2, 16), model.config.mask_token_id, np.int32)], axis=1)
    valid = np.pad(inputs[1].astype(bool), ((0, 0), (0, 16)), constant_values=True)
    mask, positions = padding_inputs(valid, *ids.shape)
    h_full, cache = model.hidden_states_cached(ids, mask, positions)
    start, size = 41, 9
    h_window, window_cache = model.hidden_states_cached(
        ids[:, start : start + size], valid, positions[:, start : start + size], cache, start
    )
    np.testing.assert_allclose(np.asarray(h_window), np.asarray(h_full)[:, start : start + size], atol=1e-5, rtol=1e-5)
    k_full, k_window = np.asarray(cache[1][0]), np.asarray(window_cache[1][0])
    np.testing.assert_allclose(k_window, k_full, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_blocks_fill_left_to_right_and_threshold_unmasks_in_parallel(model, inputs):
    L, M = inputs[0].shape[1], model.config.mask_token_id
    out = generate(model, inputs, max_new_tokens=16, steps=16, alg="maskgit_plus", block_length=4, threshold=0.2)
    history, confidence, n_transfer = out["history"], out["confidence"], out["n_transfer"]
    canvas_before = np.concatenate([np.pad(inputs[0], ((0, 0), (0, 16)), constant_values=M)[None], history[:-1]])
    for step in range(16):
        block = step // 4
        before, after = canvas_before[step, :, L:] == M, history[step, :, L:] == M
        assert after[:, (block + 1) * 4 :].all()  # later blocks stay masked
        if step % 4 == 3:  # and a block is full after its last step
            assert not after[:, : (block + 1) * 4].any()
        unmasked = before & ~after
        # maskgit_plus: the confidence is the candidate's probability, which the threshold compares
        assert (unmasked | ~(before & (confidence[step, :, L:] >= 0.2))).all()
        has_masks = before[:, block * 4 : (block + 1) * 4].any(axis=-1)
        assert ((n_transfer[step] >= 1) | ~has_masks).all() and (n_transfer[step] == unmasked.sum(-1)).all()
    assert (n_transfer > 1).any() and (n_transfer == 0).any()  # parallel steps, and blocks that ended early


@pytest.mark.slow
@pytest.mark.parametrize(
    "alg, fast",
    [
        ("maskgit_plus", {}),
        ("entropy", dict(block_length=8)),
        ("topk_margin", dict(block_length=4, cache="dual")),
        ("entropy", dict(block_length=8, cache="prefix", schedule="fastdllm")),
    ],
)
def test_saturated_confidence_ties_unmask_leftmost_first(model, inputs, alg, fast):
    """top_k=1 leaves one token per position, so every confidence is equal (1, 1 or 0): the tie rule alone
    picks the positions, the leftmost first, and a row's tokens are the same alone as in the batch."""
    L, M = inputs[0].shape[1], model.config.mask_token_id
    out = generate(model, inputs, max_new_tokens=16, steps=8, alg=alg, top_k=1, **fast)
    finite = np.isfinite(out["confidence"])
    assert len(np.unique(out["confidence"][finite])) == 1
    filled = out["history"][:, :, L:] != M
    counts = np.cumsum(out["n_transfer"], axis=0)
    assert (filled == (np.arange(16) < counts[..., None])).all()
    row = int(np.argmin(inputs[1].sum(axis=1)))  # the left-padded row
    alone = generate(
        model,
        (inputs[0][row : row + 1], inputs[1][row : row + 1]),
        max_new_tokens=16,
        steps=8,
        alg=alg,
        top_k=1,
        **fast,
    )
    np.testing.assert_array_equal(alone["sequences"][0], out["sequences"][row])


@pytest.mark.slow
def test_generate_blocks_streams_each_block(model, inputs):
    kwargs = dict(max_new_tokens=16, steps=8, alg="entropy", block_length=4, cache="dual", threshold=0.3)
    blocks = list(dream.generate_blocks(model, *inputs, **kwargs))
    L, M = inputs[0].shape[1], model.config.mask_token_id
    assert [(b.index, b.start, b.end) for b in blocks] == [(i, L + 4 * i, L + 4 * i + 4) for i in range(4)]
    for b in blocks:
        sequences = np.asarray(b.output.sequences)
        assert not (sequences[:, : b.end] == M).any() and (sequences[:, b.end :] == M).all()
        np.testing.assert_array_equal(np.asarray(b.tokens), sequences[:, b.start : b.end])
    whole = model.diffusion_generate(*inputs, **kwargs)
    np.testing.assert_array_equal(np.asarray(blocks[-1].output.sequences), np.asarray(whole.sequences))


@pytest.mark.slow
def test_tokens_hook_and_progress_block_wise(model, inputs):
    L = inputs[0].shape[1]
    calls, progress = [], []

    def force_first_token(step, x, logits):
        calls.append((step, logits))
        return x.at[:, L].set(7)

    out = model.diffusion_generate(
        *inputs,
        max_new_tokens=16,
        steps=8,
        alg="entropy",
        block_length=8,
        cache="dual",
        generation_tokens_hook_func=force_first_token,
        output_history=True,
        progress=lambda step, x: progress.append(int(step)),
    )
    assert calls[0] == (None, None) and all(logits is None for _, logits in calls)
    assert (np.asarray(out.history)[:, :, L] == 7).all()
    assert progress == list(range(8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_length=5), r"block_length: block_length=5 must divide the number of new tokens \(16\)"),
        (dict(block_length=32), r"block_length: block_length=32 must divide"),
        (
            dict(block_length=4, steps=6),
            r"steps: steps=6 must be divisible by the number of blocks "
            r"\(4 = 16 new tokens / block_length 4\)",
        ),
        (dict(threshold=0.0), r"threshold: must be in \(0, 1\], got 0.0"),
        (dict(threshold=1.5, block_length=4), r"threshold: must be in \(0, 1\], got 1.5"),
        (dict(cache="full", block_length=4), r"cache: must be None, 'prefix' or 'dual', got 'full'"),
        (dict(schedule="fast"), r"schedule: unknown schedule 'fast'; choose one of jaxport, fastdllm"),
        (dict(schedule="fastdllm"), r"alg: schedule 'fastdllm' ranks the block's masks by confidence"),
        (dict(block_len=4), r"block_len: unknown generation argument"),
        (
            dict(cache="dual", generation_logits_hook_func=lambda s, x, lg: lg),
            r"generation_logits_hook_func: not available block-wise",
        ),
    ],
)
def test_bad_combinations(model, inputs, kwargs, message):
    kwargs = {"max_new_tokens": 16, "steps": 8, **kwargs}
    with pytest.raises(JaxportError, match=message):
        model.diffusion_generate(*inputs, **kwargs)


def test_prompt_masks_need_the_exact_path(model, inputs):
    ids = inputs[0].copy()
    ids[:, -3] = model.config.mask_token_id
    with pytest.raises(JaxportError, match=r"input_ids: the prompt holds mask tokens"):
        model.diffusion_generate(ids, inputs[1], max_new_tokens=16, steps=8, block_length=8)


@pytest.mark.slow
def test_text_in_text_out(loaded):
    model, tokenizer = loaded
    chat = [{"role": "user", "content": "Add two numbers."}]
    expected = tokenizer.decode_generation(np.load(CASE / "expected.npz")["gen__entropy_s8__sequences"], 42)
    assert (
        dream.generate(model, tokenizer, [chat, "def add(a, b):"], max_new_tokens=16, steps=8, alg="entropy")
        == expected
    )
    fast = dict(max_new_tokens=16, alg="entropy", block_length=8, cache="dual", threshold=0.3)
    texts = dream.generate(model, tokenizer, ["def add(a, b):", chat, "x = "], batch_size=2, **fast)
    ids, mask = tokenizer([tokenizer.apply_chat_template(chat, add_generation_prompt=True), "def add(a, b):"])
    direct = model.diffusion_generate(ids, mask, steps=16, **fast)
    assert len(texts) == 3 and texts[1::-1] == tokenizer.decode_generation(direct.sequences, ids.shape[1])
    assert dream.generate(model, tokenizer, chat, **fast) == texts[1]
    with pytest.raises(JaxportError, match=r"prompts: expected a string, a list of chat messages"):
        dream.generate(model, tokenizer, [], max_new_tokens=16)


@pytest.mark.slow
def test_cli_fast_flags(capsys):
    args = [
        "dream",
        "generate",
        "--model",
        str(CASE / "model"),
        "--prompt",
        "def add(a, b):",
        "--max-new-tokens",
        "16",
        "--steps",
        "8",
        "--alg",
        "entropy",
        "--dtype",
        "float32",
        "--block-length",
        "4",
        "--cache",
        "dual",
        "--threshold",
        "0.3",
    ]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    completion = json.loads(captured.out.splitlines()[-1])["completion"]
    model, tokenizer = dream.load(CASE / "model")
    assert completion == dream.generate(
        model,
        tokenizer,
        "def add(a, b):",
        max_new_tokens=16,
        steps=8,
        alg="entropy",
        block_length=4,
        cache="dual",
        threshold=0.3,
    )
    assert cli.main(args + ["--schedule", "fastdllm", "--top-k", "50"]) == 0
    completion = json.loads(capsys.readouterr().out.splitlines()[-1])["completion"]
    fastdllm = dict(block_length=4, cache="dual", threshold=0.3, schedule="fastdllm", top_k=50)
    expected = dream.generate(model, tokenizer, "def add(a, b):", max_new_tokens=16, steps=8, alg="entropy", **fastdllm)
    assert completion == expected
    assert cli.main(args[:-6] + ["--cache", "full"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "jaxport dream: error: cache: must be None, 'prefix' or 'dual', got 'full'"
    )
    assert (
        cli.main(
            [
                "dream",
                "bench",
                "--random-init",
                "tiny",
                "--batch-sizes",
                "2",
                "--prompt-len",
                "8",
                "--max-new-tokens",
                "8",
                "--steps",
                "4",
                "--repeats",
                "1",
                "--block-length",
                "4",
                "--cache",
                "dual",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["generation_args"] == {"block_length": 4, "cache": "dual"}
    assert result["results"][0]["new_tokens_per_s"] > 0


MESH_SCRIPT = r"""
import json, sys
import jax, numpy as np
from jaxport import dream
from jaxport.distributed import make_mesh
from jaxport.dream import fast
from jaxport.dream.program import prepare_generation

case = sys.argv[1]
model, _ = dream.load(case + "/model", mesh=make_mesh(data=2, fsdp=1, model=4))
inputs = np.load(case + "/inputs.npz")
ids, mask = inputs["input_ids"], inputs["attention_mask"]
report = {}
for name, kwargs in [
        ("entropy_prefix", dict(alg="entropy", steps=8, block_length=8, cache="prefix")),
        ("maskgit_dual", dict(alg="maskgit_plus", steps=16, block_length=8, cache="dual", threshold=0.3, top_k=5)),
        ("origin_dual", dict(alg="origin", steps=16, block_length=4, cache="dual", rng=jax.random.key(4)))]:
    free = np.asarray(model.diffusion_generate(ids, mask, max_new_tokens=16, output_history=True,
                                               **{**kwargs, "cache": None}).history)
    prepared = prepare_generation(model, ids, mask, max_new_tokens=16, output_history=True, **kwargs)
    cached = fast.blocks_output(fast._run_blocks(model, prepared, refresh=True)).history
    report[name] = bool(np.array_equal(np.asarray(cached), free))
    report[name + "_tokens"] = free[-1].tolist()
print(json.dumps(report))
"""


@pytest.mark.slow
def test_cache_on_a_mesh_of_eight_devices(model, inputs):
    """On a (data 2, model 4) mesh the refreshed cache equals the cache-free path, whose tokens equal one device's."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, str(CASE)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["entropy_prefix"] and report["maskgit_dual"] and report["origin_dual"]
    one_device = model.diffusion_generate(
        *inputs, max_new_tokens=16, alg="maskgit_plus", steps=16, block_length=8, threshold=0.3, top_k=5
    )
    np.testing.assert_array_equal(np.asarray(report["maskgit_dual_tokens"]), np.asarray(one_device.sequences))


@pytest.mark.slow
@pytest.mark.parametrize("fast", [{}, dict(block_length=8, cache="dual", threshold=0.3)], ids=["exact", "block-wise"])
def test_a_prompt_that_fills_its_bucket_decodes_alone_as_beside_a_shorter_one(loaded, fast):
    """A prompt as long as its bucket has an all-ones attention mask unless a shorter prompt pads its batch. The
    mask is applied either way, so at one batch size its row runs the same attention beside a full prompt as beside
    a padded one, score for score, bit for bit; alone (batch 1, other kernels) it gets the same tokens."""
    model, tokenizer = loaded
    long, short = "def add(a, b):\n    return a + b", "x ="
    width = len(tokenizer.encode(long))
    alone, full, padded = (tokenizer(texts, pad_to=width) for texts in ([long], [long, long], [long, short]))
    assert alone[1].all() and full[1].all() and not padded[1].all()
    kwargs = dict(max_new_tokens=16, steps=16, alg="entropy", output_scores=True, **fast)
    one, two, mixed = (model.diffusion_generate(*inputs, **kwargs) for inputs in (alone, full, padded))
    np.testing.assert_array_equal(np.asarray(two.confidence)[:, 0], np.asarray(mixed.confidence)[:, 0])
    for out in (two, mixed):
        np.testing.assert_array_equal(np.asarray(one.sequences)[0], np.asarray(out.sequences)[0])


@pytest.mark.slow
def test_a_running_batch_runs_at_the_smallest_size_that_holds_its_rows(loaded):
    """Rows joining and leaving a running batch (continuous batching) at block boundaries: each call gathers the
    occupied slots into the smallest compiled batch size, and each row gets `diffusion_generate`'s tokens alone."""
    model, tokenizer = loaded
    settings = GenerationSettings.of(steps=16, block_length=4, cache="dual", alg="entropy").check(16).program
    lane = Lane.of(16, 16, 16, settings)
    jitted, call_sizes = JitPrograms(model), []

    def programs(function, static, x_BN, *dynamic):
        call_sizes.append(x_BN.shape[0])
        return jitted(function, static, x_BN, *dynamic)

    batch = RunningBatch(model, lane, 4, programs, tokenizer.pad_token_id, tokenizer.mask_token_id, sizes=[1, 2, 4])
    rows = {"def add(a, b):": 16, "x =": 8, "import numpy as np": 16}
    ids, valid = tokenizer(list(rows), pad_to=16)
    slots, spans = {}, {}

    def join(i):
        prompt = list(rows)[i]
        slots[batch.join(prompt, ids[i], valid[i], rows[prompt], RowSettings(), jax.random.key(i))] = prompt

    join(0)
    batch.run()
    join(1)
    join(2)
    while slots:
        batch.run()
        for b in [b for b in slots if batch.done(b)]:
            spans[slots.pop(b)] = batch.span(b).copy()
            batch.leave(b)
    assert call_sizes == [1, 4, 4, 2, 1]
    for prompt, new_tokens in rows.items():
        prompt_ids = np.array([tokenizer.encode(prompt)])
        alone = model.diffusion_generate(
            prompt_ids,
            np.ones_like(prompt_ids),
            max_new_tokens=new_tokens,
            steps=new_tokens,
            block_length=4,
            cache="dual",
            alg="entropy",
            return_dict_in_generate=False,
        )
        np.testing.assert_array_equal(spans[prompt], np.asarray(alone)[0, prompt_ids.shape[1] :], err_msg=prompt)
