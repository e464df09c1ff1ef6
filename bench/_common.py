"""What every jaxport bench prints beside its timings: the machine and versions, the peak that achieved FLOP/s
is a fraction of (an accelerator's datasheet figure, else this machine's matmul rate measured today), and peak
memory."""

import json
import os
import platform
import resource
import statistics
import sys
import time

import flax
import jax
import jax.numpy as jnp
import jaxlib
from host import cpu_description

from jaxport.gpt import device_peak_flops
from jaxport.runtime import host_memory

# as the jaxport command does; benchmarks of training steps tune for training, as `jaxport gpt train` does
host_memory.tune_process(training=False)


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device": device.device_kind,
        "device_count": jax.device_count(),
        **cpu_description(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


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
    return 2 * n**3 / statistics.median(times)


def peak_flops(dtype: str, peaks: dict) -> tuple[float, str]:
    """(the FLOP/s that utilisation is a fraction of, where it comes from): a known accelerator's dense bf16
    datasheet peak whatever `dtype` (nanoGPT's MFU convention), else this machine's `dtype` matmul rate,
    probed once per process into `peaks`."""
    datasheet, kind = device_peak_flops()
    if datasheet:
        return datasheet, f"{kind} bf16 datasheet"
    if dtype not in peaks:
        peaks[dtype] = matmul_peak_flops(dtype)
    return peaks[dtype], f"probed {dtype} matmul"


def utilisation(flops_per_call: float | None, seconds: float, dtype: str, peaks: dict) -> dict:
    """Achieved GFLOP/s and its fraction of the peak for `dtype` (see `peak_flops`)."""
    if not flops_per_call:
        return {}
    peak, source = peak_flops(dtype, peaks)
    achieved = flops_per_call / seconds
    return {
        "achieved_gflops": round(achieved / 1e9, 1),
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "peak_source": source,
        "fraction_of_peak": round(achieved / peak, 3),
    }


def compiled_flops(lowered, compiled=None) -> float | None:
    """FLOPs of a lowered program from XLA's cost analysis (a loop body counts once). Where the lowered program has
    no count (on a GPU, jax-ml/jax#22713; seen with jaxlib 0.11.2 on an H200), the compiled one's, `compiled` or
    `lowered` compiled now, which leaves out custom calls such as cuDNN's attention."""
    for analysed in (lambda: lowered, lambda: compiled or lowered.compile()):
        cost = analysed().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        if cost and cost.get("flops"):
            return float(cost["flops"])
    return None


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_high_water() -> dict:
    """This process's memory high-water mark so far: the device allocator's peak where the backend keeps one
    (GPU, TPU), else the peak RSS (CPU, where the device memory is the process's)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return {"memory_bytes": stats["peak_bytes_in_use"], "memory_source": "device peak_bytes_in_use"}
    return {"memory_bytes": peak_rss_bytes(), "memory_source": "process peak RSS"}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
    sys.stdout.flush()
