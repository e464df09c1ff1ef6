"""Record what Fast-dLLM's own Dream decoding produces, as the fixture `tests/test_dream_fastdllm.py` holds jaxport's
`schedule="fastdllm"` to. One command records everything (minutes on two cores; Fast-dLLM's 256-token
prefix-cache runs are the long part):

    eval "$(../shared/originals/setup)"          # REF_PY: the originals' Python, with Fast-dLLM's code
    python tools/record_fastdllm_fixtures.py     # -> tests/fixtures/dream/fastdllm/

Two models, both Hugging Face folders the harness (`../shared/originals/bench/dream/bench_fastdllm.py`, Fast-dLLM
unmodified) and jaxport read: the task model `tests/fixtures/dream/task_model` (trained: real confidences; re-run
this after retraining it) and `random_model/`, written here from a seed (a small config with the task model's
vocabulary and a wide initialisation, so that confidences are spread apart rather than near-uniform). Prompts:
held-out task problems of one token length (`task_prompts.jsonl`) and random ids (`random_prompts.jsonl`), equal
lengths so that Fast-dLLM's prefix cache runs them batched. Every case is greedy with blocks of 32.

For each case `case.json` holds Fast-dLLM's settings, jaxport's equivalent, the new tokens Fast-dLLM produced
per batch size, and per row the smallest decision margin jaxport's own scores show
(`jaxport.dream.fast.decision_margins`: the gap between the last unmasked and the first kept confidence at a ranked
step, relative to their size; the distance of a probability from the threshold at a threshold step). A margin of 0
is an exact tie, where the order is implementation-defined (`torch.topk` against jaxport's leftmost rule): such
rows are listed under `ties`; rows under `near_ties` (below `NEAR_TIE`) may be ordered differently by float
rounding alone. The tests claim Fast-dLLM's tokens for the other rows only.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from jaxport.dream.fast import NEAR_TIE, decision_margins
from jaxport.dream.settings import GenerationSettings, fastdllm_settings

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "dream" / "fastdllm"
TASK_MODEL = REPO / "tests" / "fixtures" / "dream" / "task_model"
COMMAND = 'eval "$(../shared/originals/setup)" && python tools/record_fastdllm_fixtures.py'
BLOCK = 32
PROMPTS = 8  # per model; a case uses the first `rows`

# name: (model, new tokens, steps, cache, Fast-dLLM's alg, Fast-dLLM's batch sizes, rows)
CASES = {
    "task_threshold_dual_128": ("task", 128, 128, "dual", "confidence_threshold", (1,), 8),
    "task_threshold_prefix_128": ("task", 128, 128, "prefix", "confidence_threshold", (1,), 4),
    "task_entropy_dual_128": ("task", 128, 128, "dual", "entropy", (1,), 4),
    "task_entropy_prefix_128": ("task", 128, 128, "prefix", "entropy", (1, 4), 4),
    "task_threshold_dual_256": ("task", 256, 256, "dual", "confidence_threshold", (1,), 2),
    "task_entropy_prefix_256": ("task", 256, 256, "prefix", "entropy", (1, 4), 4),
    "random_threshold_dual_128": ("random", 128, 128, "dual", "confidence_threshold", (1,), 4),
    "random_threshold_prefix_128": ("random", 128, 128, "prefix", "confidence_threshold", (1,), 4),
    "random_entropy_dual_256": ("random", 256, 256, "dual", "entropy", (1,), 2),
    "random_entropy_prefix_256": ("random", 256, 256, "prefix", "entropy", (1, 4), 4),
    "random_entropy_dual_128_s64": ("random", 128, 64, "dual", "entropy", (1,), 4),
    "random_entropy_prefix_128_s64": ("random", 128, 64, "prefix", "entropy", (1, 4), 4),
}


def jaxport_settings(new_tokens: int, steps: int, cache: str, alg: str) -> dict:
    """jaxport's arguments for the harness's call (greedy, threshold 0.9, blocks of 32, no top_k)."""
    settings = fastdllm_settings(steps=steps, alg=alg, block_length=BLOCK, dual_cache=cache == "dual")
    return {"max_new_tokens": new_tokens, **GenerationSettings.of(**settings).arguments()}


def write_random_model(task_config):
    """A small random-init Dream with the task model's vocabulary and special ids, as a Hugging Face folder."""
    import dataclasses

    from jaxport import dream
    from jaxport.dream.params import save_pretrained

    config = dataclasses.replace(
        task_config,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,  # logits of a few units: confidences far apart, unlike upstream's 0.02
    )
    save_pretrained(dream.random_model(config, seed=0), FIXTURE / "random_model", tokenizer_dir=TASK_MODEL)


def task_prompts(tokenizer) -> list[list[int]]:
    """The first held-out task problems of the most common prompt length, as token ids."""
    from jaxport.dream import tasks

    ids = [tokenizer.encode(p.prompt) for p in tasks.demo_test_problems(256)]
    length = collections.Counter(map(len, ids)).most_common(1)[0][0]
    return [row for row in ids if len(row) == length][:PROMPTS]


def random_prompts(config) -> list[list[int]]:
    low = min(config.mask_token_id, config.pad_token_id, config.eos_token_id, config.bos_token_id)
    return np.random.default_rng(0).integers(0, low, (PROMPTS, 12)).tolist()


