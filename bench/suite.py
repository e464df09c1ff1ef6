"""Every family's bench at the sizes that matter on an accelerator, the PyTorch originals beside them under
`torch.compile`, one JSON and one Markdown report.

    eval "$(../shared/originals/setup)"    # optional: REF_PY & co.; the originals run where its torch has CUDA
    python bench/suite.py [--only trm,gpt,dream] [--batch 8] [--out suite_report] [--tiny] [--skip-originals] \
        [--timeout SECONDS]

- TRM: one ACT call forward + backward at the paper's Sudoku architecture (batch 32), attention and mlp_t, in
  bfloat16 as the paper trains (bench/trm_step.py): FLOPs from XLA's cost analysis.
- GPT: a GPT-2 124M training iteration at block 1024 (batch `--batch`), in bfloat16 on a GPU/TPU as `jaxport gpt
  train` computes with nanoGPT's default --dtype (bench/gpt_train_step.py): tokens/s and nanoGPT's MFU.
- Dream: the 7B config with random bfloat16 weights, prompt 32 + 256 new tokens, batch 1 and 8, exact decoding
  and fast decoding (blocks of 32, dual cache, threshold 0.9; bench/dream_fast.py): new tokens/s, the fast
  decoder's speed-up, and the exact decoder's model FLOPs (one full-canvas forward per step, as upstream).
- The originals (bench/torch_originals.py, run by REF_PY on the upstream code): nanoGPT's iteration with bf16
  autocast, TRM's ACT call, Dream's exact generation. Where REF_PY is unset or its torch has no CUDA, their
  rows say so. Upstream Dream has no fast decoding.

Utilisation is a fraction of the device's dense bf16 datasheet peak (`jaxport.gpt.device_peak_flops`: A100,
H100, H200, TPUs), on other devices of a matmul probe run now (bench/_common.py). Each family runs in its own
process, jaxport's and then the original's, so a memory high-water mark covers one family (jaxport: the
family's process at the row's end; the original: each row) and a family that fails (a 7B that does not fit, say)
reports the error in its rows while the others still run. The report is rewritten after each family, and a child
that outlives `--timeout` is stopped with its rows saying so, so a run cut short keeps what it finished. `--tiny`
takes the same paths at tiny sizes: about a minute on a CPU (tests/test_suite.py runs it).

- gaps: bench/gpu_gaps.py, the gaps the H200 trace pointed at (GPT-2's iteration with and without XLA's command
  buffers, reading every loss or dispatching ahead; TRM's mlp_t bf16 step profiled), in its own process, its report
  in `gpu_gaps/` beside the suite's and summarised in it.
"""

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import compare
import gpt_train_step
import numpy as np
import trm_step
from _common import emit, environment, memory_high_water, utilisation

from jaxport.dream import preset

FAMILIES = ("trm", "gpt", "dream")
STUDIES = ("gaps",)  # bench/gpu_gaps.py
UNITS = {"trm": "puzzles/s", "gpt": "tokens/s", "dream": "new tokens/s"}  # throughput
TINY_TRM = dict(
    trm_step.PAPER_SUDOKU,
    hidden_size=64,
    num_heads=2,
    expansion=2,
    L_layers=1,
    H_cycles=2,
    L_cycles=1,
    puzzle_emb_ndim=64,
    puzzle_emb_len=2,
    halt_max_steps=2,
)
SIZES = {  # family -> the workload on an accelerator, and with --tiny (each row compiles for seconds on a CPU: there
    # TRM has both mixers and both dtypes in two rows, Dream one batch size)
    "trm": {
        "full": dict(
            arch=trm_step.PAPER_SUDOKU,
            batch=32,
            steps=10,
            warmup=2,
            title="paper Sudoku arch",
            rows=[("attention", "bfloat16"), ("mlp_t", "bfloat16")],
        ),
        "tiny": dict(
            arch=TINY_TRM,
            batch=4,
            steps=2,
            warmup=1,
            title="tiny arch",
            rows=[("attention", "bfloat16"), ("mlp_t", "float32")],
        ),
    },
    "gpt": {
        "full": dict(model={}, batch=8, iters=10, warmup=3, title="GPT-2 124M"),
        "tiny": dict(
            model=dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512),
            batch=4,
            iters=3,
            warmup=1,
            title="tiny GPT",
        ),
    },
    "dream": {
        "full": dict(
            # one timed generation after the compiling one: 256 forward steps each, minutes on an accelerator's lease
            size="7b",
            dtype="bfloat16",
            prompt_len=32,
            new_tokens=256,
            batches=[1, 8],
            block_length=32,
            repeats=1,
        ),
        "tiny": dict(
            size="tiny", dtype="bfloat16", prompt_len=8, new_tokens=32, batches=[2], block_length=16, repeats=1
        ),
    },
}
FAST = dict(cache="dual", threshold=0.9)  # with the size's block_length: Fast-dLLM's settings
NO_FAST_ORIGINAL = "upstream Dream has no fast decoding (Fast-dLLM is a separate code base)"


