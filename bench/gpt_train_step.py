"""Benchmark: nanoGPT training iterations in jaxport, printed as JSON.

Configurations: nanoGPT README's small CPU config (`cpu_readme`, nanoGPT: 32.5 ms/iter, 30.2 with
torch.compile, on this machine kind) and train_shakespeare_char (`shakespeare_char`, nanoGPT: 5.9 s/iter,
dropout 0). Compile time is reported apart from the steady state.

    python bench/gpt_train_step.py [--configs cpu_readme,shakespeare_char] [--iters 20]
"""

import argparse
import json
import statistics
import time

import jax
import numpy as np

from jaxport import malloc
from jaxport.gpt import train as gpt_train

CONFIGS = {
    "cpu_readme": dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128, dropout=0.0,
                       gradient_accumulation_steps=1, vocab_size=65, nanogpt_ms=32.5),
    "shakespeare_char": dict(block_size=256, batch_size=64, n_layer=6, n_head=6, n_embd=384, dropout=0.0,
                             gradient_accumulation_steps=1, vocab_size=65, nanogpt_ms=5900.0),
}


def bench(name: str, iters: int) -> dict:
    spec = dict(CONFIGS[name])
    vocab, nanogpt_ms = spec.pop("vocab_size"), spec.pop("nanogpt_ms")
    cfg = {**gpt_train.DEFAULTS, **gpt_train.EXTRA, **spec, "device": "cpu" if jax.default_backend() == "cpu" else "cuda",
           "init_from": "scratch", "bias": False}
    trainer = gpt_train.Trainer(cfg, vocab_size=vocab)
    rng = np.random.default_rng(0)
    shape = (cfg["gradient_accumulation_steps"], cfg["batch_size"], cfg["block_size"])
    X, Y = rng.integers(0, vocab, shape), rng.integers(0, vocab, shape)
    t0 = time.perf_counter()
    jax.block_until_ready(trainer.step(X, Y, 1e-3))
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(trainer.step(X, Y, 1e-3))
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    return {"benchmark": "gpt_train_iter", "config": name, "first_iter_incl_compile_s": round(first_s, 2),
            "iter_ms_median": round(ms, 2), "nanogpt_ms_this_machine_kind": nanogpt_ms,
            "speed_vs_nanogpt": round(nanogpt_ms / ms, 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="cpu_readme,shakespeare_char")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    malloc.keep_freed_memory()
    print(json.dumps({"machine": {"device": jax.devices()[0].device_kind, "jax": jax.__version__}}), flush=True)
    for name in args.configs.split(","):
        print(json.dumps(bench(name, args.iters if name == "cpu_readme" else max(2, args.iters // 10))), flush=True)


if __name__ == "__main__":
    main()
