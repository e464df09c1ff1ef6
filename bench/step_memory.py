"""Benchmark: what glibc's handling of a compiled step's temporaries costs, per host-memory policy.

Each policy runs in a fresh process (malloc settings belong to a process), in turn, `--rounds` times;
each prints one JSON line with the step's temporaries, median ms per call, page faults per call and peak
RSS. See docs/performance.md, "page faults".

    python bench/step_memory.py --workload trm:mlp_t:float32:demo [--policies mmap,heap,hugepages] [--rounds 2]
    python bench/step_memory.py --workload gpt:shakespeare:0.0 --calls 3

Policies: `mmap` glibc with jaxport's older settings (blocks over 32 MB mapped afresh); `heap` what the
jaxport command does for TRM (one arena, then everything from the heap if the temporaries fit under the
trim threshold); `hugepages` what `jaxport gpt` does (`mmap` plus glibc's transparent-huge-page tunable).
"""

import argparse
import json
import os
import subprocess
import sys


def measure(workload: str, policy: str, calls: int) -> dict:
    import ctypes
    import resource
    import time
    import types

    from jaxport import malloc

    if policy == "mmap":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(malloc.M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(malloc.M_TRIM_THRESHOLD, malloc.TRIM_THRESHOLD)
        libc.mallopt(malloc.M_TOP_PAD, 64 << 20)
        malloc.keep_freed_memory = lambda: None  # _common would apply jaxport's settings
    import jax
    import numpy as np
    import profile_ops  # noqa: F401  (imports _common, which applies jaxport's settings for the other policies)

    family, *spec = workload.split(":")
    if family == "trm":
        mixer, dtype, size = spec
        step, args = profile_ops.trm_step(types.SimpleNamespace(mixer=mixer, dtype=dtype, batch=32, size=size))
        options = None
    else:
        config, dropout = spec
        step, args = profile_ops.gpt_step(types.SimpleNamespace(config=config, dropout=float(dropout)))
        options = step.compiler_options
    compiled = jax.jit(step, compiler_options=options).lower(*args).compile()
    if policy == "heap":
        malloc.reuse_memory_for(compiled)
    for _ in range(3):  # a call may allocate before the previous one has freed: two blocks in turn
        jax.block_until_ready(compiled(*args))
    start, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(calls):
        began = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - began)
    end = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "workload": workload,
        "policy": policy,
        "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 2**20),
        "ms_per_call": round(1e3 * float(np.median(times)), 2),
        "page_faults_per_call": round((end.ru_minflt - start.ru_minflt) / calls),
        "system_s_per_call": round((end.ru_stime - start.ru_stime) / calls, 4),
        "peak_rss_mb": round(end.ru_maxrss / 1024),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="trm:mlp_t:float32:demo")
    parser.add_argument("--policies", default="mmap,heap,hugepages")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--policy", help=argparse.SUPPRESS)  # one measurement, in this process
    args = parser.parse_args()
    if args.policy:
        print(json.dumps(measure(args.workload, args.policy, args.calls)), flush=True)
        return
    for _ in range(args.rounds):
        for policy in args.policies.split(","):
            env = {**os.environ, "JAXPORT_NO_RESTART": "1"}
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1" if policy == "hugepages" else ""
            command = [sys.executable, __file__, "--workload", args.workload, "--calls", str(args.calls)]
            out = subprocess.run([*command, "--policy", policy], env=env, capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
