"""Forward and diffusion-generation throughput of a Dream model, as one JSON-ready dict: what `jaxport dream bench`
prints, and what the benchmarks in bench/ build on."""

import dataclasses
import platform
import statistics
import time

import flax
import jax
import numpy as np

from jaxport.dream.model import DreamModel
from jaxport.runtime.compile_seconds import with_compile_seconds


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device": device.device_kind,
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "machine": platform.machine(),
    }


def peak_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(seconds compiling in the first call; steady-state seconds of each further call)."""
    _, compile_s = with_compile_seconds(lambda: jax.block_until_ready(fn()))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return compile_s, times


def run(
    model: DreamModel,
    *,
    prompt_len: int,
    new_tokens: int,
    steps: int,
    alg: str,
    batch_sizes: list[int],
    repeats: int = 3,
    seed: int = 0,
    log=None,
    **generation_args,
) -> dict:
    """Forward and generation timings per batch size; `generation_args` go to `diffusion_generate`
    (e.g. the fast-decoding `block_length`, `cache`, `threshold`)."""
    cfg = model.config
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(flax.nnx.state(model)))
    rng = np.random.default_rng(seed)
    # prompt ids below every special id, so no prompt position is a mask token
    low = min(cfg.mask_token_id, cfg.eos_token_id, cfg.vocab_size)
    results = []
    for batch in batch_sizes:
        ids = rng.integers(0, low, (batch, prompt_len)).astype(np.int32)
        canvas = rng.integers(0, low, (batch, prompt_len + new_tokens)).astype(np.int32)
        fwd_compile, fwd_times = timed(lambda canvas=canvas: model(canvas), repeats)
        gen_compile, gen_times = timed(
            lambda ids=ids: model.diffusion_generate(
                ids, max_new_tokens=new_tokens, steps=steps, alg=alg, return_dict_in_generate=False, **generation_args
            ),
            repeats,
        )
        gen_median, fwd_median = statistics.median(gen_times), statistics.median(fwd_times)
        row = {
            "batch": batch,
            "generate_compile_s": round(gen_compile, 3),
            "generate_times_s": [round(t, 4) for t in gen_times],
            "generate_median_s": round(gen_median, 4),
            "new_tokens_per_s": round(batch * new_tokens / gen_median, 2),
            "steps_per_s": round(steps / gen_median, 2),
            "forward_compile_s": round(fwd_compile, 3),
            "forward_median_s": round(fwd_median, 5),
            "forward_tokens_per_s": round(batch * (prompt_len + new_tokens) / fwd_median, 1),
        }
        results.append(row)
        if log:
            log(f"batch {batch}: {row['generate_median_s']} s per generation, {row['new_tokens_per_s']} new tokens/s")
    return {
        "what": "jaxport Dream diffusion_generate",
        **environment(),
        "dtype": str(np.dtype(model.dtype)),
        "config": dataclasses.asdict(cfg),
        "n_params": n_params,
        "prompt_len": prompt_len,
        "max_new_tokens": new_tokens,
        "steps": steps,
        "alg": alg,
        "temperature": 0.0,
        "repeats": repeats,
        "generation_args": generation_args,
        "results": results,
        "peak_device_memory_bytes": peak_memory_bytes(),
    }
