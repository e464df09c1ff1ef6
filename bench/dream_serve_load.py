"""Load on `jaxport dream serve`: N concurrent `openai` clients on loopback, printed as JSON.

Starts the server (start-up compilation timed apart), lets `--clients` clients send completions
(prompts cycled from a fixed list, greedy, `--max-tokens` each) until `--requests` are done or
`--seconds` have passed, then reports requests/s, generated tokens/s, p50/p95 latency, the error
count, the batch sizes the server ran and its peak resident memory, and stops it with SIGTERM.

    python bench/dream_serve_load.py                       # tiny fixture model
    python bench/dream_serve_load.py --random-init 40m     # 40M config, the tiny fixture's tokenizer
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


def start_server(args) -> tuple[subprocess.Popen, str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "jaxport.cli",
        "dream",
        "serve",
        "--model",
        str(args.model),
        "--served-model-name",
        "bench",
        "--dtype",
        args.dtype,
        "--port",
        str(port),
        "--max-batch",
        str(args.max_batch),
        "--max-queue",
        str(max(args.clients, args.max_batch)),
        "--prompt-buckets",
        str(args.prompt_bucket),
        "--max-tokens-buckets",
        str(args.max_tokens),
    ]
    if args.random_init:
        command += ["--random-init", args.random_init]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=args.log.open("w"))
    url = f"http://127.0.0.1:{port}"
    while process.poll() is None:
        try:
            httpx.get(f"{url}/health")
            return process, url, time.perf_counter() - start
        except httpx.TransportError:
            time.sleep(0.2)
    sys.exit(f"the server exited with {process.returncode}; see {args.log}")


def peak_rss_bytes(pid: int) -> int | None:
    status = Path(f"/proc/{pid}/status")
    if not status.is_file():
        return None
    line = next((row for row in status.read_text().splitlines() if row.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=TINY, help="Dream directory (with --random-init: its tokenizer)")
    parser.add_argument("--random-init", default=None, help="random weights of this size (40m, 7b)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64, help="stop after this many requests")
    parser.add_argument("--seconds", type=float, default=120, help="or after this long")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prompt-bucket", type=int, default=32)
    parser.add_argument(
        "--log",
        type=Path,
        default=Path(tempfile.gettempdir()) / "dream_serve_load.log",
        help="where the server's stderr goes",
    )
    args = parser.parse_args()

    process, url, startup_s = start_server(args)
    lock, latencies, tokens, errors, sent = threading.Lock(), [], [], [], [0]
    deadline = time.perf_counter() + args.seconds

    def run_client(worker: int):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
        while time.perf_counter() < deadline:
            with lock:
                if sent[0] >= args.requests:
                    return
                sent[0] += 1
                prompt = PROMPTS[(sent[0] + worker) % len(PROMPTS)]
            start = time.perf_counter()
            try:
                answer = client.completions.create(model="bench", prompt=prompt, max_tokens=args.max_tokens)
            except openai.APIError as err:
                with lock:
                    errors.append(repr(err))
                continue
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens.append(answer.usage.completion_tokens)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(run_client, range(args.clients)))
    seconds = time.perf_counter() - start
    metrics = httpx.get(f"{url}/metrics").json()
    peak_rss = peak_rss_bytes(process.pid)
    process.send_signal(signal.SIGTERM)
    exit_code = process.wait(timeout=120)
    print(
        json.dumps(
            {
                "what": "jaxport dream serve under concurrent openai clients",
                **environment(),
                "model": f"random-init {args.random_init}" if args.random_init else str(args.model),
                "dtype": args.dtype,
                "clients": args.clients,
                "max_batch": args.max_batch,
                "prompt_bucket": args.prompt_bucket,
                "max_tokens": args.max_tokens,
                "steps": args.max_tokens,
                "alg": "entropy",
                "temperature": 0.0,
                "startup_with_compilation_s": round(startup_s, 2),
                "seconds": round(seconds, 2),
                "requests": len(latencies),
                "errors": len(errors),
                "first_errors": errors[:3],
                "requests_per_s": round(len(latencies) / seconds, 3),
                "generated_tokens_per_s": round(sum(tokens) / seconds, 2),
                "latency_p50_s": round(float(np.percentile(latencies, 50)), 3) if latencies else None,
                "latency_p95_s": round(float(np.percentile(latencies, 95)), 3) if latencies else None,
                "batch_requests": metrics["batch_requests"],
                "batch_rows": metrics["batch_rows"],
                "server_peak_rss_bytes": peak_rss,
                "server_exit_code": exit_code,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
