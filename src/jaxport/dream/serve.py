"""`jaxport dream serve`: an OpenAI-compatible HTTP server for Dream / DiffuCoder models (FastAPI + uvicorn).

`GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template
applied), `GET /health`, `GET /metrics` (Prometheus text format: `jaxport.dream.serve_metrics`) and
`GET /metrics.json` (the scheduler's counts: requests, batch sizes run, queue, compiled programs). Requests
take the OpenAI fields `max_tokens` (chat also `max_completion_tokens`), `temperature` (default 0: greedy), `top_p`,
`stop`, `n`, `seed`, `stream` (server-sent events) and `stream_options.include_usage`, and Dream's own
`steps` (default: the canvas length), `alg`, `alg_temp`, `top_k`, `block_length`, `cache`, `threshold` and
`schedule` as extra body fields, validated as `jaxport.dream.settings.GenerationSettings` validates them for
the Python API and the CLI. Which of them are compiled (and so decide which requests batch together) is said
in `jaxport.dream.scheduler`.

`max_tokens` is rounded up to a `--max-tokens-buckets` value: the canvas holds that many new tokens
and the text is cut at `max_tokens`, so a request whose `max_tokens` is a bucket gets exactly the
tokens of `diffusion_generate(max_new_tokens=max_tokens)`. Bad requests get OpenAI-format errors
(`{"error": {"message", "type", "param", "code"}}`) naming the field.
"""

import asyncio
import contextlib
import dataclasses
import json
import secrets
import signal
import time
from collections.abc import Callable
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from jaxport.dream.scheduler import BatchKey, Job, QueueFull, RowText, Scheduler, bucket, log
from jaxport.dream.serve_metrics import CONTENT_TYPE, ServerMetrics
from jaxport.dream.settings import (
    ALGORITHMS,
    BLOCKWISE,
    Algorithm,
    Cache,
    Count,
    GenerationSettings,
    NonNegative,
    Probability,
    ProgramSettings,
    Schedule,
    problem,
)
from jaxport.errors import JaxportError

