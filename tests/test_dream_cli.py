"""`jaxport dream generate|bench` on the tiny fixture."""

import json
from pathlib import Path

import numpy as np
import pytest

from jaxport import cli, dream

CASE = Path(__file__).parent / "fixtures" / "dream" / "tiny_sharded"


@pytest.mark.slow
def test_generate_batch_from_jsonl_matches_recorded_tokens(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Add two numbers."}]})
        + "\n"
        + json.dumps("def add(a, b):")
        + "\n"
    )
    code = cli.main(
        [
            "dream",
            "generate",
            "--model",
            str(CASE / "model"),
            "--prompts",
            str(prompts),
            "--batch-size",
            "2",
            "--max-new-tokens",
            "16",
            "--steps",
            "8",
            "--alg",
            "entropy",
            "--dtype",
            "float32",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    _, tokenizer = dream.load(CASE / "model")
    sequences = np.load(CASE / "expected.npz")["gen__entropy_s8__sequences"]
    assert [line["completion"] for line in lines] == tokenizer.decode_generation(sequences, 42)
    assert "batch 1: step 8/8" in captured.err


@pytest.mark.slow
def test_generate_watch_and_chat(capsys):
    code = cli.main(
        [
            "dream",
            "generate",
            "--model",
            str(CASE / "model"),
            "--prompt",
            "Add two numbers.",
            "--chat",
            "--max-new-tokens",
            "8",
            "--steps",
            "4",
            "--alg",
            "maskgit_plus",
            "--dtype",
            "float32",
            "--watch",
        ]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "[step 1/4 row 0]" in err and "[step 4/4 row 0]" in err
    first = next(line for line in err.splitlines() if line.startswith("[step 1/4"))
    assert first.count("_") >= 6  # 8 masks, 2 unmasked after the first of 4 steps


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "nowhere.jsonl"], "--prompts nowhere.jsonl: no such file"),
        (["--prompt", "x", "--alg", "greedy"], "unknown alg 'greedy'"),
        (["--prompt", "x", "--dtype", "int8"], "unsupported dtype 'int8'"),
        (["--prompt", "x", "--steps", "99", "--max-new-tokens", "8"], "steps=99 must be between 1 and"),
        # the bad value is named, not the rule between it and --steps
        (
            ["--prompt", "hi", "--max-new-tokens", "-4", "--steps", "4"],
            "max_new_tokens: must be a positive integer, got -4",
        ),
        (["--prompt", "hi", "--max-new-tokens", "-4"], "max_new_tokens: must be a positive integer, got -4"),
        (
            ["--prompt", "hi", "--max-new-tokens", "8", "--steps", "9", "--top-k", "0"],
            "top_k: must be a positive integer",
        ),
    ],
)
def test_generate_errors(capsys, args, message):
    code = cli.main(["dream", "generate", "--model", str(CASE / "model"), *args])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxport dream: error:") and message in err


@pytest.mark.slow
def test_bench_random_init(capsys):
    code = cli.main(
        [
            "dream",
            "bench",
            "--random-init",
            "tiny",
            "--batch-sizes",
            "1,2",
            "--prompt-len",
            "8",
            "--max-new-tokens",
            "8",
            "--steps",
            "4",
            "--repeats",
            "1",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["platform"] == "cpu" and result["dtype"] == "float32" and result["config"]["hidden_size"] == 64
    assert [r["batch"] for r in result["results"]] == [1, 2]
    assert all(r["new_tokens_per_s"] > 0 and r["forward_tokens_per_s"] > 0 for r in result["results"])
