"""lm-evaluation-harness with the `jaxport-dream` model (`jaxport.dream.lm_eval`): the test model's sort task
through lm-eval's own entry points (the `jaxport dream eval` command line, `lm_eval.simple_evaluate`) and the
model's requests against jaxport's decoding, offline (the task YAMLs and their data are in tests/lm_eval_tasks)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)  # before `datasets` is imported: it reads them once

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from jaxport.dream import tasks  # noqa: E402
from jaxport.dream.lm_eval import DreamLM  # noqa: E402
from jaxport.errors import JaxportError  # noqa: E402

MODEL = Path(__file__).parent / "fixtures" / "dream" / "task_model"
TASKS = Path(__file__).parent / "lm_eval_tasks"
PROBLEMS = 32  # of the 256 held-out problems (the full run is the README's command)


@pytest.fixture(scope="module")
def lm():
    return DreamLM(str(MODEL), batch_size=8, alg="entropy", mc_num=16)


def _generate(prompt: str, until) -> Instance:
    return Instance("generate_until", {}, (prompt, {"until": until}), 0)


def _score(context: str, continuation: str) -> Instance:
    return Instance("loglikelihood", {}, (context, continuation), 0)


@pytest.mark.slow
def test_sort_task_through_the_cli(tmp_path):
    """`jaxport dream eval` with lm-eval's own arguments: random-order exact decoding (as
    bench/dream_task_eval.py) solves at least 90% of the held-out problems, the figure lm-eval prints."""
    out = tmp_path / "results"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxport.cli",
            "dream",
            "eval",
            "--model_args",
            f"pretrained={MODEL},max_new_tokens=128,alg=origin",
            "--tasks",
            "jaxport_sort",
            "--include_path",
            str(TASKS),
            "--batch_size",
            "32",
            "--limit",
            str(PROBLEMS),
            "--output_path",
            str(out),
            "--log_samples",
        ],
        env=dict(os.environ, **OFFLINE),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = re.search(r"^\|jaxport_sort\s*\|.*\|exact_match\|.*?\|\s*([0-9.]+)\|", done.stdout, re.M)
    assert row, done.stdout
    assert float(row.group(1)) >= 0.9, done.stdout
    (results,) = out.rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]["jaxport_sort"]
    assert scores["exact_match,none"] == pytest.approx(float(row.group(1)), abs=1e-4)
    (samples,) = out.rglob("samples_jaxport_sort_*.jsonl")
    logged = [json.loads(line) for line in samples.read_text().splitlines()]
    problems = tasks.demo_test_problems(PROBLEMS)
    assert sorted(s["doc"]["prompt"] for s in logged) == sorted(p.prompt for p in problems)


@pytest.mark.slow
def test_multiple_choice_through_simple_evaluate():
    """The right answer among four candidates, by Dream's Monte-Carlo log-likelihood: at least 90%. The
    continuation sits in the 128-token span of end-of-text the test model was trained on."""
    results = lm_eval.simple_evaluate(
        model="jaxport-dream",
        model_args={"pretrained": str(MODEL), "mc_num": 16, "pad_continuation": True},
        tasks=["jaxport_sort_choice"],
        task_manager=TaskManager(include_path=str(TASKS)),
        batch_size=256,
        limit=PROBLEMS,
    )
    scores = results["results"]["jaxport_sort_choice"]
    assert scores["acc,none"] >= 0.9, scores


@pytest.mark.slow
def test_generate_until_is_jaxport_decoding_cut_at_until(lm):
    """`generate_until` gives `tasks.evaluate`'s completions (the same batches, padding and decoding) of the full
    decoding (its own stops early), each cut at its request's until strings, and the whole text with
    `escape_until`."""
    problems = tasks.demo_test_problems(8)
    _, expected = tasks.evaluate(lm.model, lm.tokenizer, problems, batch_size=8, alg="entropy", early_stop=False)
    stops = [["\n"]] * 6 + [["3", "5"], "x"]
    requests = [_generate(p.prompt, until) for p, until in zip(problems, stops)]
    cut = expected[:6] + [expected[6].split("3")[0].split("5")[0], expected[7].split("x")[0]]
    assert any(a != b for a, b in zip(cut, expected)), "no until string occurs: choose others"
    assert lm.generate_until(requests) == cut
    lm.escape_until = True
    try:
        assert lm.generate_until(requests) == expected
    finally:
        lm.escape_until = False


@pytest.mark.slow
def test_loglikelihood_is_seeded_and_independent_of_batching(lm):
    problem = tasks.demo_test_problems(1)[0]
    requests = [_score(problem.prompt, problem.answer), _score(problem.prompt, problem.answer[::-1])]
    requests += [_score("sort dog cat=", " cat dog"), _score("sort 94=", "49")]
    first, greedy = zip(*lm.loglikelihood(requests))
    lm.batch_size = 5  # samples of different requests share batches, in another grouping
    try:
        again = [ll for ll, _ in lm.loglikelihood(requests[::-1])[::-1]]
    finally:
        lm.batch_size = 8
    assert again == pytest.approx(first, rel=1e-5)
    assert greedy == (False,) * 4
    assert first[0] > first[1]  # the sorted answer is the likelier
    lm.seed = 1
    try:
        other = [ll for ll, _ in lm.loglikelihood(requests)]
    finally:
        lm.seed = 0
    assert other[0] != pytest.approx(first[0], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pad_continuation", [False, True])
def test_loglikelihood_padded_batches_equal_each_request_alone(lm, pad_continuation):
    """A short request batched (left-padded) with a long one scores what its Monte-Carlo samples score
    through the model's own forward, unpadded: the sum over masked continuation tokens of -log p / p;
    the context and the end-of-text tail (one token, or up to `max_new_tokens`) are never scored."""
    requests = [_score("sort dog hat goat bird cat egg=", " bird cat dog egg goat hat"), _score("sort 31=", "13")]
    lm.batch_size, lm.pad_continuation = 2 * lm.mc_num, pad_continuation
    try:
        batched = [ll for ll, _ in lm.loglikelihood(requests)]
        for request, ll in zip(requests, batched):
            context_ids, continuation_ids, tail = lm._encode_pair(*request.args)
            sequence, noisy_ML, weight_ML = lm._mc_rows(request.args[0], context_ids, continuation_ids, tail)
            assert len(continuation_ids) + len(tail) == (
                lm.max_new_tokens if pad_continuation else len(continuation_ids) + 1
            )
            logits = np.asarray(lm.model(noisy_ML), np.float64)
            logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)  # position j from hidden j - 1
            top = logits.max(-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            nll_ML = -np.take_along_axis(logp, np.broadcast_to(sequence, noisy_ML.shape)[..., None], -1)[..., 0]
            # float32 log-probabilities: a near-certain answer scores within 1e-6 of 0
            assert ll == pytest.approx(-(nll_ML * weight_ML).sum() / lm.mc_num, rel=1e-4, abs=1e-5)
            scored = weight_ML[:, len(context_ids) : len(context_ids) + len(continuation_ids)]
            assert scored.any() and weight_ML.sum() == scored.sum()
    finally:
        lm.batch_size, lm.pad_continuation = 8, False


def test_bad_model_arguments_are_named():
    with pytest.raises(JaxportError, match="unknown model argument.*nll_type.*known: pretrained"):
        DreamLM(str(MODEL), nll_type="ar_ftb")
    with pytest.raises(JaxportError, match="batch_size='auto': expected a positive integer"):
        DreamLM(str(MODEL), batch_size="auto")
    # the generation settings are checked before the model loads, each on its own before the rules between them
    with pytest.raises(JaxportError, match=r"^diffusion_steps: must be a positive integer, got 0$"):
        DreamLM(str(MODEL), diffusion_steps=0)
    with pytest.raises(JaxportError, match=r"^top_p: must be in \(0, 1\], got 1.5$"):
        DreamLM(str(MODEL), max_new_tokens=8, diffusion_steps=9, top_p=1.5)
    with pytest.raises(JaxportError, match=r"^steps: steps=9 must be between 1 and the number of new tokens \(8\)$"):
        DreamLM(str(MODEL), max_new_tokens=8, diffusion_steps=9)
    with pytest.raises(NotImplementedError, match="rolling"):
        DreamLM(str(MODEL)).loglikelihood_rolling([])
