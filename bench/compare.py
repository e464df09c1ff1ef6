"""jaxport against the PyTorch originals, back to back on this machine: one JSON line per workload with
both times, the ratio (original time / jaxport time: above 1 means jaxport is faster), jaxport's compile
time apart, the peak RSS of each side, and a Markdown table of the same.

    eval "$(../shared/originals/setup)"      # once: the originals' Python and source (REF_PY, REF_TRM, ...)
    python bench/compare.py [--only trm_step,gpt_step,gpt_run,trm_loop,dream] [--repeat 3] [--threads N] \
        [--results bench/results/HOST.json --host-label "AMD host"]
    python bench/compare_tables.py           # README.md's and docs/performance.md's tables from bench/results

Workloads that take under a minute run `--repeat` times, alternating original and jaxport, and report the
median ratio; longer ones run once. Run it on a quiet machine: nothing else on the cores.

Both sides get the same cores. `--threads N` (default: every core this process may use) pins each child process to
the first N of them (CPU affinity, which also sizes XLA:CPU's thread pool) and gives PyTorch N threads
(`torch.set_num_threads` through each harness's `--threads`, or `OMP_NUM_THREADS` for the harnesses that run
upstream's training scripts); each side makes its untimed calls before its timed ones (jaxport's Fast-dLLM
comparison one per prompt shape: its compilations). The JSON records both sides' threads (the originals' as their
harness reports them) and warm-up calls, and jaxport's compile time beside every ratio.

`fastdllm` also compares the tokens: jaxport at every batch size against Fast-dLLM's batch 1, every row equal but
at most one in 8 whose first differing token was decided after a near-tie (`fastdllm_verdict`). The command exits
with 1 when a row fails that.
"""

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compare_tables import markdown_table, run_line
from host import cpu_description

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SHARED = REPO.parent / "shared"
REF_ENV = ("REF_PY", "REF_TRM", "REF_NANOGPT", "REF_DREAM")
GPT_CPU_FLAGS = [
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]  # nanoGPT README's CPU command (the harness's CPU_FLAGS)
TRM_LOOP = [
    "arch=trm",
    "arch.hidden_size=64",
    "arch.num_heads=2",
    "arch.L_layers=2",
    "arch.H_cycles=2",
    "arch.L_cycles=2",
    "arch.halt_max_steps=4",
    "arch.puzzle_emb_ndim=0",
    "arch.puzzle_emb_len=0",
    "arch.forward_dtype=float32",
    "arch.mlp_t=True",
    "arch.pos_encodings=none",
    "global_batch_size=32",
    "lr=1e-3",
    "puzzle_emb_lr=1e-3",
    "lr_warmup_steps=100",
    "epochs=4",
    "eval_interval=1",
]


CORES = sorted(os.sched_getaffinity(0))  # the cores both sides run on (`--threads` keeps the first N)


def side_conditions(threads: int, original_threads: int | None = None) -> dict:
    """The JSON's record of what each side ran on: cores, threads (the original's as its harness reports them)."""
    return {
        "cores": CORES,
        "jaxport_threads": threads,
        "jaxport_threads_by": "CPU affinity",
        "original_threads": original_threads if original_threads is not None else threads,
        "original_threads_by": "torch.set_num_threads",
    }


def run(command: list[str], cwd=None, env=None) -> tuple[str, float, int]:
    """(stdout, wall seconds, peak RSS bytes) of a child process on `CORES`, with PyTorch's and OpenMP's thread
    count set to as many; its stderr passes through."""
    start = time.perf_counter()
    threads = {name: str(len(CORES)) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, **threads, **(env or {})},
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, CORES),
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(command)}\n{out[-3000:]}")
    return out, wall, usage.ru_maxrss * 1024


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# the harnesses in ../shared/originals/bench that take `--threads` (the others run upstream's own scripts, whose torch
# takes its thread count from OMP_NUM_THREADS)
THREADS_FLAG = ("trm/bench_upstream.py", "gpt/bench_upstream.py", "dream/bench_upstream.py", "dream/bench_fastdllm.py")


def original(script: str, *args: str, out: Path) -> tuple[dict, int]:
    """Run one of ../shared/originals/bench's harnesses on `CORES` with as many torch threads; its --out JSON and
    peak RSS."""
    threads = ["--threads", str(len(CORES))] if script in THREADS_FLAG else []
    command = [os.environ["REF_PY"], str(SHARED / "originals" / "bench" / script), "--out", str(out), *threads, *args]
    _, _, rss = run(command)
    return json.loads(out.read_text()), rss


