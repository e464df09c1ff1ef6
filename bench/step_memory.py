"""Benchmark: what glibc's handling of a compiled step's temporaries costs, per host-memory policy.

Each policy runs in a fresh process (malloc settings belong to a process), in turn, `--rounds` times; each prints
one JSON line with the step's temporaries, median ms per call, the load-independent counters (page faults and
system seconds per call, the heap's transparent huge pages) and peak RSS. See docs/performance.md, "Host memory".

    python bench/step_memory.py --workload trm:mlp_t:float32:demo [--policies mmap,heap,jaxport,tunable] [--rounds 2]
    python bench/step_memory.py --workload gpt:shakespeare:0.0 --calls 3

Policies, all with the process tuned as jaxport's training commands tune it (`host_memory.tune_process`):
`mmap` the temporaries mapped afresh every call (glibc's blocks over 32 MB); `heap` every block from the heap,
never trimmed below the temporaries, on 4 KB pages; `jaxport` what jaxport's training steps do
(`host_memory.keep_temporaries`: the heap, reserved on transparent huge pages); `tunable` jaxport's policy with
glibc's huge-page tunable set before the process starts (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, a user's opt-in).
"""

import argparse
import json
import os
import subprocess
import sys

POLICIES = ("mmap", "heap", "jaxport", "tunable")


def heap_mb() -> dict:
    """The heap's resident memory and how much of it is on transparent huge pages (`[heap]` in /proc/self/smaps)."""
    in_heap, kb = False, {"Rss:": 0, "AnonHugePages:": 0}
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if not line.split()[0].endswith(":"):
                in_heap = line.rstrip().endswith("[heap]")
            elif in_heap and line.split()[0] in kb:
                kb[line.split()[0]] += int(line.split()[1])
    return {"heap_mb": kb["Rss:"] // 1024, "heap_huge_pages_mb": kb["AnonHugePages:"] // 1024}


def measure(workload: str, policy: str, calls: int) -> dict:
    import resource
    import time
    import types

    import jax
    import numpy as np
    import profile_ops

    from jaxport import runtime
    from jaxport.runtime import host_memory

    host_memory.tune_process(training=True)
    family, *spec = workload.split(":")
    if family == "trm":
        mixer, dtype, size = spec
        workload_args = types.SimpleNamespace(mixer=mixer, dtype=dtype, batch=32, size=size)
        step, args, step_runtime = profile_ops.trm_step(workload_args)
    else:
        config, dropout = spec
        step, args, step_runtime = profile_ops.gpt_step(types.SimpleNamespace(config=config, dropout=float(dropout)))
    compiled = runtime.jit(step, step_runtime).lower(*args).compile()
    if policy == "heap":  # keep_temporaries without the huge-page reservation
        libc = host_memory._libc()
        if compiled.memory_analysis().temp_size_in_bytes > host_memory.TRIM_THRESHOLD:
            libc.mallopt(host_memory.M_TRIM_THRESHOLD, -1)
        libc.mallopt(host_memory.M_MMAP_MAX, 0)
    elif policy in ("jaxport", "tunable"):
        host_memory.keep_temporaries(compiled)
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
        **heap_mb(),
        "peak_rss_mb": round(end.ru_maxrss / 1024),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="trm:mlp_t:float32:demo")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--policy", choices=POLICIES, help=argparse.SUPPRESS)  # one measurement, in this process
    args = parser.parse_args()
    if args.policy:
        print(json.dumps(measure(args.workload, args.policy, args.calls)), flush=True)
        return
    for _ in range(args.rounds):
        for policy in args.policies.split(","):
            env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1" if policy == "tunable" else ""}
            command = [sys.executable, __file__, "--workload", args.workload, "--calls", str(args.calls)]
            out = subprocess.run([*command, "--policy", policy], env=env, capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
