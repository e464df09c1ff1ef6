"""Dream fast decoding side by side, in Fast-dLLM's form: accuracy / tokens per second / speed-up for exact
decoding, +cache, +parallel (confidence threshold) and both. Prints JSON on stdout, the Markdown table on stderr.

    python bench/dream_fast.py --model tests/fixtures/dream/task_model     # the task model, 4 settings
    python bench/dream_fast.py --model DIR --schedule fastdllm             # Fast-dLLM's schedule (jaxport.dream.fast)
    python bench/dream_fast.py --random-init 40m --settings exact,cache   # cache-only speed, no accuracy
    python bench/dream_fast.py --random-init 40m --settings exact,cache --upstream   # + the PyTorch original

Exact is `steps = generation length`, one token per step; the fast settings use the same steps in blocks of
`--block-length` (32) with `--cache` (dual) and/or `--threshold` (0.9), under `--schedule` (jaxport's by default).
Speed: every setting decodes all prompts (`--problems` held-out problems with `--model`, else `--prompts` random
ones) in batches of each batch size, `--repeats` (3) timed passes after an untimed one that compiles every shape;
the table gives the median pass and the JSON every pass and the spread ((max - min) / median). Accuracy (with
`--model`): exact match of the last timed pass's completions (`jaxport.dream.tasks.score`). `--upstream` also
runs the original's exact `diffusion_generate` on the 40M config, as `bench/compare.py --only dream_256` does
(REF_PY, REF_DREAM from ../shared/originals/setup; about 10 minutes at 256 tokens). Fast-dLLM's own decoding on
the same prompts is `bench/compare.py --only fastdllm`.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from _common import environment, peak_rss_bytes

from jaxport import dream
from jaxport.dream import throughput

NAMES = {"exact": "exact", "cache": "+cache", "parallel": "+parallel", "both": "+cache +parallel"}  # for logs


def settings(args) -> dict[str, dict]:
    fast = {
        "cache": dict(cache=args.cache),
        "parallel": dict(threshold=args.threshold),
        "both": dict(cache=args.cache, threshold=args.threshold),
    }
    if args.schedule != "jaxport":
        fast = {name: dict(setting, schedule=args.schedule) for name, setting in fast.items()}
    chosen = {}
    for name in args.settings.split(","):
        if name not in NAMES:
            sys.exit(f"--settings: unknown {name!r}; choose from {', '.join(NAMES)}")
        chosen[name] = {} if name == "exact" else dict(block_length=args.block_length, **fast[name])
    return chosen


def passes(model, batches: list, repeats: int, **generation_args) -> dict:
    """Compile time (an untimed pass over every batch) and the seconds of each timed pass over all batches, with
    the last pass's sequences."""
    run = lambda ids, mask: model.diffusion_generate(ids, mask, return_dict_in_generate=False, **generation_args)
    compile_s, _ = throughput.timed(lambda: [run(*b) for b in batches], 0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sequences = jax.block_until_ready([run(*b) for b in batches])
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "compile_s": round(compile_s, 2),
        "median_s": round(median, 5),
        "times_s": [round(t, 5) for t in times],
        "spread": round((max(times) - min(times)) / median, 3),
        "sequences": [np.asarray(jax.device_get(s)) for s in sequences],
    }


def upstream(lengths: list[int], batches: list[int], prompt_len: int) -> dict:
    """The original's exact generation on the 40M config: {(length, batch): median seconds}."""
    import compare

    compare.check_originals()
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for length in lengths:
            result, _ = compare.original(
                "dream/bench_upstream.py",
                "--max-new-tokens",
                str(length),
                "--steps",
                str(length),
                "--prompt-len",
                str(prompt_len),
                "--batches",
                ",".join(map(str, batches)),
                "--runs",
                "1",
                "--warmup",
                "0",
                out=Path(tmp) / f"upstream_{length}.json",
            )
            found.update({(length, row["batch"]): row["median_s"] for row in result["results"]})
    return found


