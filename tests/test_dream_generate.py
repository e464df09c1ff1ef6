"""diffusion_generate parity with upstream for every recorded setting, plus hooks, sampling and bad input."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxport import dream
from jaxport.dream.sampling import timesteps
from jaxport.errors import JaxportError

CASE = Path(__file__).parent / "fixtures" / "dream" / "tiny_sharded"
META = json.loads((CASE / "case.json").read_text())
SETTINGS = META["generation"]


@pytest.fixture(scope="module")
def model():
    return dream.load(CASE / "model")[0]


@pytest.fixture(scope="module")
def data():
    return np.load(CASE / "inputs.npz"), np.load(CASE / "expected.npz")


def run(model, inputs, setting, **extra):
    kwargs = dict(
        max_new_tokens=setting["max_new_tokens"],
        steps=setting["steps"],
        alg=setting["alg"],
        temperature=setting["temperature"],
        top_p=setting["top_p"],
        top_k=setting["top_k"],
        eps=setting["eps"],
        output_history=True,
        output_scores=True,
    )
    kwargs.update(extra)
    return model.diffusion_generate(inputs["input_ids"], inputs["attention_mask"], **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_recorded_generation(model, data, name):
    inputs, expected = data
    setting = SETTINGS[name]
    np.testing.assert_array_equal(
        timesteps(setting["steps"], setting["eps"]), np.asarray(setting["timesteps_float32"], np.float32)
    )
    # alg_temp 0 means "no sampling of positions", exactly as None (upstream checks both)
    out = run(model, inputs, setting, alg_temp=0.0 if name == "topk_margin_s8" else None)
    want = {k: expected[f"gen__{name}__{k}"] for k in ("sequences", "history", "n_transfer", "confidence", "x0")}
    np.testing.assert_array_equal(np.asarray(out.sequences), want["sequences"])
    np.testing.assert_array_equal(np.asarray(out.history), want["history"])
    np.testing.assert_array_equal(np.asarray(out.n_transfer), want["n_transfer"])
    np.testing.assert_array_equal(np.asarray(out.n_transfer)[:, 0], setting["n_transfer_row0"])
    np.testing.assert_array_equal(np.asarray(out.x0), want["x0"])
    conf = np.asarray(out.confidence)
    finite = np.isfinite(want["confidence"])
    np.testing.assert_array_equal(np.isfinite(conf), finite)
    assert (conf[~finite] == -np.inf).all()
    tol = META["tolerances"]["confidence"]
    np.testing.assert_allclose(conf[finite], want["confidence"][finite], atol=tol["atol"], rtol=tol["rtol"])


@pytest.mark.slow
def test_logits_hook_sees_the_shifted_logits(model, data):
    """The logits hook gets upstream's shifted [B, N, V] logits; recorded at canvas columns per step."""
    inputs, expected = data
    seen = []

    def logits_hook(step, x, logits):
        jax.debug.callback(lambda lg: seen.append(np.asarray(lg)), logits)
        return logits

    out = run(model, inputs, SETTINGS["maskgit_plus_s5"], generation_logits_hook_func=logits_hook)
    np.testing.assert_array_equal(np.asarray(out.sequences), expected["gen__maskgit_plus_s5__sequences"])
    L = inputs["input_ids"].shape[1]
    got = np.stack(seen)[:, :, L:]
    np.testing.assert_allclose(
        got,
        expected["gen__maskgit_plus_s5__step_logits_canvas"],
        **{k: META["tolerances"]["logits_shifted"][k] for k in ("atol", "rtol")},
    )


@pytest.mark.slow
def test_tokens_hook_controls_the_canvas(model, data):
    inputs, _ = data
    L = inputs["input_ids"].shape[1]
    calls = []

    def force_first_token(step, x, logits):
        calls.append(step)  # traced once: the initial call (None) and the loop body
        return x.at[:, L].set(7)

    progress = []
    out = run(
        model,
        inputs,
        SETTINGS["entropy_s8"],
        generation_tokens_hook_func=force_first_token,
        progress=lambda step, x: progress.append((int(step), np.asarray(x)[:, L])),
    )
    assert calls[0] is None and len(calls) == 2
    assert [step for step, _ in progress] == list(range(8)) and all((col == 7).all() for _, col in progress)
    history = np.asarray(out.history)
    assert (history[:, :, L] == 7).all()
    assert not (np.asarray(out.sequences) == model.config.mask_token_id).any()


