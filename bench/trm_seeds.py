"""Training outcomes over seeds: the TRM demo-size run (bench/compare.py's TRM_LOOP overrides: mlp_t, hidden 64,
batch 32, lr 1e-3) trained by jaxport and by the original on one generated Sudoku set, several seeds a side, exact
accuracy on the held-out test puzzles evaluated exactly at the chosen steps. Writes every curve and prints mean ±
standard error per side and point.

    eval "$(../shared/originals/setup)"     # the originals' Python (else found beside the repository)
    python bench/trm_seeds.py                    # both sides, seeds 0-9, 1000 steps, evaluations at 250/500/750/1000
    python bench/trm_seeds.py --sides jaxport --label de44d5b --jaxport-src ../bisect-de44d5b/src  # another commit

Each finished run is kept in `OUT/runs/<side>/seed<S>.json` (`<side>` is `original` or `jaxport-<label>`);
running again skips it unless `--redo`. `OUT/summary-<label>.json` holds every run and the table.

Evaluations land exactly on the steps: the data set has `--num-train` puzzle groups and a step takes
`global_batch_size` of them, so `eval_interval = eval_every * batch / groups` epochs (an integer, checked) and
`epochs = eval_interval * steps / eval_every`; both sides evaluate after every such iteration, at every multiple
of `--eval-every`, and the LR schedule's total is `--steps`. A seed sets the same things on both sides: the
weights' initialisation, the halting exploration's draws and the data order (the batches are the same for one
seed on both sides; the random numbers behind initialisation and exploration come from different generators).

Every run is niced and pinned to its own core(s) with `taskset` (`--threads` cores each, `--jobs` at a time):
torch takes its thread count from OMP_NUM_THREADS, XLA:CPU from the cores it may use (its results follow the core
count, not `--xla_cpu_multi_thread_eigen`). One seed gives the same bits run after run at one core count; at
another its sums run in another order (docs/performance.md, "Training outcomes over seeds").

    python bench/trm_seeds.py --out /tmp/smoke --num-train 64 --num-aug 1 --num-test 32 --steps 8 --eval-every 4 \\
        --points 4,8 --seeds 2                                  # a smoke run of the machinery (minutes)
"""

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import queue
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare import TRM_LOOP
from host import cpu_description

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SCHEDULE_KEYS = ("epochs", "eval_interval")
POINT_METRIC = "exact_accuracy"  # the decision; per-cell accuracy and loss are less noisy diagnostics
SUMMARY_METRICS = (POINT_METRIC, "accuracy", "lm_loss")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 on each side")
    p.add_argument("--seed-list", help="comma-separated seeds instead of --seeds")
    p.add_argument("--steps", type=int, default=1000, help="training steps (the LR schedule's total)")
    p.add_argument("--eval-every", type=int, default=250, help="steps between evaluations")
    p.add_argument("--points", default="500,750,1000", help="evaluation steps the summary compares")
    p.add_argument("--sides", default="jaxport,original", help="jaxport, original or both")
    p.add_argument("--label", default="head", help="name of the jaxport code under test in file names")
    p.add_argument("--jaxport-src", help="run jaxport from this source folder (PYTHONPATH), e.g. a bisect worktree")
    p.add_argument("--out", default="runs/trm_seeds", help="folder for data, runs and summaries")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="cores (and threads) per run")
    p.add_argument("--cores", help="comma-separated cores the runs are pinned to (default: all this process may use)")
    p.add_argument("--no-pin", action="store_true", help="do not pin runs to cores (thread limits by env only)")
    p.add_argument("--redo", action="store_true", help="run again the seeds that have a result")
    p.add_argument("--num-train", type=int, default=1000, help="training puzzles (groups) of the generated set")
    p.add_argument("--num-aug", type=int, default=8, help="shuffled copies per training puzzle")
    p.add_argument("--num-test", type=int, default=256, help="held-out test puzzles")
    p.add_argument("--givens", type=int, default=50)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    return p.parse_args(argv)


