"""`jaxport dream generate|bench`: diffusion generation from a Hugging Face Dream directory, and speed."""

import argparse
import json
import sys
import time
from pathlib import Path

import jax

from jaxport.errors import JaxportError


def _mesh(spec: str | None):
    if not spec:
        return None
    from jaxport.distributed import make_mesh
    try:
        data, fsdp, model = (int(v) for v in spec.split(","))
        return make_mesh(data=data, fsdp=fsdp, model=model)
    except ValueError as err:
        raise JaxportError(f"--mesh {spec!r}: expected DATA,FSDP,MODEL sizes covering "
                           f"{jax.device_count()} devices ({err})") from None


def _add_sampling(p: argparse.ArgumentParser):
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: --max-new-tokens)")
    p.add_argument("--alg", default="entropy", help="origin, maskgit_plus, topk_margin or entropy")
    p.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
    p.add_argument("--mesh", default=None, help="DATA,FSDP,MODEL device mesh sizes, e.g. 1,1,8")
    p.add_argument("--seed", type=int, default=0)


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
            raise JaxportError(f"{path}:{number}: expected a string, {{\"prompt\": ...}} or {{\"messages\": [...]}}")
        prompts.append(item)
    if not prompts:
        raise JaxportError(f"{path}: no prompts")
    return prompts


def _prompt_text(tokenizer, item, chat: bool, system: str | None) -> str:
    if isinstance(item, list):  # chat messages
        return tokenizer.apply_chat_template(item, add_generation_prompt=True)
    if not chat:
        return item
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": item}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def generate(args) -> int:
    from jaxport import dream
    prompts = _read_prompts(args)
    steps = args.steps or args.max_new_tokens
    mesh = _mesh(args.mesh)
    start = time.perf_counter()
    model, tokenizer = dream.load(args.model, dtype=args.dtype, mesh=mesh)
    print(f"loaded {args.model} ({args.dtype}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    texts = [_prompt_text(tokenizer, item, args.chat, args.system) for item in prompts]
    # One prompt length for every batch, so the generation compiles once.
    prompt_len = max(len(tokenizer.encode(t)) for t in texts)
    state = {"batch": 0}
    compiled = set()

    # Defined once: hooks and progress callbacks are part of the compiled program's identity.
    def progress(step, x):
        step = int(step) + 1
        if args.watch:
            for row, canvas in enumerate(x[:, prompt_len:].tolist()):
                shown = "".join("_" if t == tokenizer.mask_token_id else tokenizer.decode([t]) for t in canvas)
                print(f"[step {step}/{steps} row {row}] {shown}", file=sys.stderr)
        else:
            print(f"\rbatch {state['batch']}: step {step}/{steps}", end="\n" if step == steps else "",
                  file=sys.stderr, flush=True)

    for first in range(0, len(prompts), args.batch_size):
        state["batch"] += 1
        input_ids, attention_mask = tokenizer(texts[first:first + args.batch_size], pad_to=prompt_len)
        if input_ids.shape not in compiled:
            compiled.add(input_ids.shape)
            print(f"compiling generation for prompts {list(input_ids.shape)} + {args.max_new_tokens} new tokens",
                  file=sys.stderr)
        start = time.perf_counter()
        out = model.diffusion_generate(input_ids, attention_mask, max_new_tokens=args.max_new_tokens, steps=steps,
                                       alg=args.alg, temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, alg_temp=args.alg_temp, eps=args.eps,
                                       rng=jax.random.key(args.seed + first), progress=progress)
        sequences = jax.device_get(out.sequences)
        print(f"batch {state['batch']}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
        batch = prompts[first:first + args.batch_size]
        for prompt, completion in zip(batch, tokenizer.decode_generation(sequences, prompt_len)):
            print(json.dumps({"prompt": prompt, "completion": completion}, ensure_ascii=False), flush=True)
    return 0


def bench(args) -> int:
    from jaxport import dream
    from jaxport.dream import bench as bench_lib
    mesh = _mesh(args.mesh)
    if args.random_init:
        model = dream.random_model(dream.preset(args.random_init), dtype=args.dtype, mesh=mesh, seed=args.seed)
    elif args.model:
        model, _ = dream.load(args.model, dtype=args.dtype, mesh=mesh)
    else:
        raise JaxportError("give --model DIR or --random-init SIZE (7b, 40m, tiny)")
    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    result = bench_lib.run(model, prompt_len=args.prompt_len, new_tokens=args.max_new_tokens,
                           steps=args.steps or args.max_new_tokens, alg=args.alg, batch_sizes=batch_sizes,
                           repeats=args.repeats, seed=args.seed, log=lambda m: print(m, file=sys.stderr))
    result["model"] = args.model or f"random-init {args.random_init}"
    print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxport dream", description="Dream / DiffuCoder masked-diffusion LMs")
    actions = parser.add_subparsers(dest="action", required=True)

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
    gen.set_defaults(run=generate)

    ben = actions.add_parser("bench", help="forward and generation throughput, printed as JSON")
    ben.add_argument("--model", default=None, help="Hugging Face Dream directory")
    ben.add_argument("--random-init", default=None, help="random weights of a named size: 7b, 40m, tiny")
    _add_sampling(ben)
    ben.add_argument("--prompt-len", type=int, default=32)
    ben.add_argument("--batch-sizes", default="1,4")
    ben.add_argument("--repeats", type=int, default=3)
    ben.set_defaults(run=bench, max_new_tokens=64, dtype="float32")

    args = parser.parse_args(argv)
    if getattr(args, "batch_size", 1) < 1:
        raise JaxportError(f"--batch-size must be at least 1, got {args.batch_size}")
    return args.run(args)