@pytest.mark.slow
def test_prompt_masks_are_filled_like_the_full_canvas(model, data):
    """Mask tokens inside the prompt are denoised too; the windowed path equals the full one."""
    inputs, _ = data
    ids = inputs["input_ids"].copy()
    ids[:, -3] = model.config.mask_token_id
    kwargs = dict(max_new_tokens=8, steps=4, alg="maskgit_plus", output_history=True)
    windowed = model.diffusion_generate(ids, inputs["attention_mask"], **kwargs)
    full = model.diffusion_generate(
        ids, inputs["attention_mask"], generation_tokens_hook_func=lambda s, x, lg: x, **kwargs
    )
    np.testing.assert_array_equal(np.asarray(windowed.history), np.asarray(full.history))
    assert not (np.asarray(windowed.sequences) == model.config.mask_token_id).any()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(alg="origin"),
        dict(alg="maskgit_plus", temperature=0.7, top_p=0.9, top_k=20),
        dict(alg="topk_margin", alg_temp=0.3),
    ],
)
def test_random_algorithms(model, data, kwargs):
    inputs, _ = data
    gen = lambda seed: model.diffusion_generate(
        inputs["input_ids"],
        inputs["attention_mask"],
        max_new_tokens=16,
        steps=8,
        rng=jax.random.key(seed),
        output_scores=True,
        **kwargs,
    )
    a, b, c = gen(0), gen(0), gen(1)
    L = inputs["input_ids"].shape[1]
    np.testing.assert_array_equal(np.asarray(a.sequences), np.asarray(b.sequences))
    np.testing.assert_array_equal(np.asarray(a.sequences)[:, :L], inputs["input_ids"])
    assert not (np.asarray(a.sequences) == model.config.mask_token_id).any()
    assert np.asarray(a.n_transfer).sum(axis=0).tolist() == [16, 16]
    assert not np.array_equal(np.asarray(a.sequences), np.asarray(c.sequences))
    if kwargs["alg"] != "origin":  # the per-step counts follow the schedule whatever the draw
        assert np.asarray(a.n_transfer)[:, 0].tolist() == SETTINGS["entropy_s8"]["n_transfer_row0"]


@pytest.mark.slow
@pytest.mark.parametrize("fast", [{}, dict(block_length=8, cache="dual", threshold=[None, 0.6])])
def test_sampling_settings_per_row(model, data, fast):
    """Per-row settings and keys in one program: each row gets what it gets alone with its own settings and key;
    top_p 1 and no top_k change nothing."""
    inputs, _ = data
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    keys = jax.random.split(jax.random.key(3), 2)
    rows = dict(temperature=[0.0, 0.8], top_p=[1.0, 0.9], top_k=[None, 20], alg_temp=[None, 0.5])
    common = dict(max_new_tokens=16, steps=16, alg="maskgit_plus", return_dict_in_generate=False)
    both = np.asarray(model.diffusion_generate(ids, mask, rng=keys, **rows, **common, **fast))
    for b in range(2):
        alone = {name: values[b] for name, values in {**rows, **fast}.items() if isinstance(values, list)}
        settings = {**fast, **alone}
        one = model.diffusion_generate(ids[b : b + 1], mask[b : b + 1], rng=keys[b : b + 1], **settings, **common)
        np.testing.assert_array_equal(both[b], np.asarray(one)[0], err_msg=f"row {b}")
    greedy = model.diffusion_generate(
        ids[:1], mask[:1], **common, **{k: v for k, v in fast.items() if k != "threshold"}
    )
    neutral = dict(temperature=0.0, top_p=1.0, top_k=None) | ({"threshold": None} if fast else {})
    same = model.diffusion_generate(ids[:1], mask[:1], **common, **{**fast, **neutral})
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(same))
    np.testing.assert_array_equal(both[0], np.asarray(greedy)[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_length=40), r"max_length: the prompt has 42 tokens but max_length is 40"),
        (dict(max_new_tokens=8, steps=9), r"steps: steps=9 must be between 1 and the number of new tokens \(8\)"),
        (
            dict(max_new_tokens=8, steps=4, alg="greedy"),
            r"alg: unknown alg 'greedy'; choose one of origin, maskgit_plus",
        ),
        (dict(max_new_tokens=8, steps=4, top_p=1.5), r"top_p: must be in \(0, 1\]"),
        (dict(max_new_tokens=8, steps=4, top_k=0), r"top_k: must be a positive integer"),
    ],
)
def test_bad_generation_arguments(model, data, kwargs, message):
    inputs, _ = data
    with pytest.raises(JaxportError, match=message):
        model.diffusion_generate(inputs["input_ids"], inputs["attention_mask"], **kwargs)


