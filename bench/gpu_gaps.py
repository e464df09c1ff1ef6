"""The gaps the H200 trace pointed at (docs/performance.md, "On an accelerator"), measured in one run of a few
minutes: GPT-2 124M's training iteration with and without XLA's command buffers, each with the loop reading every
iteration's loss (nanoGPT's log_interval=1) and with the loop dispatching the next steps before reading the last
loss (log_interval > 1), and TRM's mlp_t bfloat16 step profiled op by op.

    python bench/gpu_gaps.py [--out gpu_gaps] [--rounds 3] [--interval 10] [--tiny]

Each GPT variant runs in its own process (XLA reads `XLA_FLAGS` once, at start-up), alternating variants round by
round; the medians over rounds go in `gpu_gaps.json` and `gpu_gaps.md`. `--tiny` takes the same paths at tiny
sizes on any machine (`bench/suite.py --tiny` runs it, so the script cannot rot).
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="  # an empty list: every kernel launched on its own
VARIANTS = {"command buffers (XLA's default)": "", "no command buffers": NO_COMMAND_BUFFERS}
GPT_TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512, batch_size=4)
SIZES = {  # GPT iterations timed per loop style, warm-up iterations (the first compiles), TRM profiled calls
    "full": dict(iters=30, warmup=5, trm_repeat=5, trm_size="paper", trm_batch=32),
    "tiny": dict(iters=4, warmup=1, trm_repeat=1, trm_size="demo", trm_batch=4),
}


def gpt_child(tiny: bool, interval: int) -> dict:
    """One process's GPT-2 iteration timings: seconds per iteration reading every loss, and reading every
    `interval`-th (the steps in between dispatched while the device runs)."""
    import jax
    import numpy as np
    from gpt_train_step import CONFIGS

    from jaxport.distributed import fetch_replicated
    from jaxport.gpt import settings as gpt_settings
    from jaxport.gpt import trainer as gpt_trainer

    size = SIZES["tiny" if tiny else "full"]
    spec = {**CONFIGS["gpt2"], **(GPT_TINY if tiny else {})}
    vocab = spec.pop("vocab_size")
    device = {"cpu": "cpu", "tpu": "tpu"}.get(jax.default_backend(), "cuda")
    cfg = {**gpt_settings.DEFAULTS, **gpt_settings.EXTRA, **spec, "device": device, "gradient_accumulation_steps": 1}
    trainer = gpt_trainer.Trainer(cfg, vocab_size=vocab)
    rng = np.random.default_rng(0)
    X, Y = (rng.integers(0, vocab, (1, cfg["batch_size"], cfg["block_size"])) for _ in range(2))
    lr = cfg["learning_rate"]
    draw = 0

    def loop(iterations: int, every: int) -> float:
        """Seconds per iteration of `jaxport gpt train`'s loop reading the loss every `every` iterations."""
        nonlocal draw
        start = time.perf_counter()
        for i in range(iterations):
            losses, _ = trainer.step(X, Y, lr, draw)
            draw += 1
            if (i + 1) % every == 0 or i + 1 == iterations:
                float(fetch_replicated(losses)[-1])  # as the loop logs nanoGPT's last micro-step loss
        return (time.perf_counter() - start) / iterations

    loop(size["warmup"], 1)
    return {
        "device": jax.devices()[0].device_kind,
        "dtype": str(trainer.dtype.name if hasattr(trainer.dtype, "name") else trainer.dtype),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "read_every_iteration_s": loop(size["iters"], 1),
        f"read_every_{interval}_s": loop(size["iters"], interval),
    }


def trm_child(tiny: bool) -> dict:
    """TRM's mlp_t bfloat16 step (one ACT call forward and backward) traced op by op (bench/profile_ops.py)."""
    import profile_ops

    size = SIZES["tiny" if tiny else "full"]
    args = argparse.Namespace(mixer="mlp_t", dtype="bfloat16", batch=size["trm_batch"], size=size["trm_size"])
    step, arguments, step_runtime = profile_ops.trm_step(args)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        profile_ops.profile(step, arguments, step_runtime, top=25, repeat=size["trm_repeat"])
    lines = printed.getvalue().splitlines()
    summary = json.loads(lines[0])
    return {"summary": summary, "top_ops": lines[1:]}


def child(kind: str, tiny: bool, interval: int) -> None:
    sys.path.insert(0, str(BENCH))
    record = gpt_child(tiny, interval) if kind == "gpt" else trm_child(tiny)
    print(json.dumps(record), flush=True)


def run_child(kind: str, tiny: bool, interval: int, xla_flags: str = "") -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), xla_flags) if f)
    command = [sys.executable, __file__, "--child", kind, "--interval", str(interval)] + (["--tiny"] if tiny else [])
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{kind} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    interval = report["interval"]
    lines = [
        f"# GPU gaps: {report['device']}, {report['date']}"
        + (" (--tiny: a smoke run, not a measurement)" if report["tiny"] else ""),
        "",
        f"GPT-2 {'tiny' if report['tiny'] else '124M, batch 8 x block 1024'}: seconds per training iteration, "
        f"median of {report['rounds']} round(s) alternating the variants",
        "",
        f"| XLA command buffers | loss read every iteration | loss read every {interval} |",
        "|---|---|---|",
    ]
    for name, row in report["gpt"].items():
        lines.append(f"| {name} | {row['read_every_iteration_s']:.5f} | {row[f'read_every_{interval}_s']:.5f} |")
    trm = report["trm"]
    lines += [
        "",
        f"TRM mlp_t bfloat16, one ACT call forward + backward: {trm['summary']['ops_s_total'] * 1e3:.2f} ms in ops, by "
        f"kind {json.dumps(trm['summary']['by_kind_s'])}",
        "",
        "```",
        *trm["top_ops"],
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_gaps", help="folder for gpu_gaps.json and gpu_gaps.md")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both GPT variants (1 with --tiny)")
    parser.add_argument("--interval", type=int, default=10, help="iterations between loss reads, the second loop")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, the same code paths (a CPU smoke run)")
    parser.add_argument("--child", choices=("gpt", "trm"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tiny, args.interval)
        return 0
    rounds = 1 if args.tiny else args.rounds
    measured = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, flags in VARIANTS.items():
            measured[name].append(run_child("gpt", args.tiny, args.interval, flags))
    keys = ("read_every_iteration_s", f"read_every_{args.interval}_s")
    gpt = {
        name: {
            **{k: statistics.median(r[k] for r in records) for k in keys},
            "rounds": [{k: r[k] for k in keys} for r in records],
            "xla_flags": records[0]["xla_flags"],
        }
        for name, records in measured.items()
    }
    first = next(iter(measured.values()))[0]
    report = {
        "benchmark": "gpu_gaps",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "tiny": args.tiny,
        "device": first["device"],
        "dtype": first["dtype"],
        "rounds": rounds,
        "interval": args.interval,
        "gpt": gpt,
        "trm": run_child("trm", args.tiny, args.interval),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_gaps.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_gaps.md").write_text(markdown(report))
    print(json.dumps({k: report[k] for k in ("device", "dtype", "gpt")}))
    print(f"wrote {out / 'gpu_gaps.json'} and {out / 'gpu_gaps.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
