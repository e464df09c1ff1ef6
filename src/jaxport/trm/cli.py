"""`jaxport trm <action>`: build datasets, train, evaluate, and the demo (the README's main job)."""

import argparse
import json
import sys
import time
from pathlib import Path

from jaxport.errors import JaxportError

ACTIONS = """actions:
  demo                      build a small Sudoku set, train TRM on it on this machine, evaluate
  build sudoku|maze|arc     write a puzzle dataset in upstream's format (--help for options)
  train [key=value ...]     upstream pretrain.py overrides, e.g. arch=trm data_paths="[data/x]" lr=1e-4
                            arch.L_layers=2 +run_name=NAME ema=True; --compile-for SLICE compiles the
                            run's step for a Cloud TPU slice (v4-8, v4-64, ...) on this machine and
                            reports its memory, FLOPs and collectives (needs jaxport[tpu]); exits
                            with 3 where it does not fit
  eval --run DIR            evaluate a run's latest checkpoint (or --checkpoint step_N --config all_config.yaml)

train, demo and eval take runtime.NAME=VALUE overrides (runtime.attention=xla runtime.remat=none) or, like every
family, --runtime attention=xla,remat=none, which wins.
"""
TRAINING_ACTIONS = {"train", "demo"}  # their steps run on the calling thread by default (runtime/settings.py)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxport trm <action> ...\n\n" + ACTIONS)
        return 0
    action, rest = argv[0], argv[1:]
    if action == "build":
        return _build(rest)
    if action == "train":
        return _train(rest)
    if action == "eval":
        return _eval(rest)
    if action == "demo":
        return _demo(rest)
    raise JaxportError(f"unknown action {action!r}\n\n{ACTIONS}")


def _build(argv):
    from jaxport.trm.build import BUILDERS

    if not argv or argv[0] not in BUILDERS:
        raise JaxportError(f"jaxport trm build needs one of {', '.join(BUILDERS)}")
    make_parser, build = BUILDERS[argv[0]]
    build(make_parser().parse_args(argv[1:]))
    return 0


def _train(argv):
    from jaxport.distributed import initialize_from_argv
    from jaxport.runtime.compile_for import take_flag
    from jaxport.trm.run_config import load_run_config
    from jaxport.trm.train import train

    slice_name, argv = take_flag(argv)
    overrides = initialize_from_argv(argv)
    if slice_name:
        return _compile_train(_configured(load_run_config(overrides)), slice_name)
    result = train(_configured(load_run_config(overrides)))
    print(json.dumps(result, indent=1))
    return 0


def _configured(config):
    """`config`, its `runtime:` settings now the process's (under the command line's `--runtime`)."""
    from jaxport import runtime

    runtime.configure(config.runtime)
    return config


def _saved_config(path) -> dict:
    """A run's saved all_config.yaml without the runtime settings in effect on its machine: this command's runtime
    chooses for its own devices."""
    from jaxport.trm.config import read_all_config

    return {key: value for key, value in read_all_config(path).items() if key != "runtime"}


def _compile_train(config, slice_name: str) -> int:
    """`jaxport trm train ... --compile-for SLICE`: the run's train step compiled for a TPU slice and reported, from
    the training set's dataset.json alone."""
    from jaxport.distributed import make_mesh
    from jaxport.runtime.compile_for import Program, compile_for
    from jaxport.trm.train import compile_target

    def build(devices, batch=config.global_batch_size):
        mesh = make_mesh(data=-1, devices=devices)
        step, args = compile_target(config.replace(global_batch_size=batch), mesh)
        a = config.arch
        title = (
            f"jaxport trm train: one training step (TRM {'mlp_t' if a.mlp_t else 'attention'}, hidden {a.hidden_size}, "
            f"L_layers {a.L_layers}, H_cycles {a.H_cycles} x L_cycles {a.L_cycles}, {a.forward_dtype}; "
            f"global_batch_size {batch}, {batch // len(devices)} per device)"
        )
        return [Program(title, step, args, mesh, f"global_batch_size={batch}")]

    def refits(devices):
        batch = config.global_batch_size // 2
        while batch >= len(devices) and batch % len(devices) == 0:
            yield f"global_batch_size={batch}", lambda batch=batch: build(devices, batch)
            batch //= 2

    return compile_for(slice_name, build, refits)


