"""Dream diffusion-generation throughput, printed as JSON.

CPU: the 40M-parameter config upstream was timed with (hidden 512, 4 layers, 8 heads, 4 KV heads,
intermediate 1408, vocab 32k, float32), prompt 32, 64 new tokens in 64 steps, alg entropy, batch 1
and 4, next to the PyTorch original's times (tests/fixtures/dream/baseline_cpu_timing.json).
GPU/TPU: the official 7B config with random bfloat16 weights, 256 new tokens in 256 steps, batch 1
and 8, with peak device memory.

    python bench/dream_generate.py [--size 40m|7b] [--repeats 3]
"""

import argparse
import json
from pathlib import Path

import jax

from jaxport import dream
from jaxport.dream import bench

BASELINE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dream" / "baseline_cpu_timing.json"


def main():
    on_cpu = jax.devices()[0].platform == "cpu"
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="40m" if on_cpu else "7b")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.size == "7b":
        settings = dict(dtype="bfloat16", prompt_len=32, new_tokens=256, steps=256, batch_sizes=[1, 8])
    else:
        settings = dict(dtype="float32", prompt_len=32, new_tokens=64, steps=64, batch_sizes=[1, 4])
    dtype = settings.pop("dtype")
    model = dream.random_model(dream.preset(args.size), dtype=dtype)
    result = bench.run(model, alg="entropy", repeats=args.repeats, **settings)
    if args.size == "40m" and BASELINE.is_file():
        baseline = json.loads(BASELINE.read_text())
        torch_s = {r["batch"]: r["median_s"] for r in baseline["results"]}
        result["pytorch_original"] = {"torch": baseline["runtime"]["torch"], "threads": baseline["threads"],
                                      "median_s": torch_s}
        for row in result["results"]:
            if row["batch"] in torch_s:
                row["speedup_vs_pytorch"] = round(torch_s[row["batch"]] / row["generate_median_s"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
