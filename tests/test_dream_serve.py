"""`jaxport dream serve` on the tiny fixture, driven by the official `openai` client against a real
server process on 127.0.0.1 (random weights: the texts are gibberish, but deterministic)."""

import concurrent.futures
import contextlib
import io
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxport import dream
from jaxport.errors import JaxportError
from jaxport.runtime import compile_for

pytestmark = pytest.mark.slow

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
    deadline = time.monotonic() + 600  # start-up compiles every program of the start-up set
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


SMALL = ("--max-batch", "2", "--max-queue", "8", "--max-context", "128", "--prompt-buckets", "64")
FAST = {"block_length": 4}  # 4 blocks of 4 tokens, 4 steps each
FASTDLLM = {"block_length": 4, "cache": "dual", "schedule": "fastdllm", "alg": "entropy"}  # Fast-dLLM's own


def _programs(*settings: dict) -> list[str]:
    return [a for s in settings for a in ("--program", ",".join(f"{k}={v}" for k, v in s.items()))]


# one prompt bucket and one canvas size, static batching: the default program, FAST and FASTDLLM at batch 1 and 2
# compile at start-up, and no other
SERVED = (*SMALL, "--max-tokens-buckets", "16", "--batching", "static", *_programs(FAST, FASTDLLM))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    process, url = start_server(log_path, *SERVED)
    yield url, log_path
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def on_demand_server(tmp_path_factory):
    """Compiles on first use (no start-up set compiled ahead) and at most one program beyond the start-up set."""
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    process, url = start_server(
        log_path, *SMALL, "--max-tokens-buckets", "16", "--no-warmup", "--compile-on-demand", "1"
    )
    yield url, log_path
    process.kill()
    process.wait()


def client(url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, **options)


def metrics(url: str) -> dict:
    return httpx.get(f"{url}/metrics.json").json()


