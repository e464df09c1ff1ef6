"""The OpenAI-compatible wire format of `jaxport dream serve`: request bodies, typed responses and errors.

Requests take the OpenAI fields `max_tokens` (chat also `max_completion_tokens`), `temperature` (default 0: greedy),
`top_p`, `stop`, `n`, `seed`, `stream` (server-sent events) and `stream_options.include_usage`, and Dream's own
`steps` (default: the canvas length), `alg`, `alg_temp`, `top_k`, `block_length`, `cache`, `threshold` and
`schedule` as extra body fields, validated as `jaxport.dream.settings.GenerationSettings` validates them for the
Python API and the CLI. Bad requests get OpenAI-format errors (`{"error": {"message", "type", "param", "code"}}`)
naming the field.
"""

import dataclasses
import json
from collections.abc import Callable
from typing import Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from jaxport.dream.settings import Algorithm, Cache, Count, NonNegative, Probability, Schedule, problem
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


# -- request bodies -------------------------------------------------------------------------------
class _Body(BaseModel):
    # strict: "16" is no integer; extra fields are checked by `check_extra_fields`
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

    def stop_strings(self) -> list[str]:
        """`stop` as a list, empty strings left out."""
        return [self.stop] if isinstance(self.stop, str) else [text for text in self.stop or [] if text]


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


# -- responses ------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TextChoice(BaseModel):
    """A choice of `/v1/completions`, whole or streamed."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class Delta(BaseModel):
    """A streamed chat delta: only the fields given (an empty object for the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _given(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None


Choice = TextChoice | ChatChoice | ChatChunkChoice


class Completion(BaseModel):
    """A whole reply: `text_completion` or `chat.completion`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Chunk(BaseModel):
    """One server-sent event of a streamed reply; `usage` is sent only with `stream_options.include_usage`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxport"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@dataclasses.dataclass(frozen=True)
class Format:
    """How one endpoint shapes its choices: whole (`choice`) and streamed (`delta`, and `start` first)."""

    object: str
    chunk_object: str
    id_prefix: str
    choice: Callable[[int, str, str | None], Choice]
    delta: Callable[[int, str, str | None], Choice]
    start: Callable[[int], Choice] | None = None


def _text_choice(index: int, text: str, finish_reason: str | None) -> TextChoice:
    return TextChoice(index=index, text=text, finish_reason=finish_reason)


COMPLETION = Format("text_completion", "text_completion", "cmpl", choice=_text_choice, delta=_text_choice)
CHAT = Format(
    "chat.completion",
    "chat.completion.chunk",
    "chatcmpl",
    choice=lambda i, text, finish: ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=finish),
    delta=lambda i, text, finish: ChatChunkChoice(index=i, delta=Delta(content=text or None), finish_reason=finish),
    start=lambda i: ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""), finish_reason=None),
)


# -- errors ---------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An OpenAI-format error: the HTTP status, the body's fields, and headers to send with it."""

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
        return ErrorBody(
            error=ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code)
        ).model_dump()


def invalid(param: str, message: str, code: str | None = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, f"{param}: {message}", param, code)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as `field[index].subfield: what is wrong`."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({error.get('ctx', {}).get('error', error['msg'])})")
    loc = [p for p in error["loc"][1:] if isinstance(p, int) or p in FIELDS]  # union branch names left out
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {error['msg']}")
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)[1:]
    return APIError(400, f"{path}: {problem(error)}", str(loc[0]))


def generation_error(err: Exception) -> APIError:
    """A failed request: jaxport's own checks are the request's fault (their message starts with the
    argument's name), anything else the server's."""
    if isinstance(err, JaxportError):
        name = str(err).split(":")[0]
        return APIError(400, str(err), name if name in FIELDS else None)
    return APIError(500, f"generation failed: {err}", kind="server_error")


def check_extra_fields(body: GenerationRequest):
    """The fields beyond the models': ignored ones pass, unsupported ones only at their neutral value."""
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED:
            continue
        if name not in UNSUPPORTED:
            raise invalid(name, "unknown field")
        if value is not None and value != UNSUPPORTED[name]:
            raise invalid(name, f"not supported by this server (only {json.dumps(UNSUPPORTED[name])})")
