"""Benchmark: the TRM training loop (`jaxport trm train`) on a dataset folder, as the original's
run_training.py harness runs upstream's pretrain.py: same upstream-style overrides, same data, evaluation
as configured. Prints JSON with the seconds per step over the whole run with evaluation, checkpoint saves, the
closing plots and the first (compiling) step excluded, the compile time, evaluation time, the final losses and peak RSS.

    python bench/trm_loop.py --data DATASET_PARENT -- arch=trm arch.hidden_size=64 ... epochs=4 eval_interval=1

`--data` is the folder that holds `data/{train,test}` (the layout the original's harness reads).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
from _common import emit, environment, peak_rss_bytes

from jaxport.runtime import host_memory
from jaxport.trm.run_config import load_run_config
from jaxport.trm.train import Trainer

host_memory.tune_process(training=True)  # as `jaxport trm train` does


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="trm_loop_")
    config = load_run_config(
        args.overrides
        + [
            f"data_paths=[{Path(args.data) / 'data'}]",
            "evaluators=[]",
            f"checkpoint_path={scratch}/run",
            "+project_name=bench",
            "+run_name=loop",
            "checkpoint_every_eval=false",
        ]
    )
    trainer = Trainer(config)
    marks = {"eval_s": 0.0, "excluded_s": 0.0}
    run_step = trainer.run_step

    def timed_run_step(state, batch, hyper):
        stepped = run_step(state, batch, hyper)
        if "first_step_done" not in marks:  # the first step compiles: time the loop from its end
            jax.block_until_ready(stepped)
            marks["first_step_done"] = time.perf_counter()
        return stepped

    def excluded(work, mark):
        """`work` timed apart once the steps before it are done: evaluation, as the original's harness excludes it,
        and the checkpoint saves and closing plots, which its train curve does not reach either."""

        def timed(*args, **kwargs):
            jax.block_until_ready(trainer.state)
            start = time.perf_counter()
            result = work(*args, **kwargs)
            marks[mark] += time.perf_counter() - start
            return result

        return timed

    trainer.run_step = timed_run_step
    trainer.evaluate = excluded(trainer.evaluate, "eval_s")
    trainer.save = excluded(trainer.save, "excluded_s")
    trainer.run.close = excluded(trainer.run.close, "excluded_s")
    start = time.perf_counter()
    result = trainer.train()
    end = time.perf_counter()
    steps = result["step"]
    loop_s = end - marks["first_step_done"] - marks["eval_s"] - marks["excluded_s"]
    rows = [json.loads(line) for line in (Path(scratch) / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/lm_loss"] for r in rows if "train/lm_loss" in r]
    emit(
        {
            "benchmark": "trm_training_loop",
            "machine": environment(),
            "overrides": args.overrides,
            "steps": steps,
            "step_s": round(loop_s / (steps - 1), 5),
            "loop_s_excluding_eval": round(loop_s, 2),
            "first_step_incl_compile_s": round(marks["first_step_done"] - start, 2),
            "eval_s": round(marks["eval_s"], 2),
            "saves_and_plots_s": round(marks["excluded_s"], 2),
            "wall_s": round(end - start, 2),
            "final_eval": result["eval"],
            "lm_loss_first_last": [losses[0], losses[-1]],
            "peak_rss_bytes": peak_rss_bytes(),
        }
    )


if __name__ == "__main__":
    main()
