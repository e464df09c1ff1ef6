"""Where a compiled step spends its time: trace one call with `jax.profiler`, match every executed op to
its instruction in the optimised HLO, and print the ops and op kinds by time, with achieved GFLOP/s for
the matrix products.

    python bench/profile_ops.py trm_step [--mixer attention] [--dtype bfloat16] [--batch 32] [--size paper|demo]
    python bench/profile_ops.py gpt_step [--config shakespeare] [--dropout 0.0]
    python bench/profile_ops.py dream [--new-tokens 64] [--batch 1]
    python bench/profile_ops.py dream_fastdllm [--new-tokens 128] [--batch 1] --repeat 20

Needs the `xprof` package's trace format only as far as `jax.profiler` writes it (trace.json.gz).
"""

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxport import runtime

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?)(?:\{[^}]*\})? (\w[\w-]*)\(")
CALLS = re.compile(r"calls=%?([\w.\-]+)")


def hlo_index(hlo_text: str) -> tuple[dict, dict]:
    """(instruction name -> (shape, opcode, called computation), computation name -> its body lines)."""
    instructions, computations, current = {}, {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and "=" not in line.split("{")[0]:
            current = header.group(1)
            computations[current] = []
            continue
        found = INSTRUCTION.match(line)
        if found:
            calls = CALLS.search(line)
            instructions[found.group(1)] = (found.group(2), found.group(3), calls.group(1) if calls else None, line)
            if current is not None:
                computations[current].append(line)
    return instructions, computations


def dot_flops(line: str, instructions: dict) -> float:
    """2 x (output elements) x (contracted size) of a dot instruction line."""
    out = re.search(r"= \w+\[([\d,]*)\]", line)
    lhs = re.search(r"dot\((?:\w+\[([\d,]*)\]\S* )?%?([\w.\-]+)", line)
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    if not (out and lhs and contracting):
        return 0.0
    shape = (
        lhs.group(1)
        if lhs.group(1) is not None
        else re.search(r"\[([\d,]*)\]", instructions.get(lhs.group(2), ("[]",))[0]).group(1)
    )
    lhs_shape = [int(d) for d in shape.split(",") if d]
    contracted = np.prod([lhs_shape[int(d)] for d in contracting.group(1).split(",") if d])
    return 2.0 * np.prod([int(d) for d in out.group(1).split(",") if d] or [1]) * contracted


def kind_of(name: str, instructions: dict, computations: dict) -> tuple[str, float, str]:
    """(op kind, FLOPs if it contains a dot, a short description) of an executed op."""
    shape, opcode, called, line = instructions.get(name, ("?", "?", None, ""))
    body = computations.get(called, []) if called else [line]
    dots = [b for b in body if " dot(" in b]
    if dots:
        operands = re.search(r"dot\(%?([\w.\-]+), %?([\w.\-]+)\)", dots[0])
        shapes = [instructions.get(o, ("?",))[0] for o in operands.groups()] if operands else []
        text = f"{' x '.join(shapes)} -> {shape}  {dots[0].split(')', 1)[1].strip()[:70]}"
        return "dot", sum(dot_flops(d, instructions) for d in dots), text
    ops = collections.Counter(INSTRUCTION.match(b).group(3) for b in body if INSTRUCTION.match(b))
    # bfloat16 elementwise fusions all hold converts (XLA:CPU computes them in float32): "convert" is a
    # fusion that only converts (e.g. a dot's float32 result rounded to bfloat16, or operands widened)
    only_converts = set(ops) <= {"convert", "parameter", "bitcast"}
    for kind in ("reduce", "transpose", "copy", "convert", "scatter", "gather", "rng-bit-generator"):
        if ops.get(kind) and (kind != "convert" or only_converts):
            return kind if kind != "copy" else "copy/layout", 0.0, f"{shape} {opcode} {dict(ops.most_common(4))}"
    return (
        ("elementwise" if opcode == "fusion" or called else opcode),
        0.0,
        f"{shape} {opcode} {dict(ops.most_common(4))}",
    )


def profile(function, args, step_runtime, top: int, only_kind: str | None = None, repeat: int = 1) -> None:
    """`function(*args)` compiled as jaxport compiles it (`step_runtime`). Times are per call, averaged over
    `repeat` traced calls (a single call's first-touch outliers even out)."""
    compiled = runtime.jit(function, step_runtime).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    jax.block_until_ready(compiled(*args))
    instructions, computations = hlo_index(compiled.as_text())
    out = tempfile.mkdtemp(prefix="profile_ops_")
    jax.profiler.start_trace(out)
    for _ in range(repeat):
        jax.block_until_ready(compiled(*args))
    jax.profiler.stop_trace()
    trace = json.load(gzip.open(glob.glob(out + "/**/*.trace.json.gz", recursive=True)[0]))
    per_op, calls, kinds = collections.Counter(), collections.Counter(), collections.Counter()
    flops, described = {}, {}
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") != "X" or name not in instructions:
            continue
        per_op[name] += event["dur"] / 1e6 / repeat
        calls[name] += 1  # an op inside a loop runs once per iteration
    total = sum(per_op.values())
    calls = collections.Counter({name: count // repeat for name, count in calls.items()})
    for name, seconds in per_op.items():
        kind, f, text = kind_of(name, instructions, computations)
        kinds[kind] += seconds
        flops[name], described[name] = (f or 0) * calls[name], f"{kind:12s} {text}"
    dot_s = kinds.get("dot", 0.0)
    dot_flops_total = sum(flops.values())
    print(
        json.dumps(
            {
                "ops_s_total": round(total, 4),
                "by_kind_s": {k: round(v, 4) for k, v in kinds.most_common()},
                "dot_gflops": round(dot_flops_total / max(dot_s, 1e-9) / 1e9, 1),
            }
        )
    )
    shown = [(n, s) for n, s in per_op.most_common() if only_kind is None or described[n].startswith(only_kind)]
    for name, seconds in shown[:top]:
        rate = f"{flops[name] / seconds / 1e9:7.1f} GFLOP/s" if flops[name] else " " * 15
        print(
            f"{seconds * 1e3:8.2f} ms {100 * seconds / total:5.1f}% {rate} {calls[name]:5d}x  {name:28s} "
            f"{described[name][:150]}"
        )


def trm_step(args):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from flax import nnx
    from trm_step import PAPER_SUDOKU, sudoku_batch

    from jaxport.trm import TRM, TRMConfig
    from jaxport.trm.model import loss_and_grad

    arch = dict(PAPER_SUDOKU)
    if args.size == "demo":  # bench/compare.py's trm_loop model (the original harness's README overrides)
        arch.update(
            hidden_size=64, num_heads=2, H_cycles=2, L_cycles=2, halt_max_steps=4, puzzle_emb_ndim=0, puzzle_emb_len=0
        )
    config = TRMConfig(
        **arch,
        mlp_t=args.mixer == "mlp_t",
        forward_dtype=args.dtype,
        pos_encodings="none" if args.mixer == "mlp_t" else "rope",
        batch_size=args.batch,
    )
    model = TRM(config, rngs=nnx.Rngs(0))
    model.train()
    batch = {k: jnp.asarray(v) for k, v in sudoku_batch(args.batch, np.random.default_rng(0)).items()}
    graphdef, state = nnx.split(model)
    step = lambda state, carry, batch: loss_and_grad(
        nnx.merge(graphdef, state),
        carry,
        batch,
        args.batch,  # noqa: E731
        jax.random.key(0),
    )
    return step, (state, model.initial_carry(batch), batch), model.runtime_for(batch["inputs"].shape)


def gpt_step(args):
    from jaxport.gpt import settings as gpt_settings
    from jaxport.gpt import trainer as gpt_trainer

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from gpt_train_step import CONFIGS

    spec = dict(CONFIGS[args.config], dropout=args.dropout)
    vocab = spec.pop("vocab_size")
    cfg = {
        **gpt_settings.DEFAULTS,
        **gpt_settings.EXTRA,
        **spec,
        "device": "cpu",
        "init_from": "scratch",
        "gradient_accumulation_steps": 1,
    }
    trainer = gpt_trainer.Trainer(cfg, vocab_size=vocab)
    X = np.random.default_rng(0).integers(0, vocab, (1, cfg["batch_size"], cfg["block_size"]))
    return trainer._step.__wrapped__, trainer.step_args(X, X, 1e-3), trainer.runtime


def dream(args):
    """The exact path of the 40M config's random weights, `--new-tokens` tokens in as many steps."""
    from flax import nnx

    from jaxport import dream as dream_lib
    from jaxport.dream.exact import exact_loop
    from jaxport.dream.program import prepare_generation

    model = dream_lib.random_model(dream_lib.preset("40m"))
    ids = np.random.default_rng(0).integers(0, 31000, (args.batch, 32)).astype(np.int32)
    prepared = prepare_generation(
        model, ids, None, max_new_tokens=args.new_tokens, steps=args.new_tokens, alg="entropy"
    )
    graphdef, state = nnx.split(model)
    p = prepared

    def generate(state, x, keys):
        return exact_loop(graphdef, state, x, p.valid_BN, keys, p.rows, p.program)

    # the runtime jaxport decodes with
    return generate, (state, p.x_BN, p.keys_B), runtime.for_tokens(p.x_BN, model.dtype)


def dream_fastdllm(args):
    """The first block of `bench/compare.py --only fastdllm`'s case (a): the task model decoding a held-out prompt
    as Fast-dLLM decodes it (threshold 0.9, dual cache, blocks of 32, `--new-tokens` new tokens)."""
    from pathlib import Path

    from flax import nnx

    from jaxport import dream as dream_lib
    from jaxport.dream import tasks
    from jaxport.dream.fast import _block
    from jaxport.dream.params import load_model
    from jaxport.dream.program import prepare_generation
    from jaxport.dream.settings import fastdllm_settings

    folder = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dream" / "task_model"
    config = dream_lib.DreamConfig.from_model_dir(folder)
    model, tokenizer = load_model(folder, config), dream_lib.DreamTokenizer.from_model_dir(folder, config)
    prompts = [tokenizer.encode(problem.prompt) for problem in tasks.demo_test_problems(args.batch)]
    ids = np.array([row + [row[-1]] * (max(map(len, prompts)) - len(row)) for row in prompts], np.int32)
    settings = fastdllm_settings(
        steps=args.new_tokens, alg="confidence_threshold", threshold=0.9, block_length=32, dual_cache=True
    )
    p = prepare_generation(model, ids, None, max_new_tokens=args.new_tokens, blockwise=True, **settings)
    graphdef, state = nnx.split(model)

    def block(state, x, keys):
        return _block(graphdef, state, x, p.valid_BN, keys, p.rows, np.int32(0), p.program, False)

    return block, (state, p.x_BN, p.keys_B), runtime.for_tokens(p.x_BN, model.dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["trm_step", "gpt_step", "dream", "dream_fastdllm"])
    parser.add_argument("--mixer", default="attention")
    parser.add_argument("--size", default="paper", choices=["paper", "demo"], help="TRM size")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--config", default="shakespeare")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--kind", default=None, help="list only ops of this kind (dot, convert, transpose, ...)")
    parser.add_argument("--repeat", type=int, default=1, help="calls to trace; times are their average")
    args = parser.parse_args()
    workloads = {"trm_step": trm_step, "gpt_step": gpt_step, "dream": dream, "dream_fastdllm": dream_fastdllm}
    workload = workloads[args.workload]
    function, call_args, step_runtime = workload(args)
    profile(function, call_args, step_runtime, args.top, args.kind, args.repeat)


if __name__ == "__main__":
    main()
