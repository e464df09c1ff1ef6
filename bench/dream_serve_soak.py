"""A soak of `jaxport dream serve`: a long run of mixed traffic that watches the server for leaks and surprises.

The server is the one `dream_serve_load.py` starts (the tiny fixture model unless told otherwise, with its flags),
here with continuous batching by default. `--clients` threads send requests back to back for `--minutes`, drawn
from one seeded stream: completions and chats, whole or streamed (streamed as the load bench sends them), prompts of
lengths across `--prompt-buckets` and some past the largest (they must get 400), `max_tokens` across its buckets
(or left out), one of 50 sampling settings (temperature, top_p, top_k, seed, alg, alg_temp, and threshold where
the server decodes block-wise), streams the client closes after their first text, and deliberately bad bodies,
each with the 4xx it must get. Every `--sample-seconds` it reads the server's RSS, memory mappings
(`/proc/PID/maps` lines), open files and threads from /proc, and its compilations and responses by status from
`/metrics`, and prints them as one JSON line. The last line is the summary (`--json OUT` also gets every sample),
with each goal passed or failed; the exit status is 1 when one fails:

* RSS and mappings within +5% (`--growth`) of the sample at `--baseline-minutes`, at every later sample;
* no compilation after start-up, no 5xx (neither the client's nor the server's count);
* every response has the status (and an error its `param`) its request expects, and the server counts each 4xx
  as often as the clients got it;
* every request answered (no transport error; the streams closed on purpose are answered 200), at least
  `--min-requests` of them.

    python bench/dream_serve_soak.py --minutes 20 --clients 16 --json soak.json   # the full soak
    python bench/dream_serve_soak.py --minutes 3 --min-requests 300               # a short check
"""

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
from dream_serve_load import PROMPTS, buckets, compilations, send, server_arguments, start_server, token_range
from prometheus_client.parser import text_string_to_metric_families

from jaxport.dream import DreamConfig, DreamTokenizer
from jaxport.dream.throughput import environment

MODEL = "bench"  # the served model name `start_server` gives
SERVER_ALG = "entropy"  # the server's --alg (`start_server` leaves its default): another alg is refused
KINDS = {"complete": 0.4, "stream": 0.25, "disconnect": 0.15, "chat": 0.1, "bad": 0.1}
OVER_LONG_SHARE = 0.08  # of the prompts: past the largest prompt bucket
BODY_LIMIT = 1 << 20  # the server's --max-body-bytes (`start_server` leaves its default)


@dataclasses.dataclass
class Request:
    """One request of the mix and what it must get: `status`, and for an error the `param` it names."""

    kind: str  # complete, chat, stream, disconnect, or "bad: what is wrong"
    path: str
    body: dict | list | bytes  # bytes: sent as they are
    status: int = 200
    param: str | None = None
    max_tokens: int = 0  # the most completion tokens a row may get
    n: int = 1


def bad_bodies(largest_tokens: int, max_batch: int) -> list[Request]:
    """Deliberately bad requests, each with the 4xx and the `param` its error must have."""
    good = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4}
    completions = "/v1/completions"
    cases = [
        ("max_tokens a string", {**good, "max_tokens": "16"}, 400, "max_tokens"),
        ("temperature a string", {**good, "temperature": "hot"}, 400, "temperature"),
        ("prompt a number", {**good, "prompt": 5}, 400, "prompt"),
        ("stream a string", {**good, "stream": "yes"}, 400, "stream"),
        ("unknown field", {**good, "max_tokns": 3}, 400, "max_tokns"),
        ("unsupported field", {**good, "echo": True}, 400, "echo"),
        ("negative max_tokens", {**good, "max_tokens": -4}, 400, "max_tokens"),
        ("max_tokens past the largest bucket", {**good, "max_tokens": largest_tokens + 1}, 400, "max_tokens"),
        ("top_p above 1", {**good, "top_p": 1.5}, 400, "top_p"),
        ("negative temperature", {**good, "temperature": -1}, 400, "temperature"),
        ("n above --max-batch", {**good, "n": max_batch + 1}, 400, "n"),
        ("alg not served", {**good, "alg": "origin"}, 400, "alg"),
        ("prompt holding the mask token", {**good, "prompt": "<|mask|> is"}, 400, "prompt"),
        ("unknown model", {**good, "model": "gpt-4"}, 404, "model"),
        ("a JSON array", [good], 400, None),
        ("malformed JSON", b'{"model": ', 400, None),
        ("body over --max-body-bytes", json.dumps({**good, "prompt": "a" * BODY_LIMIT}).encode(), 413, "body"),
    ]
    bad = [Request(f"bad: {name}", completions, body, status, param) for name, body, status, param in cases]
    bad.append(
        Request("bad: empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages")
    )
    bad.append(Request("bad: unknown route", "/v1/nothing", good, 404, None))
    return bad