def table(rows: list[dict], names: list[str], with_accuracy: bool, args) -> str:
    titles = {
        "exact": "exact",
        "cache": f"+{args.cache} cache",
        "parallel": f"+parallel ({args.threshold})",
        "both": f"+{args.cache} cache +parallel ({args.threshold})",
    }
    header = "| new tokens | batch | " + " | ".join(titles[n] for n in names) + " |"
    lines = [header, "|" + " --- |" * (len(names) + 2)]
    for length, batch in dict.fromkeys((r["max_new_tokens"], r["batch"]) for r in rows):
        cells = []
        for name in names:
            r = next(r for r in rows if (r["max_new_tokens"], r["batch"], r["setting"]) == (length, batch, name))
            accuracy = f"{100 * r['accuracy']:.1f}% / " if with_accuracy else ""
            cells.append(f"{accuracy}{r['tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x; spread {r['spread']:.0%})")
        lines.append(f"| {length} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face Dream directory with an exact-match task (task-demo)")
    source.add_argument("--random-init", help="random weights of a named size (40m, tiny, 7b): speed only")
    parser.add_argument("--lengths", default="128,256", help="generation lengths (new tokens)")
    parser.add_argument("--batch-sizes", default=None, help="default: 1,8 with --model, 1,4 (the original's) else")
    parser.add_argument(
        "--settings",
        default=None,
        help="of exact,cache,parallel,both (default: all with --model, exact,cache with --random-init)",
    )
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--cache", default="dual", help="prefix or dual")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--schedule", default="jaxport", help="jaxport or fastdllm (jaxport.dream.fast)")
    parser.add_argument("--alg", default="entropy")
    parser.add_argument("--problems", type=int, default=256, help="held-out problems, decoded and scored")
    parser.add_argument("--prompts", type=int, default=8, help="random-init prompts")
    parser.add_argument("--prompt-len", type=int, default=32, help="random-init prompt length")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over all prompts")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--upstream", action="store_true", help="also time the PyTorch original's exact path")
    args = parser.parse_args()
    args.settings = args.settings or ("exact,cache,parallel,both" if args.model else "exact,cache")
    chosen, lengths = settings(args), [int(n) for n in args.lengths.split(",")]
    batches = [int(b) for b in (args.batch_sizes or ("1,8" if args.model else "1,4")).split(",")]

    problems = tokenizer = None
    if args.model:
        from jaxport.dream import tasks

        model, tokenizer = dream.load(args.model, dtype=args.dtype)
        problems = tasks.demo_test_problems(args.problems, args.seed)
        texts = [p.prompt for p in problems]
        width = max(len(tokenizer.encode(t)) for t in texts)
        count = len(texts)
    else:
        model = dream.random_model(dream.preset(args.random_init), dtype=args.dtype, seed=args.seed)
        cfg = model.config
        low = min(cfg.mask_token_id, cfg.eos_token_id, cfg.vocab_size)  # prompts below every special id
        ids = np.random.default_rng(args.seed).integers(0, low, (args.prompts, args.prompt_len)).astype(np.int32)
        count = len(ids)

    def batches_of(size: int) -> list:
        """All prompts in batches of `size` (each task batch left-padded to the longest prompt of all)."""
        if problems:
            return [tokenizer(texts[i : i + size], pad_to=width) for i in range(0, count, size)]
        return [(ids[i : i + size], None) for i in range(0, count, size)]

    rows = []
    for length in lengths:
        for name, fast in chosen.items():
            generation_args = dict(max_new_tokens=length, steps=length, alg=args.alg, **fast)
            for batch in batches:
                timing = passes(model, batches_of(batch), args.repeats, **generation_args)
                sequences = timing.pop("sequences")
                accuracy = None
                if problems:
                    prompt_width = sequences[0].shape[1] - length
                    completions = [c for s in sequences for c in tokenizer.decode_generation(s, prompt_width)]
                    accuracy = tasks.score(problems, completions[:count])["exact_match"]
                rows.append(
                    {
                        "setting": name,
                        "max_new_tokens": length,
                        "batch": batch,
                        "prompts": count,
                        **fast,
                        **timing,
                        "tokens_per_s": round(count * length / timing["median_s"], 2),
                        "accuracy": accuracy,
                    }
                )
                print(
                    f"{length} tokens, batch {batch}, {NAMES[name]}: {rows[-1]['tokens_per_s']} tok/s "
                    f"(spread {timing['spread']:.1%} over {args.repeats} passes)"
                    + (f", accuracy {accuracy:.3f}" if problems else ""),
                    file=sys.stderr,
                )
    for r in rows:
        exact = next(
            (
                e
                for e in rows
                if e["setting"] == "exact" and (e["max_new_tokens"], e["batch"]) == (r["max_new_tokens"], r["batch"])
            ),
            None,
        )
        r["speedup"] = round(exact["median_s"] / r["median_s"], 2) if exact else float("nan")
    result = {
        "what": "jaxport Dream fast decoding (Fast-dLLM) vs exact",
        "machine": environment(),
        "model": args.model or f"random-init {args.random_init}",
        "dtype": args.dtype,
        "alg": args.alg,
        "block_length": args.block_length,
        "cache": args.cache,
        "threshold": args.threshold,
        "schedule": args.schedule,
        "problems": len(problems) if problems else None,
        "results": rows,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_memory_bytes": throughput.peak_memory_bytes(),
        "loadavg": os.getloadavg(),
    }
    if args.upstream:
        original = upstream(lengths, batches, args.prompt_len)
        for r in rows:
            if (r["max_new_tokens"], r["batch"]) in original:
                generations = -(-r["prompts"] // r["batch"])  # the original's time is one batch's
                r["speedup_vs_original_exact"] = round(
                    generations * original[(r["max_new_tokens"], r["batch"])] / r["median_s"], 2
                )
        result["original_exact_s"] = {f"{n} tokens, batch {b}": s for (n, b), s in original.items()}
    result["markdown"] = table(rows, list(chosen), bool(problems), args)
    print(json.dumps(result, indent=1))
    print(result["markdown"], file=sys.stderr)


if __name__ == "__main__":
    main()
