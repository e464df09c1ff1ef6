"""Mixed traffic on `jaxport dream serve`: Poisson arrivals from `openai` clients on loopback, printed as JSON.

One fixed list of requests (prompts cycled, `max_tokens` drawn from a range, a share of them sampled with one of
`--settings` distinct temperature/top-p pairs and a seed) arrives at the times of a Poisson process of `--rate`
requests/s; at most `--clients` are in flight (a later arrival waits for a client). Every request streams, so the
time to its first chunk is its time to first block. The same requests and arrivals run against a fresh server per
`--batching` mode (static and continuous, back to back), and with `--greedy-baseline` once more all greedy. Each run
reports requests/s, generated tokens/s, p50/p95/p99 latency and time to first block, the compilations the server
did after start-up (from its `/metrics`), errors, and with `--check-seeded` whether every seeded reply equals the
same request sent alone afterwards.

    python bench/dream_serve_load.py --requests 200 --max-tokens 32 --settings 50 --check-seeded --greedy-baseline
    python bench/dream_serve_load.py --random-init 40m --clients 16 --max-tokens 32..256 --block-length 32 \\
        --cache dual --rate 4
    python bench/dream_serve_load.py --quick          # a small smoke run of both modes on the tiny fixture

`--against-fastdllm` sets the server against what a user would run without jaxport: a server wrapping Fast-dLLM's
`diffusion_generate`, batch 1, one request after another. Fast-dLLM's own harness
(`../shared/originals/bench/dream/bench_fastdllm.py`, run as `bench/compare.py` runs it) decodes the same requests'
prompts (tokenised as the server tokenises them) one after another at batch 1 and each request's own `max_tokens`
in as many steps (a harness call per `max_tokens` value; `max_tokens` are drawn in multiples of `--block-length`, as
its blocks need), greedy, with its threshold decoding in blocks of `--block-length` with `--cache`; untimed, it also
decodes each prompt on every server canvas no request's `max_tokens` equals (the server decodes a row on its
`max_tokens` bucket). The servers run the same decoding (`jaxport.dream.settings.fastdllm_settings`: `--alg`,
`--schedule`, each request's `top_k`), all greedy. Printed beside the runs: Fast-dLLM's seconds and tokens/s (its
timed passes only; with its calls' wall time, model loads included), each mode's tokens/s over it (the server's
start-up and compilations apart, in `startup_with_compilation_s`), and how many replies equal the reply the server
makes of Fast-dLLM's tokens on the same canvas, and at their own `max_tokens`, with the first differing token of
each that does not. The full comparison, on the 40M config's random weights that both read (a tokenizer with them
whose text names every token id), both batching modes in one run (about 25 minutes on a quiet 2-core host):

    python bench/dream_fastdllm.py prepare 40m /tmp/dream40m --prompts 4
    eval "$(../shared/originals/setup)"
    python bench/dream_serve_load.py --against-fastdllm --model /tmp/dream40m/model --requests 128 --clients 16 \\
        --max-tokens 32..256 --block-length 32 --cache dual --threshold 0.9 --rate 4
"""

import argparse
import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
from compare import check_originals, original
from prometheus_client.parser import text_string_to_metric_families

from jaxport.dream.config import DreamConfig
from jaxport.dream.serving.output import RowText
from jaxport.dream.settings import fastdllm_settings
from jaxport.dream.throughput import environment
from jaxport.dream.tokenizer import DreamTokenizer

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dream" / "tiny_bf16" / "model"
PROMPTS = [
    "def add(a, b):",
    "Write a quicksort in Python.",
    "import numpy as np",
    "class Stack:",
    "# read a CSV file and print the mean of each column",
    "fn main() {",
    "SELECT name FROM users WHERE",
    "def fibonacci(n):",
]


# sampling fields of Dream's own, sent beside the OpenAI ones
DREAM_SAMPLING = ("top_k", "alg", "alg_temp", "threshold")


def token_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("..")
    return int(low), int(high or low)


