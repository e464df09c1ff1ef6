"""The ASGI middlewares of `jaxport dream serve`: the request body's size limit and the response counts, as raw ASGI
(Starlette's `BaseHTTPMiddleware` would hide a client's disconnect from the endpoint)."""

from fastapi.responses import JSONResponse

from jaxport.dream.serving.metrics import ServerMetrics
from jaxport.dream.serving.protocol import APIError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/metrics.json")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers)


class LimitBody:
    """HTTP 413 for a request body above `limit` bytes, by its Content-Length or as its bytes arrive (before
    anything reads the body)."""

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
        error = APIError(413, self._message(size), "body", "request_too_large")
        await error_response(error)({"type": "http"}, None, send)


class CountResponses:
    """Counts every response by endpoint and status."""

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
