"""`jaxport gpt prepare | train | sample`: nanoGPT's prepare.py, train.py and sample.py."""

from __future__ import annotations

import argparse
import difflib
import sys

from jaxport.errors import JaxportError

USAGE = """usage: jaxport gpt <action> [options]

actions:
  prepare DATASET     write train.bin/val.bin (+ meta.pkl) like nanoGPT's data/*/prepare.py;
                      DATASET: shakespeare_char, shakespeare (GPT-2 BPE), openwebtext
                      (HF datasets, or --input corpus) or text (--input FILE)
  train [CONFIG] [--key=value ...]
                      nanoGPT's train.py: CONFIG is a preset (train_shakespeare_char, train_gpt2,
                      finetune_shakespeare, eval_gpt2, ...) or a nanoGPT config file;
                      --compile-for SLICE compiles the run's iteration for a Cloud TPU slice
                      (v5e-8, v5p-64, ...) on this machine and reports memory, FLOPs and collectives
  sample [--key=value ...]
                      nanoGPT's sample.py (--out_dir, --start, --num_samples, --max_new_tokens,
                      --temperature, --top_k, --seed, --init_from=resume|gpt2*)
  export [--out_dir=DIR]
                      write DIR/ckpt.pt (nanoGPT's format) from the run's newest jaxport checkpoint
                      (multi-host runs write only jaxport's sharded checkpoints while training)

--runtime=NAME=VALUE,... (e.g. --runtime=attention=xla,remat=none) overrides the runtime's choices for any
action; a train config file may set them too: runtime = "attention=xla" (the command line wins).

Multi-host: add --coordinator HOST:PORT --num-processes N --process-id I to train or export on each
host (SLURM, Open MPI and TPU pods are detected without them).

`jaxport gpt <action> --help` lists an action's options and defaults."""


TRAINING_ACTIONS = {"train"}  # its steps run on the calling thread by default (runtime/settings.py)


def _flags_help(title: str, defaults: dict) -> str:
    return "\n".join([title, *(f"  --{k}={v!r}" for k, v in defaults.items())])


def prepare_main(argv: list[str]) -> int:
    from jaxport.gpt.data import prepare

    parser = argparse.ArgumentParser(prog="jaxport gpt prepare", description="prepare a nanoGPT data folder")
    parser.add_argument("dataset", choices=["shakespeare_char", "shakespeare", "openwebtext", "text"])
    parser.add_argument(
        "--input",
        help="local copy of the corpus (default: download like nanoGPT); for "
        "openwebtext a .jsonl file, a .txt file or a folder of .txt files",
    )
    parser.add_argument("--out_dir", help="output folder (default: data/DATASET)")
    parser.add_argument("--tokenizer", default="char", choices=["char", "gpt2"], help="for `text`")
    parser.add_argument("--tokenizer_dir", help="folder with GPT-2's encoder.json and vocab.bpe, for offline use")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        known = [a for action in parser._actions for a in action.option_strings]
        flag = unknown[0].split("=")[0]
        close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
        raise JaxportError(f"unknown flag {flag}" + (f"; did you mean {', '.join(close)}?" if close else ""))
    prepare(
        args.dataset, args.out_dir, input_file=args.input, tokenizer=args.tokenizer, tokenizer_dir=args.tokenizer_dir
    )
    return 0


def train_main(argv: list[str]) -> int:
    from jaxport.gpt import train
    from jaxport.gpt.configurator import configure
    from jaxport.gpt.settings import DEFAULTS, EXTRA

    defaults = {**DEFAULTS, **EXTRA, "progress": sys.stderr.isatty(), "runtime": ""}
    if any(a in ("-h", "--help") for a in argv):
        usage = (
            "usage: jaxport gpt train [CONFIG ...] [--key=value ...] [--compile-for SLICE]\n\n--compile-for SLICE "
            "compiles the run's iteration for a Cloud TPU slice (v5e-8, v5p-64, ...) on this machine and reports\n"
            "its memory per device, FLOPs, collectives and a roofline step time (needs jaxport[tpu]); it exits with 3\n"
            "where the iteration does not fit.\n\n"
            "flags and defaults:"
        )
        print(_flags_help(usage, defaults))
        return 0
    from jaxport.distributed import initialize_from_argv
    from jaxport.runtime.compile_for import take_flag

    slice_name, argv = take_flag(argv)
    cfg = configure(initialize_from_argv(argv), defaults)
    from jaxport import runtime

    runtime.configure(runtime.RuntimeSettings.parse(cfg.pop("runtime")))  # a config file's `runtime = "..."`
    if slice_name:
        return compile_train(cfg, slice_name)
    train.train(cfg)
    return 0