def sampling_settings(rng: np.random.Generator, count: int, alg: str, blockwise: bool) -> list[dict]:
    """`count` distinct sampling settings the server serves (some greedy), each as body fields."""
    chosen: dict[str, dict] = {}
    while len(chosen) < count:
        fields = {}
        if rng.uniform() < 0.8:
            fields["temperature"] = round(float(rng.uniform(0.2, 1.5)), 3)
            if rng.uniform() < 0.5:
                fields["top_p"] = round(float(rng.uniform(0.5, 1.0)), 3)
            if rng.uniform() < 0.4:
                fields["top_k"] = int(rng.choice([1, 5, 20, 50]))
        if rng.uniform() < 0.7:
            fields["seed"] = int(rng.integers(1 << 31))
        if rng.uniform() < 0.3:
            fields["alg"] = alg
        if rng.uniform() < 0.3:
            fields["alg_temp"] = round(float(rng.uniform(0.0, 0.5)), 3)
        if blockwise and rng.uniform() < 0.3:
            fields["threshold"] = round(float(rng.uniform(0.5, 0.95)), 3)
        chosen.setdefault(json.dumps(fields, sort_keys=True), fields)
    return list(chosen.values())


class Mix:
    """The seeded stream of requests (`next`, from any thread), each with the answer it must get."""

    def __init__(self, args, tokenizer: DreamTokenizer):
        self.rng, self.tokenizer, self.lock = np.random.default_rng(args.seed), tokenizer, threading.Lock()
        self.prompt_buckets = [int(b) for b in args.prompt_buckets.split(",")]
        low, high = token_range(args.max_tokens)
        self.token_buckets = buckets(low, high, args.block_length)
        self.max_batch = args.max_batch
        blockwise = args.block_length is not None
        self.settings = sampling_settings(self.rng, args.settings, SERVER_ALG, blockwise)
        self.bad = bad_bodies(self.token_buckets[-1], args.max_batch)
        text = "\n".join(PROMPTS * 4)
        self.corpus = tokenizer.encode(text)
        while len(self.corpus) < 3 * self.prompt_buckets[-1]:
            self.corpus += self.corpus

    def next(self) -> Request:
        with self.lock:
            kind = str(self.rng.choice(list(KINDS), p=list(KINDS.values())))
            if kind == "bad":
                return self.bad[int(self.rng.integers(len(self.bad)))]
            return self._generation(kind)

    def _draw(self, sizes: list[int]) -> int:
        """A size within a bucket chosen uniformly: every bucket gets its share, small or large."""
        i = int(self.rng.integers(len(sizes)))
        return int(self.rng.integers(sizes[i - 1] + 1 if i else 1, sizes[i] + 1))

    def _prompt(self) -> str:
        largest = self.prompt_buckets[-1]
        over = self.rng.uniform() < OVER_LONG_SHARE
        tokens = int(self.rng.integers(largest + 1, 2 * largest + 1)) if over else self._draw(self.prompt_buckets)
        start = int(self.rng.integers(len(self.corpus) - tokens))
        return self.tokenizer.decode(self.corpus[start : start + tokens])

    def _generation(self, kind: str) -> Request:
        """A request the server serves, unless its prompt is too long (then a 400 naming it)."""
        body = {"model": MODEL, **self.settings[int(self.rng.integers(len(self.settings)))]}
        max_tokens = self.token_buckets[0]  # the server's default
        if kind in ("stream", "disconnect") or self.rng.uniform() < 0.9:
            max_tokens = body["max_tokens"] = self._draw(self.token_buckets)
        n = 2 if kind in ("complete", "chat") and self.max_batch > 1 and self.rng.uniform() < 0.1 else 1
        if n > 1:
            body["n"] = n
        if kind == "complete" and self.rng.uniform() < 0.1:
            body["stop"] = ["\n"]
        text = self._prompt()
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            prompt = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
        else:
            body["prompt"] = prompt = text
            body["stream"] = kind == "disconnect" or None
        tokens = len(self.tokenizer.encode(prompt))
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        request = Request(kind, path, {k: v for k, v in body.items() if v is not None}, max_tokens=max_tokens, n=n)
        if not 1 <= tokens <= self.prompt_buckets[-1]:
            request.status, request.param = 400, "messages" if kind == "chat" else "prompt"
        return request


