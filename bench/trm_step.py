"""Benchmark: one TRM ACT call, forward + backward, at the paper's Sudoku architecture.

Prints one JSON object per configuration (attention / mlp_t x float32 / bfloat16): compile time apart,
steady-state seconds per step (median), FLOPs from XLA's cost analysis, achieved FLOP/s against this
machine's probed matmul peak, peak RSS. `bench/compare.py --only trm_step` runs the PyTorch original's
harness beside it.

    python bench/trm_step.py [--batch 32] [--steps 5] [--mixers attention,mlp_t] [--dtypes float32,bfloat16]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import compiled_flops, emit, environment, peak_rss_bytes, utilisation
from flax import nnx

from jaxport import runtime
from jaxport.runtime import host_memory
from jaxport.trm import TRM, TRMConfig
from jaxport.trm.model import loss_and_grad

host_memory.tune_process(training=True)  # as `jaxport trm train` does

PAPER_SUDOKU = dict(
    vocab_size=11,
    num_puzzle_identifiers=1,
    seq_len=81,
    hidden_size=512,
    num_heads=8,
    expansion=4,
    L_layers=2,
    H_cycles=3,
    L_cycles=6,
    puzzle_emb_ndim=512,
    puzzle_emb_len=16,
    halt_max_steps=16,
    halt_exploration_prob=0.1,
)


def sudoku_batch(batch_size: int, rng: np.random.Generator) -> dict:
    return {
        "inputs": rng.integers(1, 11, (batch_size, 81), dtype=np.int32),
        "labels": rng.integers(1, 11, (batch_size, 81), dtype=np.int32),
        "puzzle_identifiers": np.zeros((batch_size,), np.int32),
    }


def model_config(mixer: str, dtype: str, batch_size: int, arch: dict = PAPER_SUDOKU) -> TRMConfig:
    """`arch` with the mixer's settings as upstream runs them (the README's mlp_t run has no positions)."""
    return TRMConfig(
        **arch,
        mlp_t=mixer == "mlp_t",
        forward_dtype=dtype,
        pos_encodings="none" if mixer == "mlp_t" else "rope",
        batch_size=batch_size,
    )


def bench(
    mixer: str,
    dtype: str,
    loop: str,
    batch_size: int,
    steps: int,
    row_chunks: int | None,
    peaks: dict,
    arch: dict = PAPER_SUDOKU,
) -> dict:
    config = model_config(mixer, dtype, batch_size, arch)
    model = TRM(config, rngs=nnx.Rngs(0), unroll_cycles=loop == "unrolled", row_chunks=row_chunks)
    model.train()
    batch = {k: jnp.asarray(v) for k, v in sudoku_batch(batch_size, np.random.default_rng(0)).items()}
    carry = model.initial_carry(batch)
    graphdef, state = nnx.split(model)
    halt_key = jax.random.key(0)

    def step(state, carry, batch):
        return loss_and_grad(nnx.merge(graphdef, state), carry, batch, batch_size, halt_key)

    start = time.perf_counter()
    # the runtime jaxport trains with, and the host-memory policy its trainer sets for its step
    lowered = runtime.jit(step, model.runtime_for(batch["inputs"].shape)).lower(state, carry, batch)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    host_memory.keep_temporaries(compiled)
    # FLOPs of the unrolled program: the cost analysis counts a fori_loop body once
    flops = compiled_flops(lowered, compiled) if loop == "unrolled" else None
    (carry, *_), _ = jax.block_until_ready(compiled(state, carry, batch))  # first run: allocations, thread pools
    times = []
    for _ in range(steps):  # the ACT carry persists across steps, as in the original's harness
        start = time.perf_counter()
        (carry, *_), grads = compiled(state, carry, batch)
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {
        "benchmark": "trm_act_call_fwd_bwd",
        "mixer": mixer,
        "forward_dtype": dtype,
        "loop": loop,
        "row_chunks": model.chunks_for(batch_size),
        "batch": batch_size,
        "compile_s": round(compile_s, 2),
        "step_s_median": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times],
        "flops_per_step": flops,
        **utilisation(flops, step_s, dtype, peaks),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mixers", default="attention,mlp_t")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--loops", default="unrolled", help="unrolled and/or fori (comma-separated)")
    parser.add_argument(
        "--row-chunks", type=int, default=None, help="recursion row chunks (default: the model's choice)"
    )
    args = parser.parse_args()
    emit({"machine": environment()})
    peaks = {}
    for loop in args.loops.split(","):
        for mixer in args.mixers.split(","):
            for dtype in args.dtypes.split(","):
                emit(bench(mixer, dtype, loop, args.batch, args.steps, args.row_chunks, peaks))


if __name__ == "__main__":
    main()