def compile_train(cfg: dict, slice_name: str) -> int:
    """`jaxport gpt train ... --compile-for SLICE`: the run's iteration compiled for a TPU slice, reported; no
    weights or data read (the dataset's meta.pkl, if there is one, gives the vocabulary)."""
    import jax

    from jaxport.gpt.settings import micro_steps
    from jaxport.gpt.trainer import compile_target, training_mesh
    from jaxport.runtime.compile_for import Program, compile_for

    def build(devices, fsdp=cfg["fsdp"], batch=cfg["batch_size"]):
        run = {**cfg, "fsdp": fsdp, "batch_size": batch}
        run["gradient_accumulation_steps"] = cfg["gradient_accumulation_steps"] * cfg["batch_size"] // batch
        mesh = training_mesh(run, devices)
        step, args = compile_target(run, mesh)
        accum = micro_steps(run, len(devices))
        params = sum(x.size for x in jax.tree.leaves(args[0].params))
        title = (
            f"jaxport gpt train: one iteration of a {params / 1e6:.0f}M-parameter GPT ({cfg['init_from']}), "
            f"{accum} micro-step(s) of {batch} x {cfg['block_size']} tokens per device, "
            f"--dtype={cfg['dtype']}"
        )
        return [Program(title, step, args, mesh, f"--fsdp={fsdp}")]

    def refits(devices):
        """The fewest and the most FSDP ways other than the run's, then the same tokens per iteration in smaller
        micro-batches (nanoGPT's batch_size halved, the accumulation steps doubled)."""
        widths = [f for f in range(1, len(devices) + 1) if len(devices) % f == 0 and f != cfg["fsdp"]]
        for fsdp in dict.fromkeys(widths[:1] + widths[-1:]):
            yield f"--fsdp={fsdp}", lambda fsdp=fsdp: build(devices, fsdp)
        batch, accum = cfg["batch_size"] // 2, cfg["gradient_accumulation_steps"] * 2
        while batch >= 1 and cfg["batch_size"] % batch == 0:
            yield (
                f"--batch_size={batch} --gradient_accumulation_steps={accum}",
                lambda batch=batch: build(devices, cfg["fsdp"], batch),
            )
            batch, accum = batch // 2, accum * 2

    return compile_for(slice_name, build, refits)


def export_main(argv: list[str]) -> int:
    from jaxport.gpt import train
    from jaxport.gpt.configurator import configure

    defaults = dict(out_dir="out", device="cpu")
    if any(a in ("-h", "--help") for a in argv):
        print(
            _flags_help(
                "usage: jaxport gpt export [--out_dir=DIR] [--device=cpu]\n\nwrites DIR/ckpt.pt (nanoGPT's "
                "format) from the run's newest jaxport checkpoint\n\nflags and defaults:",
                defaults,
            )
        )
        return 0
    from jaxport.distributed import initialize_from_argv

    cfg = configure(initialize_from_argv(argv), defaults)
    print(f"wrote {train.export(cfg['out_dir'], cfg['device'])}")
    return 0


def sample_main(argv: list[str]) -> int:
    from jaxport.gpt import sample

    if any(a in ("-h", "--help") for a in argv):
        print(_flags_help("usage: jaxport gpt sample [--key=value ...]\n\nflags and defaults:", sample.DEFAULTS))
        return 0
    return sample.main(argv)


ACTIONS = {"prepare": prepare_main, "train": train_main, "sample": sample_main, "export": export_main}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    action = ACTIONS.get(argv[0])
    if action is None:
        close = difflib.get_close_matches(argv[0], list(ACTIONS), n=1)
        raise JaxportError(
            f"unknown action {argv[0]!r}"
            + (f"; did you mean {close[0]!r}?" if close else f"; use {', '.join(ACTIONS)}")
        )
    return action(argv[1:])