def workloads(family: str, size: dict) -> list[str]:
    """The rows of a family, named the same on both sides."""
    if family == "trm":
        return [f"{mixer} {dtype}" for mixer, dtype in size["rows"]]
    if family == "gpt":
        return ["training iteration"]
    return [f"{mode}, batch {batch}" for batch in size["batches"] for mode in ("exact", "fast")]


def sizes(tiny: bool, batch: int | None) -> dict:
    chosen = {family: dict(options["tiny" if tiny else "full"]) for family, options in SIZES.items()}
    if batch:
        chosen["gpt"]["batch"] = batch
    return chosen


def gpt_spec(size: dict) -> dict:
    """The GPT workload: gpt_train_step's `gpt2` config with the size's model overrides and batch."""
    spec = {**gpt_train_step.CONFIGS["gpt2"], **size["model"], "batch_size": size["batch"]}
    model = {k: spec[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "dropout")}
    return {"model": model, **{k: spec[k] for k in ("batch_size", "learning_rate", "beta2", "weight_decay")}}


def generation_flops(cfg, batch: int, length: int, steps: int) -> float:
    """Model FLOPs of exact decoding as upstream runs it: a forward over the whole canvas per step (2 FLOPs per
    weight and token, the vocabulary projection at every position, attention scores and values 4·length·hidden
    per token and layer)."""
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = cfg.hidden_size * (2 * cfg.hidden_size + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    per_token = 2 * (cfg.num_hidden_layers * layer + cfg.hidden_size * cfg.vocab_size)
    per_token += 4 * cfg.num_hidden_layers * length * cfg.hidden_size
    return float(steps * batch * length * per_token)


# -- jaxport's rows, in a child process per family (`--child FAMILY`)


def trm_rows(size: dict, peaks: dict):
    for (mixer, dtype), label in zip(size["rows"], workloads("trm", size)):
        r = trm_step.bench(mixer, dtype, "unrolled", size["batch"], size["steps"], None, peaks, arch=size["arch"])
        yield {
            "workload": label,
            "dtype": dtype,
            "compile_s": r["compile_s"],
            "step_s": r["step_s_median"],
            "throughput": size["batch"] / r["step_s_median"],
            "flops_per_step": r["flops_per_step"],
            "flops_source": "XLA cost analysis",
            **utilisation_of(r),
            "detail": r,
        }


def gpt_rows(size: dict, peaks: dict):
    model = dict(gpt_spec(size)["model"])
    r = gpt_train_step.bench(
        "gpt2", model.pop("dropout"), size["iters"], size["warmup"], peaks, **model, batch_size=size["batch"]
    )
    yield {
        "workload": workloads("gpt", size)[0],
        "dtype": r["dtype"],
        "compile_s": r["compile_s"],
        "step_s": r["iter_s_median"],
        "throughput": r["tokens_per_s"],
        "flops_per_step": r["flops_per_iter"],
        "flops_source": "XLA cost analysis",
        **utilisation_of(r),
        "mfu": r["mfu"],
        "detail": r,
    }


def dream_rows(size: dict, peaks: dict):
    import dream_fast

    from jaxport import dream

    model = dream.random_model(preset(size["size"]), dtype=size["dtype"])
    cfg, new = model.config, size["new_tokens"]
    low = min(cfg.mask_token_id, cfg.eos_token_id, cfg.vocab_size)  # prompts below every special id
    modes = [(batch, fast) for batch in size["batches"] for fast in ({}, dict(FAST, block_length=size["block_length"]))]
    exact_s = None
    for (batch, fast), label in zip(modes, workloads("dream", size)):
        ids = np.random.default_rng(batch).integers(0, low, (batch, size["prompt_len"])).astype(np.int32)
        timing = dream_fast.passes(
            model, [(ids, None)], size["repeats"], max_new_tokens=new, steps=new, alg="entropy", **fast
        )
        seconds = timing["median_s"]
        row = {
            "workload": label,
            "dtype": size["dtype"],
            "compile_s": timing["compile_s"],
            "step_s": seconds,
            "throughput": batch * new / seconds,
            "generation": {"prompt_len": size["prompt_len"], "new_tokens": new, "steps": new, **fast},
        }
        if not fast:
            exact_s, flops = seconds, generation_flops(cfg, batch, size["prompt_len"] + new, new)
            rate = utilisation(flops, seconds, size["dtype"], peaks)
            row.update(
                flops_per_step=flops,
                flops_source="model FLOPs (upstream's full-canvas forward per step)",
                **rate,
                mfu=rate["fraction_of_peak"],
            )
        else:  # the exact row of this batch came just before
            row.update(
                speedup_vs_exact=exact_s / seconds, flops_note="data-dependent (threshold, cache): compare new tokens/s"
            )
        yield row


def utilisation_of(record: dict) -> dict:
    keys = ("achieved_gflops", "matmul_peak_gflops", "peak_source", "fraction_of_peak")
    return {k: record[k] for k in keys if k in record}


def child(family: str, size: dict) -> None:
    """Print jaxport's rows of one family as JSON lines, each with the device, versions and memory high-water."""
    env = environment()
    emit({"machine": env})
    versions = {k: env[k] for k in ("jax", "jaxlib", "flax", "python")}
    peaks = {}
    for row in {"trm": trm_rows, "gpt": gpt_rows, "dream": dream_rows}[family](size, peaks):
        emit(
            {
                "section": family,
                "side": "jaxport",
                "status": "ok",
                "device": env["device"],
                "platform": env["platform"],
                "versions": versions,
                **row,
                "throughput_unit": UNITS[family],
                **memory_high_water(),
            }
        )


# -- the originals' rows


def run_child(command: list[str], timeout: float | None) -> tuple[str, int, str]:
    """(stdout, exit code, the last lines of stderr) of a child process; its stderr passes through as it runs.
    A child still running after `timeout` seconds is killed, and the last line says so."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True)
        timer = threading.Timer(timeout, proc.kill) if timeout else None
        if timer:
            timer.start()
        tail = collections.deque(maxlen=8)
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line)
        code = proc.wait()
        if timer:
            timer.cancel()
            if code == -signal.SIGKILL:
                tail.append(f"stopped after --timeout {timeout:g} s")
        out.seek(0)
        return out.read(), code, "".join(tail).strip()[-1500:]


def originals_status(skip: bool) -> dict:
    """{"available": True, "torch": ..., "cuda": ...} when REF_PY's torch has a CUDA device, else the reason why not."""
    if skip:
        return {"available": False, "reason": "skipped (--skip-originals)"}
    missing = [name for name in compare.REF_ENV if not os.environ.get(name)]
    if missing:
        return {
            "available": False,
            "reason": f'{", ".join(missing)} not set: run eval "$({compare.SHARED / "originals" / "setup"})" first',
        }
    ref_py = os.environ["REF_PY"]
    if not shutil.which(ref_py):
        return {"available": False, "reason": f"REF_PY={ref_py} is not an executable Python"}
    probe = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, torch.cuda.is_available()]))"
    proc = subprocess.run([ref_py, "-c", probe], capture_output=True, text=True)
    if proc.returncode:
        return {
            "available": False,
            "reason": f"torch is not importable by REF_PY={ref_py}: "
            f"{(proc.stderr.strip().splitlines() or [proc.returncode])[-1]}",
        }
    version, cuda, available = json.loads(proc.stdout.splitlines()[-1])
    if not available:
        return {
            "available": False,
            "reason": f"torch {version} in REF_PY has no CUDA device (the originals run "
            f"under torch.compile on a GPU only)",
            "torch": version,
        }
    return {"available": True, "torch": version, "cuda": cuda}


