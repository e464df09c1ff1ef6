"""Fault injection (a small case of tools/faults.py, which runs any number): real training runs of
TRM and GPT are killed with SIGKILL at a random moment and while an asynchronous checkpoint is being
written, restarted, and must resume from the newest intact checkpoint and then reproduce the
uninterrupted run's losses bit for bit."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "tools" / "faults.py"


@pytest.mark.slow
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