# (setting, bad value, what the error says): every value is checked on its own before any rule between them
BAD_SETTINGS = [
    ("max_new_tokens", -4, "must be a positive integer, got -4"),
    ("max_new_tokens", 2.5, "Input should be a valid integer, got a number with a fractional part, got 2.5"),
    ("max_length", 0, "must be a positive integer, got 0"),
    ("steps", 0, "must be a positive integer, got 0"),
    ("steps", True, "expected a number, got True"),
    ("alg", "greedy", "unknown alg 'greedy'; choose one of origin, maskgit_plus, topk_margin, entropy"),
    ("eps", 1.0, "must be in (0, 1), got 1.0"),
    ("block_length", 0, "must be a positive integer, got 0"),
    ("cache", "full", "must be None, 'prefix' or 'dual', got 'full'"),
    ("schedule", "fast", "unknown schedule 'fast'; choose one of jaxport, fastdllm"),
    ("temperature", -1, "must be >= 0, got -1.0"),
    ("top_p", 0, "must be in (0, 1], got 0.0"),
    ("top_k", 0, "must be a positive integer, got 0"),
    ("alg_temp", -0.5, "must be >= 0, got -0.5"),
    ("threshold", 1.5, "must be in (0, 1], got 1.5"),
    ("threshold", [0.5, 0.0], "row 1: must be in (0, 1], got 0.0"),
]


@pytest.mark.parametrize("name, value, problem", BAD_SETTINGS)
def test_each_setting_is_checked_before_the_rules_between_them(model, data, name, value, problem):
    inputs, _ = data
    # 9 steps for 8 new tokens breaks a rule between settings: the bad value is named instead
    canvas = {"max_length": 20} if name == "max_length" else {"max_new_tokens": 8}
    kwargs = {**canvas, "steps": 9, name: value}
    with pytest.raises(JaxportError) as raised:
        model.diffusion_generate(inputs["input_ids"], inputs["attention_mask"], **kwargs)
    assert str(raised.value) == f"{name}: {problem}"


def test_text_api_names_a_bad_max_new_tokens(model):
    tokenizer = dream.DreamTokenizer.from_model_dir(CASE / "model", model.config)
    with pytest.raises(JaxportError, match=r"^max_new_tokens: must be a positive integer, got -4$"):
        dream.generate(model, tokenizer, "hi", max_new_tokens=-4)
    with pytest.raises(JaxportError, match=r"^batch_size: must be a positive integer, got -1$"):
        dream.generate(model, tokenizer, "hi", max_new_tokens=8, batch_size=-1)


def test_bad_input_ids(model):
    with pytest.raises(JaxportError, match=r"token ids must lie in \[0, 512\)"):
        model.diffusion_generate(np.array([[1, 600]]), max_new_tokens=4, steps=2)
    with pytest.raises(JaxportError, match=r"attention_mask: shape \[1, 3\] differs from input_ids \[1, 2\]"):
        model.diffusion_generate(np.array([[1, 2]]), np.ones((1, 3)), max_new_tokens=4, steps=2)


