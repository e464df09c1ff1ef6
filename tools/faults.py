"""Fault injection: `kill -9` real training runs (TRM, GPT and Dream) at random moments after the first
checkpoint exists, and while an asynchronous checkpoint is being written (as soon as orbax's
temporary step folder appears), restart them with the same command, and check that each run resumes
from the newest intact checkpoint and then follows an uninterrupted run's training metrics bit for bit.

    python tools/faults.py [--families trm,gpt,dream] [--kills 20] [--seed 0] [--workdir DIR]

One JSON line per kill, then per family: `N kills, N resumed, N identical trajectories`.
Exit status 0 only if every kill resumed and every trajectory is identical.
"""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TMP_SUFFIX = ".orbax-checkpoint-tmp"
JAXPORT = [sys.executable, "-m", "jaxport.cli"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

TRM_ARCH = [
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
    "seed=3",
]
GPT_FLAGS = [
    "--device=cpu",
    "--dataset=shakespeare_char",
    "--block_size=32",
    "--batch_size=4",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=32",
    "--dropout=0.1",
    "--eval_iters=2",
    "--log_interval=1",
    "--progress=False",
    "--learning_rate=1e-3",
    "--warmup_iters=2",
    "--always_save_checkpoint=True",
]
DREAM_FLAGS = [
    "--config=tiny",
    "--seq-len=32",
    "--response-len=16",
    "--batch-size=8",
    "--lr=3e-3",
    "--warmup-steps=2",
    "--samples=0",
    "--seed=0",
]
# the training problems and tokenizer Dream's runs read (as tests/test_dream_train.py makes them)
DREAM_DATA = """
import sys
from pathlib import Path
from jaxport.dream import tasks
train, _ = tasks.train_and_test(600, 8, seed=3)
tasks.write_problems(train, Path(sys.argv[1]) / "train.jsonl")
"""


class Family:
    """How to start, restart and read one family's training run."""

    def __init__(self, name: str, data: Path, steps: int, every: int):
        self.name, self.data, self.steps, self.every = name, data, steps, every

    def command(self, run: Path, restart: bool) -> list[str]:
        if self.name == "trm":  # TRM and Dream runs resume by themselves
            return [
                *JAXPORT,
                "trm",
                "train",
                *TRM_ARCH,
                f"data_paths=[{self.data}]",
                f"checkpoint_path={run}",
                "epochs=40",
                "eval_interval=20",
                f"max_steps={self.steps}",
                f"checkpoint_every_steps={self.every}",
                "keep_last=2",
            ]
        if self.name == "dream":
            return [
                *JAXPORT,
                "dream",
                "train",
                *DREAM_FLAGS,
                f"--data={self.data / 'train.jsonl'}",
                f"--tokenizer={self.data / 'tokenizer'}",
                f"--out-dir={run}",
                f"--steps={self.steps}",
                f"--save-every={self.every}",
                "--keep-last=2",
            ]
        return [
            *JAXPORT,
            "gpt",
            "train",
            *GPT_FLAGS,
            f"--data_dir={self.data}",
            f"--out_dir={run}",
            f"--max_iters={self.steps}",
            f"--eval_interval={self.steps}",
            f"--lr_decay_iters={self.steps}",
            f"--checkpoint_interval={self.every}",
            "--keep_last=2",
            f"--init_from={'resume' if restart else 'scratch'}",
        ]

    def trajectory(self, run: Path) -> dict[int, tuple]:
        """The last logged training metrics of every step (a restart logs the steps after its checkpoint again):
        the loss, and for TRM also its halting loss, accuracy, recursion steps and example count."""
        keys = {
            "trm": (("train/lm_loss", "train/q_halt_loss", "train/accuracy", "train/steps", "train/count"), "step"),
            "dream": (("train/loss",), "step"),
            "gpt": (("loss",), "iter"),
        }
        names, step_key = keys[self.name]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r[step_key]: tuple(r[name] for name in names) for r in rows if names[0] in r}

    def resumed_from(self, output: str) -> int | None:
        if self.name == "trm":
            found = re.search(r"resumed from step (\d+)", output)
            return int(found.group(1)) if found else None
        if self.name == "dream":
            found = re.search(r"resumed at step (\d+)", output)
            return int(found.group(1)) if found else None
        start = output.find("Resuming training from")
        found = re.search(r"^iter (\d+):", output[start:], re.MULTILINE) if start >= 0 else None
        return int(found.group(1)) if found else None


def complete_steps(run: Path) -> list[int]:
    folder = run / "jaxport_checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists())


def saving_now(run: Path) -> bool:
    folder = run / "jaxport_checkpoints"
    return folder.is_dir() and any(TMP_SUFFIX in p.name for p in folder.iterdir())