def prometheus(url: str) -> dict:
    """`/metrics` parsed by prometheus_client's own parser: {(name, labels as a sorted tuple): value}."""
    response = httpx.get(f"{url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


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
        for settings in (
            "steps 16",
            "block_length 4, steps 16",
            "block_length 4, cache dual, schedule fastdllm, steps 16",
        ):
            assert f"at start-up: batch {batch}, prompt 64 + 16 new tokens, alg entropy, {settings}\n" in log


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
    whole = complete(url, PROMPTS[1], extra_body=FAST).choices[0]
    chunks = [c.choices[0] for c in complete(url, PROMPTS[1], stream=True, extra_body=FAST)]
    texts = [c.text for c in chunks if c.text]
    assert "".join(texts) == whole.text and chunks[-1].finish_reason == whole.finish_reason
    assert len(texts) > 1  # sent block by block, not all at the end
    assert "block_length 4" in log_path.read_text()
    whole = complete(url, PROMPTS[1], extra_body=FASTDLLM).choices[0]
    streamed = [c.choices[0].text for c in complete(url, PROMPTS[1], stream=True, extra_body=FASTDLLM)]
    assert "".join(streamed) == whole.text and "schedule fastdllm" in log_path.read_text()


@pytest.mark.parametrize(
    "options, status, param, message",
    [
        ({"model": "gpt-4"}, 404, "model", "does not exist"),
        ({"prompt": "word " * 200}, 400, "prompt", "leaves room for 112"),
        ({"temperature": -1}, 400, "temperature", "must be >= 0, got -1"),
        ({"top_p": 1.5}, 400, "top_p", "must be in (0, 1], got 1.5"),
        ({"max_tokens": 0}, 400, "max_tokens", "max_tokens: must be a positive integer, got 0"),
        # a bad value is named before the rules between values (here steps above the canvas)
        ({"max_tokens": -4, "extra_body": {"steps": 4}}, 400, "max_tokens", "must be a positive integer, got -4"),
        ({"extra_body": {"top_k": 0, "steps": 32}}, 400, "top_k", "top_k: must be a positive integer, got 0"),
        ({"max_tokens": 64}, 400, "max_tokens", "largest --max-tokens-buckets value 16"),
        ({"n": 3}, 400, "n", "exceed --max-batch 2"),
        ({"extra_body": {"steps": 32}}, 400, "steps", "exceeds the 16 new tokens"),
        ({"extra_body": {"alg": "greedy"}}, 400, "alg", "unknown alg 'greedy'; choose one of origin"),
        ({"extra_body": {"block_length": 5}}, 400, "block_length", "must divide the number of new tokens (16)"),
        ({"extra_body": {"schedule": "fast"}}, 400, "schedule", "unknown schedule 'fast'; choose one of jaxport"),
        ({"extra_body": {"schedule": "fastdllm", "alg": "origin"}}, 400, "alg", "schedule 'fastdllm' ranks"),
        ({"extra_body": {"cache": "all"}}, 400, "cache", "must be None, 'prefix' or 'dual', got 'all'"),
        ({"extra_body": {"n": "2"}}, 400, "n", "n: Input should be a valid integer, got '2'"),
        ({"extra_body": {"stop": ["a", 3]}}, 400, "stop", "valid string"),
        ({"extra_body": {"max_tokns": 3}}, 400, "max_tokns", "unknown field"),
        ({"echo": True}, 400, "echo", "not supported"),
        # program-shaping values outside the start-up set, with the allowed ones
        ({"extra_body": {"steps": 8}}, 400, "steps", "steps=8 is not among the programs this server compiled"),
        ({"extra_body": {"alg": "origin"}}, 400, "alg", "(allowed alg: entropy;"),
        ({"extra_body": {"block_length": 8}}, 400, "block_length", "(allowed block_length: 4, None;"),
        ({"extra_body": {"threshold": 0.9}}, 400, "threshold", "block_length=16 is not among the programs"),
        ({"extra_body": {"block_length": 4, "cache": "prefix"}}, 400, "cache", "(allowed cache: None, dual;"),
        ({"prompt": "<|mask|> is"}, 400, "prompt", "holds the mask token"),
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


def test_a_prompt_past_the_largest_bucket_is_refused_without_compiling(server):
    """A prompt longer than the largest --prompt-buckets value but within --max-context gets a 400 naming its length
    and the largest bucket: with --compile-on-demand 0 nothing compiles after start-up, whatever the request."""
    url, _ = server
    before, scraped = metrics(url), prometheus(url)
    prompt = "def add(a, b):\n    return a + b\n" * 7  # 84 tokens: past the bucket of 64, within 128 - 16
    with pytest.raises(openai.BadRequestError) as caught:
        complete(url, prompt)
    message = caught.value.body["message"]
    assert caught.value.body["param"] == "prompt" and caught.value.body["code"] == "context_length_exceeded"
    assert re.search(r"the prompt has 8\d tokens;.* the largest prompt bucket is 64 \(--prompt-buckets 64\)", message)
    after = metrics(url)
    assert after["compilations"] == before["compilations"] and after["compiled_programs"] == before["compiled_programs"]
    compiled = prometheus(url)  # /metrics says so too: no compilation, the start-up set alone held
    for label in ("start-up", "on demand"):
        key = ("jaxport_dream_compilations_total", (("set", label),))
        assert compiled[key] == scraped[key] == (6 if label == "start-up" else 0)
    assert compiled[("jaxport_dream_compiled_programs", ())] == 6


def test_malformed_json_and_unknown_route(server):
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "a " * (1 << 20)})
    assert response.status_code == 413 and response.json()["error"]["param"] == "body", response.text
    response = httpx.post(f"{url}/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert httpx.get(f"{url}/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_sampling_settings_do_not_compile(server):
    url, _ = server
    before = metrics(url)
    texts = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for (t, p, seed), answer in zip(
            settings := [(t, p, seed) for t in (0.3, 0.9) for p in (0.5, 1.0) for seed in (1, 2)],
            pool.map(lambda s: complete(url, PROMPTS[0], temperature=s[0], top_p=s[1], seed=s[2]), settings),
        ):
            texts[(t, p, seed)] = answer.choices[0].text
    assert metrics(url)["compilations"] == before["compilations"] > 0
    assert len(set(texts.values())) > 1  # the settings and seeds are used
    # a seeded request gets the same text whatever it was batched with
    assert complete(url, PROMPTS[0], temperature=0.9, top_p=0.5, seed=2).choices[0].text == texts[(0.9, 0.5, 2)]


def test_prometheus_metrics(server):
    url, _ = server
    before = prometheus(url)
    complete(url, PROMPTS[0])
    with pytest.raises(openai.BadRequestError):
        complete(url, PROMPTS[0], top_p=2)
    after = prometheus(url)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("jaxport_dream_requests_total", endpoint="/v1/completions", status="200") == 1
    assert grew("jaxport_dream_requests_total", endpoint="/v1/completions", status="400") == 1
    assert grew("jaxport_dream_time_to_first_block_seconds_count") == 1
    assert grew("jaxport_dream_request_seconds_count") == 1
    assert grew("jaxport_dream_decoding_steps_sum") == 16  # steps = the 16 new tokens, one program call
    assert grew("jaxport_dream_generated_tokens_total") > 0
    # start-up compiled 3 programs at 2 batch sizes; nothing since
    assert after[("jaxport_dream_compilations_total", (("set", "start-up"),))] == 6
    assert after[("jaxport_dream_compilations_total", (("set", "on demand"),))] == 0
    assert after[("jaxport_dream_compile_seconds_total", (("set", "start-up"),))] > 0
    assert after[("jaxport_dream_compiled_programs", ())] == 6
    for gauge in ("queue_rows", "running_rows", "batch_occupancy"):
        assert after[(f"jaxport_dream_{gauge}", ())] == 0  # idle


def test_the_start_up_set_is_reported_with_its_memory_mappings(server):
    """The log and /metrics say how many programs the start-up set compiled, in how many seconds, and the memory
    mappings they hold against vm.max_map_count."""
    url, log_path = server
    gauges = prometheus(url)
    started = gauges[("jaxport_dream_start_up_programs", ())]
    assert started == gauges[("jaxport_dream_compilations_total", (("set", "start-up"),))] == 6
    assert gauges[("jaxport_dream_start_up_seconds", ())] > 0
    mappings, limit = (
        gauges[("jaxport_dream_start_up_memory_mappings", ())],
        gauges[("jaxport_dream_memory_mappings_limit", ())],
    )
    assert limit == int(Path("/proc/sys/vm/max_map_count").read_text())
    assert 0 < mappings < gauges[("jaxport_dream_memory_mappings", ())] < limit
    line = re.search(
        r"start-up set: 6 programs compiled in [\d.]+ s; they hold ([\d,]+) memory mappings \(the process [\d,]+ of "
        r"vm.max_map_count ([\d,]+), \d+%\)",
        log_path.read_text(),
    )
    assert line and [int(g.replace(",", "")) for g in line.groups()] == [mappings, limit]


def test_the_start_up_mappings_are_projected_from_the_programs_after_the_first():
    """`StartUpMappings` refuses a set whose projected mappings pass 60% of the limit, before it gets there: each
    program to come adds the mean of those after the first (whose count holds the compiler's one-time mappings)."""
    from jaxport.dream.serving.programs import StartUpMappings

    mappings = StartUpMappings(planned=10, baseline=1000, limit=10_000)
    mappings.check(1, 1500)
    mappings.check(2, 2000)  # 500 per program: 2000 + 8 x 500 = 6000, 60% of the limit
    with pytest.raises(JaxportError) as caught:
        mappings.check(3, 2600)  # 550 per program: 2600 + 7 x 550 = 6450
    message = str(caught.value)
    assert message.startswith("the start-up set of 10 programs would hold about 5,450 memory mappings (1,600 after 3")
    assert "past 60% of its limit (vm.max_map_count 10,000" in message and "\n" not in message
    for flag in ("--prompt-buckets", "--max-tokens-buckets", "--program", "--max-batch", "--compile-on-demand"):
        assert flag in message


def test_a_start_up_set_past_its_share_of_memory_mappings_is_refused(monkeypatch):
    """A server whose start-up set would take the process past 60% of vm.max_map_count stops with one line as soon as
    the mappings show it, not at the limit: here a limit just above what the process holds before the set, so its
    first program passes the share."""
    from jaxport.dream.serving import programs
    from jaxport.dream.serving.api import DreamServer
    from jaxport.dream.serving.settings import ServeSettings

    monkeypatch.setattr(
        programs, "map_count_limit", lambda: int((programs.memory_mappings() + 1) / programs.MAP_SHARE) + 1
    )
    model, tokenizer = dream.load(MODEL, dtype="float32")
    settings = ServeSettings(model_name=NAME, max_batch=2, max_queue=4, prompt_buckets=(64,), max_tokens_buckets=(8,))
    server = DreamServer(model, tokenizer, settings)
    with pytest.raises(JaxportError, match=r"^the start-up set of 2 programs would hold about [\d,]+ memory mappings"):
        server.warmup()
    assert server.engine.stats["compilations"] == 1  # refused after its first program


def test_the_start_up_plan_has_every_block_program_and_each_running_batch_size():
    """`start_up_programs` (what `--compile-for` compiles): the prefix cache's program per block index at every batch
    size; under continuous batching, one running batch's block call per batch size for every dual-cache key."""
    from jaxport.dream.serving.engine import lane_of, start_up_programs
    from jaxport.dream.serving.programs import ServedPrograms, batch_buckets
    from jaxport.dream.serving.settings import ServeSettings

    def plan(**options):
        settings = ServeSettings(model_name=NAME, max_batch=2, prompt_buckets=(64,), **options)
        return start_up_programs(
            ServedPrograms(settings).start_up_keys(),
            batch_buckets(settings.max_batch),
            lambda key: lane_of(key, settings.lane_tokens, settings.max_context),
        )

    prefix = plan(max_tokens_buckets=(16,), programs=((("block_length", 4), ("cache", "prefix")),))
    assert [(p.batch, p.block) for p in prefix] == [(1, None), (2, None)] + [(b, i) for b in (1, 2) for i in range(4)]
    lanes = plan(max_tokens_buckets=(16, 64), batching="continuous", fast=(("block_length", 4), ("cache", "dual")))
    assert [(p.batch, p.lane.new_tokens, p.key) for p in lanes] == [(1, 64, None), (2, 64, None)]


def _library_text(model, tokenizer, prompt: str, max_tokens: int, new_tokens: int, seed, **settings) -> str:
    """What `diffusion_generate` gives for one request alone (no padding), cut as the server cuts it."""
    ids = np.array([tokenizer.encode(prompt)])
    rng = None if seed is None else jax.random.key(seed)
    sequences = dream.diffusion_generate(
        model, ids, np.ones_like(ids), max_new_tokens=new_tokens, rng=rng, return_dict_in_generate=False, **settings
    )
    span = np.asarray(sequences)[:, ids.shape[1] : ids.shape[1] + max_tokens]
    return tokenizer.decode_generation(span, 0)[0]


def test_replies_equal_the_library_alone(server):
    """Concurrent requests with different prompts, max_tokens, temperatures (greedy, seeded, seeded with top_p) and
    fast settings: every reply is what `diffusion_generate` gives for the same request alone. Each setting meets
    each sampling kind once; the library compiles a program per prompt length, program setting (a threshold is an
    input) and kind (the sampler's branches), so each program setting's kind keeps one prompt: 9 programs, not 15."""
    url, _ = server
    settings = [({}, 0), (FAST, 1), ({**FAST, "threshold": 0.5}, 1), (FASTDLLM, 2), ({**FASTDLLM, "threshold": 0.6}, 2)]
    requests = []
    for extra, program in settings:
        for kind in range(3):  # greedy, seeded, seeded with top_p: one prompt per program and kind
            i = len(requests)
            temperature = (0.0, (0.8, 1.2)[i % 2], (1.2, 0.8)[i % 2])[kind]
            options = dict(temperature=temperature, top_p=(None, None, 0.9)[kind], seed=(None, 11 + i, 5 + i)[kind])
            requests.append((PROMPTS[(program + kind) % len(PROMPTS)], (16, 9)[i % 2], options, extra))

    def send(request):
        prompt, max_tokens, options, extra = request
        return complete(url, prompt, max_tokens=max_tokens, extra_body=extra, **options).choices[0].text

    before = metrics(url)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(send, requests))
    after = metrics(url)
    assert after["compilations"] == before["compilations"] and max(map(int, after["batch_requests"])) > 1
    model, tokenizer = dream.load(MODEL, dtype="float32")
    for (prompt, max_tokens, options, extra), reply in zip(requests, replies, strict=True):
        settings = {"steps": 16, "alg": "entropy", **extra, **{k: v for k, v in options.items() if k != "seed"}}
        expected = _library_text(model, tokenizer, prompt, max_tokens, 16, options["seed"], **settings)
        assert reply == expected, (prompt, max_tokens, options, extra)


def test_seed_full_queue_disconnect_and_compile_on_demand(on_demand_server):
    url, log_path = on_demand_server
    # steps=8 is outside the start-up set: --compile-on-demand 1 compiles it on first use, which also keeps the
    # worker busy meanwhile. Sampling with a seed: the same seed gives the same text.
    sampled = {}
    thread = threading.Thread(
        target=lambda: sampled.update(
            first=complete(url, PROMPTS[0], temperature=1.0, seed=7, extra_body={"steps": 8}).choices[0].text
        )
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

    before = metrics(url)
    assert (
        complete(url, PROMPTS[0], temperature=1.0, seed=7, extra_body={"steps": 8}).choices[0].text == sampled["first"]
    )
    assert (
        complete(url, PROMPTS[0], temperature=1.0, seed=8, extra_body={"steps": 8}).choices[0].text != sampled["first"]
    )
    assert metrics(url)["compilations"] == before["compilations"]  # kept
    log = log_path.read_text()
    assert "compiling generation on first use: batch 1, prompt 64 + 16 new tokens, alg entropy, steps 8\n" in log
    assert "client disconnected" in log
    # a second program beyond the start-up set evicts the first (least recently used): it compiles again
    complete(url, PROMPTS[0], extra_body={"steps": 4})
    complete(url, PROMPTS[0], extra_body={"steps": 8})
    after = metrics(url)
    assert after["compilations_on_demand"] - before["compilations_on_demand"] == 2, after
    assert after["compiled_programs"] == before["compiled_programs"]


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


CONTINUOUS = {"block_length": 4, "cache": "dual"}
# block-wise dual-cache rows of 16 or 128 new tokens share one running batch of 4 rows
SERVED_CONTINUOUS = (
    *("--max-batch", "4", "--max-queue", "16", "--max-context", "192", "--prompt-buckets", "64"),
    *("--max-tokens-buckets", "16,128", "--batching", "continuous", "--block-length", "4", "--cache", "dual"),
)


@pytest.fixture(scope="module")
def continuous_server(tmp_path_factory):
    """Continuous batching: block-wise dual-cache rows of 16 or 128 new tokens share one running batch of 4 rows."""
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    process, url = start_server(log_path, *SERVED_CONTINUOUS)
    yield url, log_path
    process.kill()
    process.wait()


def _long_prompt(url: str) -> str:
    """A prompt whose 128 greedy tokens hold no end-of-text (so its row runs all 32 blocks)."""
    for prompt in PROMPTS:
        if complete(url, prompt, max_tokens=128).choices[0].finish_reason == "length":
            return prompt
    pytest.fail("every prompt ends early on the fixture model")


def test_continuous_batching_frees_a_gone_clients_row_at_the_next_boundary(continuous_server):
    url, _ = continuous_server
    long_prompt = _long_prompt(url)
    before = metrics(url)
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": NAME, "prompt": long_prompt, "max_tokens": 128, "stream": True},
        timeout=60,
    ) as response:
        next(response.iter_lines())  # its first block
    wait_for(lambda: metrics(url)["cancelled"] == before["cancelled"] + 1 and metrics(url)["running_rows"] == 0)
    # its row left before its 32 blocks ran
    assert metrics(url)["block_calls"] - before["block_calls"] < 32


def _in_process_server(**settings):
    """A `DreamServer` on the fixture model (2 rows, a delay factor of 100 unless `settings` say otherwise) with its
    programs compiled, and `submit(prompt, max_tokens, told=None)`, which queues a request and returns an event set
    when it ends; `told(kind, payload)` hears every post of the request, on the engine's thread. The engine
    itself, with no network between a reply and the next request."""
    from jaxport.dream.serving.api import DreamServer
    from jaxport.dream.serving.protocol import COMPLETION, CompletionRequest
    from jaxport.dream.serving.settings import ServeSettings

    model, tokenizer = dream.load(MODEL, dtype="float32")
    serve_settings = ServeSettings(
        **{"model_name": NAME, "max_batch": 2, "max_queue": 4, "prompt_buckets": (64,), "schedule_delay_factor": 100.0}
        | settings
    )
    server = DreamServer(model, tokenizer, serve_settings)
    server.warmup()

    def submit(prompt: str, max_tokens: int, told=None) -> threading.Event:
        ended = threading.Event()

        def post(kind, payload):
            if told is not None:
                told(kind, payload)
            if kind != "delta":
                ended.set()

        body = CompletionRequest(model=NAME, prompt=prompt, max_tokens=max_tokens)
        server.engine.submit(server.job(body, [prompt], "prompt", COMPLETION, post))
        return ended

    return server, submit


@pytest.fixture(scope="module")
def continuous_engine():
    """One in-process continuous-batching server (buckets 16 and 64, blocks of 4, dual cache) and its start-up log,
    shared by the tests below: each starts the engine and stops it, over the same compiled programs."""
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        server, submit = _in_process_server(
            max_tokens_buckets=(16, 64), batching="continuous", fast=(("block_length", 4), ("cache", "dual"))
        )
    return server, submit, log.getvalue()


def test_continuous_batching_starts_a_request_while_a_long_one_runs(continuous_engine):
    """A request that arrives while a long one runs gets its first block before the long one ends, with no
    compilation. The short request is submitted when the long one's first block is out, from the engine's own
    thread (before the next block boundary), and the order of the posts is read, not the clock."""
    server, submit, start_up_log = continuous_engine
    assert "at start-up: running batch 2, prompt 64 + 64 new tokens, alg entropy, block_length 4" in start_up_log
    before = server.engine.metrics()["compilations"]
    server.engine.start()

    def reply(prompt: str, max_tokens: int) -> tuple[str, int]:
        """The request's text alone, and how many tokens it generated."""
        posts, tokens = [], server.engine.metrics()["generated_tokens"]
        submit(prompt, max_tokens, lambda kind, payload: posts.append((kind, payload))).wait()
        assert posts[-1] == ("done", None), posts[-1]
        text = "".join(payload[1] for kind, payload in posts if kind == "delta")
        return text, server.engine.metrics()["generated_tokens"] - tokens

    # a prompt whose 64 tokens hold no end-of-text, so its row runs all 16 blocks
    long_prompt = next((p for p in PROMPTS if reply(p, 64)[1] == 64), None)
    assert long_prompt is not None, "every prompt ends early on the fixture model"
    alone = reply(PROMPTS[3], 16)[0]
    assert alone, "the short prompt's reply is empty: it has no first block to stream"

    order, short_text = [], []

    def short_told(kind, payload):
        order.append(("short", kind))
        if kind == "delta":
            short_text.append(payload[1])

    def long_told(kind, payload):
        if kind == "delta" and ("long", "delta") not in order:
            submit(PROMPTS[3], 16, short_told)  # the long one's first block is out: the short one joins next
        order.append(("long", kind))

    submit(long_prompt, 64, long_told).wait()
    server.engine.stop()
    assert order.index(("short", "delta")) < order.index(("long", "done")), (
        "the short request's first block came after the long one ended"
    )
    assert "".join(short_text) == alone
    stats = server.engine.metrics()
    assert stats["compilations"] == before and stats["errors"] == 0


def test_a_static_batch_waits_for_requests_that_fill_it():
    """--schedule-delay-factor with static batching: after a batch, the next one waits (up to the factor times the
    batch's seconds) until it is full; two requests sent one after the other when a batch ends run as one batch."""
    server, submit = _in_process_server(max_tokens_buckets=(8,))
    server.engine.start()
    submit(PROMPTS[0], 8).wait()  # a batch of one: no batch ran before it, so nothing to wait for
    second = submit(PROMPTS[1], 8)
    time.sleep(0.05)  # well within 100 times the first batch's seconds
    third = submit(PROMPTS[2], 8)
    second.wait()
    third.wait()
    server.engine.stop()
    stats = server.engine.metrics()
    assert stats["errors"] == 0 and stats["batch_rows"] == {"1": 1, "2": 1}


def test_a_running_batch_waits_for_the_next_request_of_a_client_whose_row_left(continuous_engine):
    """--schedule-delay-factor: a client that sends its next request as soon as its reply ends takes its row back at
    the very next block call. A long request and a chain of short ones, each sent when the one before ends, start
    together; the short rows run in every one of the long one's calls (the wait ends once the row is replaced)."""
    server, submit, _ = continuous_engine
    before = server.engine.metrics()
    long_ended, short_ended, shorts = submit(PROMPTS[1], 64), submit(PROMPTS[1], 16), 1  # both join the first call
    server.engine.start()
    while not long_ended.is_set():
        short_ended.wait()
        if not long_ended.is_set():
            short_ended, shorts = submit(PROMPTS[1], 16), shorts + 1
    short_ended.wait()
    server.engine.stop()
    stats = {k: v - before[k] for k, v in server.engine.metrics().items() if isinstance(v, int)}
    assert stats["errors"] == 0 and stats["requests"] == shorts + 1 and shorts >= 4
    tail = stats["block_calls"] - 16  # the last short row's calls after the long one's 16 blocks of 4
    long_alone = 16 - (stats["row_blocks"] - 16 - tail)
    assert long_alone == 0, f"the long row ran alone in {long_alone} of its 16 calls"


def test_continuous_batching_replies_equal_the_library_alone(continuous_server):
    url, _ = continuous_server
    requests = []
    for i, prompt in enumerate(PROMPTS[1:3] * 4):  # two prompt lengths
        temperature, seed = [(0.0, None), (0.7, 40 + i), (0.0, None), (1.1, 3)][i % 4]
        extra = {"threshold": 0.5} if i % 3 == 1 else {}
        requests.append((prompt, (128, 16, 10, 40)[i % 4], dict(temperature=temperature, seed=seed), extra))

    def send(request):
        prompt, max_tokens, options, extra = request
        return complete(url, prompt, max_tokens=max_tokens, extra_body=extra, **options).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(send, requests))
    model, tokenizer = dream.load(MODEL, dtype="float32")
    for (prompt, max_tokens, options, extra), reply in zip(requests, replies, strict=True):
        new_tokens = 16 if max_tokens <= 16 else 128
        settings = {"steps": new_tokens, "alg": "entropy", **CONTINUOUS, **extra, "temperature": options["temperature"]}
        expected = _library_text(model, tokenizer, prompt, max_tokens, new_tokens, options["seed"], **settings)
        assert reply == expected, (prompt, max_tokens, options, extra)