def harness() -> Path:
    """The harness beside the originals that `setup` points at (`REF_FASTDLLM`), else beside this checkout."""
    originals = (
        Path(os.environ["REF_FASTDLLM"]).parent
        if os.environ.get("REF_FASTDLLM")
        else REPO.parent / "shared" / "originals"
    )
    return originals / "bench" / "dream" / "bench_fastdllm.py"


def run_fastdllm(model_dir: Path, prompts: Path, rows: int, new_tokens, steps, cache, alg, batches, out: Path):
    command = [
        os.environ["REF_PY"],
        str(harness()),
        "--model",
        str(model_dir),
        "--prompt-ids",
        str(prompts),
        "--limit",
        str(rows),
        "--max-new-tokens",
        str(new_tokens),
        "--steps",
        str(steps),
        "--block-length",
        str(BLOCK),
        "--alg",
        alg,
        "--threshold",
        "0.9",
        "--batches",
        ",".join(map(str, batches)),
        "--runs",
        "1",
        "--warmup",
        "0",
        "--threads",
        "2",
        "--out",
        str(out),
        *(["--dual-cache"] if cache == "dual" else []),
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def margins(model, ids: np.ndarray, settings: dict) -> tuple[list[float], np.ndarray]:
    """Per row, the smallest gap jaxport's scores leave at a decision (`jaxport.dream.fast.decision_margins`), and
    jaxport's new tokens."""
    out = model.diffusion_generate(ids, output_scores=True, **settings)
    by_position = decision_margins(out, ids.shape[1], BLOCK, settings.get("threshold"))
    return [float(m) for m in by_position.min(axis=1)], np.asarray(out.sequences)[:, ids.shape[1] :]


def write_fixture(path: Path, fixture: dict):
    """JSON with every list of numbers on one line (a generated row per line): readable and small."""
    text = json.dumps(fixture, indent=1)
    text = re.sub(
        r"\[\s*([-+\d.e,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text
    )
    path.write_text(text + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    args = parser.parse_args()
    if not os.environ.get("REF_PY"):
        sys.exit(f"REF_PY is not set; run:\n    {COMMAND}")
    from jaxport import dream
    from jaxport.dream.params import load_model

    FIXTURE.mkdir(parents=True, exist_ok=True)
    task_model, tokenizer = dream.load(TASK_MODEL)
    write_random_model(task_model.config)
    models = {"task": TASK_MODEL, "random": FIXTURE / "random_model"}
    prompt_files = {"task": FIXTURE / "task_prompts.jsonl", "random": FIXTURE / "random_prompts.jsonl"}
    random_config = dream.DreamConfig.from_model_dir(models["random"])
    prompts = {"task": task_prompts(tokenizer), "random": random_prompts(random_config)}
    for name, rows in prompts.items():
        prompt_files[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = {"task": task_model, "random": load_model(models["random"], random_config)}

    case_file = FIXTURE / "case.json"
    previous = json.loads(case_file.read_text())["cases"] if case_file.exists() else {}
    chosen = args.only.split(",") if args.only else list(CASES)
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, new_tokens, steps, cache, alg, batches, rows) in CASES.items():
            if name not in chosen:
                if name in previous:
                    cases[name] = previous[name]
                continue
            report = run_fastdllm(
                models[kind], prompt_files[kind], rows, new_tokens, steps, cache, alg, batches, Path(tmp) / "out.json"
            )
            ids = np.asarray(prompts[kind][:rows])
            settings = jaxport_settings(new_tokens, steps, cache, alg)
            generated = {
                str(result["batch"]): [row[ids.shape[1] :] for row in result["sequences"]]
                for result in report["results"]
            }
            by_size = {}
            for size, theirs in generated.items():
                # jaxport in batches of Fast-dLLM's size: its scheduled count is the batch's average, which
                # couples the rows of a batch
                chunks = [margins(loaded[kind], ids[i : i + int(size)], settings) for i in range(0, rows, int(size))]
                row_margins = [m for chunk, _ in chunks for m in chunk]
                ours = np.concatenate([tokens for _, tokens in chunks])
                by_size[size] = {
                    "margins": row_margins,
                    "ties": [row for row, m in enumerate(row_margins) if m == 0],
                    "near_ties": [row for row, m in enumerate(row_margins) if 0 < m < NEAR_TIE],
                }
                equal = int((np.asarray(theirs) == ours).all(axis=1).sum())
                print(
                    f"{name} batch {size}: margins {[f'{m:.2e}' for m in row_margins]}; "
                    f"{equal} of {rows} rows equal to jaxport's",
                    file=sys.stderr,
                )
            cases[name] = {
                "model": str(models[kind].relative_to(REPO)),
                "prompts": str(prompt_files[kind].relative_to(REPO)),
                "rows": rows,
                "fastdllm": {
                    "alg": alg,
                    "dual_cache": cache == "dual",
                    "threshold": 0.9,
                    "block_length": BLOCK,
                    "max_new_tokens": new_tokens,
                    "steps": steps,
                    "temperature": 0.0,
                },
                "jaxport": settings,
                "generated": generated,
                "decisions": by_size,
            }
    fixture = {
        "what": "new tokens of Fast-dLLM's diffusion_generate (generation_utils_block.py), greedy, per batch size",
        "command": COMMAND,
        "fastdllm_commit": report["fastdllm_commit"],
        "torch": report["torch"],
        "transformers": report["transformers"],
        "tie_rule": "at a margin of 0 the order among tied scores is implementation-defined (torch.topk); "
        "jaxport unmasks the leftmost first",
        "cases": cases,
    }
    write_fixture(case_file, fixture)
    print(f"wrote {case_file} ({case_file.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
