"""Benchmark: nanoGPT training iterations in jaxport, printed as JSON.

Configurations as the original's harness (../shared/originals/bench/gpt/bench_upstream.py): nanoGPT
README's small CPU config (`cpu_readme`) and train_shakespeare_char (`shakespeare`); `--dropout` overrides
both (0 and 0.2 are the comparisons `bench/compare.py` makes). One iteration is what train.py does per
optimizer step with gradient_accumulation_steps=1 on random ids: forward, backward, clipping, AdamW.
Compile time is reported apart from the steady state, with achieved FLOP/s against the probed peak.

    python bench/gpt_train_step.py [--configs cpu_readme,shakespeare] [--dropout 0] [--iters 10] [--warmup 3]
"""

import argparse
import statistics
import time

import jax
import numpy as np
from _common import compiled_flops, emit, environment, peak_rss_bytes, utilisation

from jaxport.gpt import train as gpt_train

CONFIGS = {  # the original harness's CONFIGS
    "cpu_readme": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, dropout=0.0, vocab_size=65,
                       bias=False, learning_rate=1e-3, beta2=0.99, weight_decay=0.1),
    "shakespeare": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2, vocab_size=65,
                        bias=False, learning_rate=1e-3, beta2=0.99, weight_decay=0.1),
}


def bench(name: str, dropout: float | None, iters: int, warmup: int, peaks: dict) -> dict:
    spec = dict(CONFIGS[name], **({} if dropout is None else {"dropout": dropout}))
    vocab = spec.pop("vocab_size")
    cfg = {**gpt_train.DEFAULTS, **gpt_train.EXTRA, **spec, "device": "cpu" if jax.default_backend() == "cpu" else "cuda",
           "init_from": "scratch", "gradient_accumulation_steps": 1}
    trainer = gpt_train.Trainer(cfg, vocab_size=vocab)
    rng = np.random.default_rng(0)
    shape = (1, cfg["batch_size"], cfg["block_size"])
    X, Y = rng.integers(0, vocab, shape), rng.integers(0, vocab, shape)
    Xd, Yd = trainer._shard(X, Y)
    args = (trainer.params, trainer.opt_state, trainer.loss_scale, Xd, Yd, np.float32(1e-3), jax.random.key(0))
    flops = compiled_flops(trainer._step.lower(*args))
    keys = [jax.random.key(i) for i in range(warmup + iters)]  # dropout keys, made before the timing
    times = []
    for key in keys:
        start = time.perf_counter()
        jax.block_until_ready(trainer.step(X, Y, cfg["learning_rate"], key))
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[warmup:])
    return {"benchmark": "gpt_train_iter", "config": name, "dropout": spec["dropout"],
            "first_iter_incl_compile_s": round(times[0], 3), "compile_s": round(times[0] - step_s, 3),
            "iter_s_median": round(step_s, 5), "iter_s_all": [round(t, 5) for t in times[warmup:]],
            "flops_per_iter": flops, **utilisation(flops, step_s, "float32", peaks), "peak_rss_bytes": peak_rss_bytes()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="cpu_readme,shakespeare")
    parser.add_argument("--dropout", type=float, default=None, help="override every config's dropout")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    emit({"machine": environment()})
    peaks = {}
    for name in args.configs.split(","):
        emit(bench(name, args.dropout, args.iters, args.warmup, peaks))


if __name__ == "__main__":
    main()