def original_spec(family: str, size: dict) -> dict:
    """The workload for bench/torch_originals.py: the same configurations as jaxport's rows."""
    if family == "trm":
        configs = [trm_step.model_config(mixer, dtype, size["batch"], size["arch"]) for mixer, dtype in size["rows"]]
        return {
            "configs": [
                {"name": name, "arch": c.model_dump(exclude={"name", "loss"})}
                for name, c in zip(workloads(family, size), configs)
            ],
            "loss_type": configs[0].loss_type,
            "steps": size["steps"],
            "warmup": size["warmup"],
        }
    if family == "gpt":
        return {**gpt_spec(size), "iters": size["iters"], "warmup": size["warmup"]}
    return {
        "config": preset(size["size"]).to_hf_dict(size["dtype"]),
        "dtype": size["dtype"],
        "alg": "entropy",
        **{k: size[k] for k in ("prompt_len", "new_tokens", "batches", "repeats")},
    }


def original_rows(family: str, size: dict, mine: list[dict], status: dict, tmp: Path, timeout) -> list[dict]:
    """The original's row of each workload: measured beside jaxport's row (whose `vs_original` it sets), or why not."""
    labels = workloads(family, size)

    def absent(label: str, reason: str, state: str = "not run") -> dict:
        reason = NO_FAST_ORIGINAL if label.startswith("fast") else reason
        return {"section": family, "side": "original", "workload": label, "status": state, "reason": reason}

    if not status["available"]:
        return [absent(label, status["reason"]) for label in labels]
    spec, out = tmp / f"{family}_spec.json", tmp / f"{family}_original.json"
    spec.write_text(json.dumps(original_spec(family, size)))
    _, code, err = run_child(
        [
            os.environ["REF_PY"],
            str(Path(__file__).with_name("torch_originals.py")),
            family,
            "--spec",
            str(spec),
            "--out",
            str(out),
        ],
        timeout,
    )
    if code:
        return [absent(label, f"the original failed (exit {code}): {err}", "error") for label in labels]
    result = json.loads(out.read_text())
    theirs = {r["name"]: r for r in result["rows"]}
    ours = {r["workload"]: r for r in mine}
    rows = []
    for label in labels:
        r = theirs.get(label)
        if r is None:
            rows.append(absent(label, "the original has no such workload"))
            continue
        row = {
            "section": family,
            "side": "original",
            "workload": label,
            "status": "ok",
            "device": result["device"],
            "platform": result["platform"],
            "versions": result["versions"],
            "compiled": result["compiled"],
            "dtype": r["dtype"],
            "compile_s": r["compile_s"],
            "step_s": r["step_s"],
            "throughput": r["throughput"],
            "throughput_unit": UNITS[family],
            "memory_bytes": r["memory_bytes"],
            "memory_source": r["memory_source"],
            "detail": r,
        }
        mine_row = ours.get(label)
        if mine_row:  # the same computation in the original's time: the rates scale by jaxport's time / its own
            mine_row["vs_original"] = r["step_s"] / mine_row["step_s"]  # above 1: jaxport is faster
            row.update(
                {
                    k: mine_row[k]
                    for k in ("flops_per_step", "flops_source", "matmul_peak_gflops", "peak_source")
                    if k in mine_row
                }
            )
            row.update(
                {
                    k: mine_row[k] / mine_row["vs_original"]
                    for k in ("achieved_gflops", "fraction_of_peak", "mfu")
                    if mine_row.get(k) is not None
                }
            )
        rows.append(row)
    return rows


