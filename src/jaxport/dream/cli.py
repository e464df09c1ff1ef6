"""`jaxport dream generate|bench|serve|eval`: diffusion generation from a Hugging Face Dream directory, its
speed, an OpenAI-compatible server, and scores on lm-evaluation-harness tasks."""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxport.dream.cache_kinds import CACHES, cache_help
from jaxport.errors import JaxportError

TRAINING_ACTIONS = {"train"}  # its steps run on the calling thread by default (runtime/settings.py)
RUNTIME_HELP = "--runtime NAME=VALUE,... (any action, e.g. --runtime attention=xla,remat=none) overrides the runtime"


def _mesh(spec: str | None):
    from jaxport.distributed import parse_mesh

    return parse_mesh(spec)


def _add_sampling(p: argparse.ArgumentParser):
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: --max-new-tokens)")
    p.add_argument("--alg", default="entropy", help="origin, maskgit_plus, topk_margin or entropy")
    p.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
    p.add_argument("--mesh", default=None, help="DATA,FSDP,MODEL device mesh sizes, e.g. 1,1,8")
    p.add_argument("--seed", type=int, default=0)
    _add_fast(p)


def _add_fast(p: argparse.ArgumentParser):
    fast = p.add_argument_group("fast decoding (Fast-dLLM)")
    fast.add_argument(
        "--block-length",
        type=int,
        default=None,
        help="generate in blocks of this many tokens, left to right (must divide --max-new-tokens)",
    )
    fast.add_argument(
        "--cache",
        default=None,
        help=f"{' or '.join(CACHES)}: approximate KV cache refreshed once per block ({cache_help()})",
    )
    fast.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="also unmask every mask of the block whose token has at least this probability, in (0, 1]",
    )
    fast.add_argument(
        "--schedule",
        default=None,
        help="jaxport (default: steps / blocks steps per block, each row's share of its masks) or fastdllm "
        "(Fast-dLLM's decoding token for token)",
    )


def _add_compile_for(p: argparse.ArgumentParser, what: str):
    p.add_argument(
        "--compile-for",
        default=None,
        metavar="SLICE",
        help=f"compile {what} for a Cloud TPU slice (v2-8, v4-8, v5e-8, v5p-64, ...) on this machine and report its "
        f"memory per device, FLOPs, collectives and a roofline time, reading no weights (needs jaxport[tpu]); exits "
        f"with 3 where a program does not fit",
    )


def _fast_args(args) -> dict:
    """The fast-decoding flags given (block-wise decoding when any is)."""
    names = ("block_length", "cache", "threshold", "schedule")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _steps(args) -> int:
    """--steps, by default --max-new-tokens, which is checked first: a bad one is named as itself, not as steps."""
    from jaxport.dream.settings import count

    new_tokens = count("max_new_tokens", args.max_new_tokens)
    return new_tokens if args.steps is None else args.steps  # --steps 0 is an error, not the default


def _settings(args, steps: int, **row) -> dict:
    """The generation settings of the flags, validated before any model is loaded (`GenerationSettings`)."""
    from jaxport.dream.settings import GenerationSettings

    settings = GenerationSettings.of(steps=steps, alg=args.alg, **row, **_fast_args(args))
    return settings.check(args.max_new_tokens).arguments()


def _generation_args(args) -> dict:
    """`diffusion_generate`'s arguments from `jaxport dream generate`'s flags, validated before any model is loaded."""
    steps = _steps(args)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, alg_temp=args.alg_temp)
    settings = _settings(args, steps, eps=args.eps, early_stop=not args.no_early_stop, **sampling)
    return dict(max_new_tokens=args.max_new_tokens, **settings)


def _read_prompts(args) -> list:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompts)
    if not path.is_file():
        raise JaxportError(f"--prompts {path}: no such file")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise JaxportError(f"{path}:{number}: not JSON ({err})") from None
        if isinstance(item, dict):
            item = item.get("messages", item.get("prompt"))
        if not isinstance(item, (str, list)):
            raise JaxportError(f'{path}:{number}: expected a string, {{"prompt": ...}} or {{"messages": [...]}}')
        prompts.append(item)
    if not prompts:
        raise JaxportError(f"{path}: no prompts")
    return prompts


