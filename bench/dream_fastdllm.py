"""jaxport's `schedule="fastdllm"` on the inputs Fast-dLLM's harness reads (a Hugging Face folder, a JSONL of prompt
token ids), timed as the harness times itself: one JSON line per batch size with the seconds of each timed pass over
all prompts, their median, the new tokens, and the FLOPs of Fast-dLLM's algorithm against this machine's matmul
peak. `bench/compare.py --only fastdllm` runs it beside `../shared/originals/bench/dream/bench_fastdllm.py`.

    python bench/dream_fastdllm.py prepare task DIR [--prompts 64]     # DIR/prompts.jsonl: held-out task prompts
    python bench/dream_fastdllm.py prepare 40m DIR [--prompts 4]       # DIR/model (random weights), DIR/prompts.jsonl

`prepare 40m` (or `tiny`) writes the preset's layers with the fixture tokenizer's special ids and a tokenizer that
gives every other id a text of its own (`write_benchmark_tokenizer`): `jaxport dream serve --model DIR/model` serves
the same weights, and its replies name their token ids.

    python bench/dream_fastdllm.py run --model DIR --prompt-ids FILE --max-new-tokens 128 --steps 128 \
        --block-length 32 --dual-cache --alg confidence_threshold --threshold 0.9 --batches 1,8 --runs 3
    python bench/dream_fastdllm.py early-stop --model DIR --prompt-ids FILE ...   # the same flags

`early-stop` decodes the same inputs under jaxport's default schedule instead, with early stop off and on
(`jaxport.dream.decoding.diffusion_generate`), and reports the block calls and new tokens/s of each.

`run` takes the harness's flags and Fast-dLLM's `--alg` names (`confidence_threshold`, else the scheduled entropy
ranking) and decodes as Fast-dLLM does (`jaxport.dream.settings.fastdllm_settings`). Batches of several rows are
left-padded with the pad id and an attention mask, as the harness pads them. Warm-up: one untimed batch of each
prompt shape (jaxport's compilation, reported as `compile_s`, the calls as `warmup_calls`; Fast-dLLM has nothing to
compile and the harness warms up on one batch). Each row also gets its `decision_margins`
(`jaxport.dream.fast.decision_margins`, below `near_tie` a near-tie), by which `compare.py` judges a row whose
tokens differ from Fast-dLLM's.
"""

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from _common import emit, environment, peak_rss_bytes, utilisation

from jaxport import dream
from jaxport.dream.cache_kinds import cache_kind
from jaxport.dream.fast import NEAR_TIE, decision_margins
from jaxport.dream.params import load_model, save_pretrained
from jaxport.dream.settings import fastdllm_settings

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dream"
TASK_MODEL = FIXTURES / "task_model"
TOKENIZER = FIXTURES / "tiny_bf16" / "model"  # the tokenizer of the random-weight models `prepare` writes