def torch_threads(report: dict) -> int | None:
    """The thread count an original's harness says torch used."""
    for found in (
        report.get("threads"),
        report.get("conditions", {}).get("torch_threads"),
        report.get("machine", {}).get("torch_threads"),
    ):
        if found is not None:
            return int(found)
    return None


def jaxport_bench(script: str, *args: str) -> tuple[list[dict], int]:
    text, _, rss = run([sys.executable, str(BENCH / script), *args])
    return json_lines(text), rss


# -- workloads: each returns [(name, original seconds, jaxport seconds, extras)] for one back-to-back round


def trm_step(tmp: Path, quick: bool):
    steps, warmup = ("2", "1") if quick else ("3", "1")  # jaxport's trm_step.py: one untimed call after compiling
    up, up_rss = original(
        "trm/bench_upstream.py",
        "--batch",
        "32",
        "--steps",
        steps,
        "--warmup",
        warmup,
        out=tmp / "trm_step.json",
    )
    ours, rss = jaxport_bench("trm_step.py", "--batch", "32", "--steps", steps)
    rows = []
    for r in up["results"]:
        mixer = "attention" if r["variant"] == "att" else "mlp_t"
        mine = next(o for o in ours if o.get("mixer") == mixer and o.get("forward_dtype") == r["forward_dtype"])
        rows.append(
            (
                f"trm_step {mixer} {r['forward_dtype']}",
                r["median_s"],
                mine["step_s_median"],
                {
                    "jaxport_compile_s": mine["compile_s"],
                    "original_peak_rss": up_rss,
                    "jaxport_peak_rss": rss,
                    **{k: mine[k] for k in ("achieved_gflops", "fraction_of_peak") if k in mine},
                    "warmup_calls": {"original": int(warmup), "jaxport": 1},
                    "original_threads": torch_threads(up),
                },
            )
        )
    return rows


def gpt_step(tmp: Path, quick: bool, configs=("cpu_readme",), dropouts=(0.0,)):
    rows = []
    for dropout in dropouts:
        iters = ["--iters", "3", "--warmup", "1"] if "shakespeare" in configs else ["--iters", "20", "--warmup", "3"]
        up, up_rss = original(
            "gpt/bench_upstream.py",
            "--configs",
            *configs,
            "--compile-configs",
            "--dropout",
            str(dropout),
            *iters,
            out=tmp / "gpt_step.json",
        )
        ours, rss = jaxport_bench(
            "gpt_train_step.py", "--configs", ",".join(configs), "--dropout", str(dropout), *iters
        )
        for r in up["results"]:
            mine = next(o for o in ours if o.get("config") == r["config"])
            rows.append(
                (
                    f"gpt_step {r['config']} dropout {dropout}",
                    r["median_iter_s"],
                    mine["iter_s_median"],
                    {
                        "jaxport_compile_s": mine["compile_s"],
                        "original_peak_rss": up_rss,
                        "jaxport_peak_rss": rss,
                        **{k: mine[k] for k in ("achieved_gflops", "fraction_of_peak") if k in mine},
                        "warmup_calls": {"original": int(iters[3]), "jaxport": int(iters[3])},
                        "original_threads": torch_threads(up),
                    },
                )
            )
    return rows