@pytest.mark.skipif(compile_for.libtpu_version() is None, reason="libtpu is not installed")
@pytest.mark.parametrize(
    "fixture, options, rows, canvas",
    [("server", SERVED, [1, 2] * 3, (64, 16)), ("continuous_server", SERVED_CONTINUOUS, [1, 2, 4], (64, 128))],
)
def test_compile_for_compiles_the_programs_the_server_compiles(request, tmp_path, fixture, options, rows, canvas):
    """`serve --compile-for` compiles what a server of the same flags compiles at start-up, as many programs, from
    the folder's config.json and tokenizer alone: each program setting at both batch sizes (static batching), the
    running batch's block call at each of the three sizes (continuous); each on one device, of the prompt bucket and
    canvas the server's flags give, with its memory, collectives and roofline; then the memory of them all held at
    once."""
    url, _ = request.getfixturevalue(fixture)
    started = prometheus(url)[("jaxport_dream_start_up_programs", ())]
    for f in MODEL.iterdir():  # no weights
        if not f.name.startswith("model"):
            shutil.copy(f, tmp_path / f.name)
    command = ["dream", "serve", "--model", str(tmp_path), "--dtype", "float32", *options, "--compile-for", "v5e-4"]
    proc = subprocess.run([sys.executable, "-m", "jaxport.cli", *command], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reports = re.split(r"\n(?=jaxport dream serve: )", proc.stdout.strip())
    assert len(reports) == started == len(rows), proc.stdout
    assert [int(re.search(r" of (\d+) row\(s\)", report).group(1)) for report in reports] == rows, proc.stdout
    for report in reports:
        assert re.search(r"needs [\d.]+ [KMG]?i?B per device of a v5e device's 16 GiB HBM: fits \(", report), report
        assert "(no --mesh: one device)" in report and "roofline" in report and "collectives" in report, report
        assert "prompt bucket {} + {} new tokens".format(*canvas) in report, report
    assert re.search(rf"^the server: its {len(rows)} programs held at once", proc.stdout, re.M)
    assert "DOES NOT FIT" not in proc.stdout
