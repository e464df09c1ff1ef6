"""bench/dream_serve_load.py's comparison of the server's replies with another implementation's tokens
(`--against-fastdllm`), without a server: `token_agreement` on the fixture tokenizer."""

import importlib.util
from pathlib import Path

import pytest

from jaxport.dream import DreamConfig, DreamTokenizer

BENCH = Path(__file__).resolve().parents[1] / "bench"
MODEL = Path(__file__).resolve().parent / "fixtures" / "dream" / "tiny_bf16" / "model"
EOS = 400


@pytest.fixture
def load_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports its neighbour compare.py
    spec = importlib.util.spec_from_file_location("dream_serve_load", BENCH / "dream_serve_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replies_equal_the_reference_tokens_cut_as_the_server_cuts_them_and_differences_are_placed(load_bench):
    tokenizer = DreamTokenizer.from_model_dir(MODEL, DreamConfig.from_model_dir(MODEL))
    reference = [[70, 71, 72, 73, 74], [80, 81, EOS, 83], [90, 91, 92, 93], [60, 61, 62, 63], [50, 51, 52, 53]]
    requests = [{"max_tokens": n} for n in (4, 4, 4, 4, 3)]

    def reply(ids, max_tokens):
        return {"text": tokenizer.decode(ids[:max_tokens], skip_special_tokens=True), "tokens": len(ids[:max_tokens])}

    replies = [
        reply([70, 71, 72, 73, 74], 4),  # cut at max_tokens
        reply([80, 81], 4),  # cut at end-of-text
        reply([90, 91, 99, 93], 4),  # differs at new token 2
        None,  # the request failed
        reply([50, 51, 52, 53], 4),  # one token past max_tokens
    ]
    agreement = load_bench.token_agreement(tokenizer, requests, replies, reference)
    assert agreement == {
        "equal": "2/5",
        "differing": [
            {"request": 2, "max_tokens": 4, "first_differing_token": 2},
            {"request": 3, "max_tokens": 4, "first_differing_token": 0},
            {"request": 4, "max_tokens": 3, "first_differing_token": 3},
        ],
    }