# OpenAI fields this server does not implement: accepted only when absent, null or at this neutral value.
UNSUPPORTED = {
    "echo": False,
    "suffix": "",
    "best_of": 1,
    "logprobs": 0,
    "top_logprobs": 0,
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
}
# OpenAI fields that do not change generation here.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """What the server accepts and how it batches (see `jaxport dream serve --help`)."""

    model_name: str
    max_batch: int = 8
    max_queue: int = 64
    max_context: int = 2048
    prompt_buckets: tuple[int, ...] = (128, 512)
    max_tokens_buckets: tuple[int, ...] = (64, 256)
    default_max_tokens: int | None = None  # None: the smallest max_tokens bucket
    alg: str = "entropy"
    fast: tuple = ()  # fast-decoding (name, value) pairs (`settings.BLOCKWISE`), for requests that do not set them
    # more program-shaping combinations compiled at start-up, each a tuple of (name, value) pairs over the defaults
    programs: tuple = ()
    compile_on_demand: int = 0  # programs outside the start-up set compiled for requests, least recently used evicted
    batching: str = "static"  # or "continuous": block-wise dual-cache requests join a running batch between blocks
    max_body_bytes: int = 1 << 20  # a longer request body gets HTTP 413
    # a batch with room waits up to this many times the last call's seconds for requests to fill it (0: never)
    schedule_delay_factor: float = 0.0

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "max_context", "default_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise JaxportError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_queue < self.max_batch:
            raise JaxportError(f"--max-queue {self.max_queue} must hold a full batch (--max-batch {self.max_batch})")
        for name in ("prompt_buckets", "max_tokens_buckets"):
            values = getattr(self, name)
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise JaxportError(
                    f"--{name.replace('_', '-')} {','.join(map(str, values))}: expected increasing positive sizes"
                )
        if self.default_max_tokens and self.default_max_tokens > self.max_tokens_buckets[-1]:
            raise JaxportError(
                f"--default-max-tokens {self.default_max_tokens} exceeds the largest "
                f"--max-tokens-buckets value {self.max_tokens_buckets[-1]}"
            )
        if self.alg not in ALGORITHMS:
            raise JaxportError(f"--alg {self.alg!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.batching not in ("static", "continuous"):
            raise JaxportError(f"--batching {self.batching!r}: choose static or continuous")
        if not self.schedule_delay_factor >= 0:
            raise JaxportError(f"--schedule-delay-factor must be at least 0, got {self.schedule_delay_factor}")
        if self.compile_on_demand < 0:
            raise JaxportError(f"--compile-on-demand must be at least 0, got {self.compile_on_demand}")
        for new_tokens in self.max_tokens_buckets:
            self.allowed(new_tokens)  # a bad --program is an error at start-up

    def defaults(self, new_tokens: int) -> dict:
        """The program settings of a request that sets none (steps: one per new token)."""
        return {"steps": new_tokens, "alg": self.alg, **dict(self.fast)}

    def allowed(self, new_tokens: int) -> list[ProgramSettings]:
        """The program settings compiled at start-up for canvases of `new_tokens` new tokens: the defaults, then
        each `--program` over them."""
        allowed = []
        for extra in ((), *self.programs):
            try:
                settings = GenerationSettings.of(**{**self.defaults(new_tokens), **dict(extra)}).check(new_tokens)
            except JaxportError as err:
                spec = ",".join(f"{k}={v}" for k, v in extra)
                raise JaxportError(f"--program {spec} (with {new_tokens} new tokens): {err}") from None
            if settings.program not in allowed:
                allowed.append(settings.program)
        return allowed

    def warmup_keys(self) -> list[BatchKey]:
        """The start-up set: every allowed program at every prompt and max_tokens bucket."""
        return [
            BatchKey(prompt_len, new_tokens, settings)
            for new_tokens in self.max_tokens_buckets
            for settings in self.allowed(new_tokens)
            for prompt_len in self.prompt_buckets
            if prompt_len + new_tokens <= self.max_context
        ]

    def outside(self, key: BatchKey, given: set[str]) -> "APIError | None":
        """The 400 for a request whose program is not in the start-up set (None when it is, or when
        `--compile-on-demand` lets the server compile it): names the first setting whose value no allowed program
        has, with the allowed values."""
        allowed = self.allowed(key.new_tokens)
        if key.settings in allowed or self.compile_on_demand:
            return None
        fields = ("alg", "steps", "block_length", "cache", "schedule", "eps")
        name = next(
            (n for n in fields if getattr(key.settings, n) not in {getattr(a, n) for a in allowed}),
            next(n for n in fields if n in given) if given & set(fields) else "steps",
        )
        param = "threshold" if name == "block_length" and "block_length" not in given and "threshold" in given else name
        combos = "; ".join(
            ", ".join(f"{n}={getattr(a, n)}" for n in fields if getattr(a, n) is not None) for a in allowed
        )
        return _invalid(
            param,
            f"{name}={getattr(key.settings, name)} is not among the programs this server compiled at start-up "
            f"for {key.new_tokens} new tokens (allowed {name}: "
            f"{', '.join(sorted({str(getattr(a, name)) for a in allowed}))}; programs: {combos}); "
            f"start it with --program or --compile-on-demand",
            "setting_not_served",
        )


# -- request bodies -------------------------------------------------------------------------------
class _Body(BaseModel):
    # strict: "16" is no integer; extra fields are checked by `_check_extra_fields`
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationRequest(_Body):
    model: str
    max_tokens: Count | None = None
    n: Count = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # generation settings, checked by the rules of GenerationSettings; None: the server's default
    temperature: NonNegative | None = None
    top_p: Probability | None = None
    top_k: Count | None = None
    steps: Count | None = None
    alg: Algorithm | None = None
    alg_temp: NonNegative | None = None
    block_length: Count | None = None
    cache: Cache | None = None
    threshold: Probability | None = None
    schedule: Schedule | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] = Field(min_length=1)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Count | None = None


FIELDS = {
    name for m in (CompletionRequest, ChatRequest, Message, ContentPart, StreamOptions) for name in m.model_fields
}


# -- errors ---------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = (
            status,
            message,
            param,
            code,
            kind,
            headers,
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def _invalid(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param, code)


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as `field[index].subfield: what is wrong`."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({error.get('ctx', {}).get('error', error['msg'])})")
    loc = [p for p in error["loc"][1:] if isinstance(p, int) or p in FIELDS]  # union branch names left out
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {error['msg']}")
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)[1:]
    return APIError(400, f"{path}: {problem(error)}", str(loc[0]))


def _generation_error(err: Exception) -> APIError:
    """A failed batch: jaxport's own checks are the request's fault (their message starts with the
    argument's name), anything else the server's."""
    if isinstance(err, JaxportError):
        name = str(err).split(":")[0]
        return APIError(400, str(err), name if name in FIELDS else None)
    return APIError(500, f"generation failed: {err}", kind="server_error")


