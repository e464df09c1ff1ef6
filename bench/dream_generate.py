"""Dream diffusion-generation throughput (the exact decoder), printed as JSON.

CPU default: the 40M-parameter config the original's harness times (hidden 512, 4 layers, 8 heads, 4 KV
heads, intermediate 1408, vocab 32k, float32), prompt 32, 64 new tokens in 64 steps, alg entropy, batch 1
and 4 (`bench/compare.py --only dream` runs the original beside it, also at 256 tokens). GPU/TPU default:
the official 7B config with random bfloat16 weights, 256 new tokens in 256 steps, batch 1 and 8.

    python bench/dream_generate.py [--size 40m|7b|tiny] [--new-tokens 64] [--steps 64] [--batches 1,4] [--repeats 3]
"""

import argparse
import json

import jax
from _common import environment, peak_rss_bytes

from jaxport import dream
from jaxport.dream import throughput


def main():
    on_cpu = jax.devices()[0].platform == "cpu"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="40m" if on_cpu else "7b")
    parser.add_argument("--dtype", default="float32" if on_cpu else "bfloat16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64 if on_cpu else 256)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: --new-tokens)")
    parser.add_argument("--batches", default="1,4" if on_cpu else "1,8")
    parser.add_argument("--alg", default="entropy")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = dream.random_model(dream.preset(args.size), dtype=args.dtype)
    result = throughput.run(
        model,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        steps=args.steps or args.new_tokens,
        alg=args.alg,
        batch_sizes=[int(b) for b in args.batches.split(",")],
        repeats=args.repeats,
    )
    print(json.dumps({**result, "machine": environment(), "peak_rss_bytes": peak_rss_bytes()}))


if __name__ == "__main__":
    main()