# ----- set-up


def originals_python() -> dict:
    """REF_PY and REF_TRM: from the environment, else from the originals' setup script beside the repository."""
    if os.environ.get("REF_PY") and os.environ.get("REF_TRM"):
        return {k: os.environ[k] for k in ("REF_PY", "REF_TRM")}
    for shared in (REPO / "shared", REPO.parent / "shared", REPO.parent.parent / "shared"):
        setup = shared / "originals" / "setup"
        if setup.is_file():
            text = subprocess.run([str(setup)], check=True, capture_output=True, text=True).stdout
            env = dict(
                pair.split("=", 1)
                for line in text.splitlines()
                if line.startswith("export ")
                for pair in line[7:].split()
            )
            return {k: env[k] for k in ("REF_PY", "REF_TRM")}
    raise SystemExit('the originals\' Python is not set: run  eval "$(../shared/originals/setup)"  first')


def originals_harness(ref: dict) -> Path:
    harness = Path(ref["REF_TRM"]).resolve().parent / "bench" / "trm" / "run_training.py"
    if not harness.is_file():
        raise SystemExit(f"the original's training harness is not at {harness}")
    return harness


def jaxport_env(src: str | None) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = str(Path(src).resolve()) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def jaxport_code(src: str | None) -> dict:
    """Which jaxport the runs import (checked by importing it as the runs do) and its commit."""
    env = jaxport_env(src)
    where = subprocess.run(
        [sys.executable, "-c", "import jaxport; print(jaxport.__file__)"], env=env, capture_output=True, text=True
    )
    if where.returncode:
        raise SystemExit(f"jaxport does not import{' from ' + src if src else ''}:\n{where.stderr[-2000:]}")
    package = Path(where.stdout.strip()).resolve().parent
    if src and Path(src).resolve() not in package.parents:
        raise SystemExit(f"--jaxport-src {src}: the runs would import jaxport from {package} instead")

    def git(*args):
        out = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None

    return {
        "package": str(package),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", ".")),
        "source_sha256_16": tree_digest(package, "*.py"),
    }


def same_code(kept: dict, now: dict) -> bool:
    """The kept result ran the jaxport source under test now (results without a source hash: same clean commit)."""
    if "source_sha256_16" in kept:
        return kept["source_sha256_16"] == now["source_sha256_16"]
    return kept["commit"] == now["commit"] and not kept["dirty"] and not now["dirty"]


def build_data(args, out: Path) -> Path:
    name = (
        f"sudoku-gen-{args.givens}givens-{args.num_train}x{args.num_aug + 1}-test{args.num_test}-seed{args.data_seed}"
    )
    data = out / "data" / name / "data"  # the original's harness reads PARENT/data/{train,test}
    if not (data / "test" / "dataset.json").exists():
        shutil.rmtree(data, ignore_errors=True)
        command = [
            sys.executable,
            "-m",
            "jaxport.cli",
            "trm",
            "build",
            "sudoku",
            "--generate",
            "--num-train",
            str(args.num_train),
            "--num-test",
            str(args.num_test),
            "--givens",
            str(args.givens),
            "--num-aug",
            str(args.num_aug),
            "--seed",
            str(args.data_seed),
            "--output-dir",
            str(data),
        ]
        subprocess.run(command, check=True, env=jaxport_env(None), stdout=subprocess.DEVNULL)
    return data