def _param(error) -> str | None:
    return error.get("param") if isinstance(error, dict) else None


def _error_param(response: httpx.Response) -> str | None:
    try:
        return _param(response.json().get("error"))
    except (ValueError, AttributeError):
        return None


def _reply_problem(request: Request, choices: int, tokens: int) -> str:
    """What is wrong with a 200's reply of `choices` choices and `tokens` completion tokens ("" when nothing is)."""
    if choices != request.n:
        return f"{choices} choices for n={request.n}"
    if tokens > request.n * request.max_tokens:
        return f"{tokens} completion tokens for max_tokens {request.max_tokens} x n {request.n}"
    return ""


def _streamed(request: Request, ai: openai.OpenAI) -> tuple:
    """Streamed to its end by the load bench's `send`."""
    try:
        reply = send(ai, request.body)
    except openai.APIStatusError as err:
        return err.status_code, _param(err.body), err.message
    except openai.APIConnectionError as err:  # timeouts too
        return "transport", None, repr(err)
    except openai.APIError as err:  # an error event inside the 200 stream
        return "stream error", None, err.message
    return 200, None, _reply_problem(request, 1, reply["tokens"])


def _disconnected(request: Request, http: httpx.Client) -> tuple:
    """Streamed until its first text, then the connection closed."""
    with http.stream("POST", request.path, json=request.body) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, _error_param(response), response.text[:200]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return "stream error", None, line[:200]
            if any(choice.get("text") for choice in event["choices"]):
                break  # leaving the block closes the connection mid-stream
    return 200, None, ""


