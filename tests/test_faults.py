"""Fault injection (a small case of tools/faults.py, which runs any number): real training runs of
TRM and GPT are killed with SIGKILL at a random moment and while an asynchronous checkpoint is being
written, restarted, and must resume from the newest intact checkpoint and then reproduce the
uninterrupted run's losses bit for bit. And a damaged checkpoint: the newest step of a real run with
its largest array file truncated is skipped in one line, again and again, with nothing else printed."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "tools" / "faults.py"
JAXPORT = [sys.executable, "-m", "jaxport.cli"]


@pytest.mark.parametrize("family", ["trm", "gpt"])
def test_kill_and_resume_reproduces_the_trajectory(family, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--families",
            family,
            "--kills",
            "2",
            "--modes",
            "during-save,random",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{family}: 2 kills, 2 resumed, 2 identical trajectories" in done.stdout
    assert '"killed_at": "during a save"' in done.stdout  # the save-in-flight case was really hit


# Restores a copy of a run's checkpoints `repeats` times, each with the newest step's largest array file
# truncated, as resuming the run does (`RunCheckpoints.restore` with the saved shapes and shardings).
RESTORE_DAMAGED = """
import gc, os, shutil, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxport.checkpoint.runs import RunCheckpoints

folder, copy, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
mesh = Mesh(np.asarray(jax.devices()).reshape(-1, 1, 1), ("data", "fsdp", "model"))
for _ in range(repeats):
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    with RunCheckpoints(copy) as checkpoints:
        newest = checkpoints.latest_step()
        files = [os.path.join(d, name) for d, _, names in os.walk(f"{copy}/{newest}/state") for name in names]
        largest = max(files, key=os.path.getsize)
        os.truncate(largest, os.path.getsize(largest) // 4)
        saved = checkpoints.manager.item_metadata(newest)["state"]
        spec = lambda m: NamedSharding(mesh, PartitionSpec(*m.sharding.partition_spec))
        checkpoints.restore(jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=spec(m)), saved))
    gc.collect()  # what orbax left in flight is collected here, not at exit
"""


def test_a_truncated_array_file_is_skipped_in_one_line_and_nothing_else_reaches_the_terminal(tmp_path):
    """orbax's other reads, still in flight when one array's read fails, used to print their own tracebacks now and
    then (asyncio's "_GatheringFuture exception was never retrieved", and their coroutines closed after orbax's event
    loop: "Exception: Encountered error while reading array index ..."). Four devices: more reads in flight."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    data, run = tmp_path / "sudoku", tmp_path / "run"
    build = ["trm", "build", "sudoku", "--generate", "--num-train", "64", "--num-test", "16", "--output-dir", str(data)]
    subprocess.run([*JAXPORT, *build], check=True, capture_output=True, env=env)
    arch = ["arch.mlp_t=True", "arch.pos_encodings=none", "arch.hidden_size=256", "arch.num_heads=4"]
    arch += ["arch.H_cycles=2", "arch.L_cycles=1", "arch.L_layers=1", "arch.halt_max_steps=3"]
    train = ["trm", "train", *arch, "global_batch_size=16", "evaluators=[]", f"data_paths=[{data}]"]
    train += [f"checkpoint_path={run}", "epochs=40", "eval_interval=20", "max_steps=4", "checkpoint_every_steps=2"]
    subprocess.run([*JAXPORT, *train], check=True, capture_output=True, env=env)
    repeats = 12
    folder, copy = run / "jaxport_checkpoints", tmp_path / "copy"
    done = subprocess.run(
        [sys.executable, "-c", RESTORE_DAMAGED, str(folder), str(copy), str(repeats)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    skipped = rf"checkpoint step 4 in {copy} cannot be read \(an array file is truncated \(array [^)]+\): .*\)"
    used = f"using step 2 instead, the newest intact checkpoint in {copy}"
    lines = done.stderr.splitlines()
    assert len(lines) == 2 * repeats, done.stderr[-3000:]
    for first, second in zip(lines[::2], lines[1::2]):
        assert re.fullmatch(skipped, first) and second == used, done.stderr[-3000:]
