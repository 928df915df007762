"""The OpenAI-compatible HTTP API of the coordinator (Starlette on uvicorn).

/v1/completions and /v1/chat/completions, streamed (server-sent events) or not, /v1/models and
/health. Requests run on the same GenerationService as the gRPC API. The engine loop blocks, so
each request runs in a worker thread that feeds an asyncio queue; when a streaming client goes
away, the response task is cancelled, the thread sees the stop flag at its next step and closes
the request's sessions on both services.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coordinator import openai_schema as oa
from coordinator.admission import Ticket
from coordinator.service import GenerationService, PromptInput, RequestHandle
from specd.auth import bearer_token, token_matches
from specd.errors import InvalidArgument, ResourceExhausted, SpecdError, Unavailable
from specd.tls import ServerTLS

# The largest request body read (HTTP 413 beyond it), like the gRPC API's message limit.
MAX_BODY_BYTES = 4 * 1024 * 1024

log = logging.getLogger(__name__)

_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
}


def error_response(exc: BaseException) -> JSONResponse:
    """One place mapping failures to OpenAI-shaped errors with the right HTTP status."""
    if isinstance(exc, InvalidArgument):
        return JSONResponse(oa.error_body(str(exc), "invalid_request_error", exc.field), 400)
    if isinstance(exc, ResourceExhausted):
        retry_ms = exc.retry_after_ms if exc.retry_after_ms is not None else 1000
        # Retry-After in whole seconds (HTTP), retry-after-ms as the OpenAI clients read it.
        headers = {"Retry-After": str(max(1, math.ceil(retry_ms / 1000))), "retry-after-ms": str(retry_ms)}
        return JSONResponse(oa.error_body(str(exc), "rate_limit_error"), 429, headers=headers)
    if isinstance(exc, Unavailable):
        return JSONResponse(oa.error_body(str(exc), "service_unavailable"), 503)
    if isinstance(exc, grpc.RpcError):
        status, type_ = _GRPC_TO_HTTP.get(exc.code(), (500, "internal_error"))  # type: ignore[attr-defined]
        details = exc.details() or exc.code().name  # type: ignore[attr-defined]
        param = details.split(":", 1)[0].strip() if status == 400 and ":" in details else None
        return JSONResponse(oa.error_body(details, type_, param), status)
    if isinstance(exc, SpecdError):
        return JSONResponse(oa.error_body(str(exc), "invalid_request_error"), 400)
    log.exception("internal error", exc_info=exc)
    return JSONResponse(oa.error_body(f"internal error ({type(exc).__name__}); see the server log", "internal_error"), 500)


class _Worker:
    """Runs a request's engine loop in a thread; events come back through an asyncio queue."""

    def __init__(self, service: GenerationService, handle: RequestHandle, loop: asyncio.AbstractEventLoop,
                 ticket: Ticket | None = None):
        self.service = service
        self.handle = handle
        self.loop = loop
        self.ticket = ticket  # the admission slot, freed when the request ends
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=f"specd-http-{handle.request_id[:8]}").start()

    def _put(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.stop.set()

    def _run(self) -> None:
        with self.service.track():
            try:
                for ids, text in self.handle:
                    if self.stop.is_set():
                        break
                    self._put(("chunk", ids, text))
                self._put(("done", None, None))
            except BaseException as exc:  # reported to the client by the async side
                self._put(("error", exc, None))
            finally:
                self.handle.close()
                if self.ticket is not None:
                    self.ticket.release()


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class OpenAIApp:
    """`token`: the bearer token every route but /health requires (None: no authentication)."""

    def __init__(self, service: GenerationService, model_name: str, aliases: tuple[str, ...] = ("specd",),
                 token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
        self.service = service
        self.model_name = model_name
        self.aliases = {model_name, *aliases}
        self.token = token
        self.max_body_bytes = max_body_bytes
        # Requests that wait in the admission queue wait here, off the event loop.
        self._queue_pool = ThreadPoolExecutor(max_workers=max(1, service.admission.max_queue),
                                              thread_name_prefix="specd-http-queue")
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])

    async def health(self, request: Request) -> Response:
        if self.service.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok", "active_requests": self.service.active})

    def _refusal(self, request: Request) -> Response | None:
        """401 unless the request carries the bearer token (None: it may pass)."""
        if self.token is None or token_matches(self.token, bearer_token(request.headers.get("authorization"))):
            return None
        return JSONResponse(oa.error_body("missing or invalid bearer token: send the header "
                                          "'Authorization: Bearer <token>'", "invalid_request_error", None,
                                          "invalid_api_key"), 401, headers={"WWW-Authenticate": "Bearer"})

    async def _admit(self) -> Ticket:
        """A running slot: at once when one is free, else after a wait in the queue (in a thread
        of its own, so the event loop and the other requests go on)."""
        admission = self.service.admission
        entry = admission.enter()
        if isinstance(entry, Ticket):
            return entry
        return await asyncio.get_running_loop().run_in_executor(self._queue_pool, admission.wait, entry)

    async def _body(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _TooLarge(self.max_body_bytes)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge(self.max_body_bytes)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except ValueError:  # UnicodeDecodeError included: the body is not UTF-8
            raise InvalidArgument("body", "the request body is not valid JSON (UTF-8)") from None

    async def models(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "specd"}]})

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        ticket: Ticket | None = None
        try:
            if self.service.draining:
                raise Unavailable("the coordinator is draining; retry on another replica")
            body = await self._body(request)
            if not isinstance(body, dict):
                raise InvalidArgument("body", "must be a JSON object")
            model = body.get("model", self.model_name)
            if model not in self.aliases:
                return JSONResponse(oa.error_body(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                                  "invalid_request_error", "model", "model_not_found"), 404)
            prompt: PromptInput = oa.parse_messages(body) if chat else oa.parse_completion_prompt(body)
            params = oa.parse_sampling(body, oa.DEFAULT_CHAT_MAX_TOKENS if chat else oa.DEFAULT_COMPLETION_MAX_TOKENS)
            method, k = oa.parse_speculation(body)
            stream, include_usage = oa.parse_stream(body)
            carrier = request.headers if self.service.telemetry.tracing_on else None  # a client's traceparent
            ticket = await self._admit()
            depth = k if isinstance(k, str) else ""
            handle = self.service.start(prompt, params, method, None if depth else k, trace_carrier=carrier, depth=depth)
        except _TooLarge as exc:
            return JSONResponse(oa.error_body(str(exc), "invalid_request_error", "body"), 413)
        except Exception as exc:
            if ticket is not None:
                ticket.release()
            return error_response(exc)
        worker = _Worker(self.service, handle, asyncio.get_running_loop(), ticket)
        first = await worker.queue.get()  # the prefill: errors such as a prompt over the context surface here
        if first[0] == "error":
            return error_response(first[1])
        shape = _ChatShape(self.model_name) if chat else _CompletionShape(self.model_name)
        if stream:
            return StreamingResponse(self._events(worker, first, shape, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(worker, first, shape)

    async def _whole(self, worker: _Worker, first: tuple, shape: "_Shape") -> Response:
        item = first
        try:
            while item[0] == "chunk":
                item = await worker.queue.get()
        finally:
            worker.stop.set()
        if item[0] == "error":
            return error_response(item[1])
        return JSONResponse(shape.whole(worker.handle))

    async def _events(self, worker: _Worker, first: tuple, shape: "_Shape", include_usage: bool) -> AsyncIterator[str]:
        item = first
        try:
            yield _sse(shape.opening())
            while item[0] == "chunk":
                if item[2]:
                    yield _sse(shape.delta(item[2]))
                item = await worker.queue.get()
            if item[0] == "error":
                resp = error_response(item[1])
                yield _sse(json.loads(resp.body))
            else:
                yield _sse(shape.closing(worker.handle))
                if include_usage:
                    yield _sse(shape.usage_chunk(worker.handle))
            yield "data: [DONE]\n\n"
        finally:
            worker.stop.set()  # a client gone mid-stream lands here: the worker frees the sessions


class _TooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is over the limit of {limit} bytes")


class _Shape:
    object_whole = ""
    object_chunk = ""
    prefix = ""

    def __init__(self, model: str):
        self.model = model
        self.id = oa.new_id(self.prefix)
        self.created = oa.now()

    def _frame(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def opening(self) -> dict:
        return self._frame(self.object_chunk, [self._choice_delta("", None, first=True)])

    def delta(self, text: str) -> dict:
        return self._frame(self.object_chunk, [self._choice_delta(text, None)])

    def closing(self, handle: RequestHandle) -> dict:
        frame = self._frame(self.object_chunk, [self._choice_delta("", handle.generation.finish_reason)])
        frame["speculation"] = oa.speculation(handle)
        return frame

    def usage_chunk(self, handle: RequestHandle) -> dict:
        frame = self._frame(self.object_chunk, [])
        gen = handle.generation
        frame["usage"] = oa.usage(len(gen.prompt_ids), len(gen.token_ids))
        return frame

    def whole(self, handle: RequestHandle) -> dict:
        gen = handle.generation
        frame = self._frame(self.object_whole, [self._choice_whole(handle.text, gen.finish_reason)])
        frame["usage"] = oa.usage(len(gen.prompt_ids), len(gen.token_ids))
        frame["speculation"] = oa.speculation(handle)
        return frame

    def _choice_delta(self, text: str, finish: str | None, first: bool = False) -> dict:
        raise NotImplementedError

    def _choice_whole(self, text: str, finish: str | None) -> dict:
        raise NotImplementedError


class _CompletionShape(_Shape):
    object_whole = object_chunk = "text_completion"
    prefix = "cmpl"

    def _choice_delta(self, text: str, finish: str | None, first: bool = False) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def _choice_whole(self, text: str, finish: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


class _ChatShape(_Shape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    prefix = "chatcmpl"

    def _choice_delta(self, text: str, finish: str | None, first: bool = False) -> dict:
        delta: dict = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _choice_whole(self, text: str, finish: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


class HttpServer:
    """uvicorn in a background thread of the coordinator process."""

    def __init__(self, service: GenerationService, host: str, port: int, max_context: int = 0, grace_seconds: float = 10.0,
                 token: str | None = None, tls: ServerTLS | None = None, max_body_bytes: int = MAX_BODY_BYTES):
        self.service = service
        self.grace_seconds = grace_seconds
        self.tls = tls
        self.api = OpenAIApp(service, service.model_name, token=token, max_body_bytes=max_body_bytes)
        config = uvicorn.Config(self.api.app, host=host, port=port, log_level="warning", lifespan="off", access_log=False,
                                **(tls.uvicorn_options() if tls is not None else {}))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="specd-http")

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (is the port free?)")
            time.sleep(0.02)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def drain(self) -> None:
        """Refuse new requests (503), let running ones finish, then stop."""
        self.service.draining = True

        def finish() -> None:
            deadline = time.monotonic() + self.grace_seconds
            while self.service.active > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.server.should_exit = True

        threading.Thread(target=finish, daemon=True).start()


__all__ = ["HttpServer", "OpenAIApp", "error_response"]

