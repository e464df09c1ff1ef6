"""TRM training end to end: resume after kill -9 follows the uninterrupted trajectory, 8 devices give
the losses of 1, two processes train/checkpoint/resume, and bad input stops with one clear message."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY = [
    "arch.mlp_t=True",
    "arch.pos_encodings=none",
    "arch.hidden_size=32",
    "arch.num_heads=2",
    "arch.H_cycles=2",
    "arch.L_cycles=1",
    "arch.L_layers=1",
    "arch.halt_max_steps=3",
    "arch.puzzle_emb_len=1",
    "arch.forward_dtype=float32",
    "arch.halt_exploration_prob=0.5",
    "global_batch_size=16",
    "lr=1e-3",
    "lr_warmup_steps=2",
    "evaluators=[]",
    "epochs=20",
    "eval_interval=10",
    "seed=3",
]


def jaxport(*args, env=None, **kwargs):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "jaxport.cli", *args], env=env, capture_output=True, text=True, **kwargs
    )


@pytest.fixture(scope="module")
def sudoku(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "sudoku"
    r = jaxport(
        "trm",
        "build",
        "sudoku",
        "--generate",
        "--num-train",
        "48",
        "--num-test",
        "16",
        "--givens",
        "60",
        "--output-dir",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    return out


def metrics(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/lm_loss" in r}


def approx_or_none(expected, **tolerance):
    """pytest.approx for a metric that is None on steps where nothing was measured (no row halted)."""
    return None if expected is None else pytest.approx(expected, **tolerance)


def train_args(sudoku, run, *extra):
    return ["trm", "train", *TINY, f"data_paths=[{sudoku}]", f"checkpoint_path={run}", *extra]


def test_eval_and_load_checkpoint_of_a_saved_run(sudoku, tmp_path):
    """A saved run's evaluation and weights (resuming after SIGKILL: tests/test_faults.py, which kills TRM runs at
    random and during a save and compares every step's metrics bit for bit)."""
    straight = tmp_path / "straight"
    r = jaxport(*train_args(sudoku, straight, "max_steps=24"))
    assert r.returncode == 0, r.stderr[-3000:]
    # `jaxport trm eval` on the saved run reproduces the run's final evaluation.
    r = jaxport("trm", "eval", "--run", str(straight))
    assert r.returncode == 0, r.stderr[-3000:]
    final_eval = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()][-1]
    for key, value in json.loads(r.stdout[r.stdout.index("{") :]).items():
        assert value == pytest.approx(final_eval[f"eval/{key}"], rel=1e-6), key
    # load_checkpoint= a jaxport run folder takes its weights (lr 0 keeps them: same evaluation).
    finetune = tmp_path / "finetune"
    r = jaxport(*train_args(sudoku, finetune, f"load_checkpoint={straight}", "lr=0", "puzzle_emb_lr=0", "max_steps=1"))
    assert r.returncode == 0, r.stderr[-3000:]
    finetune_eval = [json.loads(line) for line in (finetune / "metrics.jsonl").read_text().splitlines()][-1]
    for key, value in final_eval.items():
        if key.startswith("eval/"):
            assert finetune_eval[key] == pytest.approx(value, rel=1e-6), key