def gpt_run(tmp: Path, quick: bool):
    """nanoGPT README's CPU command, the whole run (2000 iterations), wall time of train.py / jaxport gpt train:
    jaxport's first run of the command (nothing compiled yet), then the same command again, which loads the
    first run's compiled programs from the `jaxport` command's cache (a folder of this comparison's own)."""
    text_file = SHARED / "data" / "tinyshakespeare" / "input.txt"
    up, up_rss = original("gpt/run_training.py", "--input", str(text_file), out=tmp / "gpt_run.json")
    up_iter_ms = statistics.median(row[2] for row in up["train_iter_log"]["rows"][5:])
    work = tmp / "gpt_run"
    work.mkdir(exist_ok=True)
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp / "gpt_run_xla_cache")}
    shutil.rmtree(cache["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    run(
        [sys.executable, "-m", "jaxport.cli", "gpt", "prepare", "shakespeare_char", "--input", str(text_file)], cwd=work
    )
    rows = []
    for name in ("first run", "compiled programs cached"):
        shutil.rmtree(work / "out-shakespeare-char", ignore_errors=True)
        command = [sys.executable, "-m", "jaxport.cli", "gpt", "train", "train_shakespeare_char", *GPT_CPU_FLAGS]
        _, wall, rss = run([*command, "--progress=False"], cwd=work, env=cache)
        lines = (work / "out-shakespeare-char" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        iter_ms = statistics.median(r["dt_ms"] for r in records if "dt_ms" in r and r["iter"] > 5)
        final = [r for r in records if "val_loss" in r][-1]
        extras = {
            "original_iter_ms": up_iter_ms,
            "jaxport_iter_ms": round(iter_ms, 2),
            "original_val_loss": up["final"]["val_loss"],
            "jaxport_val_loss": round(final["val_loss"], 4),
            "original_peak_rss": up_rss,
            "jaxport_peak_rss": rss,
            "warmup_calls": {"original": 0, "jaxport": 0},  # whole runs from a cold start
            "original_threads": torch_threads(up),
        }
        rows.append((f"gpt_run README CPU command (wall, {name})", up["wall_time_s"]["train_py_total"], wall, extras))
    return rows


def trm_loop(tmp: Path, quick: bool):
    """The demo-size training loop on one dataset both read; seconds per step, evaluation excluded."""
    data = tmp / "trm_loop"
    if not (data / "data" / "test" / "dataset.json").exists():
        run(
            [
                sys.executable,
                "-m",
                "jaxport.cli",
                "trm",
                "build",
                "sudoku",
                "--generate",
                "--num-train",
                "1000",
                "--num-test",
                "256",
                "--givens",
                "50",
                "--num-aug",
                "8" if not quick else "1",
                "--seed",
                "0",
                "--output-dir",
                str(data / "data"),
            ]
        )
    up, up_rss = original("trm/run_training.py", "--data", str(data), "--", *TRM_LOOP, out=tmp / "trm_loop.json")
    curve, evals = up["train_curve"], up["evals"]
    first, last = curve[0], curve[-1]
    eval_s = sum(e["eval_s"] for e in evals if first["wall_s"] < e["wall_s"] <= last["wall_s"] + e["eval_s"])
    up_step = (last["wall_s"] - first["wall_s"] - eval_s) / (last["step_last"] - first["step_last"])
    ours, rss = jaxport_bench("trm_loop.py", "--data", str(data), "--", *TRM_LOOP)
    mine = ours[-1]
    return [
        (
            "trm_loop demo size (s/step, eval excluded)",
            up_step,
            mine["step_s"],
            {
                "steps": mine["steps"],
                "original_steps": up["total_steps"],
                "jaxport_compile_s": mine["first_step_incl_compile_s"],
                "original_wall_s": up["wall_time_s"],
                "jaxport_wall_s": mine["wall_s"],
                "original_peak_rss": up_rss,
                "jaxport_peak_rss": rss,
                "warmup_calls": {"original": 1, "jaxport": 1},  # seconds per step from the first step's end on
                "original_threads": torch_threads(up),
            },
        )
    ]


def dream(tmp: Path, quick: bool, new_tokens: int = 64):
    # one untimed generation on each side: jaxport's compiles and runs, the original's runs
    runs = ["--runs", "1", "--warmup", "1"] if new_tokens > 64 else ["--runs", "3", "--warmup", "1"]
    up, up_rss = original(
        "dream/bench_upstream.py",
        "--max-new-tokens",
        str(new_tokens),
        "--steps",
        str(new_tokens),
        "--batches",
        "1,4",
        *runs,
        out=tmp / "dream.json",
    )
    ours, rss = jaxport_bench(
        "dream_generate.py", "--new-tokens", str(new_tokens), "--batches", "1,4", "--repeats", runs[1]
    )
    mine = {r["batch"]: r for r in ours[-1]["results"]}
    return [
        (
            f"dream 40M {new_tokens} tokens batch {r['batch']}",
            r["median_s"],
            mine[r["batch"]]["generate_median_s"],
            {
                "jaxport_compile_s": mine[r["batch"]]["generate_compile_s"],
                "original_peak_rss": up_rss,
                "jaxport_peak_rss": rss,
                "warmup_calls": {"original": int(runs[3]), "jaxport": 1},
                "original_threads": torch_threads(up),
            },
        )
        for r in up["results"]
    ]


# -- fastdllm: Fast-dLLM's own decoding against jaxport's schedule="fastdllm", same inputs, same passes

TORCH_PEAK = """import json, statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[1])); a = torch.randn(2048, 2048); a @ a; times = []
for _ in range(5):
    t = time.perf_counter(); a @ a; times.append(time.perf_counter() - t)
print(json.dumps(2 * 2048**3 / statistics.median(times)))"""


NEAR_TIE_SHARE = 8  # at most one row in this many may differ from Fast-dLLM's, and only at a near-tie


def fastdllm_verdict(theirs: list[list[int]], ours: list[list[int]], margins: list[list], near_tie: float) -> dict:
    """Whether jaxport's tokens pass against Fast-dLLM's: every row equal, except at most one in `NEAR_TIE_SHARE`
    whose first differing new token was decided after a near-tie. `theirs`, `ours`: each row's prompt and new
    tokens; `margins`: jaxport's per row and new position, the smallest margin of the row's decisions up to that
    position's (`jaxport.dream.fast.decision_margins`; None: no choice yet); below `near_tie` a near-tie, where
    torch's and XLA's rounding may order two scores differently."""
    near_ties, differing = [], []
    for row, (a, b, m) in enumerate(zip(theirs, ours, margins, strict=True)):
        new = len(m)
        first = next((i for i, (x, y) in enumerate(zip(a[-new:], b[-new:])) if x != y), None)
        if len(a) != len(b) or a[:-new] != b[:-new]:
            differing.append(row)  # not the same prompt: no margin explains it
        elif first is not None:
            (near_ties if m[first] is not None and m[first] < near_tie else differing).append(row)
    rows = len(theirs)
    return {
        "rows_equal": f"{rows - len(near_ties) - len(differing)}/{rows}",
        "rows_differing_after_a_near_tie": near_ties,
        "rows_differing_otherwise": differing,
        "passed": not differing and len(near_ties) * NEAR_TIE_SHARE <= rows,
    }


def fastdllm_rows(label: str, original_run: tuple, jaxport_run: tuple, ours: list[int], torch_peak: float) -> list:
    """The rows of one case: each Fast-dLLM batch size against jaxport's (batch 1 against each of `ours`).
    `original_run`: the harness's report and peak RSS; `jaxport_run`: dream_fastdllm.py's lines and peak RSS."""
    (up, up_rss), (mine, rss) = original_run, jaxport_run
    rows = []
    by_batch = {r["batch"]: r for r in mine}
    alone = by_batch[1]["sequences"]
    reference = next(result for result in up["results"] if result["batch"] == 1)["sequences"]
    for result in up["results"]:
        if "median_s" not in result:
            continue
        for size in ours if result["batch"] == 1 else [result["batch"]]:
            if size < result["batch"]:
                continue
            r = by_batch[size]
            equal = [a == b for a, b in zip(result["sequences"], r["sequences"])]
            as_alone = sum(a == b for a, b in zip(alone, r["sequences"]))
            rows.append(
                (
                    f"fastdllm {label}: Fast-dLLM batch {result['batch']}, jaxport batch {size}",
                    result["median_s"],
                    r["median_s"],
                    {
                        "rows_equal": f"{sum(equal)}/{len(equal)}",
                        # the pass/fail of the run: jaxport at this batch size against Fast-dLLM's batch 1
                        "tokens": fastdllm_verdict(reference, r["sequences"], r["decision_margins"], r["near_tie"]),
                        "jaxport_rows_equal_to_its_batch_1": f"{as_alone}/{len(alone)}",
                        "original_new_tokens_per_s": round(result["new_tokens_per_s"], 1),
                        "jaxport_new_tokens_per_s": r["new_tokens_per_s"],
                        "original_fraction_of_peak": round(r["algorithm_flops"] / result["median_s"] / torch_peak, 3),
                        "jaxport_fraction_of_peak": r.get("fraction_of_peak"),
                        "original_matmul_peak_gflops": round(torch_peak / 1e9, 1),
                        "jaxport_matmul_peak_gflops": r.get("matmul_peak_gflops"),
                        "original_times_s": [round(t, 3) for t in result["times_s"]],
                        "jaxport_times_s": r["times_s"],
                        "jaxport_compile_s": r["compile_s"],
                        "original_peak_rss": up_rss,
                        "jaxport_peak_rss": rss,
                        # the harness: --warmup calls of its first batch; jaxport: one per prompt shape
                        "warmup_calls": {"original": up["args"]["warmup"], "jaxport": r["warmup_calls"]},
                        **side_conditions(len(CORES), torch_threads(up)),
                    },
                )
            )
    return rows


def fastdllm(tmp: Path, quick: bool):
    """Issue workloads: (a) the task model, 128 new tokens, blocks of 32, dual cache, `confidence_threshold` 0.9,
    64 held-out prompts, Fast-dLLM at batch 1 against jaxport at batch 1 and 8; (b) the 40M config's random weights
    written once as a Hugging Face folder, equal-length prompts, 256 new tokens in 256 steps, blocks of 32, the
    scheduled entropy ranking, dual cache (Fast-dLLM at batch 1 against jaxport at 1 and 4) and prefix cache (both
    at 1 and 4). Each side: median of 3 timed passes over all prompts after its warm-up; tokens compared in the
    same run (rows equal to Fast-dLLM's, and jaxport's batched rows equal to its batch-1 rows) and judged against
    Fast-dLLM's batch 1 (`fastdllm_verdict`)."""
    runs = ["--runs", "1" if quick else "3"]
    torch_peak = json.loads(run([os.environ["REF_PY"], "-c", TORCH_PEAK, str(len(CORES))])[0])
    task, big = tmp / "fastdllm_task", tmp / "fastdllm_40m"
    jaxport_bench("dream_fastdllm.py", "prepare", "task", str(task), "--prompts", "8" if quick else "64")
    jaxport_bench("dream_fastdllm.py", "prepare", "tiny" if quick else "40m", str(big), "--prompts", "4")
    model = {task: str(REPO / "tests" / "fixtures" / "dream" / "task_model"), big: str(big / "model")}
    new, big_name = ("128", "tiny") if quick else ("256", "40M")
    cases = [  # (label, inputs, decoding flags, Fast-dLLM's batch sizes, jaxport's)
        (
            "(a) task model, threshold 0.9, dual",
            task,
            ["--max-new-tokens", "128", "--steps", "128", "--dual-cache", "--alg", "confidence_threshold"],
            [1],
            [1, 8],
        ),
        (
            f"(b) {big_name} random, entropy, dual",
            big,
            ["--max-new-tokens", new, "--steps", new, "--dual-cache", "--alg", "entropy"],
            [1],
            [1, 4],
        ),
        (
            f"(b) {big_name} random, entropy, prefix",
            big,
            ["--max-new-tokens", new, "--steps", new, "--alg", "entropy"],
            [1, 4],
            [1, 4],
        ),
    ]
    rows = []
    for label, inputs, flags, theirs, ours in cases:
        common = ["--model", model[inputs], "--prompt-ids", str(inputs / "prompts.jsonl"), "--block-length", "32"]
        up, up_rss = original(
            "dream/bench_fastdllm.py",
            *common,
            *flags,
            *runs,
            "--warmup",
            "1",
            "--threads",
            str(len(CORES)),
            "--batches",
            ",".join(map(str, theirs)),
            out=tmp / "fastdllm.json",
        )
        mine, rss = jaxport_bench(
            "dream_fastdllm.py", "run", *common, *flags, *runs, "--batches", ",".join(map(str, ours))
        )
        rows += fastdllm_rows(label, (up, up_rss), (mine, rss), ours, torch_peak)
    return rows


WORKLOADS = {  # name -> (each side of a round takes under a minute, function)
    "trm_step": (False, trm_step),
    "gpt_step": (True, lambda tmp, quick: gpt_step(tmp, quick)),
    "gpt_step_shakespeare": (False, lambda tmp, quick: gpt_step(tmp, quick, ("shakespeare",), (0.0, 0.2))),
    "gpt_run": (False, gpt_run),
    "trm_loop": (True, trm_loop),  # 30-40 s a side, and its ratio moved 1.08-1.40 within one hour (2026-11-26)
    "dream_64": (True, dream),
    "dream_256": (False, lambda tmp, quick: dream(tmp, quick, 256)),
    "fastdllm": (False, fastdllm),  # each side times 3 passes itself
}


def summary(label: str, rounds: list[tuple], threads: int, cpu: dict) -> dict:
    """One workload's JSON record from its `(label, original s, jaxport s, extras)` of each round: the median ratio
    with jaxport's compile time beside it (None where the timed run includes compiling)."""
    up, ours, extras = [r[1] for r in rounds], [r[2] for r in rounds], rounds[-1][3]
    ratios = [u / o for u, o in zip(up, ours)]
    return {
        "workload": label,
        "original_s": round(statistics.median(up), 4),
        "jaxport_s": round(statistics.median(ours), 4),
        "ratio": round(statistics.median(ratios), 3),
        "jaxport_compile_s": extras.get("jaxport_compile_s"),
        "rounds": len(rounds),
        "round_ratios": [round(r, 3) for r in ratios],
        **extras,
        **side_conditions(threads, extras.get("original_threads")),
        **cpu,
    }


def versions() -> dict:
    """jax's (this Python's) and torch's (the originals' Python) versions."""
    torch = run([os.environ["REF_PY"], "-c", "import torch; print(torch.__version__)"])[0].strip()
    return {"jax": importlib.metadata.version("jax"), "torch": torch}


def check_originals() -> None:
    missing = [name for name in REF_ENV if not os.environ.get(name)]
    if missing:
        raise SystemExit(
            f"{', '.join(missing)} not set: the originals are found through them. From the project "
            f'root run\n    eval "$({SHARED / "originals" / "setup"})"\n(it builds their Python once, '
            f"several minutes) and then this command again."
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        default="trm_step,gpt_step,gpt_run,trm_loop,dream",
        help="comma-separated workloads: "
        + ", ".join(WORKLOADS)
        + " (gpt_step selects gpt_step and gpt_step_shakespeare, dream selects dream_64 and dream_256)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the workloads under a minute")
    parser.add_argument("--markdown", default="compare.md", help="where to write the Markdown table")
    parser.add_argument("--results", help="also store the run as JSON here (bench/results/HOST.json)")
    parser.add_argument("--host-label", help="the host's short name in the tables (default: its CPU model)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, not a measurement)")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(CORES),
        help=f"cores (and torch threads) for both sides (default: the {len(CORES)} this process may use)",
    )
    args = parser.parse_args()
    if not 1 <= args.threads <= len(CORES):
        parser.error(f"--threads {args.threads}: this process may use 1 to {len(CORES)} cores")
    CORES[:] = CORES[: args.threads]
    check_originals()
    chosen = []
    for name in args.only.split(","):
        aliases = {"gpt_step": ["gpt_step", "gpt_step_shakespeare"], "dream": ["dream_64", "dream_256"]}
        chosen += aliases.get(name, [name])
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    records, failed = [], []
    tmp = Path(tempfile.mkdtemp(prefix="jaxport_compare_"))
    cpu = cpu_description()
    started = time.gmtime()
    for name in dict.fromkeys(chosen):
        short, function = WORKLOADS[name]
        rounds = [function(tmp, args.quick) for _ in range(args.repeat if short else 1)]
        for i, (label, *_rest) in enumerate(rounds[0]):
            record = summary(label, [r[i] for r in rounds], args.threads, cpu)
            print(json.dumps(record), flush=True)
            records.append(record)
            failed += [label] if any(r[i][3].get("tokens", {}).get("passed") is False for r in rounds) else []
    results = {
        "host": f"{cpu['cpu_count']} cores of {cpu['cpu_model']} ({', '.join(cpu['cpu_isa']) or 'no AVX2'}; "
        f"{' '.join(os.uname()[::2])}), both sides on {args.threads} of them",
        "short": args.host_label or cpu["cpu_model"],
        "command": shlex.join(["python", "bench/compare.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", started),
        "utc": f"{time.strftime('%H:%M', started)}–{time.strftime('%H:%M', time.gmtime())}",
        "versions": versions(),
        "threads": args.threads,
        "records": records,
    }
    Path(args.markdown).write_text(run_line(results) + "\n\n" + markdown_table(records) + "\n")
    print(f"wrote {args.markdown}")
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.results}; python bench/compare_tables.py puts it in README.md and docs/performance.md")
    for label in failed:
        print(f"FAILED: {label}: jaxport's tokens differ from Fast-dLLM's (its JSON line's `tokens`)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
