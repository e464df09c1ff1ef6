"""`schedule="fastdllm"` against the tokens Fast-dLLM itself produced (tests/fixtures/dream/fastdllm, recorded by
`tools/record_fastdllm_fixtures.py`), and tests that see the KV cache's approximation: the cached result differs
from a fresh one and equals Fast-dLLM's, and later steps attend to the window's new keys and values."""

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import free_compiled_programs

from jaxport import dream
from jaxport.dream import fast
from jaxport.dream.params import load_model
from jaxport.dream.program import padding_inputs, prepare_generation

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "dream" / "fastdllm"
META = json.loads((FIXTURE / "case.json").read_text())
CASES = META["cases"]


@functools.cache
def model_at(path: str):
    return load_model(REPO / path, dream.DreamConfig.from_model_dir(REPO / path))


def prompts(case) -> np.ndarray:
    rows = [json.loads(line) for line in (REPO / case["prompts"]).read_text().splitlines()]
    return np.asarray(rows[: case["rows"]], np.int32)


def new_tokens(model, ids, size: int, **settings) -> np.ndarray:
    """jaxport's new tokens for `ids`, decoded in batches of `size` rows (Fast-dLLM's batch size)."""
    out = [model.diffusion_generate(ids[i : i + size], **settings).sequences for i in range(0, len(ids), size)]
    return np.concatenate([np.asarray(o) for o in out])[:, ids.shape[1] :]


def claimed(case, size: str) -> list[int]:
    """The rows whose decisions are clear of ties and near-ties (the fixture lists the others)."""
    decisions = case["decisions"][size]
    doubtful = set(decisions["ties"]) | set(decisions["near_ties"])
    return [row for row in range(case["rows"]) if row not in doubtful]


@pytest.fixture(autouse=True)
def free_each_cases_programs():
    """Each case compiles its own programs (the prefix cache: one per block), thousands of memory mappings apiece."""
    yield
    free_compiled_programs()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_tokens_fastdllm_produced(name):
    """jaxport decodes at Fast-dLLM's largest batch size of the case, whose rows are then compared with what
    Fast-dLLM produced at every batch size it ran (its batch-1 and batch-4 rows are the same; one compiled program
    per case keeps this test short)."""
    case = CASES[name]
    ids, size = prompts(case), max(map(int, case["generated"]))
    ours = new_tokens(model_at(case["model"]), ids, size, **case["jaxport"])
    for recorded, expected in case["generated"].items():
        rows = claimed(case, recorded)
        assert len(rows) >= case["rows"] - 1, f"{name}: the fixture claims too few rows ({rows})"
        np.testing.assert_array_equal(ours[rows], np.asarray(expected)[rows], err_msg=f"batch {recorded}")


def test_decision_margins_follow_each_position_to_the_step_that_decided_it():
    """A block of 4 new tokens after a 1-token prompt, one row: step 0 fixes the first position (no choice), step 1
    unmasks the best of three (0.9 against 0.5), step 2 the better of two near-equal scores, step 3 the last (no
    choice). Each position carries the smallest margin up to its own decision; a threshold step measures the
    distance from the threshold."""
    off = -np.inf
    confidence = np.array(
        [
            [[off, 0.7, off, off, off]],
            [[off, off, 0.9, 0.5, 0.5 - 1e-7]],
            [[off, off, off, 0.5, 0.5 - 1e-7]],
            [[off, off, off, off, 0.3]],
        ]
    )
    out = dream.GenerationOutput(sequences=None, confidence=confidence, n_transfer=np.ones((4, 1), np.int32))
    ranked = fast.decision_margins(out, 1, 4)
    np.testing.assert_allclose(ranked, [[np.inf, 0.4 / 0.9, 2e-7, 2e-7]], rtol=1e-6)
    assert ranked[0, 2] < fast.NEAR_TIE <= ranked[0, 1]
    # 0.9 is 0.05 short of the threshold at step 1; at step 2 no score reaches it and the best leads by 1e-7
    by_threshold = fast.decision_margins(out, 1, 4, threshold=0.95)
    np.testing.assert_allclose(by_threshold, [[np.inf, 0.05, 1e-7, 1e-7]], rtol=1e-6)