def test_eight_devices_give_the_losses_of_one(sudoku, tmp_path):
    runs = {}
    for n in (1, 8):
        run = tmp_path / f"dev{n}"
        r = jaxport(
            *train_args(sudoku, run, "max_steps=4", "export_upstream=true"),
            env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[n] = metrics(run)
    # export_upstream=true also wrote the weights in upstream's format, which load back.
    from jaxport import trm

    exported = trm.load_upstream_checkpoint(tmp_path / "dev8" / "step_4", tmp_path / "dev8" / "all_config.yaml")
    assert exported.config.hidden_size == 32 and exported.config.mlp_t
    for step in range(1, 5):
        for key in ("train/lm_loss", "train/q_halt_loss", "train/accuracy"):
            assert runs[8][step][key] == approx_or_none(runs[1][step][key], rel=2e-5, abs=1e-6), (step, key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(args, timeout=600):
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxport.cli",
                *args,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def test_two_processes_train_checkpoint_and_resume(sudoku, tmp_path):
    run = tmp_path / "multi"
    two_processes(train_args(sudoku, run, "max_steps=3"))
    assert (run / "jaxport_checkpoints" / "3").is_dir()
    outs = two_processes(train_args(sudoku, run, "max_steps=6"))
    assert "resumed from step 3" in outs[0][0] + outs[0][1]
    single = tmp_path / "single"
    r = jaxport(*train_args(sudoku, single, "max_steps=6"))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = metrics(single), metrics(run)
    for step in range(1, 7):
        assert b[step]["train/lm_loss"] == pytest.approx(a[step]["train/lm_loss"], rel=2e-5), step


def test_missing_data_path(tmp_path):
    r = jaxport("trm", "train", *TINY, f"data_paths=[{tmp_path / 'nope'}]", f"checkpoint_path={tmp_path / 'r'}")
    assert r.returncode == 1 and "data path not found" in r.stderr and "nope" in r.stderr
    assert "Traceback" not in r.stderr


def test_folder_that_is_not_a_dataset(tmp_path):
    (tmp_path / "notdata").mkdir()
    r = jaxport("trm", "train", *TINY, f"data_paths=[{tmp_path / 'notdata'}]", f"checkpoint_path={tmp_path / 'r'}")
    assert r.returncode == 1 and "notdata" in r.stderr and "Traceback" not in r.stderr


def test_unknown_config_key_lists_close_matches(sudoku, tmp_path):
    r = jaxport(*train_args(sudoku, tmp_path / "r", "global_bach_size=8"))
    assert r.returncode == 1 and "unknown config key 'global_bach_size'" in r.stderr
    assert "did you mean global_batch_size" in r.stderr and "Traceback" not in r.stderr


def test_checkpoint_from_another_architecture(sudoku, tmp_path):
    upstream = Path(__file__).parent / "fixtures" / "trm" / "att_rope_f32" / "step_0"
    r = jaxport(*train_args(sudoku, tmp_path / "r", f"load_checkpoint={upstream}"))
    assert r.returncode == 1 and "does not fit the config" in r.stderr and "step_0" in r.stderr
    assert "Traceback" not in r.stderr


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(sudoku, tmp_path):
    run = tmp_path / "nan"
    # Adam-atan2 steps are bounded by lr * pi / 2: step 1 leaves huge but finite weights, step 2 overflows.
    r = jaxport(*train_args(sudoku, run, "lr=1e30", "lr_warmup_steps=0", "checkpoint_every_steps=1", "max_steps=5"))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "loss is nan at step 2" in r.stderr and "last good checkpoint is step 1" in r.stderr
    assert {p.name for p in (run / "jaxport_checkpoints").iterdir() if p.name.isdigit()} == {"1"}


def test_tensorboard_logs_the_run_metrics(sudoku, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = tmp_path / "tb_run"
    r = jaxport(*train_args(sudoku, run, "max_steps=2", "loggers=[jsonl,tensorboard]"))
    assert r.returncode == 0, r.stderr[-3000:]
    events = event_accumulator.EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = metrics(run)
    for name in ("train/lm_loss", "train/lr"):
        assert [e.step for e in events.Scalars(name)] == sorted(logged)
        assert events.Scalars(name)[-1].value == pytest.approx(logged[max(logged)][name], rel=1e-6)


def test_wandb_offline_needs_no_account(sudoku, tmp_path):
    pytest.importorskip("wandb")  # in the test extra; optional for users
    run = tmp_path / "wandb_run"
    r = jaxport(
        *train_args(sudoku, run, "max_steps=2", "loggers=[jsonl,wandb]"),
        env={"WANDB_MODE": "offline", "WANDB_API_KEY": "", "HOME": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    offline_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and any(offline_runs[0].glob("*.wandb")), offline_runs
    assert max(metrics(run)) == 2