# -- the report


def family_rows(family: str, size: dict, args, status: dict, tmp: Path) -> tuple[dict | None, list[dict]]:
    command = [
        sys.executable,
        __file__,
        "--child",
        family,
        *(["--tiny"] if args.tiny else []),
        *(["--batch", str(args.batch)] if args.batch else []),
    ]
    out, code, err = run_child(command, args.timeout)
    lines = compare.json_lines(out)
    machine = next((line["machine"] for line in lines if "machine" in line), None)
    mine = [line for line in lines if line.get("section") == family]
    if code:
        mine.append(
            {
                "section": family,
                "side": "jaxport",
                "workload": "(the rest)",
                "status": "error",
                "reason": f"exit {code}: {err}",
            }
        )
    ok = [r for r in mine if r["status"] == "ok"]
    return machine, mine + original_rows(family, size, ok, status, tmp, args.timeout)


def titles(size: dict) -> dict:
    trm, gpt, dream = size["trm"], size["gpt"], size["dream"]
    spec = gpt_spec(gpt)["model"]
    return {
        "trm": f"TRM: one ACT call, forward + backward ({trm['title']}, batch {trm['batch']})",
        "gpt": f"GPT: one training iteration ({gpt['title']}, batch {gpt['batch']} x block {spec['block_size']})",
        "dream": f"Dream: diffusion generation ({dream['size']} random-init {dream['dtype']}, prompt "
        f"{dream['prompt_len']} + {dream['new_tokens']} new tokens; fast: blocks of "
        f"{dream['block_length']}, {FAST['cache']} cache, threshold {FAST['threshold']})",
    }


