"""Two start-ups of `jaxport dream serve` with the same flags, over one fresh persistent compilation cache, as JSON.

The first start compiles the start-up set and writes it to the cache; the second loads it. Each start reports the
seconds until `/health` answers and the server's own start-up report from `/metrics.json` (programs, their
seconds, memory mappings). The server is the one `dream_serve_load.py` starts, with its flags.

    python bench/dream_serve_start.py --model tests/fixtures/dream/task_model --prompt-buckets 64 --max-tokens 64
"""

import argparse
import json
import os
import signal
import tempfile
from pathlib import Path

import httpx
from dream_serve_load import server_arguments, start_server

from jaxport.dream.throughput import environment


def one_start(args, batching: str) -> dict:
    process, url, ready_s = start_server(args, batching)
    try:
        start_up = httpx.get(f"{url}/metrics.json").json()["start_up"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait()
    return {"ready_s": round(ready_s, 2), **start_up}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    server_arguments(parser, "dream_serve_start")
    parser.add_argument("--batching", default="continuous", help="static or continuous")
    args = parser.parse_args()
    args.requests = args.max_batch  # sizes the server's queue
    with tempfile.TemporaryDirectory() as cache:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # the server inherits it: a cache nothing else wrote
        starts = [one_start(args, args.batching) for _ in range(2)]
        cached_files = sum(1 for _ in Path(cache).rglob("*") if _.is_file())
    print(
        json.dumps(
            {
                "bench": "dream_serve_start",
                "model": str(args.random_init or args.model),
                "batching": args.batching,
                "first_start": starts[0],
                "second_start": starts[1],
                "cache_files": cached_files,
                "environment": environment(),
            }
        )
    )


if __name__ == "__main__":
    main()
