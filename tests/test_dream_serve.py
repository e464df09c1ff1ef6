"""`jaxport dream serve` on the tiny fixture, driven by the official `openai` client against a real
server process on 127.0.0.1 (random weights: the texts are gibberish, but deterministic)."""

import concurrent.futures
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

MODEL = Path(__file__).parent / "fixtures" / "dream" / "tiny_bf16" / "model"
NAME = "tiny-dream"
PROMPTS = ["def add(a, b):", "Write a quicksort in Python.", "import numpy as np", "class Stack:"]


def start_server(log_path: Path, *options: str):
    """A `jaxport dream serve` process on a free port, once /health answers: (process, base url)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = log_path.open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxport.cli",
            "dream",
            "serve",
            "--model",
            str(MODEL),
            "--served-model-name",
            NAME,
            "--dtype",
            "float32",
            "--port",
            str(port),
            *options,
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.3)
    process.kill()
    raise AssertionError(f"the server did not start:\n{log_path.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    # one prompt bucket and one canvas size: two programs (batch 1 and 2) compile at start-up
    process, url = start_server(
        log_path,
        "--max-batch",
        "2",
        "--max-queue",
        "8",
        "--max-context",
        "128",
        "--prompt-buckets",
        "64",
        "--max-tokens-buckets",
        "16",
    )
    yield url, log_path
    process.kill()
    process.wait()


def client(url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, **options)


def metrics(url: str) -> dict:
    return httpx.get(f"{url}/metrics").json()


def wait_for(condition, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def complete(url: str, prompt, **options):
    return client(url).completions.create(**{"model": NAME, "prompt": prompt, "max_tokens": 16, **options})


def test_models_health_and_start_up_compilation(server):
    url, log_path = server
    assert [m.id for m in client(url).models.list().data] == [NAME]
    assert client(url).models.retrieve(NAME).id == NAME
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    log = log_path.read_text()
    for batch in (1, 2):
        assert (
            f"compiling generation at start-up: batch {batch}, prompt 64 + 16 new tokens, alg entropy, steps 16, "
            "temperature 0.0"
        ) in log


def test_concurrent_clients_are_batched_and_greedy_text_does_not_depend_on_batching(server):
    url, log_path = server
    alone = {p: complete(url, p).choices[0] for p in PROMPTS}  # one at a time: batches of one request
    assert all(c.finish_reason in ("stop", "length") for c in alone.values())
    before = metrics(url)

    def one_client(worker: int):
        c = client(url)
        answers = []
        for i in range(3):
            prompt = PROMPTS[(worker + i) % len(PROMPTS)]
            answers.append((prompt, c.completions.create(model=NAME, prompt=prompt, max_tokens=16)))
        return answers

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [a for batch in pool.map(one_client, range(8)) for a in batch]
    assert len(answers) == 24
    for prompt, answer in answers:
        assert answer.choices[0].text == alone[prompt].text and answer.usage.completion_tokens > 0
    after = metrics(url)
    assert after["requests"] - before["requests"] == 24 and after["errors"] == 0
    # some batch held more than one request (every one of them gave its alone text above)
    batched = {int(k) for k, v in after["batch_requests"].items() if v > before["batch_requests"].get(k, 0)}
    assert max(batched) > 1, after
    assert re.search(r"cmpl-\w+ 200: .* batch of 2 requests", log_path.read_text())  # the request log says so too


def test_completion_fields(server):
    url, log_path = server
    full = complete(url, PROMPTS[0])
    text = full.choices[0].text
    assert full.object == "text_completion" and full.model == NAME and full.id.startswith("cmpl-")
    assert full.usage.prompt_tokens == 7 and full.usage.total_tokens == 7 + full.usage.completion_tokens
    assert f"{full.id} 200: 7 prompt + {full.usage.completion_tokens} completion tokens" in log_path.read_text()

    # max_tokens below the canvas cuts the same generation
    cut = complete(url, PROMPTS[0], max_tokens=4)
    assert cut.usage.completion_tokens <= 4 and text.startswith(cut.choices[0].text)

    # a stop string cuts the text before it
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stopped = complete(url, PROMPTS[0], stop=[stop, "never appears"]).choices[0]
    assert stopped.text == text[: text.index(stop)] and stopped.finish_reason == "stop"

    # a list of prompts, and n rows (greedy rows alike)
    other = complete(url, PROMPTS[1]).choices[0].text
    assert [(c.index, c.text) for c in complete(url, PROMPTS[:2]).choices] == [(0, text), (1, other)]
    assert [(c.index, c.text) for c in complete(url, PROMPTS[0], n=2).choices] == [(0, text), (1, text)]


def test_chat_and_streaming(server):
    url, _ = server
    messages = [{"role": "user", "content": "Add two numbers."}]
    chat = client(url).chat.completions.create(model=NAME, messages=messages, max_tokens=16)
    answer = chat.choices[0]
    assert chat.object == "chat.completion" and answer.message.role == "assistant"
    assert chat.usage.prompt_tokens > 20  # the chat template was applied

    stream = client(url).chat.completions.create(
        model=NAME, messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == answer.finish_reason
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    streamed = client(url).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == complete(url, PROMPTS[2]).choices[0].text


def test_block_wise_decoding_streams_each_block(server):
    url, log_path = server
    fast = {"block_length": 4}  # 4 blocks of 4 tokens, 4 steps each
    whole = complete(url, PROMPTS[1], extra_body=fast).choices[0]
    chunks = [c.choices[0] for c in complete(url, PROMPTS[1], stream=True, extra_body=fast)]
    texts = [c.text for c in chunks if c.text]
    assert "".join(texts) == whole.text and chunks[-1].finish_reason == whole.finish_reason
    assert len(texts) > 1  # sent block by block, not all at the end
    assert "block_length 4" in log_path.read_text()
    fastdllm = {"block_length": 4, "cache": "dual", "schedule": "fastdllm", "alg": "entropy"}  # Fast-dLLM's own
    whole = complete(url, PROMPTS[1], extra_body=fastdllm).choices[0]
    streamed = [c.choices[0].text for c in complete(url, PROMPTS[1], stream=True, extra_body=fastdllm)]
    assert "".join(streamed) == whole.text and "schedule fastdllm" in log_path.read_text()


@pytest.mark.parametrize(
    "options, status, param, message",
    [
        ({"model": "gpt-4"}, 404, "model", "does not exist"),
        ({"prompt": "word " * 200}, 400, "prompt", "leaves room for 112"),
        ({"temperature": -1}, 400, "temperature", "must be >= 0, got -1"),
        ({"top_p": 1.5}, 400, "top_p", "must be in (0, 1], got 1.5"),
        ({"max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": 64}, 400, "max_tokens", "largest --max-tokens-buckets value 16"),
        ({"n": 3}, 400, "n", "exceed --max-batch 2"),
        ({"extra_body": {"steps": 32}}, 400, "steps", "exceeds the 16 new tokens"),
        ({"extra_body": {"alg": "greedy"}}, 400, "alg", "unknown alg 'greedy'; choose one of origin"),
        ({"extra_body": {"block_length": 5}}, 400, "block_length", "must divide the number of new tokens (16)"),
        ({"extra_body": {"schedule": "fast"}}, 400, "schedule", "unknown schedule 'fast'; choose one of jaxport"),
        ({"extra_body": {"schedule": "fastdllm", "alg": "origin"}}, 400, "alg", "schedule 'fastdllm' ranks"),
        ({"extra_body": {"cache": "all"}}, 400, "cache", "must be None, 'prefix' or 'dual', got 'all'"),
        ({"extra_body": {"n": "2"}}, 400, "n", "valid integer"),
        ({"extra_body": {"stop": ["a", 3]}}, 400, "stop", "valid string"),
        ({"extra_body": {"max_tokns": 3}}, 400, "max_tokns", "unknown field"),
        ({"echo": True}, 400, "echo", "not supported"),
    ],
)
def test_bad_requests_get_openai_errors(server, options, status, param, message):
    url, _ = server
    fields = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 16, **options}
    with pytest.raises(openai.APIStatusError) as caught:
        client(url).completions.create(**fields)
    error = caught.value
    assert error.status_code == status and error.body["param"] == param and message in error.body["message"]
    assert error.body["message"].startswith(param) and error.body["type"]


def test_malformed_json_and_unknown_route(server):
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert httpx.get(f"{url}/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_seed_full_queue_and_disconnect(server):
    url, log_path = server
    # Sampling with a seed runs alone under the seed's key: the same seed gives the same text.
    # Its new temperature compiles on first use, which also keeps the worker busy meanwhile.
    sampled = {}
    thread = threading.Thread(
        target=lambda: sampled.update(first=complete(url, PROMPTS[0], temperature=1.0, seed=7).choices[0].text)
    )
    thread.start()
    wait_for(lambda: metrics(url)["running_rows"] == 1)

    # clients that give up while their requests wait free the queue slots
    impatient = client(url, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16)
    with pytest.raises(openai.APITimeoutError):
        list(impatient.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, stream=True))
    wait_for(lambda: metrics(url)["cancelled"] == 2 and metrics(url)["queued_rows"] == 0)

    # more rows than --max-queue 8 while the worker is busy: 429 with Retry-After
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda _: _try(lambda: complete(url, PROMPTS[2], n=2)), range(5)))
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(rejected) == 1 and int(rejected[0].response.headers["retry-after"]) >= 1
    assert [len(r.choices) for r in results if r not in rejected] == [2, 2, 2, 2]
    thread.join()

    assert complete(url, PROMPTS[0], temperature=1.0, seed=7).choices[0].text == sampled["first"]
    assert complete(url, PROMPTS[0], temperature=1.0, seed=8).choices[0].text != sampled["first"]
    log = log_path.read_text()
    assert (
        "compiling generation on first use: batch 1, prompt 64 + 16 new tokens, alg entropy, steps 16, temperature 1.0"
        in log
    )
    assert "client disconnected" in log


def _try(call):
    try:
        return call()
    except openai.APIError as err:
        return err


def test_sigterm_finishes_requests_in_flight_and_exits_0(tmp_path):
    process, url = start_server(
        tmp_path / "server.log", "--no-warmup", "--prompt-buckets", "32", "--max-tokens-buckets", "8"
    )
    answer = {}
    thread = threading.Thread(
        target=lambda: answer.update(
            response=httpx.post(
                f"{url}/v1/completions", json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8}, timeout=120
            )
        )
    )
    thread.start()
    wait_for(lambda: "compiling generation on first use" in (tmp_path / "server.log").read_text())
    process.send_signal(signal.SIGTERM)
    wait_for(lambda: _refused(url))  # no new connections at once...
    assert thread.is_alive()  # ...while the request in flight (compiling for seconds) goes on
    assert process.wait(timeout=120) == 0
    thread.join()
    assert answer["response"].status_code == 200 and answer["response"].json()["choices"][0]["finish_reason"]
    assert "Finished server process" in (tmp_path / "server.log").read_text()


def _refused(url: str) -> bool:
    """No new request is served: the connection is refused, or (while uvicorn closes its socket) reset."""
    try:
        httpx.get(f"{url}/health")
        return False
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