def flops_text(gflops) -> str:
    if gflops is None:
        return "—"
    return f"{gflops / 1e3:.1f} TFLOP/s" if gflops >= 1e3 else f"{gflops:.1f} GFLOP/s"


def percent(fraction) -> str:
    return "—" if fraction is None else f"{100 * fraction:.1f}%"


def table_row(r: dict) -> str:
    if r["status"] != "ok":
        last = r["reason"].strip().splitlines()[-1]  # an error's last line names it; the JSON has more
        return f"| {r['workload']} | {r['side']} | | | | | | | | | | {r['status']}: {last} |"
    versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items() if k in ("jax", "torch", "cuda"))
    note = [
        f"{r['speedup_vs_exact']:.2f}x exact" if "speedup_vs_exact" in r else "",
        f"{r['vs_original']:.2f}x the original" if "vs_original" in r else "",
        "torch.compile" if r.get("compiled") else "",
        "" if r["dtype"] in r["workload"] else r["dtype"],
    ]
    throughput = f"{r['throughput']:,.0f}" if r["throughput"] >= 100 else f"{r['throughput']:.3g}"
    return (
        f"| {r['workload']} | {r['side']} | {r['device']} | {versions} | {r['compile_s']:.2f} | "
        f"{r['step_s']:.4g} | {throughput} {r['throughput_unit']} | {flops_text(r.get('achieved_gflops'))} | "
        f"{percent(r.get('fraction_of_peak'))} | {percent(r.get('mfu'))} | {r['memory_bytes'] / 2**20:,.0f} | "
        f"{', '.join(n for n in note if n)} |"
    )


def markdown(report: dict) -> str:
    machine, originals = report["machine"] or {}, report["originals"]
    lines = [
        f"# jaxport suite: {machine.get('device', '?')} ({machine.get('platform', '?')}), {report['date']}",
        "",
        f"jax {machine.get('jax')}, jaxlib {machine.get('jaxlib')}, flax {machine.get('flax')}, "
        f"{machine.get('device_count')} device(s); originals: "
        + (
            f"torch {originals['torch']} (CUDA {originals['cuda']}) under torch.compile"
            if originals["available"]
            else f"not run ({originals['reason']})"
        )
        + (". **--tiny**: tiny sizes, a smoke run, not a measurement." if report["tiny"] else "."),
        "",
    ]
    for family, rows in report["sections"].items():
        peaks = sorted({(r["peak_source"], r["matmul_peak_gflops"]) for r in rows if "peak_source" in r})
        lines += [
            f"## {report['titles'][family]}",
            "",
            "| workload | side | device | versions | compile (s) | step (s) | throughput | FLOP/s | % of peak "
            "| MFU | memory (MiB) | note |",
            "|" + "---|" * 12,
            *map(table_row, rows),
            "",
            "Peak: " + ("; ".join(f"{source} {flops_text(g)}" for source, g in peaks) or "—"),
            "",
        ]
    if "gpu_gaps" in report:
        lines += gaps_markdown(report["gpu_gaps"])
    lines += [
        "Memory: jaxport, the high-water mark of the family's process when the row finished (device "
        "peak_bytes_in_use, or peak RSS on a CPU); the original, each row's torch.cuda.max_memory_allocated. "
        "MFU: nanoGPT's formula (GPT) or the upstream algorithm's model FLOPs (Dream exact) over the peak; % of "
        "peak: XLA-counted FLOPs (TRM, GPT). An original's row counts the same FLOPs as jaxport's in its own "
        "time; \"Nx the original\" is the original's time over jaxport's.",
        "",
    ]
    return "\n".join(lines)


