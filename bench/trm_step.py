"""Benchmark: one TRM ACT call, forward + backward, at the paper's Sudoku architecture.

Prints one JSON object per configuration (attention / mlp_t x float32 / bfloat16):
compile time, steady-state seconds per step (median), and achieved FLOP/s from XLA's
cost analysis. Compare with the PyTorch original's medians on the same machine.

    python bench/trm_step.py [--batch 32] [--steps 5] [--loops unrolled,fori] [--row-chunks N]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

# Keeping freed memory in the heap instead of returning it to the OS between steps saves
# page faults on every step; glibc reads this only at start-up, hence the re-exec.
GLIBC_TUNABLES = "glibc.malloc.trim_threshold=4294967296:glibc.malloc.top_pad=1073741824:glibc.malloc.mmap_threshold=4294967296"
if os.environ.get("GLIBC_TUNABLES") is None and platform.system() == "Linux":
    os.environ["GLIBC_TUNABLES"] = GLIBC_TUNABLES
    os.execv(sys.executable, [sys.executable, *sys.argv])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxport.trm import TRM, TRMConfig  # noqa: E402
from jaxport.trm.model import loss_and_grad  # noqa: E402

PAPER_SUDOKU = dict(vocab_size=11, num_puzzle_identifiers=1, seq_len=81, hidden_size=512, num_heads=8, expansion=4,
                    L_layers=2, H_cycles=3, L_cycles=6, puzzle_emb_ndim=512, puzzle_emb_len=16, halt_max_steps=16,
                    halt_exploration_prob=0.1)
# The PyTorch original on this machine kind (2 threads, eager), seconds per ACT call fwd+bwd, batch 32.
TORCH_CPU_SECONDS = {("attention", "float32"): 6.98, ("attention", "bfloat16"): 3.08,
                     ("mlp_t", "float32"): 7.52, ("mlp_t", "bfloat16"): 2.52}


def sudoku_batch(batch_size: int, rng: np.random.Generator) -> dict:
    return {"inputs": rng.integers(1, 11, (batch_size, 81), dtype=np.int32),
            "labels": rng.integers(2, 11, (batch_size, 81), dtype=np.int32),
            "puzzle_identifiers": np.zeros((batch_size,), np.int32)}


def count_flops(config: TRMConfig, batch_size: int, batch: dict) -> float:
    """FLOPs of one step from XLA's cost analysis of the unrolled program (the analysis counts a
    loop body once, so a fori_loop program would be under-counted)."""
    model = TRM(config, rngs=nnx.Rngs(0), unroll_cycles=True)
    model.train()
    graphdef, state = nnx.split(model)
    carry = model.initial_carry(batch)
    lowered = jax.jit(lambda state, carry, batch: loss_and_grad(nnx.merge(graphdef, state), carry, batch, batch_size,
                                                               jax.random.key(0))).lower(state, carry, batch)
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)) if cost else 0.0


def bench(mixer: str, dtype: str, loop: str, batch_size: int, steps: int, row_chunks: int | None) -> dict:
    config = TRMConfig(**PAPER_SUDOKU, mlp_t=mixer == "mlp_t", forward_dtype=dtype,
                       pos_encodings="none" if mixer == "mlp_t" else "rope", batch_size=batch_size)
    model = TRM(config, rngs=nnx.Rngs(0), unroll_cycles=loop == "unrolled", row_chunks=row_chunks)
    model.train()
    batch = {k: jnp.asarray(v) for k, v in sudoku_batch(batch_size, np.random.default_rng(0)).items()}
    carry = model.initial_carry(batch)
    graphdef, state = nnx.split(model)
    halt_key = jax.random.key(0)

    def step(state, carry, batch):
        return loss_and_grad(nnx.merge(graphdef, state), carry, batch, batch_size, halt_key)

    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(state, carry, batch).compile()
    compile_s = time.perf_counter() - t0
    flops = count_flops(config, batch_size, batch)
    jax.block_until_ready(compiled(state, carry, batch))  # first run: allocations, thread pools
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        (carry_out, *_), grads = compiled(state, carry, batch)
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    result = {"benchmark": "trm_act_call_fwd_bwd", "mixer": mixer, "forward_dtype": dtype, "loop": loop,
              "row_chunks": model.chunks_for(batch_size), "batch": batch_size, "compile_s": round(compile_s, 2),
              "step_s_median": round(step_s, 3),
              "step_s_all": [round(t, 3) for t in times], "flops_per_step": flops,
              "achieved_gflops": round(flops / step_s / 1e9, 1) if flops else None}
    torch_s = TORCH_CPU_SECONDS.get((mixer, dtype))
    if jax.default_backend() == "cpu" and torch_s and batch_size == 32:
        result["torch_cpu_2thread_s"] = torch_s
        result["speed_vs_torch_cpu"] = round(torch_s / step_s, 3)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mixers", default="attention,mlp_t")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--loops", default="unrolled", help="unrolled and/or fori (comma-separated)")
    parser.add_argument("--row-chunks", type=int, default=None, help="recursion row chunks (default: the model's choice)")
    args = parser.parse_args()
    header = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "num_devices": jax.device_count(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
              "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
              "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}
    print(json.dumps({"machine": header}), flush=True)
    for loop in args.loops.split(","):
        for mixer in args.mixers.split(","):
            for dtype in args.dtypes.split(","):
                print(json.dumps(bench(mixer, dtype, loop, args.batch, args.steps, args.row_chunks)), flush=True)


if __name__ == "__main__":
    main()