def write_benchmark_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """The fixture tokenizer (400 byte-level BPE tokens, Dream's 24 added ones) with a token for every further id
    below `vocab_size` that decodes to its own text (" #ID"; no merge makes one): a server's reply then names every
    token id it holds, so its text compares with the detokenised ids of another implementation."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(TOKENIZER / name, model_dir / name)
    spec = json.loads((TOKENIZER / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab.update({token["content"]: token["id"] for token in spec["added_tokens"]})  # else renumbered past the vocab
    vocab.update({f"\u0120#{i}": i for i in range(len(vocab), vocab_size)})  # \u0120: a space
    (model_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))


def prepare(args):
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "task":
        from jaxport.dream import tasks

        tokenizer = dream.DreamTokenizer.from_model_dir(TASK_MODEL, dream.DreamConfig.from_model_dir(TASK_MODEL))
        rows = [tokenizer.encode(p.prompt) for p in tasks.demo_test_problems(args.prompts)]
    else:  # the preset's random weights, written once so both sides read the same ones, served with a tokenizer
        config = dream.preset(args.what).with_token_ids_of(dream.DreamConfig.from_model_dir(TOKENIZER))
        save_pretrained(dream.random_model(config, seed=0), out / "model")
        write_benchmark_tokenizer(out / "model", config.vocab_size)
        low = min(config.mask_token_id, config.pad_token_id, config.eos_token_id, config.bos_token_id)
        rows = np.random.default_rng(0).integers(0, low, (args.prompts, 32)).tolist()
    (out / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(out)


def settings(args) -> dict:
    s = fastdllm_settings(
        steps=args.steps,
        alg=args.alg,
        threshold=args.threshold,
        block_length=args.block_length,
        dual_cache=args.dual_cache,
    )
    return {"max_new_tokens": args.max_new_tokens, **s}


def batches(rows: list[list[int]], size: int, pad: int):
    """`(input_ids, attention_mask or None)` of `size` rows each, left-padded as the harness pads."""
    out = []
    for i in range(0, len(rows), size):
        chunk = rows[i : i + size]
        width = max(map(len, chunk))
        ids = np.array([[pad] * (width - len(r)) + r for r in chunk], np.int32)
        mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in chunk], np.int32)
        out.append((ids, None if mask.all() else mask))
    return out


def forward_flops(config, queries: int, keys: int) -> float:
    """Multiply-add FLOPs of one forward of `queries` positions attending over `keys`, logits at every query."""
    D, Dh = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * Dh, config.num_key_value_heads * Dh
    per_position = D * (q + 2 * kv) + q * D + 3 * D * config.intermediate_size
    attention = 2 * queries * keys * q  # scores and the weighted sum
    layers = config.num_hidden_layers * (2 * queries * per_position + 2 * attention)
    return layers + 2 * queries * D * config.vocab_size


def algorithm_flops(config, ids, out, s: dict) -> float:
    """FLOPs of Fast-dLLM's algorithm on these rows (as Fast-dLLM computes it: every window position projected to
    the vocabulary), with the steps each block takes here (`out`: their generation with `output_scores`)."""
    n_transfer = np.asarray(out.n_transfer).max(axis=1)  # per step, > 0 where the batch still had masks
    L, width, new = ids.shape[1], s["block_length"], s["max_new_tokens"]
    N, blocks = L + new, new // width
    per_block = len(n_transfer) // blocks
    total = 0.0
    for block in range(blocks):
        start = L + block * width
        taken = int((n_transfer[block * per_block : (block + 1) * per_block] > 0).sum())
        window = cache_kind(s["cache"]).window(start, width, 0, N)
        total += forward_flops(config, N, N) + max(taken - 1, 0) * forward_flops(config, window, N)
    return ids.shape[0] * total


def run(args):
    config = dream.DreamConfig.from_model_dir(args.model)
    model = load_model(args.model, config)
    rows = [json.loads(line) for line in Path(args.prompt_ids).read_text().splitlines() if line.strip()]
    rows = rows[: args.limit] if args.limit else rows
    s, peaks = settings(args), {}
    for size in (int(b) for b in args.batches.split(",")):
        work = batches(rows, size, config.pad_token_id)

        def generate(ids, mask):
            return model.diffusion_generate(ids, mask, return_dict_in_generate=False, **s)

        start = time.perf_counter()
        shapes = dict.fromkeys((ids.shape, mask is None) for ids, mask in work)
        for shape in shapes:
            ids, mask = next((i, m) for i, m in work if (i.shape, m is None) == shape)
            jax.block_until_ready(generate(ids, mask))
        compile_s = time.perf_counter() - start
        times, sequences = [], []
        for _ in range(args.runs):
            start = time.perf_counter()
            outputs = [generate(ids, mask) for ids, mask in work]
            jax.block_until_ready(outputs)
            times.append(time.perf_counter() - start)
        # the new tokens of each row (a padded row's prompt is shorter than its batch's width)
        sequences = [
            rows[i * size + r] + np.asarray(out)[r, ids.shape[1] :].tolist()
            for i, ((ids, _), out) in enumerate(zip(work, outputs))
            for r in range(ids.shape[0])
        ]
        median = statistics.median(times)
        flops, margins = 0.0, []
        for ids, mask in work:  # untimed: the same generation with its scores
            scored = model.diffusion_generate(ids, mask, output_scores=True, **s)
            flops += algorithm_flops(config, ids, scored, s)
            by_position = decision_margins(scored, ids.shape[1], s["block_length"], s.get("threshold"))
            margins += [[float(m) if np.isfinite(m) else None for m in row] for row in by_position]
        emit(
            {
                "batch": size,
                "rows": len(rows),
                "settings": s,
                "compile_s": round(compile_s, 2),
                "warmup_calls": len(shapes),
                "times_s": [round(t, 4) for t in times],
                "median_s": round(median, 4),
                "new_tokens_per_s": round(len(rows) * args.max_new_tokens / median, 1),
                "algorithm_flops": flops,
                **utilisation(flops, median, "float32", peaks),
                "sequences": sequences,
                # per row and new position: how close jaxport's decisions up to that position's came to a tie
                "decision_margins": margins,
                "near_tie": NEAR_TIE,
                "peak_rss_bytes": peak_rss_bytes(),
                "machine": environment(),
            }
        )


def early_stop(args):
    """The same inputs under jaxport's default schedule (`schedule="jaxport"`, the rest as `run` decodes them), with
    early stop off and on: one JSON line each per batch size, with the block calls, the median seconds of the timed
    passes and the new tokens per second (the canvas's new positions, as `run` counts them), and whether every
    text is the full decoding's."""
    config = dream.DreamConfig.from_model_dir(args.model)
    model, tokenizer = load_model(args.model, config), dream.DreamTokenizer.from_model_dir(args.model, config)
    rows = [json.loads(line) for line in Path(args.prompt_ids).read_text().splitlines() if line.strip()]
    rows = rows[: args.limit] if args.limit else rows
    s = {**settings(args), "schedule": "jaxport"}
    for size in (int(b) for b in args.batches.split(",")):
        work, full_texts = batches(rows, size, config.pad_token_id), None
        for stop in (False, True):

            def generate(ids, mask, stop=stop):  # (canvas, block calls)
                blocks = list(
                    dream.generate_blocks(model, ids, mask, stop_token_ids=tokenizer.stop_ids, early_stop=stop, **s)
                )
                return blocks[-1].output.sequences, len(blocks)

            start = time.perf_counter()
            for shape in dict.fromkeys((ids.shape, mask is None) for ids, mask in work):
                ids, mask = next((i, m) for i, m in work if (i.shape, m is None) == shape)
                jax.block_until_ready(generate(ids, mask)[0])
            compile_s = time.perf_counter() - start
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                outputs = [generate(ids, mask) for ids, mask in work]
                jax.block_until_ready([canvas for canvas, _ in outputs])
                times.append(time.perf_counter() - start)
            texts = [
                text
                for (ids, _), (canvas, _) in zip(work, outputs)
                for text in tokenizer.decode_generation(np.asarray(canvas), ids.shape[1])
            ]
            full_texts = full_texts or texts
            median = statistics.median(times)
            emit(
                {
                    "batch": size,
                    "rows": len(rows),
                    "settings": s,
                    "early_stop": stop,
                    "block_calls": sum(calls for _, calls in outputs),
                    "block_calls_full": len(work) * (args.max_new_tokens // args.block_length),
                    "compile_s": round(compile_s, 2),
                    "times_s": [round(t, 4) for t in times],
                    "median_s": round(median, 4),
                    "new_tokens_per_s": round(len(rows) * args.max_new_tokens / median, 1),
                    "texts_equal_to_full": texts == full_texts,
                    "machine": environment(),
                }
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    actions = parser.add_subparsers(dest="action", required=True)
    prep = actions.add_parser("prepare")
    prep.add_argument("what", choices=["task", "40m", "tiny"])
    prep.add_argument("dir")
    prep.add_argument("--prompts", type=int, default=64)
    go = actions.add_parser("run")
    stop = actions.add_parser("early-stop", help="block calls and tokens/s with and without early stop")
    _add_run_flags(go)
    _add_run_flags(stop)
    args = parser.parse_args()
    {"prepare": prepare, "run": run, "early-stop": early_stop}[args.action](args)
    return 0


def _add_run_flags(parser):
    """The flags of `run` and `early-stop`: the harness's."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-ids", required=True)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--dual-cache", action="store_true")
    parser.add_argument("--alg", default="confidence_threshold")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--batches", default="1")
    parser.add_argument("--runs", type=int, default=3)


if __name__ == "__main__":
    sys.exit(main())