def buckets(low: int, high: int, block: int | None) -> list[int]:
    """The server's max_tokens buckets for a range: powers of two from `low` up to `high` (multiples of `block`)."""
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= 2
    sizes.append(high)
    if block:
        sizes = sorted({-(-s // block) * block for s in sizes})
    return sizes


def make_requests(args, rng: np.random.Generator, step: int = 1) -> list[dict]:
    """The run's requests: arrival time, prompt, max_tokens (a multiple of `step`) and sampling settings (shared by
    every mode)."""
    low, high = token_range(args.max_tokens)
    pairs = [
        (round(float(t), 3), round(float(p), 3)) for t, p in rng.uniform([0.2, 0.5], [1.5, 1.0], (args.settings, 2))
    ]
    arrivals = np.cumsum(rng.exponential(1 / args.rate, args.requests)) if args.rate > 0 else np.zeros(args.requests)
    requests = []
    for i in range(args.requests):
        request = {
            "at": float(arrivals[i]),
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": int(rng.integers(-(-low // step), high // step + 1)) * step,
        }
        if pairs and rng.uniform() < args.sampled_share:
            temperature, top_p = pairs[i % len(pairs)]
            request.update(temperature=temperature, top_p=top_p, seed=int(rng.integers(1 << 31)))
        requests.append(request)
    return requests


def start_server(args, batching: str) -> tuple[subprocess.Popen, str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    low, high = token_range(args.max_tokens)
    longest_prompt = max(map(int, args.prompt_buckets.split(",")))
    command = [sys.executable, "-m", "jaxport.cli", "dream", "serve", "--model", str(args.model)]
    command += ["--served-model-name", "bench", "--dtype", args.dtype, "--port", str(port)]
    command += ["--max-batch", str(args.max_batch), "--max-queue", str(max(args.requests, args.max_batch))]
    command += ["--prompt-buckets", args.prompt_buckets, "--batching", batching]
    command += ["--max-tokens-buckets", ",".join(map(str, buckets(low, high, args.block_length)))]
    command += ["--max-context", str(longest_prompt + high + (args.block_length or 0))]
    for flag in ("random_init", "alg", "block_length", "cache", "threshold", "schedule", "schedule_delay_factor"):
        if getattr(args, flag) is not None:
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    start = time.perf_counter()
    log = args.log.with_suffix(f".{batching}.log")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    while process.poll() is None:
        try:
            httpx.get(f"{url}/health")
            return process, url, time.perf_counter() - start
        except httpx.TransportError:
            time.sleep(0.2)
    sys.exit(f"the server exited with {process.returncode}; see {log}")


def compilations(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "jaxport_dream_compilations_total"
    )


def send(client: openai.OpenAI, request: dict) -> dict:
    """One streamed completion: its text, tokens, latency and time to first chunk."""
    options = {k: request[k] for k in ("temperature", "top_p", "seed") if k in request}
    dream_fields = {k: request[k] for k in DREAM_SAMPLING if k in request}
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    stream = client.completions.create(
        model="bench",
        prompt=request["prompt"],
        max_tokens=request["max_tokens"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body=dream_fields or None,
        **options,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"text": "".join(text), "tokens": tokens, "latency": end - start, "first": (first or end) - start}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 95, 99)}


def run(args, batching: str, requests: list[dict]) -> tuple[dict, list[dict | None]]:
    """The requests against a fresh server in `batching` mode: its report and each request's reply (`send`'s; None
    for an error)."""
    process, url, startup_s = start_server(args, batching)
    compiled_at_start = compilations(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=1200)
    results: list[dict | None] = [None] * len(requests)
    errors, lock = [], threading.Lock()

    def one(i: int):
        try:
            results[i] = send(client, requests[i])
        except openai.APIError as err:
            with lock:
                errors.append(repr(err))

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        futures = []
        for i, request in enumerate(requests):
            time.sleep(max(0.0, start + request["at"] - time.perf_counter()))
            futures.append(pool.submit(one, i))
        concurrent.futures.wait(futures)
    seconds = time.perf_counter() - start
    compiled_in_run = compilations(url) - compiled_at_start
    done = [r for r in results if r is not None]
    report = {
        "batching": batching,
        "startup_with_compilation_s": round(startup_s, 2),
        "seconds": round(seconds, 2),
        "requests": len(done),
        "errors": len(errors),
        "first_errors": errors[:3],
        "requests_per_s": round(len(done) / seconds, 3),
        "generated_tokens_per_s": round(sum(r["tokens"] for r in done) / seconds, 2),
        "latency_s": percentiles([r["latency"] for r in done]),
        "time_to_first_block_s": percentiles([r["first"] for r in done]),
        "compilations_after_start_up": int(compiled_in_run),
    }
    if args.check_seeded:
        seeded = [i for i, r in enumerate(requests) if "seed" in r and results[i] is not None]
        differ = [i for i in seeded if send(client, requests[i])["text"] != results[i]["text"]]
        report["seeded_requests"], report["seeded_replies_differing_alone"] = len(seeded), len(differ)
    metrics = httpx.get(f"{url}/metrics.json").json()
    report["block_calls"], report["batch_rows"] = metrics["block_calls"], metrics["batch_rows"]
    process.send_signal(signal.SIGTERM)
    report["server_exit_code"] = process.wait(timeout=120)
    return report, results


# -- --against-fastdllm: the requests' prompts decoded by Fast-dLLM's harness at batch 1, one after another


def fastdllm_decoding(args) -> dict:
    """What both sides decode with: Fast-dLLM's threshold decoding (`confidence_threshold`, greedy) in blocks of
    `--block-length` with `--cache`, as `fastdllm_settings` gives it jaxport: the server's `--alg` and `--schedule`
    (set here) and each request's `top_k`; steps are the server's default, one per new token of the canvas."""
    check_originals()
    if args.random_init or args.block_length is None or args.cache not in ("dual", "prefix") or not args.threshold:
        sys.exit(
            "--against-fastdllm needs --model DIR (weights both sides read: `bench/dream_fastdllm.py prepare 40m "
            "DIR` writes DIR/model), --block-length, --cache dual or prefix and --threshold"
        )
    settings = fastdllm_settings(
        steps=None,
        alg="confidence_threshold",
        threshold=args.threshold,
        block_length=args.block_length,
        dual_cache=args.cache == "dual",
    )
    args.alg, args.schedule, args.settings = settings["alg"], settings["schedule"], 0
    longest, largest = max(map(len, encode(args, PROMPTS).values())), max(map(int, args.prompt_buckets.split(",")))
    if longest > largest:
        sys.exit(f"a prompt of {longest} tokens is past --prompt-buckets {args.prompt_buckets}")
    return settings


def encode(args, prompts) -> dict[str, list[int]]:
    """Each prompt's token ids, as the server serving `--model` tokenises it."""
    tokenizer = DreamTokenizer.from_model_dir(args.model, DreamConfig.from_model_dir(args.model))
    return {prompt: tokenizer.encode(prompt) for prompt in prompts}


def server_canvas(args, max_tokens: int) -> int:
    """The new tokens of the canvas the server decodes a request on: its `max_tokens` bucket (also in a running
    batch, whose longer canvas the row does not see)."""
    return next(size for size in buckets(*token_range(args.max_tokens), args.block_length) if size >= max_tokens)


def fastdllm_pass(args, new: int, prompts: list[list[int]], tmp: Path, timed: bool) -> tuple[list[list[int]], float]:
    """Fast-dLLM's harness on `prompts` at batch 1, one after another, `new` tokens in as many steps: each prompt's
    new tokens, and the seconds of the pass (after one untimed prompt where `timed`)."""
    file = tmp / f"prompts_{new}_{'timed' if timed else 'reference'}.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in prompts))
    report, _ = original(
        "dream/bench_fastdllm.py",
        *("--model", str(args.model), "--prompt-ids", str(file), "--dtype", args.dtype, "--batches", "1"),
        *("--max-new-tokens", str(new), "--steps", str(new), "--block-length", str(args.block_length)),
        *("--alg", "confidence_threshold", "--threshold", str(args.threshold)),
        *(["--dual-cache"] if args.cache == "dual" else []),
        *("--runs", "1", "--warmup", "1" if timed else "0"),
        out=tmp / f"{file.stem}.json",
    )
    result = report["results"][0]
    if "failed" in result:
        sys.exit(f"Fast-dLLM's harness failed at {new} new tokens: {result['failed']}")
    return [row[len(prompt) :] for prompt, row in zip(prompts, result["sequences"], strict=True)], result["times_s"][0]


def fastdllm_side(args, requests: list[dict], encoded: dict) -> tuple[dict, dict]:
    """Fast-dLLM's harness at batch 1: every request's prompt at its own `max_tokens`, in order and timed (a call per
    value: the harness takes one), then untimed each prompt at a server canvas no request asked for. Returns the new
    tokens by (prompt, new tokens) and the timing."""
    tmp = Path(tempfile.mkdtemp(prefix="dream_serve_fastdllm_"))
    tokens, seconds, start = {}, 0.0, time.perf_counter()
    by_length: dict[int, list[str]] = {}
    for request in requests:
        by_length.setdefault(request["max_tokens"], []).append(request["prompt"])
    for new, prompts in sorted(by_length.items()):
        rows, took = fastdllm_pass(args, new, [encoded[p] for p in prompts], tmp, timed=True)
        tokens.update({(p, new): row for p, row in zip(prompts, rows)})
        seconds += took
    missing: dict[int, set[str]] = {}
    for request in requests:
        canvas = server_canvas(args, request["max_tokens"])
        if (request["prompt"], canvas) not in tokens:
            missing.setdefault(canvas, set()).add(request["prompt"])
    for new, prompts in sorted(missing.items()):
        rows, _ = fastdllm_pass(args, new, [encoded[p] for p in sorted(prompts)], tmp, timed=False)
        tokens.update({(p, new): row for p, row in zip(sorted(prompts), rows)})
    timing = {
        "seconds": round(seconds, 2),
        "harness_calls": len(by_length) + len(missing),
        "harness_wall_s": round(time.perf_counter() - start, 2),
    }
    return tokens, timing


def reply_of(tokenizer, ids: list[int], max_tokens: int) -> RowText:
    """The reply the server makes of a row's new tokens `ids`: text and tokens cut at end-of-text and `max_tokens`."""
    row = RowText(tokenizer, max_tokens, [])
    row.update(np.asarray(ids), final=True)
    return row


def token_agreement(tokenizer, requests: list[dict], replies: list[dict | None], reference: list[list[int]]) -> dict:
    """How many replies are the reply the server makes of the `reference` tokens (text and token count; with
    `bench/dream_fastdllm.py prepare`'s tokenizer a text names its token ids), and for each that is not the
    position of its first differing new token (the first reference token whose text the reply does not go on with)."""
    differing = []
    for i, (request, reply, ids) in enumerate(zip(requests, replies, reference, strict=True)):
        expected = reply_of(tokenizer, ids, request["max_tokens"])
        if reply is not None and (reply["text"], reply["tokens"]) == (expected.text, expected.tokens):
            continue
        text = "" if reply is None else reply["text"]
        first = next(
            (k for k in range(expected.tokens) if not text.startswith(reply_of(tokenizer, ids, k + 1).text)),
            expected.tokens,
        )
        differing.append({"request": i, "max_tokens": request["max_tokens"], "first_differing_token": first})
    return {"equal": f"{len(requests) - len(differing)}/{len(requests)}", "differing": differing}


def against_fastdllm(args, requests: list[dict], modes: list[str], runs: list[tuple[dict, list]]) -> dict:
    """Fast-dLLM's side of `--against-fastdllm` (`fastdllm_side`), each mode's tokens/s over it, and each mode's
    replies against Fast-dLLM's tokens on the canvas the server decoded them on (`server_canvas`) and at their own
    `max_tokens` (what a Fast-dLLM server would reply)."""
    tokenizer = DreamTokenizer.from_model_dir(args.model, DreamConfig.from_model_dir(args.model))
    tokens, timing = fastdllm_side(args, requests, encode(args, dict.fromkeys(r["prompt"] for r in requests)))
    own = [tokens[r["prompt"], r["max_tokens"]] for r in requests]
    reply_tokens = sum(reply_of(tokenizer, ids, r["max_tokens"]).tokens for r, ids in zip(requests, own))
    speed = reply_tokens / timing["seconds"]
    side = {
        "what": "Fast-dLLM's harness, batch 1, the requests one after another (no HTTP), greedy",
        **timing,
        "requests_per_s": round(len(requests) / timing["seconds"], 3),
        "generated_tokens_per_s": round(speed, 2),  # the tokens its replies would hold, as the server counts them
        "new_tokens_per_s": round(sum(r["max_tokens"] for r in requests) / timing["seconds"], 2),
    }
    by_mode = {}
    for mode, (report, replies) in zip(modes, runs):
        canvas = [tokens[r["prompt"], server_canvas(args, r["max_tokens"])] for r in requests]
        by_mode[mode] = {
            "tokens_per_s_over_fastdllm": round(report["generated_tokens_per_s"] / speed, 2),
            "replies_against_fastdllm_on_the_same_canvas": token_agreement(tokenizer, requests, replies, canvas),
            "replies_equal_to_fastdllm_at_their_own_max_tokens": token_agreement(tokenizer, requests, replies, own)[
                "equal"
            ],
        }
    return {"fastdllm": side, "jaxport": by_mode}


def server_arguments(parser: argparse.ArgumentParser, log_name: str):
    """The flags `start_server` reads (besides `requests`, which sizes the server's queue)."""
    parser.add_argument("--model", type=Path, default=TINY, help="Dream directory (with --random-init: its tokenizer)")
    parser.add_argument("--random-init", default=None, help="random weights of this size (40m, 7b)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", default="32", help="N, or LOW..HIGH drawn uniformly per request")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prompt-buckets", default="32", help="the server's, e.g. 16,64")
    parser.add_argument("--alg", default=None, help="the server's, for requests that give none")
    parser.add_argument("--block-length", type=int, default=None)
    parser.add_argument("--cache", default=None)
    parser.add_argument("--threshold", type=float, default=None)
    parser.add_argument("--schedule", default=None, help="the server's: jaxport or fastdllm")
    parser.add_argument("--schedule-delay-factor", type=float, default=None, help="the server's, in every mode")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / log_name, help="server stderr prefix")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    server_arguments(parser, "dream_serve_load")
    parser.add_argument("--clients", type=int, default=16, help="most requests in flight")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (0: all at once)")
    parser.add_argument("--settings", type=int, default=50, help="distinct temperature/top-p pairs (0: all greedy)")
    parser.add_argument("--sampled-share", type=float, default=1.0, help="share of requests sampled with a seed")
    parser.add_argument("--batching", default="static,continuous", help="modes run back to back")
    parser.add_argument("--greedy-baseline", action="store_true", help="also run the same requests all greedy")
    parser.add_argument("--check-seeded", action="store_true", help="resend each seeded request alone and compare")
    parser.add_argument(
        "--against-fastdllm",
        action="store_true",
        help="also decode the requests' prompts with Fast-dLLM's harness at batch 1, one after another (greedy, "
        "its threshold decoding; --model: weights both read)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the request mix and arrivals")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 12 requests, 4 settings, 16 tokens")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.settings, args.max_tokens, args.clients, args.max_batch = 12, 4, "8..16", 4, 4
        args.block_length, args.cache, args.check_seeded, args.rate = 4, "dual", True, 20.0
    decoding = fastdllm_decoding(args) if args.against_fastdllm else None
    rng = np.random.default_rng(args.seed)
    requests = make_requests(args, rng, args.block_length if decoding else 1)
    for request in requests if decoding else []:
        request["top_k"] = decoding["top_k"]
    modes = args.batching.split(",")
    runs = [run(args, mode, requests) for mode in modes]
    reports = [report for report, _ in runs]
    if args.greedy_baseline:
        greedy = [{k: v for k, v in r.items() if k not in ("temperature", "top_p", "seed")} for r in requests]
        reports.append({**run(args, modes[0], greedy)[0], "all_greedy": True})
    speed = {mode: report["generated_tokens_per_s"] for mode, report in zip(modes, reports)}
    low, high = token_range(args.max_tokens)
    record = {
        "what": "jaxport dream serve under Poisson arrivals of mixed requests",
        **environment(),
        "model": f"random-init {args.random_init}" if args.random_init else str(args.model),
        "dtype": args.dtype,
        "clients": args.clients,
        "rate_per_s": args.rate,
        "max_batch": args.max_batch,
        "prompt_buckets": args.prompt_buckets,
        "max_tokens": [low, high],
        "settings_pairs": args.settings,
        "sampled_share": args.sampled_share,
        "fast": {k: getattr(args, k) for k in ("alg", "block_length", "cache", "threshold", "schedule")},
        "schedule_delay_factor": args.schedule_delay_factor,
        "runs": reports,
    }
    if {"static", "continuous"} <= speed.keys() and speed["static"]:
        record["continuous_over_static_tokens_per_s"] = round(speed["continuous"] / speed["static"], 2)
    if decoding:
        record["against_fastdllm"] = against_fastdllm(args, requests, modes, runs)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
