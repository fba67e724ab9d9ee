"""The FastAPI app: routes, the OpenAI-key check, and the upstream Generate calls.

    app = build_app(ApiSettings(upstream="127.0.0.1:50050"))   # then uvicorn.run(app, ...)

A client that disconnects (mid-stream, or while a non-streaming reply is being collected) cancels the upstream
`Generate` call at once, which aborts the request there and frees its KV pages and conv state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from common.auth import aio_channel
from common.errors import InvalidInputError
from common.grpc_util import channel_options
from common.request_ids import check_request_id
from decode_service.http_api.config import ApiSettings
from decode_service.http_api.errors import ApiError, bad_request, from_grpc
from decode_service.http_api.media import MediaLoader
from decode_service.http_api.metrics import ApiMetrics, RequestTimer
from decode_service.http_api.protocol import Parsed, check_model, parse_chat, parse_completion
from decode_service.http_api.responses import (
    ChatChunks,
    ChatReply,
    CompletionChunks,
    CompletionReply,
    ReplyMeta,
)
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc

log = logging.getLogger(__name__)


class Upstream:
    """The gRPC channel to the router / decode replica (token and TLS as configured)."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self.channel = aio_channel(settings.upstream, settings.upstream_security, channel_options())
        self.generator = generator_pb2_grpc.GeneratorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._model_id: str | None = settings.served_model_name

    async def model_id(self) -> str:
        """`--served-model-name`, else the upstream's ModelInfo.model_id (asked once, then cached)."""
        if self._model_id is None:
            try:
                info = await self.generator.GetModelInfo(pb.ModelInfoRequest(), timeout=self.settings.health_timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise from_grpc(exc.code(), exc.details()) from None
            self._model_id = info.model_id
        return self._model_id

    async def serving(self) -> bool:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=self.settings.health_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()


async def _wait_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is already read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes exceeds the {limit}-byte limit")
    raw = await request.body()
    if len(raw) > limit:
        raise ApiError(413, f"request body of {len(raw)} bytes exceeds the {limit}-byte limit")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request("body", f"not valid JSON ({exc})") from None


def build_app(
    settings: ApiSettings,
    registry: CollectorRegistry | None = None,
    media_loader: MediaLoader | None = None,
) -> FastAPI:
    registry = registry or CollectorRegistry(auto_describe=True)
    metrics = ApiMetrics(registry)
    loader = media_loader or MediaLoader(settings.media)
    state: dict[str, Upstream] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state["upstream"] = Upstream(settings)
        try:
            yield
        finally:
            await state.pop("upstream").close()

    app = FastAPI(title="Inkling EPD OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.upstream = lambda: state["upstream"]

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.middleware("http")
    async def count_and_authorize(request: Request, call_next: Callable) -> Response:
        path = request.url.path
        if settings.api_key is not None and path.startswith("/v1/") and not _authorized(request, settings.api_key):
            response: Response = JSONResponse(
                ApiError(401, "missing or invalid API key (Authorization: Bearer ...)", code="invalid_api_key").body(),
                status_code=401,
            )
        else:
            response = await call_next(request)
        route = path if path in _ROUTES else "other"
        metrics.http_requests.labels(route, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> Response:
        ok = await state["upstream"].serving()
        return JSONResponse({"status": "SERVING" if ok else "NOT_SERVING"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        model = await state["upstream"].model_id()
        card = {"id": model, "object": "model", "created": 0, "owned_by": "inkling-epd"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _body(request, settings.max_body_bytes)
        upstream = state["upstream"]
        check_model(body, await upstream.model_id())
        rid = _request_id(request, "chatcmpl")
        parsed = await parse_chat(body, rid, loader)
        meta = ReplyMeta(rid, body["model"], int(time.time()))
        return await _generate(request, upstream, parsed, meta, ChatReply, ChatChunks)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request, settings.max_body_bytes)
        upstream = state["upstream"]
        check_model(body, await upstream.model_id())
        rid = _request_id(request, "cmpl")
        parsed = parse_completion(body, rid)
        meta = ReplyMeta(rid, body["model"], int(time.time()))
        return await _generate(request, upstream, parsed, meta, CompletionReply, CompletionChunks)

    async def _generate(
        request: Request, upstream: Upstream, parsed: Parsed, meta: ReplyMeta, reply_cls: type, chunks_cls: type
    ) -> Response:
        timer = RequestTimer(metrics)
        call = upstream.generator.Generate(parsed.request, timeout=settings.request_timeout_s)
        metrics.running.inc()
        try:
            # The first message decides the HTTP status (bad media, too-long prompts, ... are found upstream),
            # so even a stream answers an error with its status and OpenAI error JSON.
            first = await _until_disconnect(request, call.read(), parsed)
        except BaseException:
            call.cancel()
            metrics.running.dec()
            raise
        if not parsed.stream:
            try:
                reply = reply_cls()
                await _until_disconnect(request, _collect(call, first, reply, timer), parsed)
            finally:
                call.cancel()
                metrics.running.dec()
            return JSONResponse(reply.json(meta, parsed.logprobs, parsed.top_logprobs))
        chunks = chunks_cls(meta, parsed.include_usage, parsed.logprobs, parsed.top_logprobs)
        release = _Release(call, metrics)
        # `release` runs when the event generator ends and again as the response's background task, which also
        # covers a client gone before the generator ever started (its `finally` would never run).
        events = _events(call, first, chunks, timer, parsed, release)
        return EventSourceResponse(events, ping=15, background=BackgroundTask(release))

    async def _until_disconnect(request: Request, work: Any, parsed: Parsed) -> Any:
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await task
            metrics.disconnects.inc()
            raise ApiError(499, "client disconnected")
        try:
            return task.result()
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc.code(), exc.details(), parsed.media_paths) from None

    async def _collect(call: Any, first: Any, reply: Any, timer: RequestTimer) -> None:
        message = first
        while message is not grpc.aio.EOF:
            timer.feed(message)
            reply.feed(message)
            message = await call.read()
        if reply.final is None:
            raise ApiError(502, "upstream stream ended without a Final message")

    async def _events(
        call: Any, first: Any, chunks: Any, timer: RequestTimer, parsed: Parsed, release: _Release
    ) -> AsyncIterator[str]:
        """SSE data lines; an upstream failure after the first chunk becomes an `error` event (the status line
        is already sent). Cancellation (client gone) cancels the upstream call in `finally`."""
        try:
            opening = chunks.first()
            if opening is not None:
                yield json.dumps(opening)
            message, finished = first, False
            while message is not grpc.aio.EOF:
                timer.feed(message)
                finished = finished or message.WhichOneof("response") == "final"
                for chunk in chunks.feed(message):
                    yield json.dumps(chunk)
                message = await call.read()
            if not finished:
                yield json.dumps(ApiError(502, "upstream stream ended without a Final message").body())
                return
            yield "[DONE]"
        except grpc.aio.AioRpcError as exc:
            yield json.dumps(from_grpc(exc.code(), exc.details(), parsed.media_paths).body())
        except ApiError as exc:
            yield json.dumps(exc.body())
        except asyncio.CancelledError:
            metrics.disconnects.inc()
            raise
        finally:
            release()

    return app


class _Release:
    """Cancels one upstream call and counts it out of `num_requests_running`, once."""

    def __init__(self, call: Any, metrics: ApiMetrics) -> None:
        self.call, self.metrics, self.done = call, metrics, False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.call.cancel()
            self.metrics.running.dec()


def _request_id(request: Request, kind: str) -> str:
    """The caller's `X-Request-Id` (a gateway's, so logs line up end to end) or a fresh `<kind>-<hex>`; it is
    the upstream request id and the reply's `id`."""
    given = request.headers.get("x-request-id")
    if given is None:
        return f"{kind}-{uuid.uuid4().hex}"
    try:
        return check_request_id(given, "X-Request-Id") or f"{kind}-{uuid.uuid4().hex}"
    except InvalidInputError as exc:
        raise ApiError(400, str(exc), param="X-Request-Id") from None


_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


def _authorized(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