@pytest.mark.slow
def test_bfloat16_generation():
    """bf16 runs end to end (upstream's bf16 sampler ties make token parity unrecordable, see case.json)."""
    model = dream.load(CASE.parent / "tiny_bf16" / "model", dtype="bfloat16")[0]
    inputs = np.load(CASE / "inputs.npz")
    out = model.diffusion_generate(
        inputs["input_ids"], inputs["attention_mask"], max_new_tokens=16, steps=8, alg="entropy", output_scores=True
    )
    assert out.confidence.dtype == jnp.bfloat16
    assert not (np.asarray(out.sequences) == model.config.mask_token_id).any()
    np.testing.assert_array_equal(np.asarray(out.n_transfer)[:, 0], SETTINGS["entropy_s8"]["n_transfer_row0"])


@pytest.mark.slow
def test_decoding_program_keeps_reductions_out_of_dot_fusions(model, data):
    """On a CPU the compiled decoding loop runs each YNNPACK fusion on one dot: XLA's default also pulls the
    sampler's softmax reductions into YNNPACK fusions, which slows the vocabulary projection that feeds them."""
    from jaxport.dream.exact import exact_target
    from jaxport.dream.program import prepare_generation

    inputs, _ = data
    p = prepare_generation(model, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=8, steps=8)
    program, arguments = exact_target(model, p)
    hlo = program.lower(*arguments).compile().as_text()
    fused = [line for line in hlo.splitlines() if '"kind":"__ynn_fusion"' in line]
    assert fused, "no YNNPACK fusion in the decoding program"
    assert all("/dot_general" in line for line in fused), [line[:200] for line in fused if "/dot_general" not in line]


@pytest.mark.slow
def test_programs_hold_the_sampler_branches_their_rows_need(model, data):
    """A greedy generation compiles without the whole-vocabulary filter and the categorical draw (their buffers and
    compile time); a top-p one holds the filter's bisection over the vocabulary, a top-k one a partial sort and, on a
    small vocabulary, a cheaper search of one key; a row needing a branch gets it; no program sorts the vocabulary."""
    from jaxport.dream.exact import exact_target
    from jaxport.dream.program import prepare_generation
    from jaxport.dream.sampling import Branches

    inputs, _ = data
    vocab = model.config.vocab_size

    def compiled(**settings):
        p = prepare_generation(
            model, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=8, steps=8, **settings
        )
        jitted, arguments = exact_target(model, p)
        return p.program.branches, jitted.lower(*arguments).compile().as_text()

    def vocabulary(program, op):
        """The lines of `program` with `op` on a vocabulary-sized array: `u32[` the random bits of such an array."""
        shape = re.compile(rf"{re.escape(op)}[\d,]*,{vocab}\]" if op.endswith("[") else rf"\[[\d,]*,{vocab}\]")
        return [line for line in program.splitlines() if op in line and shape.search(line)]

    greedy_branches, greedy = compiled()
    assert greedy_branches == Branches(draw=False, filters=0)
    top_p_branches, top_p = compiled(top_p=[1.0, 0.9])  # greedy: no random bits over the vocabulary
    assert top_p_branches == Branches(draw=False, filters=2)
    assert vocabulary(top_p, "u32[") and not vocabulary(greedy, "u32[")  # the keys the bisection compares
    assert compiled(temperature=[0.0, 0.7], top_p=[1.0, 0.9])[0] == Branches(draw=True, filters=2)
    top_k_branches, top_k = compiled(top_k=[None, 20])
    assert top_k_branches == Branches(draw=False, filters=1)
    # a partial sort, and on this small vocabulary the bisection of one key per row for a top-k above PARTIAL_SORT;
    # not top-p's bisections over the vocabulary's probabilities
    assert 0 < 4 * len(vocabulary(top_k, "u32[")) < len(vocabulary(top_p, "u32["))
    assert not any(vocabulary(program, " sort(") for program in (greedy, top_p, top_k))
    assert compiled(top_k=[None, 200])[0] == Branches(draw=False, filters=2)


