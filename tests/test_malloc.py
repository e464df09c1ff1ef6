"""The host-memory tuning of the jaxport command, in fresh processes (it changes the process it runs in)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc tuning")

FAULTS_PER_CALL = """
import json, resource, jax, jax.numpy as jnp
from jaxport import malloc
malloc.keep_freed_memory()

def step(x):  # temporaries of ~130 MB, more than glibc's largest mmap threshold (32 MB)
    ys = [jnp.sin(x * i) for i in range(8)]  # each read twice, so each is materialised
    return sum(y @ x[:, :8] + y.T @ x[:, :8] for y in ys)

x = jnp.ones((2048, 2048))
compiled = jax.jit(step).lower(x).compile()

def faults_per_call(calls=20):
    for _ in range(3):  # a call may allocate before the previous one has freed: two blocks in turn
        jax.block_until_ready(compiled(x))
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        jax.block_until_ready(compiled(x))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / calls

before = faults_per_call()
malloc.reuse_memory_for(compiled)
print(json.dumps({"temp": compiled.memory_analysis().temp_size_in_bytes, "before": before, "after": faults_per_call()}))
"""


def test_a_step_under_the_trim_threshold_reuses_its_temporaries_instead_of_faulting_them_in():
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_CALL], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["temp"] > 32 << 20
    assert result["before"] > 0.5 * result["temp"] / 4096  # a fresh mapping, faulted in page by page
    # steady state: none; a call that allocates before the previous one has freed adds a block, once
    assert result["after"] < 0.2 * result["before"]


def test_restart_with_huge_pages_keeps_the_arguments_and_sets_the_tunable_once():
    code = (
        "import os, sys; from jaxport import malloc; malloc.restart_with_huge_pages(); "
        "print(os.environ['GLIBC_TUNABLES'], sys.argv[1:])"
    )
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}
    env.pop("JAXPORT_NO_RESTART", None)
    out = subprocess.run([sys.executable, "-c", code, "a", "--b"], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.splitlines() == ["glibc.malloc.trim_threshold=1048576:glibc.malloc.hugetlb=1 ['a', '--b']"]


GPT_STEP_FAULTS = """
import json, resource, jax, numpy as np
from jaxport import malloc
from jaxport.gpt import train
malloc.keep_freed_memory()
cfg = {**train.DEFAULTS, **train.EXTRA, "device": "cpu", "init_from": "scratch", "gradient_accumulation_steps": 1,
       "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12, "dropout": 0.0}
trainer = train.Trainer(cfg, vocab_size=65)  # nanoGPT README's CPU config: ~44 MB of temporaries per step
X = np.random.default_rng(0).integers(0, 65, (1, 12, 64))
for i in range(3):
    jax.block_until_ready(trainer.step(X, X, 1e-3, i))
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(10):
    jax.block_until_ready(trainer.step(X, X, 1e-3, i))
temp = trainer._step.lower(*trainer.step_args(X, X, 1e-3, 0)).compile().memory_analysis().temp_size_in_bytes
print(json.dumps({"temp": temp, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 10}))
"""


def test_gpt_training_steps_reuse_their_temporaries():
    """Before the trainer sized the policy on its first step, each README-config step mapped its temporaries
    afresh and faulted them in (docs/performance.md, "Host memory for GPT's and Dream's training steps")."""
    out = subprocess.run([sys.executable, "-c", GPT_STEP_FAULTS], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["temp"] > 32 << 20  # above glibc's largest mmap threshold
    assert result["faults"] < 0.1 * result["temp"] / 4096
