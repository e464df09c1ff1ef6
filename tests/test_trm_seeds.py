"""bench/trm_seeds.py at a tiny size (jaxport's side): evaluations land exactly on the asked steps, every step's
curve is kept, a finished seed is kept and skipped when run again, and a kept seed from other settings is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "trm_seeds.py"
TINY = ["--num-train", "64", "--num-aug", "1", "--num-test", "32", "--steps", "8", "--eval-every", "4"]


def run_seeds(out: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--sides", "jaxport", "--jobs", "1", *TINY, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def test_tiny_run_evaluates_at_the_steps_and_resumes(tmp_path):
    proc = run_seeds(tmp_path, "--points", "4,8", "--seed-list", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary-head.json").read_text())
    (run,) = summary["runs"]["jaxport-head"]
    assert run["seed"] == 3 and "seed=3" in run["overrides"]
    # 64 groups, batch 32: an evaluation every 4 steps is eval_interval=2 epochs, 8 steps are 4 epochs
    assert "epochs=4" in run["overrides"] and "eval_interval=2" in run["overrides"]
    assert [e["step"] for e in run["evals"]] == [4, 8]
    assert all(0 <= e["exact_accuracy"] <= 1 for e in run["evals"])
    assert run["train"]["step"] == list(range(1, 9)) and len(run["train"]["lm_loss"]) == 8
    table = summary["summary"]["exact_accuracy"]
    assert table["8"]["jaxport-head"]["by_seed"] == {"3": run["evals"][1]["exact_accuracy"]}
    assert "| 8 |" in summary["summary_markdown"]

    kept = tmp_path / "runs" / "jaxport-head" / "seed3.json"
    before = kept.read_text()
    again = run_seeds(tmp_path, "--points", "4,8", "--seed-list", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 runs to do" in again.stderr and kept.read_text() == before

    other = run_seeds(tmp_path, "--points", "4", "--seed-list", "3", "--steps", "4")
    assert other.returncode != 0 and "seed3.json was run with other settings" in other.stderr