def _eval(argv):
    parser = argparse.ArgumentParser(prog="jaxport trm eval")
    parser.add_argument("--run", help="a jaxport run folder (checkpoint_path of `jaxport trm train`)")
    parser.add_argument("--checkpoint", help="an upstream step_N file")
    parser.add_argument("--config", help="the all_config.yaml of --checkpoint (default: beside it)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data_paths_test=[data/x]")
    from jaxport.distributed import initialize_from_argv

    args = parser.parse_args(initialize_from_argv(argv))
    from jaxport.trm.run_config import load_run_config
    from jaxport.trm.train import Trainer

    if args.run:
        run = Path(args.run)
        config = _configured(
            load_run_config(args.overrides + [f"checkpoint_path={run}"], base=_saved_config(run / "all_config.yaml"))
        )
        trainer = Trainer(config)
        with trainer.run:
            if not trainer.resume():
                raise JaxportError(f"no checkpoint in {run}")
            print(json.dumps(trainer.evaluate(), indent=1))
        return 0
    if args.checkpoint:
        config_path = Path(args.config) if args.config else Path(args.checkpoint).parent / "all_config.yaml"
        config = _configured(
            load_run_config(args.overrides + [f"load_checkpoint={args.checkpoint}"], base=_saved_config(config_path))
        )
        if config.checkpoint_path is None:
            config = config.replace(checkpoint_path=str(Path(args.checkpoint).parent))
        trainer = Trainer(config)
        with trainer.run:
            print(json.dumps(trainer.evaluate(), indent=1))
        return 0
    raise JaxportError("give --run DIR or --checkpoint step_N")


DEMO_OVERRIDES = [
    "arch.mlp_t=True",
    "arch.pos_encodings=none",
    "arch.hidden_size=64",
    "arch.num_heads=2",
    "arch.H_cycles=2",
    "arch.L_cycles=2",
    "arch.halt_max_steps=4",
    "arch.puzzle_emb_len=2",
    "arch.forward_dtype=float32",
    "global_batch_size=32",
    "lr=1e-3",
    "puzzle_emb_lr=1e-2",
    "lr_warmup_steps=50",
    "weight_decay=0.1",
    "puzzle_emb_weight_decay=0.1",
    "evaluators=[]",
    "ema=False",
    "seed=0",
]


def _demo(argv):
    parser = argparse.ArgumentParser(prog="jaxport trm demo", description="Train a small TRM on generated Sudoku.")
    parser.add_argument("--out", default="runs/trm-demo", help="folder for the dataset and the run")
    parser.add_argument("--givens", type=int, default=50, help="filled cells per generated puzzle")
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--num-test", type=int, default=256)
    parser.add_argument("--num-aug", type=int, default=8, help="shuffled copies of each training puzzle")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="extra config overrides")
    args = parser.parse_args(argv)
    from jaxport.trm.build import sudoku
    from jaxport.trm.run_config import load_run_config
    from jaxport.trm.train import train

    out = Path(args.out)
    data = out / f"sudoku-gen-{args.givens}givens-{args.num_train}x{args.num_aug + 1}"
    if not (data / "test" / "dataset.json").exists():
        print(
            f"building {args.num_train} training and {args.num_test} test Sudoku puzzles with {args.givens} givens "
            f"in {data}"
        )
        sudoku.build_sudoku(
            sudoku.parser().parse_args(
                [
                    "--generate",
                    "--num-train",
                    str(args.num_train),
                    "--num-test",
                    str(args.num_test),
                    "--givens",
                    str(args.givens),
                    "--num-aug",
                    str(args.num_aug),
                    "--output-dir",
                    str(data),
                ]
            )
        )
    config = load_run_config(
        DEMO_OVERRIDES
        + [
            f"data_paths=[{data}]",
            f"epochs={args.epochs}",
            f"eval_interval={args.eval_interval}",
            f"checkpoint_path={out / 'run'}",
            "+run_name=trm-demo",
        ]
        + args.overrides
    )
    t0 = time.time()
    result = train(_configured(config))
    accuracy = result["eval"].get("all/exact_accuracy")
    print(
        f"\ntrained TRM (mlp_t, hidden 64) for {result['step']} steps in {time.time() - t0:.0f} s; "
        f"test exact accuracy (whole puzzle solved): {accuracy:.3f}"
        if accuracy is not None
        else "no eval ran"
    )
    print(f"run folder: {result['run_dir']} (metrics.jsonl, all_config.yaml, learning_curves.png, checkpoints)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