def _check_extra_fields(body: GenerationRequest):
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED:
            continue
        if name not in UNSUPPORTED:
            raise _invalid(name, "unknown field")
        if value is not None and value != UNSUPPORTED[name]:
            raise _invalid(name, f"not supported by this server (only {json.dumps(UNSUPPORTED[name])})")


# -- response shapes ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Format:
    """How one endpoint shapes its choices: whole (`choice`) and streamed (`delta`, and `start` first)."""

    object: str
    chunk_object: str
    id_prefix: str
    choice: Callable[[int, str, str], dict]
    delta: Callable[[int, str, str | None], dict]
    start: Callable[[int], dict] | None = None


def _text_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


COMPLETION = Format("text_completion", "text_completion", "cmpl", choice=_text_choice, delta=_text_choice)
CHAT = Format(
    "chat.completion",
    "chat.completion.chunk",
    "chatcmpl",
    choice=lambda i, text, finish: {
        "index": i,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish,
    },
    delta=lambda i, text, finish: {
        "index": i,
        "delta": {"content": text} if text else {},
        "logprobs": None,
        "finish_reason": finish,
    },
    start=lambda i: {
        "index": i,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    },
)


# -- the app --------------------------------------------------------------------------------------
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/metrics.json")


class DreamServer:
    """Validates requests, turns them into scheduler `Job`s and shapes the answers."""

    def __init__(self, model, tokenizer, settings: ServeSettings):
        self.tokenizer, self.settings = tokenizer, settings
        self.scheduler = Scheduler(
            model,
            tokenizer,
            max_batch=settings.max_batch,
            max_queue=settings.max_queue,
            on_demand=settings.compile_on_demand,
            batching=settings.batching,
            lane_tokens=settings.max_tokens_buckets[-1],
            max_context=settings.max_context,
            delay_factor=settings.schedule_delay_factor,
        )
        self.metrics = ServerMetrics(self.scheduler)
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.created, "owned_by": "jaxport"}

    def job(self, body: GenerationRequest, prompts: list[str], prompt_field: str, fmt: Format, post) -> Job:
        """The scheduler job for a request, or an APIError naming what is wrong with it."""
        s = self.settings
        _check_extra_fields(body)
        if body.model != s.model_name:
            raise APIError(
                404,
                f"model: the model {body.model!r} does not exist; this server has {s.model_name!r}",
                "model",
                "model_not_found",
            )
        max_tokens = (
            getattr(body, "max_completion_tokens", None)
            or body.max_tokens
            or s.default_max_tokens
            or s.max_tokens_buckets[0]
        )
        new_tokens = bucket(max_tokens, list(s.max_tokens_buckets))
        if new_tokens is None:
            raise _invalid(
                "max_tokens", f"{max_tokens} exceeds the largest --max-tokens-buckets value {s.max_tokens_buckets[-1]}"
            )
        steps = body.steps or new_tokens
        if steps > new_tokens:
            raise _invalid(
                "steps",
                f"{steps} exceeds the {new_tokens} new tokens of this request's canvas "
                f"(max_tokens {max_tokens} rounded up to a --max-tokens-buckets value)",
            )
        if len(prompts) * body.n > s.max_batch:
            raise _invalid("n", f"{len(prompts)} prompt(s) x n={body.n} rows exceed --max-batch {s.max_batch}")
        encoded = [self.tokenizer.encode(p) for p in prompts]
        if not all(encoded):
            raise _invalid(prompt_field, "a prompt is empty")
        longest, room = max(map(len, encoded)), s.max_context - new_tokens
        if longest > room:
            raise _invalid(
                prompt_field,
                f"the prompt has {longest} tokens, but with {new_tokens} new tokens the "
                f"context of {s.max_context} (--max-context) leaves room for {max(room, 0)}",
                "context_length_exceeded",
            )
        try:
            checked = GenerationSettings.of(
                steps=steps,
                alg=body.alg or s.alg,
                temperature=float(body.temperature or 0.0),
                top_p=body.top_p,
                top_k=body.top_k,
                alg_temp=body.alg_temp,
                **self._fast(body),
            ).check(new_tokens)
        except JaxportError as err:
            raise _generation_error(err) from None
        key = BatchKey(self._prompt_bucket(longest, new_tokens, prompt_field), new_tokens, checked.program)
        given = {name for name in ("steps", "alg", *BLOCKWISE) if getattr(body, name) is not None}
        if (error := s.outside(key, given)) is not None:
            raise error
        job_id = f"{fmt.id_prefix}-{secrets.token_hex(12)}"
        if any(self.tokenizer.mask_token_id in ids for ids in encoded):
            if not s.compile_on_demand:
                raise _invalid(
                    prompt_field,
                    "holds the mask token, which makes a program of its own; start the server with "
                    "--compile-on-demand to serve such prompts",
                    "setting_not_served",
                )
            key = dataclasses.replace(key, alone=job_id)
        stop = [body.stop] if isinstance(body.stop, str) else [text for text in body.stop or [] if text]
        rows = [p for p in prompts for _ in range(body.n)]
        return Job(
            job_id,
            key,
            rows,
            [RowText(self.tokenizer, max_tokens, stop) for _ in rows],
            post,
            row=checked.row,
            seed=body.seed,
            prompt_tokens=sum(map(len, encoded)),
        )

    def _prompt_bucket(self, longest: int, new_tokens: int, prompt_field: str) -> int:
        """The prompt bucket a prompt of `longest` tokens runs in with `new_tokens` new tokens. Past the largest
        bucket that fits the context, the request is refused unless `--compile-on-demand` lets the server compile
        a program for it (then its prompt length is the room the context leaves): nothing else compiles after
        start-up."""
        s = self.settings
        room = s.max_context - new_tokens
        usable = [b for b in s.prompt_buckets if b <= room]
        prompt_len = bucket(longest, usable)
        if prompt_len is not None:
            return prompt_len
        if s.compile_on_demand:
            return room
        largest = f"the largest prompt bucket is {usable[-1]}" if usable else "no prompt bucket fits"
        raise _invalid(
            prompt_field,
            f"the prompt has {longest} tokens; with {new_tokens} new tokens and --max-context {s.max_context}, "
            f"{largest} (--prompt-buckets {','.join(map(str, s.prompt_buckets))}); start the server with a larger "
            "--prompt-buckets value, or --compile-on-demand to compile such prompts' programs on first use",
            "context_length_exceeded",
        )

    def _fast(self, body: GenerationRequest) -> dict:
        """The request's fast-decoding settings, each defaulting to the server's."""
        server = dict(self.settings.fast)
        chosen = {name: server.get(name) if getattr(body, name) is None else getattr(body, name) for name in BLOCKWISE}
        return {name: value for name, value in chosen.items() if value is not None}

    async def respond(
        self, request: Request, body: GenerationRequest, prompts: list[str], prompt_field: str, fmt: Format
    ) -> Response:
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def post(kind, payload):  # from the worker thread
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody waits for the event
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        job = self.job(body, prompts, prompt_field, fmt, post)
        try:
            self.scheduler.submit(job)
        except QueueFull as full:
            raise APIError(
                429, str(full), None, "rate_limit_exceeded", "server_error", {"Retry-After": str(full.retry_after)}
            ) from None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(job, fmt, events, include_usage), media_type="text/event-stream")
        try:
            async for _ in self._events(job, events, request):
                pass  # a non-streamed reply waits until every event is in: then job.texts is final
        except ConnectionAbortedError:
            return Response(status_code=499)
        choices = [fmt.choice(i, t.text, t.finish_reason) for i, t in enumerate(job.texts)]
        return JSONResponse(
            {
                "id": job.id,
                "object": fmt.object,
                "created": int(time.time()),
                "model": self.settings.model_name,
                "choices": choices,
                "usage": self._usage(job),
            }
        )

    async def _events(self, job: Job, events: asyncio.Queue, request: Request | None = None):
        """The job's deltas until it is done; raises its error as an APIError. With `request`, checks
        twice a second whether the client went away (StreamingResponse watches that itself)."""
        while True:
            try:
                kind, payload = await asyncio.wait_for(events.get(), 0.5)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    self._gone(job)
                    raise ConnectionAbortedError from None
                continue
            if kind == "error":
                error = _generation_error(payload)
                self._log(job, error.status)
                raise error
            if kind == "done":
                self._log(job, 200)
                return
            yield payload

    async def _stream(self, job: Job, fmt: Format, events: asyncio.Queue, include_usage: bool):
        created = int(time.time())

        def chunk(choices, usage=None):
            data = {
                "id": job.id,
                "object": fmt.chunk_object,
                "created": created,
                "model": self.settings.model_name,
                "choices": choices,
            }
            if include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        finished = False
        try:
            if fmt.start:
                yield chunk([fmt.start(i) for i in range(len(job.texts))])
            try:
                async for index, text in self._events(job, events):
                    yield chunk([fmt.delta(index, text, None)])
            except APIError as err:
                finished = True
                yield f"data: {json.dumps(err.body())}\n\n"
                return
            yield chunk([fmt.delta(i, "", t.finish_reason) for i, t in enumerate(job.texts)])
            if include_usage:
                yield chunk([], self._usage(job))
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self._gone(job)

    def _usage(self, job: Job) -> dict:
        completion = sum(t.tokens for t in job.texts)
        return {
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion,
        }

    def _gone(self, job: Job):
        self.scheduler.cancel(job)
        log(f"{job.id} client disconnected after {time.perf_counter() - job.submitted:.2f} s; its rows are dropped")

    def _log(self, job: Job, status: int):
        now = time.perf_counter()
        self.metrics.ended(job)
        queued = (job.started or now) - job.submitted
        log(
            f"{job.id} {status}: {job.prompt_tokens} prompt + {sum(t.tokens for t in job.texts)} completion tokens "
            f"in {len(job.texts)} rows, {now - job.submitted:.2f} s (queued {queued:.2f} s, batch of "
            f"{job.batch_requests} requests)"
        )


