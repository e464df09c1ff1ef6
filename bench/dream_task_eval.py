"""Exact-match accuracy of a Dream model on held-out synthetic problems (`jaxport.dream.tasks`), as JSON.

    jaxport dream train --preset task-demo          # trains and exports runs/dream-task-demo/hf
    python bench/dream_task_eval.py --model runs/dream-task-demo/hf [--problems 256]

The problems are the `task-demo` preset's two test splits (no test prompt occurs in training):
`new_orders`, answers (sets of digits or words) that training has, in input orders it does not;
`new_answers`, answers training never has (`tasks.held_out_answers()`). Decoding is exact: 128 new
tokens in 128 steps (one token per step), temperature 0, once per split and unmasking order in
`--algs` (one JSON object each): `origin` (upstream's default: a random order, from `--seed`) and
`entropy` (most confident first). The tiny model scores far higher in random order: training masks
positions independently, while confidence orders reveal the end-of-text tail first and then ask for
the answer under a mask pattern training almost never shows.
"""

import argparse
import json
import time

import jax
from _common import environment

from jaxport import dream
from jaxport.dream import tasks


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face Dream directory (e.g. runs/dream-task-demo/hf)")
    parser.add_argument("--problems", type=int, default=256, help="problems per split (at least 200 for the target)")
    parser.add_argument("--splits", default=",".join(tasks.SPLITS), help="test splits, comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="the seed the task-demo run was trained with")
    parser.add_argument("--gen-len", type=int, default=128, help="new tokens (the trained response span)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: --gen-len, exact)")
    parser.add_argument("--algs", default="origin,entropy", help="unmasking orders, comma-separated")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--show", type=int, default=3, help="print this many wrong answers")
    args = parser.parse_args()
    model, tokenizer = dream.load(args.model, dtype=args.dtype)
    for split in args.splits.split(","):
        problems = tasks.demo_test_problems(args.problems, args.seed, split)
        for alg in args.algs.split(","):
            start = time.perf_counter()
            scores, completions = tasks.evaluate(
                model,
                tokenizer,
                problems,
                gen_len=args.gen_len,
                batch_size=args.batch_size,
                steps=args.steps or args.gen_len,
                alg=alg,
                rng=jax.random.key(args.seed),
            )
            seconds = time.perf_counter() - start
            wrong = [
                {"prompt": p.prompt, "answer": p.answer, "completion": c}
                for p, c in zip(problems, completions)
                if c != p.answer
            ][: args.show]
            result = {
                "what": f"exact match on the task-demo test split {split}",
                "split": split,
                "model": args.model,
                **scores,
                "gen_len": args.gen_len,
                "steps": args.steps or args.gen_len,
                "alg": alg,
                "temperature": 0.0,
                "dtype": args.dtype,
                "seconds": round(seconds, 1),
                "wrong_examples": wrong,
                **environment(),
            }
            print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