@pytest.mark.slow
def test_the_categorical_draw_follows_the_probabilities_and_never_draws_a_zero():
    """The sampler's draw (the inverse of the cumulative distribution, one uniform per row): over 40,000 keys each
    token's frequency is within 4 standard errors of its probability, and tokens of probability 0 (filtered out,
    first and last included) are never drawn."""
    from jaxport.dream.sampling import _categorical

    probs = np.array([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0], np.float32)
    n = 40_000
    keys = jax.random.split(jax.random.key(0), n)
    drawn = np.asarray(jax.jit(_categorical)(keys, jnp.tile(jnp.asarray(probs), (n, 1))))
    counts = np.bincount(drawn, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, counts
    standard_error = np.sqrt(probs * (1 - probs) / n)
    np.testing.assert_array_less(np.abs(counts / n - probs), 4 * standard_error + 1e-9)
    one_token = np.zeros((n, 7), np.float32)
    one_token[:, 6] = 1.0
    assert (np.asarray(_categorical(keys, jnp.asarray(one_token))) == 6).all()


def _filters_reference(logits_V: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """Top-p then top-k as upstream's `top_p_logits` / `top_k_logits`, with a stable sort (ties: lowest id first)."""
    order = np.argsort(-logits_V, kind="stable")
    sorted_V = logits_V[order]
    probabilities = np.exp(sorted_V - sorted_V[0]) / np.exp(sorted_V - sorted_V[0]).sum()
    remove_sorted = np.zeros(len(order), bool)
    if top_p < 1:
        remove_sorted[1:] = np.cumsum(probabilities)[:-1] > top_p
    remove = np.zeros(len(order), bool)
    remove[order] = remove_sorted
    if top_k:
        kept = np.where(remove, -np.inf, logits_V)
        remove |= kept < np.sort(kept)[::-1][min(top_k, len(kept)) - 1]
    return remove


@pytest.mark.slow
@pytest.mark.parametrize("large", [False, True], ids=["small vocabulary", "chunked vocabulary"])
def test_sampling_filters_match_a_sorted_reference_row_by_row(large):
    """Top-p and top-k read off a partial sort (on a large vocabulary, of the chunks holding the largest logits), or
    found by bisection over the whole vocabulary when a row's survivors lie beyond it: the tokens a stable sort
    removes, ties at the cut included, and each row's the same whatever its batch."""
    from jaxport.dream.sampling import CHUNK, PARTIAL_SORT, TOP_K_SORT, filters

    rng = np.random.default_rng(0)
    V = TOP_K_SORT * CHUNK + 7 if large else 4 * PARTIAL_SORT  # 7: the last chunk padded
    peaked = rng.normal(size=(8, V)) * 8  # narrow nuclei: the partial sort holds them
    flat = rng.normal(size=(4, V)) * 0.1  # wide nuclei: the bisection
    tied = np.round(rng.normal(size=(4, V)) * 3)  # many equal logits at every cut
    tied_flat = np.round(rng.normal(size=(3, V)) * 0.7)  # ... beyond the partial sort
    logits = np.concatenate([peaked, flat, tied, tied_flat]).astype(np.float32)
    top_p = np.array([1, 0.3, 0.9, 0.97, 1, 0.5, 1, 0.8, 0.9, 1, 0.6, 0.99, 0.5, 1, 0.95, 0.7, 0.6, 0.9, 1], np.float32)
    top_k = np.array([0, 0, 0, 10, 20, 3, PARTIAL_SORT + 5, 0, 0, 30, 7, 0, 0, 5, 2, 0, 0, 80, 100], np.int32)
    removed = (
        np.asarray(filters(jnp.asarray(logits), jnp.asarray(top_p), jnp.asarray(top_k))) == np.finfo(np.float32).min
    )
    for r in range(len(logits)):
        expected = _filters_reference(logits[r].astype(np.float64), float(top_p[r]), int(top_k[r]))
        np.testing.assert_array_equal(removed[r], expected, err_msg=f"row {r}")
        alone = filters(jnp.asarray(logits[r : r + 1]), jnp.asarray(top_p[r : r + 1]), jnp.asarray(top_k[r : r + 1]))
        np.testing.assert_array_equal(np.asarray(alone)[0] == np.finfo(np.float32).min, removed[r], err_msg=f"row {r}")
    top_k_only = (top_p == 1) & (top_k <= TOP_K_SORT)  # what a program without the bisection serves
    partial = filters(
        jnp.asarray(logits[top_k_only]), jnp.asarray(top_p[top_k_only]), jnp.asarray(top_k[top_k_only]), sort=False
    )
    np.testing.assert_array_equal(np.asarray(partial) == np.finfo(np.float32).min, removed[top_k_only])
    for r in np.flatnonzero(top_k_only):  # alone, the top-k program may take the other branch
        alone = filters(
            jnp.asarray(logits[r : r + 1]), jnp.asarray(top_p[r : r + 1]), jnp.asarray(top_k[r : r + 1]), sort=False
        )
        np.testing.assert_array_equal(np.asarray(alone)[0] == np.finfo(np.float32).min, removed[r], err_msg=f"row {r}")
    if large:
        return
    kept = (~removed).sum(axis=-1)
    assert (
        kept[[1, 2, 3, 5, 7]].max() < PARTIAL_SORT < kept[[8, 11]].min()
    )  # alone: the partial sort; in the batch: not


def test_packed_masks_score_as_the_whole_window():
    """Scoring the masks alone, packed into buckets (what a large vocabulary runs), gives every mask position the
    candidate, confidence and probability the whole window's scoring gives it, for rows with every mask count (each
    bucket) and every sampler branch (a draw, top-p, top-k). Packing is the same for every `alg`."""
    from jaxport.dream.sampling import Rows, bucket_sizes, masked_scores

    alg = "topk_margin"
    rng = np.random.default_rng(0)
    B, W, D, V = 6, 32, 16, 96
    table_DV = jnp.asarray(rng.normal(size=(D, V)).astype(np.float32))
    hidden_BWD = jnp.asarray(rng.normal(size=(B, W, D)).astype(np.float32))

    def head(h_BSD):
        return h_BSD @ table_DV

    def hidden_at(index_BS):
        return jnp.take_along_axis(hidden_BWD, index_BS[..., None], axis=1)

    rows = Rows(
        temperature=jnp.asarray([0.0, 0.7, 1.0, 0.0, 0.5, 0.0], jnp.float32),
        top_p=jnp.asarray([1.0, 0.9, 1.0, 0.8, 1.0, 1.0], jnp.float32),
        top_k=jnp.asarray([0, 0, 20, 5, 0, 0], jnp.int32),
        alg_temp=jnp.zeros(B, jnp.float32),
        threshold=jnp.full(B, jnp.inf, jnp.float32),
    )
    keys_B = jax.random.split(jax.random.key(3), B)
    whole_window, packed_masks = (
        jax.jit(
            lambda is_mask_BW, packed=packed: masked_scores(
                head, hidden_at, is_mask_BW, keys_B, alg, rows, packed=packed
            )
        )
        for packed in (False, True)
    )
    for most in bucket_sizes(W):  # the most masks of a row: each bucket of the packed program in turn
        counts = rng.integers(0, most + 1, size=B)
        counts[0], counts[-1] = most, 0
        is_mask_BW = np.zeros((B, W), bool)
        for b, count in enumerate(counts):
            is_mask_BW[b, rng.choice(W, count, replace=False)] = True
        whole, masks_alone = whole_window(is_mask_BW), packed_masks(is_mask_BW)
        for name, a, b in zip(whole._fields, whole, masks_alone, strict=True):
            assert a.dtype == b.dtype, name
            at_masks = np.asarray(a)[is_mask_BW], np.asarray(b)[is_mask_BW]
            np.testing.assert_allclose(*at_masks, rtol=1e-6, atol=0, err_msg=f"{name}, {most} masks")
        assert len(set(np.asarray(whole.x0)[is_mask_BW])) > 1