class LimitBody:
    """HTTP 413 for a request body above `limit` bytes, by its Content-Length or as its bytes arrive (an ASGI
    middleware, before anything reads the body)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await self._too_large(send, int(length))
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise APIError(413, self._message(received), "body", "request_too_large")
            return message

        return await self.app(scope, counted, send)

    def _message(self, size: int) -> str:
        return f"body: the request body has {size} bytes or more, above the limit of {self.limit} (--max-body-bytes)"

    async def _too_large(self, send, size: int):
        await APIError(413, self._message(size), "body", "request_too_large").response()({"type": "http"}, None, send)


class CountResponses:
    """Counts every response by endpoint and status (an ASGI middleware: Starlette's `BaseHTTPMiddleware` would hide
    a client's disconnect from the endpoint)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.answered(endpoint, message["status"])
            await send(message)

        return await self.app(scope, receive, counted)


def create_app(model, tokenizer, settings: ServeSettings) -> FastAPI:
    """The FastAPI app; its scheduler (`app.state.server.scheduler`) runs while the app's lifespan does."""
    server = DreamServer(model, tokenizer, settings)
    keys = settings.warmup_keys()
    server.scheduler.start_up |= {key.program for key in keys} | server.scheduler.lanes(keys)  # now or on first use

    async def lifespan(app):
        server.scheduler.start()
        yield
        server.scheduler.stop()

    app = FastAPI(title="jaxport Dream", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        log(f"{request.method} {request.url.path} {err.status}: {err.message}")
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return await api_error(request, _validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return await api_error(
            request,
            APIError(
                exc.status_code,
                str(exc.detail),
                kind="not_found_error" if exc.status_code == 404 else "invalid_request_error",
            ),
        )

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    app.add_middleware(LimitBody, limit=settings.max_body_bytes)
    app.add_middleware(CountResponses, metrics=server.metrics)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/metrics.json")
    async def metrics_json():
        return {"model": settings.model_name, **server.scheduler.metrics()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != settings.model_name:
            raise APIError(404, f"model: the model {model_id!r} does not exist", "model", "model_not_found")
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        return await server.respond(request, body, prompts, "prompt", COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except JaxportError as err:
            raise _invalid("messages", str(err)) from None
        return await server.respond(request, body, [prompt], "messages", CHAT)

    return app


def serve(
    model, tokenizer, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000, warmup: bool = True
) -> int:
    """Compile the default shapes (with `warmup`), then serve until SIGTERM or SIGINT: stop accepting,
    finish the requests in flight, return 0."""
    app = create_app(model, tokenizer, settings)
    if warmup:
        start = time.perf_counter()
        app.state.server.scheduler.warmup(settings.warmup_keys())
        log(f"start-up compilation done in {time.perf_counter() - start:.1f} s")
    # uvicorn shuts down gracefully on these, then re-raises them under the handlers it found: make
    # those do nothing, so that the process ends normally with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, access_log=False, log_level="info")).run()
    return 0