def tree_digest(folder: Path, pattern: str = "*") -> str:
    """A short hash of the files under `folder` (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob(pattern)):
        if path.is_file():
            digest.update(str(path.relative_to(folder)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def schedule(args, data: Path) -> list[str]:
    """The `epochs` and `eval_interval` overrides that put evaluations exactly at multiples of --eval-every."""
    meta = json.loads((data / "train" / "dataset.json").read_text())
    batch = int(next(o.split("=", 1)[1] for o in TRM_LOOP if o.startswith("global_batch_size=")))
    groups, examples = meta["total_groups"], meta["mean_puzzle_examples"]
    if examples != 1:
        raise SystemExit(f"{data}: puzzles of {examples} examples each; this schedule assumes 1 (Sudoku)")
    per_iter, rest = divmod(args.eval_every * batch, groups)
    if rest or args.steps % args.eval_every:
        raise SystemExit(
            f"--eval-every {args.eval_every} x batch {batch} must be a whole number of epochs of {groups} groups, "
            f"and --steps {args.steps} a multiple of it"
        )
    return [f"epochs={per_iter * args.steps // args.eval_every}", f"eval_interval={per_iter}"]


# ----- one run


def pinned(command: list[str], cores: list[int] | None) -> list[str]:
    prefix = ["nice", "-n", "10"]
    if cores is not None:
        prefix += ["taskset", "-c", ",".join(map(str, cores))]
    return prefix + command


def thread_env(env: dict, threads: int) -> dict:
    return dict(env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))


def run_jaxport(seed, overrides, data, work, cores, args) -> dict:
    run_dir = work / "run"
    command = [
        sys.executable,
        "-m",
        "jaxport.cli",
        "trm",
        "train",
        *overrides,
        f"seed={seed}",
        f"data_paths=[{data}]",
        "evaluators=[]",
        f"checkpoint_path={run_dir}",
        "+project_name=trm_seeds",
        f"+run_name=seed{seed}",
        "checkpoint_every_eval=false",
    ]
    run_logged(pinned(command, cores), thread_env(jaxport_env(args.jaxport_src), args.threads), work, args.timeout)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [
        {"step": r["step"], **{k[len("eval/all/") :]: v for k, v in r.items() if k.startswith("eval/all/")}}
        for r in rows
        if any(k.startswith("eval/") for k in r)
    ]
    train = {}
    for r in (r for r in rows if "train/lm_loss" in r):
        for k, v in r.items():
            if k.startswith("train/") and k not in ("train/count", "train/lr"):
                train.setdefault(k[len("train/") :], []).append(v)
    train["step"] = [r["step"] for r in rows if "train/lm_loss" in r]
    return {"evals": evals, "train": train}


def run_original(seed, overrides, data, work, cores, args, ref) -> dict:
    out = work / "original.json"
    command = [
        ref["REF_PY"],
        str(originals_harness(ref)),
        "--data",
        str(data.parent),
        "--out",
        str(out),
        "--label",
        f"seed{seed}",
        "--train-window",
        "1",
        "--",
        *overrides,
        f"seed={seed}",
    ]
    run_logged(pinned(command, cores), thread_env(dict(os.environ, **ref), args.threads), work, args.timeout)
    result = json.loads(out.read_text())
    evals = [{k: v for k, v in e.items() if k not in ("wall_s", "eval_s")} for e in result["evals"]]
    train = {}
    for row in result["train_curve"]:
        for k, v in row.items():
            if k not in ("wall_s", "halted_count", "lr", "step_last"):
                train.setdefault(k, []).append(v)
    train["step"] = [row["step_last"] for row in result["train_curve"]]
    return {"evals": evals, "train": train, "upstream": result["upstream"], "machine": result["machine"]}


def run_logged(command, env, work: Path, timeout: float) -> None:
    with open(work / "stdout.log", "w") as stdout, open(work / "stderr.log", "w") as stderr:
        proc = subprocess.run(command, env=env, stdout=stdout, stderr=stderr, timeout=timeout)
    if proc.returncode:
        tail = (work / "stderr.log").read_text()[-3000:]
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(command)}\n{tail}")


def one_run(side, seed, args, context, cores_pool) -> dict:
    path = context["runs"][side] / f"seed{seed}.json"
    work = context["out"] / "work" / f"{path.parent.name}-seed{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cores = cores_pool.get()
    try:
        start = time.time()
        overrides = context["overrides"]
        if side == "original":
            curves = run_original(seed, overrides, context["data"], work, cores, args, context["ref"])
        else:
            curves = run_jaxport(seed, overrides, context["data"], work, cores, args)
        wall = time.time() - start
    finally:
        cores_pool.put(cores)
    result = {
        "side": side,
        "seed": seed,
        "code": context["code"][side],
        "overrides": overrides + [f"seed={seed}"],
        "data": context["data_id"],
        "threads": args.threads,
        "cores": cores,
        "wall_s": round(wall, 1),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        **curves,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    tmp.replace(path)  # a result file is always complete
    shutil.rmtree(work, ignore_errors=True)
    return result


# ----- summary


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return mean, se


def summarize(results: dict[str, list[dict]], points: list[int], jaxport_side: str, metric: str) -> dict:
    """Per point: each side's mean and standard error over seeds of the test set's `metric`, and jaxport's difference
    with its standard error (the two sides' errors combined)."""
    table = {}
    for point in points:
        row = {}
        for side, runs in results.items():
            values = {r["seed"]: e[metric] for r in runs for e in r["evals"] if e["step"] == point}
            if values:
                mean, se = mean_se(list(values.values()))
                row[side] = {"mean": mean, "se": se, "n": len(values), "by_seed": values}
        if jaxport_side in row and "original" in row:
            ours, theirs = row[jaxport_side], row["original"]
            diff = ours["mean"] - theirs["mean"]
            se_diff = math.hypot(ours["se"], theirs["se"])
            row["difference"] = {
                "jaxport_minus_original": diff,
                "se_of_difference": se_diff,
                "z": diff / se_diff if se_diff > 0 else math.nan,
                "within_2se_of_original_mean": abs(diff) <= 2 * theirs["se"],
                "within_2se_of_difference": abs(diff) <= 2 * se_diff,
            }
        table[point] = row
    return table


def markdown(table: dict, jaxport_side: str, metric: str) -> str:
    lines = [
        f"| test {metric} at step | original mean ± SE (n) | {jaxport_side} mean ± SE (n) | difference ± SE | z | "
        "within 2 SE of the original's mean |",
        "|---|---|---|---|---|---|",
    ]

    def cell(entry):
        return f"{entry['mean']:.4f} ± {entry['se']:.4f} ({entry['n']})" if entry else "—"

    for point, row in table.items():
        d = row.get("difference")
        lines.append(
            f"| {point} | {cell(row.get('original'))} | {cell(row.get(jaxport_side))} | "
            + (
                f"{d['jaxport_minus_original']:+.4f} ± {d['se_of_difference']:.4f} | {d['z']:+.2f} | "
                f"{'yes' if d['within_2se_of_original_mean'] else 'no'} |"
                if d
                else "— | — | — |"
            )
        )
    return "\n".join(lines)


def per_seed_markdown(results: dict[str, list[dict]], steps: list[int]) -> str:
    lines = ["| side | seed | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|---|" + "---|" * len(steps)]
    for side, runs in results.items():
        for r in sorted(runs, key=lambda r: r["seed"]):
            by_step = {e["step"]: e[POINT_METRIC] for e in r["evals"]}
            lines.append(
                f"| {side} | {r['seed']} | " + " | ".join(f"{by_step.get(s, math.nan):.3f}" for s in steps) + " |"
            )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    seeds = [int(s) for s in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
    points = [int(p) for p in args.points.split(",")]
    sides = [s.strip() for s in args.sides.split(",")]
    if set(sides) - {"jaxport", "original"}:
        raise SystemExit(f"--sides {args.sides}: choose from jaxport, original")
    if any(p % args.eval_every or p > args.steps for p in points):
        raise SystemExit(f"--points {args.points} must be multiples of --eval-every {args.eval_every} up to --steps")
    out = Path(args.out).resolve()
    jaxport_side = f"jaxport-{args.label}"
    runs = {"original": out / "runs" / "original", "jaxport": out / "runs" / jaxport_side}
    for folder in runs.values():
        folder.mkdir(parents=True, exist_ok=True)
    data = build_data(args, out)
    context = {
        "out": out,
        "runs": runs,
        "data": data,
        "data_id": {"path": str(data), "sha256_16": tree_digest(data)},
        "overrides": [o for o in TRM_LOOP if o.split("=", 1)[0] not in SCHEDULE_KEYS] + schedule(args, data),
        "code": {},
    }
    if "original" in sides:
        context["ref"] = originals_python()
        context["code"]["original"] = {"harness": str(originals_harness(context["ref"]))}
    if "jaxport" in sides:
        context["code"]["jaxport"] = jaxport_code(args.jaxport_src)
        print(f"jaxport under test: {context['code']['jaxport']}", file=sys.stderr)

    todo = []
    for seed in seeds:
        for side in sides:
            done = runs[side] / f"seed{seed}.json"
            if done.exists() and not args.redo:
                kept = json.loads(done.read_text())
                if (
                    kept["overrides"] != context["overrides"] + [f"seed={seed}"]
                    or kept["data"]["sha256_16"] != context["data_id"]["sha256_16"]
                ):
                    raise SystemExit(f"{done} was run with other settings or data: --redo, or another --out")
                if side == "jaxport" and not same_code(kept["code"], context["code"]["jaxport"]):
                    raise SystemExit(
                        f"{done} was run with other jaxport source ({kept['code']}): another --label for this code, "
                        "or --redo"
                    )
                continue
            todo.append((side, seed))
    cpus = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    cores_pool = queue.Queue()
    for job in range(args.jobs):
        if args.no_pin:
            cores_pool.put(None)
        else:
            cores_pool.put([cpus[(job * args.threads + i) % len(cpus)] for i in range(args.threads)])
    print(f"{len(todo)} runs to do ({args.jobs} at a time): {todo}", file=sys.stderr)
    failures = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(one_run, side, seed, args, context, cores_pool): (side, seed) for side, seed in todo}
        for future in concurrent.futures.as_completed(futures):
            side, seed = futures[future]
            try:
                r = future.result()
                accs = ", ".join(f"{e['step']}: {e[POINT_METRIC]:.3f}" for e in r["evals"])
                print(f"{side} seed {seed}: {r['wall_s']} s; exact accuracy {accs}", file=sys.stderr)
            except Exception as err:  # the other runs go on; the summary covers what finished
                failures.append((side, seed))
                print(f"{side} seed {seed} failed: {err}", file=sys.stderr)

    results = {}
    for side in sides:
        name = "original" if side == "original" else jaxport_side
        results[name] = [
            json.loads((runs[side] / f"seed{s}.json").read_text())
            for s in seeds
            if (runs[side] / f"seed{s}.json").exists()
        ]
    tables = {m: summarize(results, points, jaxport_side, m) for m in SUMMARY_METRICS}
    all_steps = list(range(args.eval_every, args.steps + 1, args.eval_every))
    summary = {
        "benchmark": "trm_seeds",
        "label": args.label,
        "seeds": seeds,
        "points": points,
        "metrics": [f"all/{m} on the test split" for m in SUMMARY_METRICS],
        "overrides": context["overrides"],
        "data": context["data_id"],
        "code": context["code"],
        "machine": cpu_description(),
        "threads_per_run": args.threads,
        "summary": {m: {str(k): v for k, v in t.items()} for m, t in tables.items()},
        "summary_markdown": "\n\n".join(markdown(t, jaxport_side, m) for m, t in tables.items()),
        "per_seed_markdown": per_seed_markdown(results, all_steps),
        "failures": failures,
        "runs": results,
    }
    path = out / f"summary-{args.label}.json"
    path.write_text(json.dumps(summary) + "\n")
    print(summary["per_seed_markdown"] + "\n\n" + summary["summary_markdown"])
    print(f"\nevery curve: {path}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
