"""Benchmark: nanoGPT training iterations in jaxport, printed as JSON.

Configurations as the original's harness (../shared/originals/bench/gpt/bench_upstream.py): nanoGPT
README's small CPU config (`cpu_readme`) and train_shakespeare_char (`shakespeare`); `--dropout` overrides
both (0 and 0.2 are the comparisons `bench/compare.py` makes). `gpt2` is GPT-2 124M at block 1024, the
accelerator size (`bench/suite.py`). One iteration is what train.py does per optimizer step with
gradient_accumulation_steps=1 on random ids: forward, backward, clipping, AdamW, computed in float32 on a CPU
and in bfloat16 on a GPU/TPU (as `jaxport gpt train` with nanoGPT's default --dtype). Compile time is reported
apart from the steady state, with tokens/s, nanoGPT's MFU and XLA-counted FLOP/s against the device's peak.

    python bench/gpt_train_step.py [--configs cpu_readme,shakespeare,gpt2] [--dropout 0] [--iters 10] [--warmup 3]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import compiled_flops, emit, environment, peak_flops, peak_rss_bytes, utilisation

from jaxport.gpt import settings as gpt_settings
from jaxport.gpt import trainer as gpt_trainer
from jaxport.gpt.model import estimate_mfu
from jaxport.runtime import host_memory
from jaxport.runtime.compile_seconds import with_compile_seconds

host_memory.tune_process(training=True)  # as `jaxport gpt train` does

CONFIGS = {  # the original harness's CONFIGS
    "cpu_readme": dict(
        n_layer=4,
        n_head=4,
        n_embd=128,
        block_size=64,
        batch_size=12,
        dropout=0.0,
        vocab_size=65,
        bias=False,
        learning_rate=1e-3,
        beta2=0.99,
        weight_decay=0.1,
    ),
    "shakespeare": dict(
        n_layer=6,
        n_head=6,
        n_embd=384,
        block_size=256,
        batch_size=64,
        dropout=0.2,
        vocab_size=65,
        bias=False,
        learning_rate=1e-3,
        beta2=0.99,
        weight_decay=0.1,
    ),
    # jaxport's own: GPT-2 124M as nanoGPT's train.py defaults, one micro-batch of 8 rows
    "gpt2": dict(
        n_layer=12,
        n_head=12,
        n_embd=768,
        block_size=1024,
        batch_size=8,
        dropout=0.0,
        vocab_size=50304,
        bias=False,
        learning_rate=6e-4,
        beta2=0.95,
        weight_decay=0.1,
    ),
}


def bench(name: str, dropout: float | None, iters: int, warmup: int, peaks: dict, **overrides) -> dict:
    """One configuration's record; `overrides` replace its entries (batch_size, n_layer, ...)."""
    spec = {**CONFIGS[name], **({} if dropout is None else {"dropout": dropout}), **overrides}
    vocab = spec.pop("vocab_size")
    device = {"cpu": "cpu", "tpu": "tpu"}.get(jax.default_backend(), "cuda")
    cfg = {
        **gpt_settings.DEFAULTS,
        **gpt_settings.EXTRA,
        **spec,
        "device": device,
        "init_from": "scratch",
        "gradient_accumulation_steps": 1,
    }
    trainer = gpt_trainer.Trainer(cfg, vocab_size=vocab)
    rng = np.random.default_rng(0)
    shape = (1, cfg["batch_size"], cfg["block_size"])
    X, Y = rng.integers(0, vocab, shape), rng.integers(0, vocab, shape)
    times, compile_s = [], 0.0
    for draw in range(warmup + iters):  # a new dropout key each iteration
        start = time.perf_counter()
        _, seconds = with_compile_seconds(
            lambda draw=draw: jax.block_until_ready(trainer.step(X, Y, cfg["learning_rate"], draw))
        )
        times.append(time.perf_counter() - start)
        compile_s += seconds
    step_s = statistics.median(times[warmup:])
    # after the timed calls: where only the compiled program has a count (a GPU), the compilation is the step's own
    flops = compiled_flops(trainer._step.lower(*trainer.step_args(X, Y, 1e-3)))
    dtype, rows = jnp.dtype(trainer.dtype).name, cfg["batch_size"]
    mfu = estimate_mfu(trainer.model.get_num_params(), trainer.model_config, rows, step_s, peak_flops(dtype, peaks)[0])
    return {
        "benchmark": "gpt_train_iter",
        "config": name,
        "dropout": spec["dropout"],
        "dtype": dtype,
        "batch_size": rows,
        "block_size": cfg["block_size"],
        "first_iter_incl_compile_s": round(times[0], 3),
        "compile_s": round(compile_s, 3),
        "iter_s_median": round(step_s, 5),
        "iter_s_all": [round(t, 5) for t in times[warmup:]],
        "tokens_per_s": round(rows * cfg["block_size"] / step_s, 1),
        "mfu": round(mfu, 4),
        "flops_per_iter": flops,
        **utilisation(flops, step_s, dtype, peaks),
        "peak_rss_bytes": peak_rss_bytes(),
    }


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
