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
from prometheus_client.parser import text_string_to_metric_families

from jaxport.dream.throughput import environment

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


def make_requests(args, rng: np.random.Generator) -> list[dict]:
    """The run's requests: arrival time, prompt, max_tokens and sampling settings (shared by every mode)."""
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
            "max_tokens": int(rng.integers(low, high + 1)),
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
    for flag in ("random_init", "block_length", "cache", "threshold", "schedule_delay_factor"):
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


def run(args, batching: str, requests: list[dict]) -> dict:
    """The requests against a fresh server in `batching` mode."""
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
    return report


def server_arguments(parser: argparse.ArgumentParser, log_name: str):
    """The flags `start_server` reads (besides `requests`, which sizes the server's queue)."""
    parser.add_argument("--model", type=Path, default=TINY, help="Dream directory (with --random-init: its tokenizer)")
    parser.add_argument("--random-init", default=None, help="random weights of this size (40m, 7b)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", default="32", help="N, or LOW..HIGH drawn uniformly per request")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prompt-buckets", default="32", help="the server's, e.g. 16,64")
    parser.add_argument("--block-length", type=int, default=None)
    parser.add_argument("--cache", default=None)
    parser.add_argument("--threshold", type=float, default=None)
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
    parser.add_argument("--seed", type=int, default=0, help="of the request mix and arrivals")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 12 requests, 4 settings, 16 tokens")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.settings, args.max_tokens, args.clients, args.max_batch = 12, 4, "8..16", 4, 4
        args.block_length, args.cache, args.check_seeded, args.rate = 4, "dual", True, 20.0
    requests = make_requests(args, np.random.default_rng(args.seed))
    runs = [run(args, mode, requests) for mode in args.batching.split(",")]
    if args.greedy_baseline:
        greedy = [{k: v for k, v in r.items() if k not in ("temperature", "top_p", "seed")} for r in requests]
        runs.append({**run(args, args.batching.split(",")[0], greedy), "all_greedy": True})
    low, high = token_range(args.max_tokens)
    print(
        json.dumps(
            {
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
                "fast": {k: getattr(args, k) for k in ("block_length", "cache", "threshold")},
                "schedule_delay_factor": args.schedule_delay_factor,
                "runs": runs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
