"""`jaxport dream serve`: an OpenAI-compatible HTTP server for Dream / DiffuCoder models (FastAPI + uvicorn).

`GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template applied),
`GET /health`, `GET /metrics` (Prometheus text format: `jaxport.dream.serving.metrics`) and `GET /metrics.json` (the
engine's counts: requests, batch sizes run, queue, compiled programs). The wire format is
`jaxport.dream.serving.protocol`; which settings are compiled (and so decide which requests batch together) is said in
`jaxport.dream.serving.programs`.

This layer tokenises each prompt once and hands the engine token ids. `max_tokens` is rounded up to a
`--max-tokens-buckets` value: the canvas holds that many new tokens and the text is cut at `max_tokens`, so a request
whose `max_tokens` is a bucket gets exactly the tokens of `diffusion_generate(max_new_tokens=max_tokens)`.
"""

import asyncio
import contextlib
import dataclasses
import json
import secrets
import signal
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxport.dream.serving.engine import Engine, Job, QueueFull, log
from jaxport.dream.serving.metrics import CONTENT_TYPE, ServerMetrics
from jaxport.dream.serving.middleware import CountResponses, LimitBody, error_response
from jaxport.dream.serving.output import RowText
from jaxport.dream.serving.programs import BatchKey, NotServed, ServedPrograms, bucket
from jaxport.dream.serving.protocol import (
    CHAT,
    COMPLETION,
    APIError,
    ChatRequest,
    Chunk,
    Completion,
    CompletionRequest,
    Format,
    GenerationRequest,
    ModelCard,
    ModelList,
    Usage,
    check_extra_fields,
    generation_error,
    invalid,
    validation_error,
)
from jaxport.dream.serving.settings import ServeSettings
from jaxport.dream.settings import BLOCKWISE, GenerationSettings
from jaxport.errors import JaxportError


class DreamServer:
    """Validates requests, turns them into engine `Job`s and shapes the answers."""

    def __init__(self, model, tokenizer, settings: ServeSettings):
        self.tokenizer, self.settings = tokenizer, settings
        self.programs = ServedPrograms(settings)
        self.engine = Engine(
            model,
            tokenizer,
            max_batch=settings.max_batch,
            max_queue=settings.max_queue,
            on_demand=settings.compile_on_demand,
            lane_tokens=settings.lane_tokens,
            max_context=settings.max_context,
            delay_factor=settings.schedule_delay_factor,
        )
        self.metrics = ServerMetrics(self.engine)
        self.created = int(time.time())

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.settings.model_name, created=self.created)

    def warmup(self):
        """Compile the start-up set now (else each program compiles on first use)."""
        self.engine.warmup(self.programs.start_up_keys(), self.tokenizer.encode("Hello"))

    def job(self, body: GenerationRequest, prompts: list[str], prompt_field: str, fmt: Format, post) -> Job:
        """The engine's job for a request, or an APIError naming what is wrong with it."""
        s = self.settings
        check_extra_fields(body)
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
            raise invalid(
                "max_tokens", f"{max_tokens} exceeds the largest --max-tokens-buckets value {s.max_tokens_buckets[-1]}"
            )
        steps = body.steps or new_tokens
        if steps > new_tokens:
            raise invalid(
                "steps",
                f"{steps} exceeds the {new_tokens} new tokens of this request's canvas "
                f"(max_tokens {max_tokens} rounded up to a --max-tokens-buckets value)",
            )
        if len(prompts) * body.n > s.max_batch:
            raise invalid("n", f"{len(prompts)} prompt(s) x n={body.n} rows exceed --max-batch {s.max_batch}")
        encoded = self._encode(prompts, prompt_field, new_tokens)
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
            raise generation_error(err) from None
        job_id = f"{fmt.id_prefix}-{secrets.token_hex(12)}"
        key = self._key(body, encoded, prompt_field, new_tokens, checked, job_id)
        rows = [ids for ids in encoded for _ in range(body.n)]
        return Job(
            job_id,
            key,
            rows,
            [RowText(self.tokenizer, max_tokens, body.stop_strings()) for _ in rows],
            post,
            row=checked.row,
            seed=body.seed,
            prompt_tokens=sum(map(len, encoded)),
        )

    def _encode(self, prompts: list[str], prompt_field: str, new_tokens: int) -> list[list[int]]:
        """The prompts' token ids, each non-empty and within the context with `new_tokens` new tokens."""
        encoded = [self.tokenizer.encode(p) for p in prompts]
        if not all(encoded):
            raise invalid(prompt_field, "a prompt is empty")
        longest, room = max(map(len, encoded)), self.settings.max_context - new_tokens
        if longest > room:
            raise invalid(
                prompt_field,
                f"the prompt has {longest} tokens, but with {new_tokens} new tokens the "
                f"context of {self.settings.max_context} (--max-context) leaves room for {max(room, 0)}",
                "context_length_exceeded",
            )
        return encoded

    def _key(self, body, encoded, prompt_field: str, new_tokens: int, checked, job_id: str) -> BatchKey:
        """The request's program, if this server runs it (`ServedPrograms`): else a 400 saying why."""
        try:
            prompt_len = self.programs.prompt_bucket(max(map(len, encoded)), new_tokens, prompt_field)
            key = BatchKey(prompt_len, new_tokens, checked.program)
            self.programs.check(key, {name for name in ("steps", "alg", *BLOCKWISE) if getattr(body, name) is not None})
            if any(self.tokenizer.mask_token_id in ids for ids in encoded):
                self.programs.mask_prompt(prompt_field)
                key = dataclasses.replace(key, alone=job_id)
        except NotServed as refused:
            raise invalid(refused.param, refused.message, refused.code) from None
        return key

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
            self.engine.submit(job)
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
        reply = Completion(
            id=job.id,
            object=fmt.object,
            created=int(time.time()),
            model=self.settings.model_name,
            choices=[fmt.choice(i, t.text, t.finish_reason) for i, t in enumerate(job.texts)],
            usage=self._usage(job),
        )
        return JSONResponse(reply.model_dump())

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
                error = generation_error(payload)
                self._log(job, error.status)
                raise error
            if kind == "done":
                self._log(job, 200)
                return
            yield payload

    async def _stream(self, job: Job, fmt: Format, events: asyncio.Queue, include_usage: bool):
        """The server-sent events of a streamed reply: each delta as it comes, the finish reasons, the usage."""
        created = int(time.time())

        def chunk(choices, usage=None):
            model = self.settings.model_name
            data = Chunk(id=job.id, object=fmt.chunk_object, created=created, model=model, choices=choices, usage=usage)
            return f"data: {json.dumps(data.model_dump(exclude=None if include_usage else {'usage'}))}\n\n"

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

    def _usage(self, job: Job) -> Usage:
        completion = sum(t.tokens for t in job.texts)
        return Usage(
            prompt_tokens=job.prompt_tokens,
            completion_tokens=completion,
            total_tokens=job.prompt_tokens + completion,
        )

    def _gone(self, job: Job):
        self.engine.cancel(job)
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


