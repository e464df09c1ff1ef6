"""What CPU a benchmark ran on, in a few words: ratios against the originals depend on it (which matrix kernels
PyTorch and XLA:CPU pick for its instruction sets), so every report names it. Standard library only:
`compare.py` uses it without importing jax."""

import os
import platform

# instruction sets that decide which matrix kernels PyTorch and XLA:CPU can use
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_description() -> dict:
    """`{"cpu_model": ..., "cpu_isa": [...]}` from /proc/cpuinfo where there is one."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return {"cpu_model": model, "cpu_isa": [f for f in ISA_FLAGS if f in flags], "cpu_count": os.cpu_count()}
