"""The host-memory policy (`jaxport.runtime.host_memory`), in fresh processes (it changes the process it runs in),
judged by load-independent counters: page faults per call, the heap's huge pages, the dispatch setting."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc tuning")]

# The median over calls, not the mean: on these VMs (whose kernel runs DAMON page-out) two calls in a row now and then
# fault a whole block of temporaries in again among calls that fault nothing, with the heap policy on; that rare
# burst is not what these tests measure.
MEDIAN_FAULTS = """
import json, resource, statistics, jax
from jaxport.runtime import host_memory
host_memory.tune_process(training=True)

def median_faults(call, calls=20, warmup=3):
    for _ in range(warmup):  # a call may allocate before the previous one has freed: two blocks in turn
        jax.block_until_ready(call())
    counts = []
    for _ in range(calls):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(call())
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    return statistics.median(counts)

def heap_memory():
    # the heap's resident bytes and those on transparent huge pages (its [heap] mappings in /proc/self/smaps)
    in_heap, kb = False, {"Rss:": 0, "AnonHugePages:": 0}
    for line in open("/proc/self/smaps"):
        if not line.split()[0].endswith(":"):
            in_heap = line.rstrip().endswith("[heap]")
        elif in_heap and line.split()[0] in kb:
            kb[line.split()[0]] += int(line.split()[1])
    return {"heap": kb["Rss:"] * 1024, "heap_huge_pages": kb["AnonHugePages:"] * 1024}
"""


def run_with_median_faults(script: str) -> dict:
    """The JSON line that `script`, run after MEDIAN_FAULTS in a fresh process (no glibc tunables), prints last."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", MEDIAN_FAULTS + script], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def transparent_huge_pages() -> str:
    """The kernel's transparent-huge-page mode: always, madvise or never (empty where there is none)."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text.split("[")[1].split("]")[0]


FAULTS_PER_CALL = """
import jax.numpy as jnp

def step(x):  # temporaries of ~130 MB, more than glibc's largest mmap threshold (32 MB)
    ys = [jnp.sin(x * i) for i in range(8)]  # each read twice, so each is materialised
    return sum(y @ x[:, :8] + y.T @ x[:, :8] for y in ys)

x = jnp.ones((2048, 2048))
compiled = jax.jit(step).lower(x).compile()

before = median_faults(lambda: compiled(x))
host_memory.keep_temporaries(compiled)
after = median_faults(lambda: compiled(x))
print(json.dumps({"temp": compiled.memory_analysis().temp_size_in_bytes, "before": before, "after": after,
                  **heap_memory()}))
"""


def test_a_step_under_the_trim_threshold_keeps_its_temporaries_on_huge_pages_instead_of_faulting_them_in():
    result = run_with_median_faults(FAULTS_PER_CALL)
    assert result["temp"] > 32 << 20
    assert result["before"] > 0.5 * result["temp"] / 4096  # a fresh mapping, faulted in page by page
    # steady state: none; a call that allocates before the previous one has freed adds a block, once
    assert result["after"] < 0.2 * result["before"]
    if transparent_huge_pages() in ("always", "madvise"):  # advised in-process: no restart, no glibc tunable
        # the temporaries' bytes, at least, sit on huge pages (the kernel may leave a fragmented edge of the heap on
        # small pages: 84% of it huge was seen under load)
        assert result["heap"] > result["temp"] and result["heap_huge_pages"] > result["temp"]


@pytest.mark.parametrize("memory_gb", [64, 0.25])
def test_a_step_over_the_trim_threshold_reuses_its_temporaries_where_two_fit_in_half_the_memory(memory_gb):
    """The same ~130 MB step with the trim threshold lowered under it: the heap keeps its temporaries (never trimmed)
    on a machine of 64 GB; on one of 256 MB, where a second block of them could not be afforded, they stay mapped
    afresh every call."""
    fake_machine = f"""
import types
host_memory.TRIM_THRESHOLD = 64 << 20
pages = int({memory_gb} * (1 << 30)) // 4096
host_memory.os = types.SimpleNamespace(sysconf=lambda name: {{"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": pages}}[name])
"""
    result = run_with_median_faults(fake_machine + FAULTS_PER_CALL)
    assert result["temp"] > 64 << 20
    assert result["before"] > 0.5 * result["temp"] / 4096
    if memory_gb == 64:
        assert result["after"] < 0.2 * result["before"]
    else:
        assert result["after"] > 0.5 * result["temp"] / 4096


GPT_STEP_FAULTS = """
import numpy as np
from jaxport.gpt.settings import DEFAULTS, EXTRA
from jaxport.gpt.trainer import Trainer
cfg = {**DEFAULTS, **EXTRA, "device": "cpu", "init_from": "scratch", "gradient_accumulation_steps": 1,
       "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12, "dropout": 0.0}
trainer = Trainer(cfg, vocab_size=65)  # nanoGPT README's CPU config: ~44 MB of temporaries per step
X = np.random.default_rng(0).integers(0, 65, (1, 12, 64))
faults = median_faults(lambda: trainer.step(X, X, 1e-3), calls=10)
temp = trainer._step.lower(*trainer.step_args(X, X, 1e-3)).compile().memory_analysis().temp_size_in_bytes
print(json.dumps({"temp": temp, "faults": faults}))
"""


def test_gpt_training_steps_reuse_their_temporaries():
    """Before the trainer sized the policy on its first step, each README-config step mapped its temporaries
    afresh and faulted them in (docs/performance.md, "Host memory for GPT's and Dream's training steps")."""
    result = run_with_median_faults(GPT_STEP_FAULTS)
    assert result["temp"] > 32 << 20  # above glibc's largest mmap threshold
    assert result["faults"] < 0.1 * result["temp"] / 4096


ARENAS = """
import ctypes, tempfile
import jax.numpy as jnp

x = jnp.ones((256, 256))
jax.block_until_ready(jax.jit(lambda x: jnp.einsum("ij,kj->ik", x, x @ x.T))(x))
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile(suffix=".xml") as report:
    stream = ctypes.c_void_p(libc.fopen(report.name.encode(), b"w"))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    arenas = open(report.name).read().count("<heap nr=")
print(json.dumps({"async_dispatch": jax.config.read("jax_cpu_enable_async_dispatch"), "arenas": arenas}))
"""


def test_training_steps_run_on_the_calling_thread_and_xla_s_workers_keep_arenas_of_their_own():
    """One arena for every thread made the workers' many small allocations (oneDNN's matmul workspace) queue on
    one lock (docs/performance.md, "Host memory")."""
    result = run_with_median_faults(ARENAS)
    assert result["async_dispatch"] is False  # the step's temporaries come from the main thread's arena
    assert result["arenas"] > 1


COMMAND_DISPATCH = """
import contextlib, io, jax
from jaxport import cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    cli.main([{family!r}, {action!r}, "--help"])
print(jax.config.read("jax_cpu_enable_async_dispatch"))
"""


@pytest.mark.parametrize(
    "family, action, asynchronous",
    [("gpt", "train", False), ("trm", "train", False), ("dream", "train", False), ("dream", "serve", True)],
)
def test_only_the_training_commands_turn_asynchronous_dispatch_off(family, action, asynchronous):
    """A server's or decoder's calls keep JAX's asynchronous CPU dispatch; training steps need the calling thread."""
    code = COMMAND_DISPATCH.format(family=family, action=action)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(asynchronous)
