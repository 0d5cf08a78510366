"""The OpenAI-compatible HTTP API over a batching Scheduler (FastAPI).

Every request is validated and tokenized here, then handed to the scheduler's thread; its events come
back through an asyncio queue. A client that goes away cancels its request, which frees its batch
slot before the next engine step.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager

import uvicorn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.engine import GenerationResult, TokenEvent
from specdecode.errors import InvalidRequestError
from specdecode.heap import release_freed_memory
from specdecode.serving.limits import DEFAULT_MAX_REQUEST_BYTES, LARGE_PROMPT_CHARACTERS, RETRY_AFTER_SECONDS
from specdecode.serving.metrics import Metrics
from specdecode.serving.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, error_body
from specdecode.serving.scheduler import QueueFullError, Scheduler

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
KNOWN_PATHS = GENERATION_ENDPOINTS + ("/v1/models", "/health", "/metrics")
ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
DISCONNECT_POLL_SECONDS = 0.5


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class _ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: an error message that quotes a client's invalid text (a lone
    surrogate) still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                    headers: Mapping[str, str] | None = None) -> JSONResponse:
    return _ASCIIJSONResponse(error_body(message, ERROR_KINDS.get(status, "invalid_request_error"), param, code),
                              status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if err.get("type") == "extra_forbidden":
        return f"unknown field {param!r}", param
    if err.get("type") == "missing" and param is None:
        return "the request has no body: send a JSON object", None
    if err.get("type") == "missing":
        return f"missing required field {param!r}", param
    message = str(err.get("msg")).removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


class _CountRequests:
    """ASGI middleware counting every HTTP request by endpoint and status (499: the client went away, also
    after a stream's 200 began)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 499}

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status["code"] = 500  # answered by the server-error handler, outside this middleware
            raise
        finally:
            if scope.get("state", {}).get("cancelled"):
                status["code"] = 499
            path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
            self.metrics.requests.labels(endpoint=path, status=str(status["code"])).inc()


class _RequireKey:
    """ASGI middleware: every path but `open_paths` needs 'Authorization: Bearer KEY', checked before the body is
    read, in time that does not depend on how much of the key a guess got right."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app, self.open_paths = app, open_paths
        self.expected = hashlib.sha256(b"Bearer " + api_key.encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(hashlib.sha256(given).digest(), self.expected):
                response = _error_response(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _LimitBody:
    """ASGI middleware: a request body over `limit` bytes gets a 413 before any of it is parsed. The body is read
    here (at most `limit` bytes kept) and handed to the app as one message."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._too_large(scope, receive, send)
        first: dict | None = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay() -> dict:
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        response = _error_response(413, f"the request body is larger than {self.limit} bytes (the server's "
                                        "--max-request-bytes)", code="request_too_large")
        await response(scope, receive, send)


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None, *, open_metrics: bool = False,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               gather_metrics: Callable[[], Awaitable[bytes]] | None = None) -> FastAPI:
    """The OpenAI-compatible app. With `api_key`, every endpoint but /health (and /metrics if `open_metrics`)
    needs it; request bodies over `max_request_bytes` are refused unread. gather_metrics: what /metrics serves, if
    not this app's own (a replica of a cluster serves every replica's, serving/cluster.py)."""
    if api_key is not None and not api_key:
        raise InvalidRequestError("the API key is empty")
    gen = scheduler.gen
    metrics = Metrics(running=lambda: scheduler.running, waiting=lambda: scheduler.queued)
    scheduler.on_step = metrics.batch_size.observe

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="specdecode", description="OpenAI-compatible API with lossless speculative decoding",
                  lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(_LimitBody, limit=max_request_bytes)  # the last added runs first: count, key, size
    open_paths = None
    if api_key is not None:
        open_paths = frozenset({"/health"} | ({"/metrics"} if open_metrics else set()))
        app.add_middleware(_RequireKey, api_key=api_key, open_paths=open_paths)
    app.add_middleware(_CountRequests, metrics=metrics)
    app.openapi = lambda: _openapi(app, open_paths, gen.target.config.vocab_size,  # type: ignore[method-assign]
                                   gen.max_context)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(400, *_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail), headers=exc.headers)  # e.g. a 405's Allow

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        return _error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "running": scheduler.running, "waiting": scheduler.queued}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        text = await gather_metrics() if gather_metrics is not None else generate_latest(metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "specdecode", "max_model_len": gen.max_context}]}

    @app.post("/v1/completions", responses=GENERATION_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        return await _generate("text_completion", body, body.prompt, body.max_tokens, request)

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [m.as_template_message() for m in body.messages]
        return await _generate("chat.completion", body, messages, body.max_completion_tokens or body.max_tokens,
                               request)

    async def _generate(kind: str, body, prompt, max_tokens: int | None, request: Request):
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

        def prepare():  # on a worker thread: tokenizing a long prompt must not hold up the event loop
            try:
                return gen.prepare(prompt, max_new_tokens=max_tokens or gen.max_context, temperature=body.temperature,
                                   top_k=body.top_k, top_p=body.top_p, seed=body.seed, stop=body.stop,
                                   coupling=body.coupling)
            finally:
                if _characters(prompt) > LARGE_PROMPT_CHARACTERS:
                    release_freed_memory()

        try:
            seq = await asyncio.to_thread(prepare)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from exc
        if max_tokens is not None and seq.max_new < max_tokens:
            raise APIError(400, f"the prompt has {len(seq.ids)} tokens and max_tokens is {max_tokens}, but the "
                                f"context holds {gen.max_context} tokens (--max-context)", param="max_tokens",
                           code="context_length_exceeded")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:  # runs on the scheduler's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        try:
            req = scheduler.submit(seq, emit)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from exc

        def cancel() -> None:  # the client went away: free the slot, count the work done so far
            request.state.cancelled = True  # counted as 499, also where a stream's 200 went out
            scheduler.cancel(req)
            seq.stats.new_tokens = len(seq.out)
            metrics.record_generation(seq.stats)

        reply = _Reply(kind, model_name, request.url.path, metrics, time.perf_counter())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(reply.stream(events, cancel, include_usage), media_type="text/event-stream")
        return JSONResponse(await reply.collect(events, request, cancel))

    return app


GENERATION_ERRORS: dict[int | str, dict] = {
    status: {"model": ErrorResponse, "description": description} for status, description in (
        (400, "Invalid request"), (404, "Unknown model"), (413, "Request body too large"),
        (429, "Every slot busy and the queue full; retry after Retry-After seconds"), (500, "Generation failed"))}
UNAUTHORIZED = {"description": "Missing or wrong API key",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _openapi(app: FastAPI, open_paths: frozenset[str] | None, vocab: int, max_context: int) -> dict:
    """FastAPI's document with what the server does: invalid bodies get 400 (OpenAI's), never 422; streams are
    text/event-stream; with a key (`open_paths` not None), every other path needs it; token ids and max_tokens are
    bounded by this model's vocabulary and context."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        models = schema["components"]["schemas"]
        models["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]["maximum"] = vocab - 1
        for model, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                             ("ChatCompletionRequest", "max_completion_tokens")):
            models[model]["properties"][field]["anyOf"][0]["maximum"] = max_context - 1
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if open_paths is not None and path not in open_paths:
                    operation["security"] = [{"bearer": []}]
                    operation["responses"]["401"] = UNAUTHORIZED
                if path in GENERATION_ENDPOINTS:
                    operation["responses"]["200"]["content"]["text/event-stream"] = {
                        "schema": {"description": "server-sent events (with \"stream\": true): JSON chunks, then "
                                                  "[DONE]"}}
        for name in ("HTTPValidationError", "ValidationError"):
            models.pop(name, None)
        if open_paths is not None:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema


def _characters(prompt: str | list) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) for m in prompt if isinstance(m, dict))


class _Reply:
    """Turns one request's engine events into an OpenAI response body or a stream of SSE chunks."""

    def __init__(self, kind: str, model: str, endpoint: str, metrics: Metrics, t0: float) -> None:
        self.kind, self.model, self.endpoint, self.metrics, self.t0 = kind, model, endpoint, metrics, t0
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.first_token = True

    def _note(self, event) -> None:
        if isinstance(event, TokenEvent) and event.token_id is not None and self.first_token:
            self.first_token = False
            self.metrics.ttft.observe(time.perf_counter() - self.t0)
        if isinstance(event, GenerationResult):
            self.metrics.record_generation(event.stats)
            self.metrics.latency.labels(endpoint=self.endpoint).observe(time.perf_counter() - self.t0)

    def _usage(self, result: GenerationResult) -> dict:
        p, c = result.stats.prompt_tokens, result.stats.new_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def collect(self, events: asyncio.Queue, request: Request, cancel) -> dict:
        async def disconnected() -> None:  # polled on a clock: a busy request gets events every step
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_SECONDS)

        watcher = asyncio.create_task(disconnected())
        getter = None
        result: GenerationResult | Exception | None = None  # an Exception: it failed (raised below)
        try:
            while result is None:
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    raise APIError(499, "the client disconnected")
                event = getter.result()
                self._note(event)
                if isinstance(event, Exception):
                    result = event
                    raise APIError(500, f"generation failed: {type(event).__name__}: {event}")
                if isinstance(event, GenerationResult):
                    result = event
        finally:
            watcher.cancel()
            if getter is not None:
                getter.cancel()
            if result is None:  # disconnected, or this handler was cancelled
                cancel()
        assert isinstance(result, GenerationResult)  # the loop ends on one; an Exception raised above
        if self.kind == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": result.finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self._usage(result), "speculative": result.stats.to_dict()}

    def _chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if self.kind == "chat.completion":
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    async def stream(self, events: asyncio.Queue, cancel, include_usage: bool) -> AsyncIterator[str]:
        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        done = False
        try:
            if self.kind == "chat.completion":
                yield sse(self._chunk("", role=True))
            while True:
                event = await events.get()
                self._note(event)
                if isinstance(event, Exception):
                    done = True
                    yield sse(error_body(f"generation failed: {type(event).__name__}: {event}", "server_error"))
                    break
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield sse(self._chunk(event.text))
                    continue
                done = True
                last = self._chunk(finish=event.finish_reason)
                last["speculative"] = event.stats.to_dict()
                yield sse(last)
                if include_usage:
                    yield sse(self._chunk() | {"choices": [], "usage": self._usage(event)})
                break
            yield "data: [DONE]\n\n"
        finally:  # also reached when the client disconnects and the server cancels this generator
            if not done:
                cancel()


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` under uvicorn in a background thread (port 0: a free one); yields its base URL."""
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="specdecode-http", daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