def _error_handlers(app: FastAPI):
    """Every error as an OpenAI-format body, logged."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        log(f"{request.method} {request.url.path} {err.status}: {err.message}")
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def request_error(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await api_error(request, APIError(exc.status_code, str(exc.detail), kind=kind))


def create_app(model, tokenizer, settings: ServeSettings) -> FastAPI:
    """The FastAPI app; its engine (`app.state.server.engine`) runs while the app's lifespan does."""
    server = DreamServer(model, tokenizer, settings)
    keys = server.programs.start_up_keys()
    server.engine.start_up |= {key.program for key in keys} | server.engine.lanes(keys)  # now or on first use

    async def lifespan(app):
        server.engine.start()
        yield
        server.engine.stop()

    app = FastAPI(title="jaxport Dream", lifespan=lifespan)
    app.state.server = server
    _error_handlers(app)
    app.add_middleware(LimitBody, limit=settings.max_body_bytes)
    app.add_middleware(CountResponses, metrics=server.metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/metrics.json")
    async def metrics_json():
        return {"model": settings.model_name, **server.engine.metrics()}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[server.model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != settings.model_name:
            raise APIError(404, f"model: the model {model_id!r} does not exist", "model", "model_not_found")
        return server.model_card().model_dump()

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
            raise invalid("messages", str(err)) from None
        return await server.respond(request, body, [prompt], "messages", CHAT)

    return app


def serve(
    model, tokenizer, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000, warmup: bool = True
) -> int:
    """Compile the default shapes (with `warmup`), then serve until SIGTERM or SIGINT: stop accepting,
    finish the requests in flight, return 0."""
    app = create_app(model, tokenizer, settings)
    if warmup:
        app.state.server.warmup()  # logs what the start-up set took
    # uvicorn shuts down gracefully on these, then re-raises them under the handlers it found: make
    # those do nothing, so that the process ends normally with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, access_log=False, log_level="info")).run()
    return 0