def gaps_section(args, out: Path) -> dict:
    """bench/gpu_gaps.py's report (its `--tiny` mode with the suite's), or why it has none."""
    command = [sys.executable, str(Path(__file__).with_name("gpu_gaps.py")), "--out", str(out / "gpu_gaps")]
    _, code, err = run_child(command + (["--tiny"] if args.tiny else []), args.timeout)
    if code:
        return {"status": "error", "reason": f"exit {code}: {err}"}
    return {"status": "ok", **json.loads((out / "gpu_gaps" / "gpu_gaps.json").read_text())}


def gaps_markdown(gaps: dict) -> list[str]:
    lines = ["## GPU gaps (bench/gpu_gaps.py)", ""]
    if gaps["status"] != "ok":
        return [*lines, f"{gaps['status']}: {gaps['reason'].strip().splitlines()[-1]}", ""]
    interval = gaps["interval"]
    lines += [
        f"| XLA command buffers | s per GPT iteration, loss read every iteration | every {interval} |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {row['read_every_iteration_s']:.5f} | {row[f'read_every_{interval}_s']:.5f} |"
        for name, row in gaps["gpt"].items()
    ]
    kinds = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in list(gaps["trm"]["summary"]["by_kind_s"].items())[:4])
    return [*lines, "", f"TRM mlp_t bf16 step by op kind: {kinds} (the top ops: gpu_gaps/gpu_gaps.md)", ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", default=",".join(FAMILIES + STUDIES), help="comma-separated: trm, gpt, dream, gaps (gpu_gaps.py)"
    )
    parser.add_argument("--batch", type=int, default=None, help="GPT batch size (default 8; 4 with --tiny)")
    parser.add_argument("--out", default="suite_report", help="folder for suite.json and suite.md")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, the same code paths (a CPU smoke run)")
    parser.add_argument("--skip-originals", action="store_true", help="do not run the PyTorch originals")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds each side of a family may run before it is stopped"
    )
    parser.add_argument("--child", choices=FAMILIES, help=argparse.SUPPRESS)  # one family's jaxport rows
    args = parser.parse_args()
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch {args.batch}: expected a positive number of rows")
    size = sizes(args.tiny, args.batch)
    if args.child:
        child(args.child, size[args.child])
        return 0
    chosen = args.only.split(",")
    unknown = [f for f in chosen if f not in FAMILIES + STUDIES]
    if unknown:
        parser.error(f"--only {args.only}: unknown {', '.join(unknown)}; choose from {', '.join(FAMILIES + STUDIES)}")
    families = [f for f in chosen if f in FAMILIES]
    status = originals_status(args.skip_originals)
    report = {
        "suite": "jaxport accelerator suite",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "tiny": args.tiny,
        "command": " ".join(sys.argv),
        "machine": None,
        "originals": status,
        "titles": {f: t for f, t in titles(size).items() if f in families},
        "sizes": {},
        "sections": {},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxport_suite_") as tmp:
        for family in families:
            machine, rows = family_rows(family, size[family], args, status, Path(tmp))
            report["machine"] = report["machine"] or machine
            report["sizes"][family], report["sections"][family] = size[family], rows
            (out / "suite.json").write_text(json.dumps(report, indent=1, default=str))  # after each family: a run
            (out / "suite.md").write_text(markdown(report))  # cut short keeps what it finished
    if "gaps" in chosen:
        report["gpu_gaps"] = gaps_section(args, out)
        (out / "suite.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "suite.md").write_text(markdown(report))
    print(f"wrote {out / 'suite.json'} and {out / 'suite.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