def test_the_fixture_is_current():
    """Fast-dLLM's settings in the fixture are jaxport's of the recording tool (which `case.json` names)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("record", REPO / "tools" / "record_fastdllm_fixtures.py")
    record = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(record)
    assert META["command"] == record.COMMAND
    for name, case in CASES.items():
        model, new, steps, cache, alg, batches, rows = record.CASES[name]
        assert case["jaxport"] == record.jaxport_settings(new, steps, cache, alg)
        assert sorted(case["generated"]) == sorted(map(str, batches)) and case["rows"] == rows


@pytest.mark.slow
@pytest.mark.parametrize("name", ["random_entropy_prefix_128_s64", "random_entropy_dual_128_s64"])
def test_the_cache_is_an_approximation_fastdllm_shares(name):
    """Fast-dLLM's tokens need jaxport's cache as it is: neither a fresh cache (refreshed every step, or none),
    nor the other cache kind gives them. So a cache too fresh, a stale window or a prefix cache that behaves like
    a dual one (or the reverse) fails."""
    case = CASES[name]
    model, ids, expected = model_at(case["model"]), prompts(case), np.asarray(case["generated"]["1"])
    rows, settings = claimed(case, "1"), case["jaxport"]
    assert (new_tokens(model, ids, len(ids), **settings)[rows] == expected[rows]).all()
    other = {"prefix": "dual", "dual": "prefix"}[settings["cache"]]
    for variant in ({"cache": None}, {"cache": other}):
        tokens = new_tokens(model, ids, len(ids), **{**settings, **variant})
        assert not (tokens[rows] == expected[rows]).all(axis=1).any(), variant
    prepared = prepare_generation(model, ids, **settings)
    refreshed = np.asarray(fast.blocks_output(fast._run_blocks(model, prepared, refresh=True)).sequences)
    assert not (refreshed[:, ids.shape[1] :][rows] == expected[rows]).all(axis=1).any()


@pytest.mark.slow
def test_later_steps_attend_to_the_window_fresh_keys_and_values():
    """A cached forward writes its window's keys and values into the cache and attends over them: what the cache
    held at the window's positions does not matter, what it holds elsewhere does, and the cache it returns holds
    the window's fresh keys there (layer 0: the keys of the new tokens exactly) and the old ones elsewhere."""
    case = CASES["random_entropy_dual_128_s64"]
    model, ids = model_at(case["model"]), prompts(case)[:2]
    mask_id, (B, L) = model.config.mask_token_id, ids.shape
    old = np.concatenate([ids, np.full((B, 64), mask_id, np.int32)], axis=1)
    new = old.copy()
    new[:, L : L + 32] = np.random.default_rng(0).integers(0, mask_id, (B, 32))
    _, positions = padding_inputs(None, *old.shape)
    _, cache = model.hidden_states_cached(old)
    start, size = L, 32

    def window(cache):
        return model.hidden_states_cached(
            new[:, start : start + size], None, positions[:, start : start + size], cache, start
        )

    h, written = window(cache)
    garbage_in_window = [
        (k.at[:, :, start : start + size].set(7.0), v.at[:, :, start : start + size].set(-7.0)) for k, v in cache
    ]
    garbage_outside = [(k.at[:, :, :start].set(7.0), v.at[:, :, :start].set(-7.0)) for k, v in cache]
    np.testing.assert_array_equal(np.asarray(window(garbage_in_window)[0]), np.asarray(h))
    assert not np.allclose(np.asarray(window(garbage_outside)[0]), np.asarray(h), atol=1e-3)
    _, fresh = model.hidden_states_cached(new)
    k_written, k_old, k_fresh = (np.asarray(c[0][0]) for c in (written, cache, fresh))
    # the cache is heads first, [B, K, T, Dh]
    np.testing.assert_allclose(k_written[:, :, start : start + size], k_fresh[:, :, start : start + size], atol=1e-5)
    np.testing.assert_array_equal(k_written[:, :, :start], k_old[:, :, :start])
    np.testing.assert_array_equal(k_written[:, :, start + size :], k_old[:, :, start + size :])