def generate(args) -> int:
    from jaxport import dream
    from jaxport.dream.text import prompt_text

    if args.compile_for:
        return _compile_generate(args)
    prompts = _read_prompts(args)
    generation = _generation_args(args)
    steps = generation["steps"]
    mesh = _mesh(args.mesh)
    start = time.perf_counter()
    model, tokenizer = dream.load(args.model, dtype=args.dtype, mesh=mesh)
    print(f"loaded {args.model} ({args.dtype}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    texts = [prompt_text(tokenizer, item, args.chat, args.system) for item in prompts]
    # One prompt length for every batch, so the generation compiles once.
    prompt_len = max(len(tokenizer.encode(t)) for t in texts)
    state = {"batch": 0}
    compiled = set()

    # Defined once: hooks and progress callbacks are part of the compiled program's identity.
    def progress(step, x):
        step = state["step"] = int(step) + 1
        if args.watch:
            for row, canvas in enumerate(x[:, prompt_len:].tolist()):
                shown = "".join("_" if t == tokenizer.mask_token_id else tokenizer.decode([t]) for t in canvas)
                print(f"[step {step}/{steps} row {row}] {shown}", file=sys.stderr)
        else:
            print(
                f"\rbatch {state['batch']}: step {step}/{steps}",
                end="\n" if step == steps else "",
                file=sys.stderr,
                flush=True,
            )

    for first in range(0, len(prompts), args.batch_size):
        state["batch"] += 1
        input_ids, attention_mask = tokenizer(texts[first : first + args.batch_size], pad_to=prompt_len)
        if input_ids.shape not in compiled:
            compiled.add(input_ids.shape)
            print(
                f"compiling generation for prompts {list(input_ids.shape)} + {args.max_new_tokens} new tokens",
                file=sys.stderr,
            )
        start = time.perf_counter()
        out = model.diffusion_generate(
            input_ids,
            attention_mask,
            rng=jax.random.key(args.seed + first),
            progress=progress,
            stop_token_ids=tokenizer.stop_ids,
            **generation,
        )
        sequences = jax.device_get(out.sequences)
        if not args.watch and state.get("step") != steps:  # block-wise: blocks may end before their last step
            print(file=sys.stderr)
        print(f"batch {state['batch']}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
        batch = prompts[first : first + args.batch_size]
        for prompt, completion in zip(batch, tokenizer.decode_generation(sequences, prompt_len)):
            print(json.dumps({"prompt": prompt, "completion": completion}, ensure_ascii=False), flush=True)
    return 0


def bench(args) -> int:
    from jaxport import dream
    from jaxport.dream import throughput

    steps = _steps(args)
    mesh = _mesh(args.mesh)
    if args.random_init:
        model = dream.random_model(dream.preset(args.random_init), dtype=args.dtype, mesh=mesh, seed=args.seed)
    elif args.model:
        model, _ = dream.load(args.model, dtype=args.dtype, mesh=mesh)
    else:
        raise JaxportError("give --model DIR or --random-init SIZE (7b, 40m, tiny)")
    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    result = throughput.run(
        model,
        prompt_len=args.prompt_len,
        new_tokens=args.max_new_tokens,
        steps=steps,
        alg=args.alg,
        batch_sizes=batch_sizes,
        repeats=args.repeats,
        seed=args.seed,
        log=lambda m: print(m, file=sys.stderr),
        **_fast_args(args),
    )
    result["model"] = args.model or f"random-init {args.random_init}"
    print(json.dumps(result, indent=1))
    return 0


def _sizes(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise JaxportError(f"{flag} {text!r}: expected comma-separated integers, e.g. 64,256") from None


def _program(text: str) -> tuple:
    """`--program NAME=VALUE,...` as (name, value) pairs (values checked by the settings model)."""
    pairs = [part.split("=", 1) for part in text.split(",") if part]
    if not pairs or any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise JaxportError(f"--program {text!r}: expected NAME=VALUE pairs separated by commas, e.g. block_length=32")
    return tuple((name.strip(), value.strip()) for name, value in pairs)


def serve(args) -> int:
    from jaxport import dream
    from jaxport.dream.serving.api import serve as run_server
    from jaxport.dream.serving.settings import ServeSettings

    settings = ServeSettings(
        model_name=args.served_model_name
        or (f"dream-{args.random_init}-random" if args.random_init else Path(args.model).resolve().name),
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_context=args.max_context,
        prompt_buckets=_sizes(args.prompt_buckets, "--prompt-buckets"),
        max_tokens_buckets=_sizes(args.max_tokens_buckets, "--max-tokens-buckets"),
        default_max_tokens=args.default_max_tokens,
        alg=args.alg,
        fast=tuple((name, value) for name, value in _fast_args(args).items() if value is not None),
        programs=tuple(_program(text) for text in args.program),
        compile_on_demand=args.compile_on_demand,
        batching=args.batching,
        max_body_bytes=args.max_body_bytes,
        schedule_delay_factor=args.schedule_delay_factor,
    )
    if args.compile_for:
        return _compile_serve(args, settings)
    mesh = _mesh(args.mesh)
    start = time.perf_counter()
    if args.random_init:
        config, tokenizer = _serve_config(args)
        model = dream.random_model(config, dtype=args.dtype, mesh=mesh, seed=args.seed)
    else:
        model, tokenizer = dream.load(args.model, dtype=args.dtype, mesh=mesh)
    print(f"loaded {settings.model_name} ({args.dtype}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return run_server(model, tokenizer, settings, host=args.host, port=args.port, warmup=not args.no_warmup)


def _serve_config(args):
    """(model config, tokenizer) of `jaxport dream serve`: the directory's, or with --random-init the size's layers
    with the directory's vocabulary ids (a tokenizer for a benchmark model)."""
    from jaxport import dream

    tokens = dream.DreamConfig.from_model_dir(args.model)
    if not args.random_init:
        return tokens, dream.DreamTokenizer.from_model_dir(args.model, tokens)
    config = dream.preset(args.random_init)
    if tokens.vocab_size > config.vocab_size:
        raise JaxportError(
            f"--random-init {args.random_init}: its {config.vocab_size}-token vocabulary cannot "
            f"hold the {tokens.vocab_size} tokens of {args.model}"
        )
    config = config.with_token_ids_of(tokens)
    return config, dream.DreamTokenizer.from_model_dir(args.model, config)


# -- --compile-for: the programs a command compiles, for a TPU slice (jaxport.runtime.compile_for)


class _AbstractCanvas:
    """What `prepare_generation` reads of a model (its config and dtype) and where it puts the canvas: here shapes
    placed as `DreamModel.place_batch` places arrays, since nothing can be put on a slice that is not here."""

    def __init__(self, model):
        self.config, self.mesh, self.dtype = model.config, model.mesh, model.dtype

    def place_batch(self, *arrays):
        from jaxport.dream.model import batch_sharding

        return [
            None
            if a is None
            else jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=batch_sharding(self.mesh, a.shape))
            for a in arrays
        ]


def _compile_mesh(spec: str | None, devices):
    """(the run's mesh over the slice's devices, the flag that sets it): `--mesh`, else one device, where the
    commands put a model given no mesh."""
    from jaxport.distributed import make_mesh, parse_mesh

    if spec:
        return parse_mesh(spec, devices), f"--mesh {spec}"
    return make_mesh(devices=devices[:1]), "no --mesh: one device"


def _mesh_refits(devices, spec: str | None, layouts: tuple[str, ...]):
    """`--mesh` alternatives for a program that does not fit, in the order to prefer them: `layouts` are
    DATA,FSDP,MODEL patterns over `n`, the slice's devices."""
    n = len(devices)
    for layout in layouts:
        other = layout.format(n=n)
        if other != spec:
            yield f"--mesh {other}", other


def _generation_program(model, tokenizer, texts: list[str], prompt_len: int, title: str, flag: str, **generation):
    """The decoding program `diffusion_generate` compiles for these prompts (a full batch) and settings."""
    from jaxport.dream.decoding import decoding_target
    from jaxport.dream.program import prepare_generation
    from jaxport.runtime.compile_for import Program

    input_ids, attention_mask = tokenizer(texts, pad_to=prompt_len)
    # the rows' keys and sampling settings are placed as the canvas is, by `_AbstractCanvas.place_batch`
    prepared = prepare_generation(_AbstractCanvas(model), input_ids, attention_mask, **generation)
    program, arguments = decoding_target(model, prepared)
    return Program(title, program, arguments, model.mesh, flag)


def _decoding_name(settings: dict) -> str:
    fast = {k: v for k, v in settings.items() if k in ("block_length", "cache", "threshold") and v is not None}
    return "block-wise decoding (" + ", ".join(f"{k} {v}" for k, v in fast.items()) + ")" if fast else "exact decoding"


def _compile_generate(args) -> int:
    """`jaxport dream generate ... --compile-for SLICE`: the generation program of a full --batch-size batch of the
    prompts, compiled for a TPU slice and reported; the folder's config.json and tokenizer only."""
    from jaxport import dream
    from jaxport.dream.params import placed_abstract_model
    from jaxport.dream.text import prompt_text
    from jaxport.runtime.compile_for import compile_for

    config = dream.DreamConfig.from_model_dir(args.model)
    tokenizer = dream.DreamTokenizer.from_model_dir(args.model, config)
    texts = [prompt_text(tokenizer, item, args.chat, args.system) for item in _read_prompts(args)]
    prompt_len = max(len(tokenizer.encode(t)) for t in texts)
    rows = (texts * args.batch_size)[: args.batch_size]  # a full batch, as the first batch of enough prompts
    steps = _steps(args)
    generation = _generation_args(args)

    def build(devices, spec=args.mesh):
        mesh, flag = _compile_mesh(spec, devices)
        model = placed_abstract_model(config, args.dtype, mesh)
        title = (
            f"jaxport dream generate: {_decoding_name(generation)} of {args.batch_size} row(s), prompt {prompt_len} + "
            f"{args.max_new_tokens} new tokens in {steps} steps, {args.dtype} weights"
        )
        if mesh.devices.size == 1:  # with the command's progress callback, a host call after each step
            return [_generation_program(model, tokenizer, rows, prompt_len, title, flag, **generation, progress=print)]
        program = _generation_program(model, tokenizer, rows, prompt_len, title, flag, **generation)
        program.notes.append(
            "compiled without the command's progress callback: JAX refuses its ordered host callback on several "
            "devices, and the command itself stops there (jaxport.dream.generate, ordered=True)"
        )
        return [program]

    def refits(devices):
        for flag, spec in _mesh_refits(devices, args.mesh, ("1,1,{n}", "1,{n},1")):
            yield flag, lambda spec=spec: build(devices, spec)

    return compile_for(args.compile_for, build, refits)


def _served_program(model, tokenizer, planned, flag: str, dtype: str):
    """The program `planned` (`jaxport.dream.serving.engine.StartUpProgram`) as the server compiles it
    (`CompiledPrograms`): its rows left-padded to the prompt bucket, every branch of the sampler, its block index
    where each block is a program of its own, and in a running batch (continuous batching) a block index per row."""
    from jaxport.dream.exact import exact_target
    from jaxport.dream.fast import block_target
    from jaxport.dream.model import batch_sharding
    from jaxport.dream.program import prepare_generation
    from jaxport.dream.sampling import Branches
    from jaxport.dream.serving.programs import BatchKey
    from jaxport.runtime.compile_for import Program

    canvas = planned.key or planned.lane  # its prompt bucket, new tokens and program settings
    generation = dict(canvas.settings, max_new_tokens=canvas.new_tokens)
    input_ids, attention_mask = tokenizer(["Hello"] * planned.batch, pad_to=canvas.prompt_len)
    prepared = prepare_generation(_AbstractCanvas(model), input_ids, attention_mask, **generation)
    program = dataclasses.replace(prepared.program, branches=Branches())
    # a running batch's calls take no [D, V] head table (`RunningBatch.run`)
    prepared = dataclasses.replace(prepared, program=program, head_DV=None if planned.lane else prepared.head_DV)
    what = f"{_decoding_name(generation)} of {planned.batch} row(s)"
    if not program.blockwise:
        jitted, arguments = exact_target(model, prepared)
    elif planned.lane is not None:
        jitted, arguments = block_target(model, prepared)
        rows = (planned.batch,)
        block = jax.ShapeDtypeStruct(rows, np.int32, sharding=batch_sharding(model.mesh, rows))
        arguments = (*arguments[:-3], block, *arguments[-2:])  # (..., head_DV, block, program, refresh)
        what = f"a running batch's block call, {what}, each at its own block"
    else:
        jitted, arguments = block_target(model, prepared, np.int32(0) if planned.block is None else planned.block)
        if planned.block is not None:
            what += f", block {planned.block + 1} of {canvas.new_tokens // canvas.settings.block_length}"
    described = BatchKey(canvas.prompt_len, canvas.new_tokens, canvas.settings).describe()
    title = (
        f"jaxport dream serve: {what}, prompt bucket {canvas.prompt_len} + {canvas.new_tokens} new tokens "
        f"({described}), {dtype} weights"
    )
    return Program(title, jitted, arguments, model.mesh, flag)


def _compile_serve(args, settings) -> int:
    """`jaxport dream serve ... --compile-for SLICE`: every program the server compiles at start-up
    (`start_up_programs`: each prompt and max_tokens bucket, program setting and batch size, every block program of a
    generation, the running batch's under continuous batching), compiled for a TPU slice and reported, then what the
    server needs holding them all; `DOES_NOT_FIT` where one program, or all of them held at once, does not fit."""
    from jaxport.dream.params import placed_abstract_model
    from jaxport.dream.serving.engine import lane_of, start_up_programs
    from jaxport.dream.serving.programs import ServedPrograms, batch_buckets
    from jaxport.runtime.compile_for import compile_for

    config, tokenizer = _serve_config(args)
    plan = start_up_programs(
        ServedPrograms(settings).start_up_keys(),
        batch_buckets(settings.max_batch),
        lambda key: lane_of(key, settings.lane_tokens, settings.max_context),
    )

    def build(devices, spec=args.mesh):
        mesh, flag = _compile_mesh(spec, devices)
        model = placed_abstract_model(config, args.dtype, mesh)
        return [_served_program(model, tokenizer, planned, flag, args.dtype) for planned in plan]

    def refits(devices):
        for flag, spec in _mesh_refits(devices, args.mesh, ("1,1,{n}", "1,{n},1")):
            yield flag, lambda spec=spec: build(devices, spec)

    return compile_for(args.compile_for, build, refits, holder="the server")


def _compile_train(cfg, slice_name: str) -> int:
    """`jaxport dream train ... --compile-for SLICE`: the run's training step compiled for a TPU slice and reported."""
    from jaxport.dream import train as train_lib
    from jaxport.runtime.compile_for import Program, compile_for

    def build(devices, spec=cfg.mesh):
        run = dataclasses.replace(cfg, mesh=spec)
        mesh = train_lib.training_mesh(run, devices)
        step, arguments = train_lib.compile_target(run, mesh)
        params = sum(x.size for x in jax.tree.leaves(arguments[0].params))
        title = (
            f"jaxport dream train: one step of a {params / 1e9:.3g}B-parameter Dream ({cfg.model or cfg.config}), "
            f"{cfg.grad_accum} micro-batch(es) of {cfg.batch_size} x {cfg.seq_len} tokens, "
            f"{train_lib.compute_dtype(run, mesh).name} compute, float32 weights and AdamW moments"
        )
        return [Program(title, step, arguments, mesh, f"--mesh {spec}" if spec else "no --mesh: data-parallel")]

    def refits(devices):  # FSDP over every device first, then some of it as tensor parallelism
        n = len(devices)
        layouts = [f"1,{n},1"] + [f"1,{n // m},{m}" for m in (2, 4, 8) if n % m == 0 and n > m]
        for flag, spec in _mesh_refits(devices, cfg.mesh, tuple(layouts)):
            yield flag, lambda spec=spec: build(devices, spec)

    return compile_for(slice_name, build, refits)


def train(args) -> int:
    from jaxport.distributed import initialize
    from jaxport.dream import train as train_lib
    from jaxport.dream.train_config import TrainConfig, make_config

    options = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    if getattr(args, "compile_for", None):
        return _compile_train(make_config(**options), args.compile_for)
    initialize(args.coordinator, args.num_processes, args.process_id)
    result = train_lib.train(**options)
    print(json.dumps(result))
    return 0


def export(args) -> int:
    from jaxport.dream.params import export_run

    print(export_run(args.source, args.output, step=args.step, dtype=args.dtype, max_shard_size=args.max_shard_size))
    return 0


def tokenizer(args) -> int:
    from jaxport.dream.data import read_texts
    from jaxport.dream.tokenizer import train_tokenizer

    print(
        train_tokenizer(
            read_texts(args.input), args.output, vocab_size=args.vocab_size, min_frequency=args.min_frequency
        )
    )
    return 0


def evaluate(argv: list[str]) -> int:
    """`jaxport dream eval ARGS`: lm-evaluation-harness's command line, `ARGS` as `lm-eval` takes them, with the
    `jaxport-dream` model (`jaxport.dream.lm_eval`)."""
    try:
        from jaxport.dream.lm_eval import cli
    except ModuleNotFoundError as err:
        raise JaxportError(
            f"jaxport dream eval needs lm-evaluation-harness, and {err.name} is not installed: "
            "pip install 'jaxport[eval]'"
        ) from None
    return cli(argv)


def _add_train(actions):
    from jaxport.dream.train_config import TrainConfig

    tr = actions.add_parser(
        "train",
        help="masked-diffusion training (from a Hugging Face directory or from scratch), then a Hugging Face export",
        argument_default=argparse.SUPPRESS,
    )  # unset flags leave the preset's settings
    for field in dataclasses.fields(TrainConfig):
        flag, text = "--" + field.name.replace("_", "-"), field.metadata["help"]
        if field.type is bool:
            tr.add_argument(flag, action="store_true", help=text)
        else:
            kind = next(t for t in (int, float, str) if t is field.type or t in getattr(field.type, "__args__", ()))
            tr.add_argument(
                flag, type=kind, help=text if field.default is None else f"{text} (default: {field.default})"
            )
    tr.add_argument("--coordinator", default=None, help="multi-host: HOST:PORT of process 0")
    tr.add_argument("--num-processes", type=int, default=None)
    tr.add_argument("--process-id", type=int, default=None)
    _add_compile_for(tr, "the run's training step")
    tr.set_defaults(run=train)

    exp = actions.add_parser(
        "export",
        help="a Hugging Face directory from a training run folder (or another "
        "Hugging Face directory, to change dtype or shards)",
    )
    exp.add_argument("source", help="run folder of `jaxport dream train`, or a Hugging Face Dream directory")
    exp.add_argument("--output", required=True, help="directory to write")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest intact one)")
    exp.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the model's torch_dtype)")
    exp.add_argument("--max-shard-size", default="5GB", help="split the weights into shards above this size")
    exp.set_defaults(run=export)

    tok = actions.add_parser("tokenizer", help="train a byte-level BPE tokenizer with Dream's special tokens")
    tok.add_argument(
        "--input",
        required=True,
        nargs="+",
        help='text files, or JSONL ({"prompt", "completion"}, {"messages": [...]} or {"text"})',
    )
    tok.add_argument("--output", required=True, help="directory for tokenizer.json and tokenizer_config.json")
    tok.add_argument("--vocab-size", type=int, default=4096, help="tokens in all, Dream's 24 added tokens included")
    tok.add_argument("--min-frequency", type=int, default=2, help="a pair must occur this often to be merged")
    tok.set_defaults(run=tokenizer)


def _add_generate(actions):
    """`jaxport dream generate`'s flags."""
    gen = actions.add_parser("generate", help="generate text from prompts")
    gen.add_argument("--model", required=True, help="Hugging Face Dream/DiffuCoder directory")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts", help='JSONL file: one "string", {"prompt": ...} or {"messages": [...]} per line')
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    _add_sampling(gen)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--alg-temp", type=float, default=None)
    gen.add_argument("--eps", type=float, default=1e-3)
    gen.add_argument("--batch-size", type=int, default=1)
    gen.add_argument("--watch", action="store_true", help="print the canvas after every step (masks as _)")
    gen.add_argument(
        "--no-early-stop",
        action="store_true",
        help="decode every position: by default a batch stops once every row's text has ended (its first "
        "end-of-text decided, every position before it too), which changes no completion",
    )
    _add_compile_for(gen, "the generation program of a full --batch-size batch")
    gen.set_defaults(run=generate)


def _add_bench(actions):
    """`jaxport dream bench`'s flags."""
    ben = actions.add_parser("bench", help="forward and generation throughput, printed as JSON")
    ben.add_argument("--model", default=None, help="Hugging Face Dream directory")
    ben.add_argument("--random-init", default=None, help="random weights of a named size: 7b, 40m, tiny")
    _add_sampling(ben)
    ben.add_argument("--prompt-len", type=int, default=32)
    ben.add_argument("--batch-sizes", default="1,4")
    ben.add_argument("--repeats", type=int, default=3)
    ben.set_defaults(run=bench, max_new_tokens=64, dtype="float32")


def _add_serve(actions):
    """`jaxport dream serve`'s flags."""
    srv = actions.add_parser("serve", help="an OpenAI-compatible HTTP server that batches concurrent requests")
    srv.add_argument("--model", required=True, help="Hugging Face Dream/DiffuCoder directory")
    srv.add_argument(
        "--random-init",
        default=None,
        help="random weights of a named size (7b, 40m, tiny) for benchmarks; --model then only "
        "gives the tokenizer and its special token ids",
    )
    srv.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: the directory name)"
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-batch", type=int, default=8, help="most rows generated together")
    srv.add_argument("--max-queue", type=int, default=64, help="most rows waiting; more get HTTP 429")
    srv.add_argument("--max-context", type=int, default=2048, help="most prompt + new tokens per row")
    srv.add_argument("--prompt-buckets", default="128,512", help="prompt lengths rows are padded to")
    srv.add_argument("--max-tokens-buckets", default="64,256", help="canvas sizes max_tokens is rounded up to")
    srv.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of requests that give none (default: the smallest bucket)",
    )
    srv.add_argument("--alg", default="entropy", help="alg of requests that give none")
    srv.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
    srv.add_argument("--mesh", default=None, help="DATA,FSDP,MODEL device mesh sizes, e.g. 1,1,8")
    srv.add_argument("--seed", type=int, default=0, help="seed of --random-init weights")
    srv.add_argument(
        "--no-warmup",
        action="store_true",
        help="compile on first use only (default: the default settings' shapes at start-up)",
    )
    srv.add_argument(
        "--program",
        action="append",
        default=[],
        metavar="NAME=VALUE,...",
        help="one more combination of program settings (steps, alg, eps, block_length, cache, schedule; threshold "
        "for block-wise decoding) compiled at start-up over the defaults, e.g. block_length=32,cache=dual; repeat "
        "for more. Requests may choose any of these; other values get HTTP 400",
    )
    srv.add_argument(
        "--compile-on-demand",
        type=int,
        default=0,
        metavar="N",
        help="compile programs outside the start-up set for the requests that ask for them, keeping at most N "
        "(least recently used evicted; default 0: such requests get HTTP 400)",
    )
    srv.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="longest request body accepted (more: HTTP 413)"
    )
    srv.add_argument(
        "--batching",
        default="continuous",
        choices=("static", "continuous"),
        help="continuous (default): block-wise requests with the dual cache join and leave a running batch at block "
        "boundaries, the others keep static batching; static: a batch runs until every row's text has ended",
    )
    srv.add_argument(
        "--schedule-delay-factor",
        type=float,
        default=0.0,
        metavar="F",
        help="a batch with free rows waits up to F times the last batch (static) or block call (continuous) for "
        "more requests before it runs; continuous batching waits only where rows just left. Clients that send "
        "their next request on a reply then join the next call, not the one after (default 0: never wait)",
    )
    _add_fast(srv)  # defaults for requests that do not set them
    _add_compile_for(srv, "the programs the server compiles at start-up")
    srv.set_defaults(run=serve)


def _parser() -> argparse.ArgumentParser:
    """`jaxport dream`'s command line: every action's flags (`eval` passes its own to lm-eval)."""
    parser = argparse.ArgumentParser(
        prog="jaxport dream", description="Dream / DiffuCoder masked-diffusion LMs", epilog=RUNTIME_HELP
    )
    actions = parser.add_subparsers(dest="action", required=True)
    _add_generate(actions)
    _add_bench(actions)
    _add_serve(actions)
    _add_train(actions)
    actions.add_parser(
        "eval",
        add_help=False,
        help="score on lm-evaluation-harness tasks: lm-eval's own arguments (--model_args pretrained=DIR,... "
        "--tasks ...), with the jaxport-dream model",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # lm-eval parses its own arguments
        return evaluate(argv[1:])
    args = _parser().parse_args(argv)
    if getattr(args, "batch_size", 1) < 1:
        raise JaxportError(f"--batch-size must be at least 1, got {args.batch_size}")
    return args.run(args)