def kill_run(family: Family, run: Path, mode: str, rng: random.Random, timeout: float = 600) -> dict:
    """Start a run, kill -9 it as `mode` says, and report where it stood."""
    proc = subprocess.Popen(
        family.command(run, restart=False), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV
    )
    deadline = time.time() + timeout
    while not complete_steps(run) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    killed_at, how = None, mode
    if mode == "during-save":
        while proc.poll() is None and time.time() < deadline and not saving_now(run):
            time.sleep(0.0005)
        if proc.poll() is None and saving_now(run):
            proc.kill()
            killed_at = "during a save"
        else:
            how = "random (the run ended before a save was caught)"
    if killed_at is None and proc.poll() is None:
        time.sleep(rng.uniform(0, 3))
        proc.kill()
        killed_at = "at a random moment"
    proc.wait()
    return {
        "mode": how,
        "killed": killed_at is not None,
        "killed_at": killed_at,
        "intact_steps": complete_steps(run),
        "interrupted_save": saving_now(run),
    }


def run_to_end(family: Family, run: Path, restart: bool) -> tuple[int, str]:
    done = subprocess.run(family.command(run, restart), capture_output=True, text=True, env=ENV, timeout=1200)
    return done.returncode, done.stdout + done.stderr


def prepare(family: str, root: Path) -> Path:
    if family == "trm":
        data = root / "sudoku"
        command = [
            *JAXPORT,
            "trm",
            "build",
            "sudoku",
            "--generate",
            "--num-train",
            "64",
            "--num-test",
            "16",
            "--givens",
            "60",
            "--output-dir",
            str(data),
        ]
    elif family == "dream":
        data = root / "dream"
        data.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", DREAM_DATA, str(data)], check=True, capture_output=True, env=ENV)
        command = [
            *JAXPORT,
            "dream",
            "tokenizer",
            "--input",
            str(data / "train.jsonl"),
            "--output",
            str(data / "tokenizer"),
            "--vocab-size",
            "400",
        ]
    else:
        data = root / "data"
        command = [
            *JAXPORT,
            "gpt",
            "prepare",
            "shakespeare_char",
            "--input",
            str(REPO / "tests" / "fixtures" / "gpt" / "tinyshakespeare" / "input.txt"),
            "--out_dir",
            str(data / "shakespeare_char"),
        ]
    subprocess.run(command, check=True, capture_output=True, env=ENV)
    return data


def run_family(name: str, kills: int, modes: list[str], root: Path, rng: random.Random, steps: int, every: int) -> dict:
    family = Family(name, prepare(name, root), steps, every)
    reference_run = root / f"{name}-reference"
    code, output = run_to_end(family, reference_run, restart=False)
    if code:
        raise SystemExit(f"the uninterrupted {name} run failed:\n{output[-3000:]}")
    reference = family.trajectory(reference_run)
    tally = {"kills": 0, "resumed": 0, "identical": 0}
    for i in range(kills):
        run = root / f"{name}-kill{i}"
        report = {"family": name, "case": i, **kill_run(family, run, modes[i % len(modes)], rng)}
        if not report["killed"]:
            print(json.dumps({**report, "note": "the run finished before it could be killed"}), flush=True)
            continue
        tally["kills"] += 1
        code, output = run_to_end(family, run, restart=True)
        newest = report["intact_steps"][-1] if report["intact_steps"] else None
        report["resumed_from"] = family.resumed_from(output)
        report["resumed"] = code == 0 and report["resumed_from"] == newest
        trajectory = family.trajectory(run) if code == 0 else {}
        report["identical"] = code == 0 and trajectory == reference
        if not report["identical"] and code == 0:
            report["first_difference"] = next((s for s in sorted(reference) if trajectory.get(s) != reference[s]), None)
        if code:
            report["error"] = output[-2000:]
        tally["resumed"] += report["resumed"]
        tally["identical"] += report["identical"]
        print(json.dumps(report), flush=True)
        shutil.rmtree(run, ignore_errors=True)
    print(
        f"{name}: {tally['kills']} kills, {tally['resumed']} resumed, {tally['identical']} identical trajectories",
        flush=True,
    )
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="trm,gpt,dream")
    parser.add_argument("--kills", type=int, default=20, help="kill points per family")
    parser.add_argument("--modes", default="random,during-save", help="kill modes, taken in turn")
    parser.add_argument("--steps", type=int, default=24, help="training steps per run")
    parser.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="jaxport_faults_"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    ok = True
    try:
        for name in args.families.split(","):
            tally = run_family(name, args.kills, args.modes.split(","), root, rng, args.steps, args.every)
            ok &= tally["kills"] == tally["resumed"] == tally["identical"] == args.kills
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
