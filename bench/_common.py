"""What every jaxport bench prints beside its timings: the machine and versions, this machine's measured
matmul peak (so achieved FLOP/s reads as a fraction of what the hardware does here today), and peak memory."""

import json
import os
import platform
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jaxport import malloc

malloc.keep_freed_memory()  # as the jaxport command does


def environment() -> dict:
    device = jax.devices()[0]
    return {"platform": device.platform, "device": device.device_kind, "device_count": jax.device_count(),
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}


def matmul_peak_flops(dtype="float32", n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one large square dot (f32 accumulation) on the default device: a short probe of the
    machine's attainable matmul rate, measured now."""
    dtype = jnp.dtype(dtype)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    jax.block_until_ready(dot(a, a))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(dot(a, a))
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times)


def utilisation(flops_per_call: float | None, seconds: float, dtype: str, peaks: dict) -> dict:
    """Achieved GFLOP/s and its fraction of the probed peak for `dtype` (probed once per process)."""
    if not flops_per_call:
        return {}
    if dtype not in peaks:
        peaks[dtype] = matmul_peak_flops(dtype)
    achieved = flops_per_call / seconds
    return {"achieved_gflops": round(achieved / 1e9, 1), "matmul_peak_gflops": round(peaks[dtype] / 1e9, 1),
            "fraction_of_peak": round(achieved / peaks[dtype], 3)}


def compiled_flops(lowered) -> float | None:
    """FLOPs of a lowered program from XLA's cost analysis (a loop body counts once)."""
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)) or None if cost else None


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
    sys.stdout.flush()
