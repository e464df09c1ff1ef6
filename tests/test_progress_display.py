"""Honest progress display: the progress bar shows the latest measured values, and `metrics.jsonl`
records null (never 0) for a metric nothing measured, e.g. a TRM step where no row halted."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxport.training.metrics_log import MetricsLog


def train_rows(run_dir) -> dict[int, dict]:
    logged = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in logged if "train/lm_loss" in r}


def test_postfix_keeps_the_last_measured_value_and_jsonl_records_null(tmp_path):
    log = MetricsLog(tmp_path, total_steps=4, shown=("lm_loss", "accuracy"))
    log.log(1, {"train/lm_loss": 2.5, "train/accuracy": None, "train/q_halt_accuracy": None})
    assert log.bar.n == 1 and log.bar.postfix == "lm_loss=2.5"  # no accuracy yet, not accuracy=0
    log.log(2, {"train/lm_loss": 2.25, "train/accuracy": 0.375, "train/q_halt_accuracy": 1.0})
    assert log.bar.postfix == "lm_loss=2.25, accuracy=0.375"  # q_halt_accuracy is not one of the shown
    log.log(3, {"train/lm_loss": 2.0, "train/accuracy": None, "train/q_halt_accuracy": None})
    assert log.bar.postfix == "lm_loss=2, accuracy=0.375"  # carried over from step 2
    log.log(3, {"eval/accuracy": 0.125})  # evaluation results go to the log, not into the training postfix
    assert log.bar.postfix == "lm_loss=2, accuracy=0.375"
    log.close()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/accuracy"] for r in logged[:3]] == [None, 0.375, None]
    assert "null" in (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert logged[3]["eval/accuracy"] == 0.125


def test_a_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "run", total_steps=2, enabled=False)  # processes other than 0
    log.log(1, {"train/loss": 1.0})
    assert log.close() is None and not (tmp_path / "run").exists()


TINY = [
    "arch.mlp_t=True",
    "arch.pos_encodings=none",
    "arch.hidden_size=32",
    "arch.num_heads=2",
    "arch.H_cycles=1",
    "arch.L_cycles=1",
    "arch.L_layers=1",
    "arch.puzzle_emb_len=1",
    "arch.forward_dtype=float32",
    "global_batch_size=16",
    "lr=1e-3",
    "lr_warmup_steps=2",
    "evaluators=[]",
    "epochs=20",
    "eval_interval=10",
    "seed=3",
]


@pytest.mark.slow
def test_trm_steps_where_no_row_halted_log_null(tmp_path):
    """halt_max_steps=4 without exploration: rows halt on every 4th step only (q_halt starts at -5), so steps
    1-3 and 5-7 measure no accuracy; upstream logs 0 there, jaxport null."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    jaxport = [sys.executable, "-m", "jaxport.cli", "trm"]
    data, run = tmp_path / "sudoku", tmp_path / "run"
    built = subprocess.run(
        [
            *jaxport,
            "build",
            "sudoku",
            "--generate",
            "--num-train",
            "32",
            "--num-test",
            "16",
            "--givens",
            "60",
            "--output-dir",
            str(data),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    shutil.rmtree(data / "test")  # no evaluation: training steps only
    trained = subprocess.run(
        [
            *jaxport,
            "train",
            *TINY,
            "arch.halt_max_steps=4",
            "arch.halt_exploration_prob=0",
            f"data_paths=[{data}]",
            f"checkpoint_path={run}",
            "max_steps=8",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    steps = train_rows(run)
    assert sorted(steps) == list(range(1, 9))
    halted_row_metrics = ("train/accuracy", "train/exact_accuracy", "train/q_halt_accuracy", "train/steps")
    for step, row in steps.items():
        assert row["train/lm_loss"] is not None and row["train/q_halt_loss"] is not None, step
        if step % 4:
            assert row["train/count"] == 0 and all(row[k] is None for k in halted_row_metrics), row
        else:  # every row halted: averages over the 16 rows
            assert row["train/count"] == 1 and row["train/steps"] == 4, row
            assert all(isinstance(row[k], float) for k in halted_row_metrics), row


@pytest.mark.slow
def test_a_run_imports_what_its_end_needs_on_a_thread_once(tmp_path):
    """`ImportAhead` (the training loop's): matplotlib's pyplot (the learning curves at close) and the modules named,
    loaded on one background thread, started once however often a loop calls it; a module that does not exist is
    left to fail where it is used."""
    probe = """
import sys, threading
from jaxport.training.loop import ImportAhead
assert "matplotlib.pyplot" not in sys.modules and "tabnanny" not in sys.modules
import_ahead = ImportAhead()
import_ahead("tabnanny", "no_such_module_here")
first = import_ahead.thread
import_ahead("wave")
first.join(60)
print(first is import_ahead.thread, first.daemon, "matplotlib.pyplot" in sys.modules, "tabnanny" in sys.modules,
      "wave" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True", "True", "False"]