def answer(request: Request, http: httpx.Client, ai: openai.OpenAI) -> tuple:
    """What the server answered: (status, or "transport" / "stream error"; the error's param; a note on a
    reply that is wrong, else "")."""
    try:
        if request.kind == "stream":
            return _streamed(request, ai)
        if request.kind == "disconnect":
            return _disconnected(request, http)
        if isinstance(request.body, bytes):
            headers = {"content-type": "application/json"}
            response = http.post(request.path, content=request.body, headers=headers)
        else:
            response = http.post(request.path, json=request.body)
    except httpx.TransportError as err:
        return "transport", None, repr(err)
    if response.status_code != 200:
        return response.status_code, _error_param(response), response.text[:200]
    try:
        reply = response.json()
        return 200, None, _reply_problem(request, len(reply["choices"]), reply["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return 200, None, f"not a completion: {response.text[:200]}"


class Tally:
    """The clients' outcomes: counts by status and by kind, and the unexpected ones (the first few kept)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.status, self.by_kind = collections.Counter(), collections.Counter()
        self.unexpected, self.examples = 0, []

    def add(self, request: Request, status, param: str | None, note: str):
        # a 200 must hold a right reply, an error name the param its request expects
        expected = status == request.status and (not note if status == 200 else param == request.param)
        with self.lock:
            self.status[str(status)] += 1
            self.by_kind[f"{request.kind}: {status}"] += 1
            if not expected:
                self.unexpected += 1
                if len(self.examples) < 10:
                    got = {"status": status, "param": param, "note": note}
                    self.examples.append({"kind": request.kind, "expected": [request.status, request.param], **got})

    @property
    def done(self) -> int:
        return sum(self.status.values())


def server_status(url: str) -> dict[str, int]:
    """The server's responses by status, all endpoints together (its `/metrics`)."""
    counts = collections.Counter()
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "jaxport_dream_requests_total":
                counts[sample.labels["status"]] += int(sample.value)
    return dict(sorted(counts.items()))


def sample(process: subprocess.Popen, url: str, seconds: float, requests: int) -> dict:
    """The server's RSS, mappings, open files and threads (/proc) and compilations and statuses (/metrics)."""
    if process.poll() is not None:
        raise SystemExit(f"the server exited with {process.returncode} during the soak")
    proc = Path(f"/proc/{process.pid}")
    status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
    return {
        "minute": round(seconds / 60, 2),
        "requests": requests,
        "rss_mib": round(int(status["VmRSS"].split()[0]) / 1024, 1),
        "mappings": len((proc / "maps").read_text().splitlines()),
        "open_files": len(os.listdir(proc / "fd")),
        "threads": int(status["Threads"]),
        "compilations": int(compilations(url)),
        "status": server_status(url),
    }


def traffic(args, process: subprocess.Popen, url: str, mix: Mix) -> tuple[Tally, list[dict], float]:
    """`--clients` threads sending the mix back to back for `--minutes`, sampled every `--sample-seconds`; a last
    sample once every request in flight is answered. (The tally, the samples, the seconds.)"""
    http = httpx.Client(base_url=url, timeout=args.timeout)
    ai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=args.timeout)
    tally, samples, failed = Tally(), [], threading.Event()
    start = time.perf_counter()
    deadline = start + 60 * args.minutes

    def client():
        while time.perf_counter() < deadline and not failed.is_set():
            request = mix.next()
            tally.add(request, *answer(request, http, ai))

    def record(seconds: float):
        samples.append(sample(process, url, seconds, tally.done))
        print(json.dumps(samples[-1]), flush=True)

    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        clients = [pool.submit(client) for _ in range(args.clients)]
        at = start + args.sample_seconds
        try:
            while at < deadline:
                time.sleep(max(0.0, at - time.perf_counter()))
                record(at - start)
                at += args.sample_seconds
        except BaseException:
            failed.set()  # the server is gone (or the bench is stopped): the clients stop after their request
            raise
        for done in clients:
            done.result()  # a client that failed (a bug of this bench) fails the soak here
    seconds = time.perf_counter() - start
    record(seconds)
    http.close()
    return tally, samples, seconds


def goals(args, tally: Tally, samples: list[dict], compiled_at_start: int) -> dict:
    """Each goal: passed or not, and the numbers it was judged on."""
    baseline = next((s for s in samples if s["minute"] >= args.baseline_minutes), samples[-1])
    later = [s for s in samples if s["minute"] > baseline["minute"]]
    verdicts = {}
    for field in ("rss_mib", "mappings"):
        most = max((s[field] for s in later), default=None)
        verdicts[f"{field}_within_{args.growth:g}_percent"] = {
            "pass": most is not None and most <= baseline[field] * (1 + args.growth / 100),
            "baseline": baseline[field],
            "baseline_minute": baseline["minute"],
            "most_after": most,
        }
    compiled = samples[-1]["compilations"] - compiled_at_start
    verdicts["no_compilations_after_start_up"] = {"pass": compiled == 0, "compilations": compiled}
    server = samples[-1]["status"]
    client_5xx = {k: v for k, v in tally.status.items() if k.startswith("5")}
    server_5xx = {k: v for k, v in server.items() if k.startswith("5")}
    verdicts["no_5xx"] = {"pass": not client_5xx and not server_5xx, "client_5xx": client_5xx, "server_5xx": server_5xx}
    client_4xx = {k: v for k, v in tally.status.items() if k.startswith("4")}
    server_4xx = {k: v for k, v in server.items() if k.startswith("4")}
    verdicts["every_status_expected"] = {
        "pass": tally.unexpected == 0 and client_4xx == server_4xx,
        "unexpected": tally.unexpected,
        "client_4xx": dict(sorted(client_4xx.items())),
        "server_4xx": server_4xx,
        "examples": tally.examples,
    }
    unanswered = tally.status["transport"] + tally.status["stream error"]
    verdicts["every_request_answered"] = {"pass": unanswered == 0, "unanswered": unanswered}
    verdicts["requests"] = {"pass": tally.done >= args.min_requests, "requests": tally.done, "least": args.min_requests}
    return verdicts


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    server_arguments(parser, "dream_serve_soak")
    parser.set_defaults(max_tokens="4..32", prompt_buckets="16,64", block_length=4, cache="dual")
    parser.add_argument("--batching", default="continuous", help="static or continuous")
    parser.add_argument("--minutes", type=float, default=20.0, help="of traffic")
    parser.add_argument("--clients", type=int, default=16, help="threads sending requests back to back")
    parser.add_argument("--settings", type=int, default=50, help="distinct sampling settings")
    parser.add_argument("--seed", type=int, default=0, help="of the request stream")
    parser.add_argument("--sample-seconds", type=float, default=60.0, help="between two samples of the server")
    parser.add_argument("--baseline-minutes", type=float, default=2.0, help="the sample growth is measured from")
    parser.add_argument("--growth", type=float, default=5.0, help="most percent of RSS / mappings growth")
    parser.add_argument("--min-requests", type=int, default=3000, help="fewer requests fail the soak")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a client waits for an answer")
    parser.add_argument("--json", type=Path, default=None, help="write the summary and every sample here")
    return parser.parse_args()


def main():
    args = arguments()
    tokenizer = DreamTokenizer.from_model_dir(args.model, DreamConfig.from_model_dir(args.model))
    mix = Mix(args, tokenizer)
    # the load bench sizes the server's queue by its request count: here every row in flight fits (n <= 2), so no 429
    process, url, startup_s = start_server(argparse.Namespace(**vars(args), requests=2 * args.clients), args.batching)
    try:
        at_start = sample(process, url, 0.0, 0)
        tally, samples, seconds = traffic(args, process, url, mix)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            exit_code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            exit_code = process.wait()
    verdicts = goals(args, tally, samples, at_start["compilations"])
    summary = {
        "what": "jaxport dream serve soaked with mixed traffic",
        **environment(),
        "model": f"random-init {args.random_init}" if args.random_init else str(args.model),
        **{k: getattr(args, k) for k in ("batching", "clients", "seed", "max_batch", "prompt_buckets", "max_tokens")},
        "fast": {k: getattr(args, k) for k in ("block_length", "cache", "threshold")},
        "startup_with_compilation_s": round(startup_s, 2),
        "seconds": round(seconds, 2),
        "requests": tally.done,
        "requests_per_s": round(tally.done / seconds, 2),
        "client_status": dict(sorted(tally.status.items())),
        "by_kind": dict(sorted(tally.by_kind.items())),
        "at_start": at_start,
        "server_exit_code": exit_code,
        "goals": verdicts,
        "passed": all(v["pass"] for v in verdicts.values()),
    }
    print(json.dumps(summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps({**summary, "samples": samples}, indent=1))
    raise SystemExit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
