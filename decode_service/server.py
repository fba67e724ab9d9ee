"""gRPC front of a decode replica: `inkling_epd.v1.Generator` over `DecodeService`, plus health, reflection,
metrics and graceful shutdown.

The servicer is a thin adapter: protobuf -> `GenerateInput` at the edge (`generate_input`), service events ->
`GenerateResponse` messages, and every exception -> a status code in `_abort` (via
`common.grpc_util.status_for`). Health is NOT_SERVING until the weights are loaded and a warm-up generation
ran, then SERVING; on SIGTERM/SIGINT it goes NOT_SERVING, running calls drain for `--grace-seconds`, then the
server stops. `build_server` makes a ready-to-start server (tests run it on port 0); `serve` is the
`inkling-epd decode` entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from redis.exceptions import RedisError

from common.auth import bind_server, server_interceptors
from common.cache_store import RedisCache
from common.errors import InklingError, InvalidInputError
from common.fingerprint import encoder_fingerprint_of
from common.grpc_util import (
    UNAVAILABLE_DEPENDENCY_KEY,
    ServerHealth,
    create_server,
    enable_reflection,
    graceful_stop,
    status_for,
)
from common.media import media_from_proto, media_modality
from common.metrics import DecodeMetrics, MetricsServer, new_registry, start_metrics_server
from common.prefix_routing import PrefixDirectory, request_prefix_hashes
from common.settings import DecodeSettings, GrpcSettings, decode_settings
from common.wire import modality_to_proto
from decode_service.api import DeltaEvent, FinalEvent, GenerateInput, SamplingParams
from decode_service.chat import ChatMessage, MediaPart, TextPart, ToolCall, ToolSpec, token_bytes
from decode_service.encoder_client import ClientSettings, EncoderClient, EncoderPoolUnavailableError
from decode_service.engine.build import build_engine
from decode_service.service import DecodeService
from decode_service.structured.constraint import constraint_from_proto
from encoder_service.planner import MediaPlanner
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
_ROLES = {pb.ROLE_SYSTEM: "system", pb.ROLE_USER: "user", pb.ROLE_ASSISTANT: "assistant", pb.ROLE_TOOL: "tool"}
_CHANNELS = {"reasoning": pb.CHANNEL_REASONING, "content": pb.CHANNEL_CONTENT, "tool_call": pb.CHANNEL_TOOL_CALL}
_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
    "abort": pb.FINISH_REASON_ABORT,
}


# ---------------------------------------------------------------------------------------------------------
# protobuf <-> native


def _json_object(text: str, where: str) -> dict:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where}: must be a JSON object")
    return value


def sampling_params(s: pb.SamplingParams) -> SamplingParams:
    """The proto's sampling (unset fields: the neutral defaults; max_tokens unset: None, the server's
    bounded default); validation is `SamplingParams.validate`, in the service."""

    def opt(name: str, default):
        return getattr(s, name) if s.HasField(name) else default

    return SamplingParams(
        temperature=opt("temperature", 1.0),
        top_k=opt("top_k", 0),
        top_p=opt("top_p", 1.0),
        min_p=opt("min_p", 0.0),
        seed=opt("seed", None),
        repetition_penalty=opt("repetition_penalty", 1.0),
        presence_penalty=opt("presence_penalty", 0.0),
        frequency_penalty=opt("frequency_penalty", 0.0),
        logprobs=opt("logprobs", None),
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        max_tokens=opt("max_tokens", None),
        ignore_eos=s.ignore_eos,
        min_tokens=opt("min_tokens", 0),
        speculative=not s.disable_speculation,
    )


def generate_input(request: pb.GenerateRequest, timeout_s: float | None) -> GenerateInput:
    """A `GenerateRequest` -> the service's native input; malformed fields raise `InvalidInputError`."""
    common = dict(
        request_id=request.request_id,
        sampling=sampling_params(request.sampling),
        cache_salt=request.cache_salt,
        priority=request.priority,
        timeout_s=timeout_s,
        constraint=constraint_from_proto(request),
        return_prompt_token_ids=request.return_prompt_token_ids,
    )
    kind = request.WhichOneof("prompt")
    if kind == "tokens":
        media = tuple(media_from_proto(i, m) for i, m in enumerate(request.tokens.media))
        return GenerateInput(prompt_token_ids=tuple(request.tokens.token_ids), media=media, **common)
    if kind == "text":
        if not request.text.text:
            raise InvalidInputError("text.text: is empty")
        return GenerateInput(prompt_text=request.text.text, **common)
    if kind != "chat":
        raise InvalidInputError("prompt: none of chat, tokens or text is set")
    chat = request.chat
    media = []
    messages = []
    for m, message in enumerate(chat.messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise InvalidInputError(f"chat.messages[{m}].role: not set or unknown ({message.role})")
        parts = []
        for p, part in enumerate(message.content):
            which = part.WhichOneof("part")
            if which == "text":
                parts.append(TextPart(part.text))
            elif which == "media":
                where = f"chat.messages[{m}].content[{p}].media"
                parts.append(MediaPart(media_modality(part.media.modality, where), len(media)))
                media.append(media_from_proto(len(media), part.media))
            else:
                raise InvalidInputError(f"chat.messages[{m}].content[{p}]: empty content part")
        calls = [ToolCall(c.name, c.arguments_json or "{}", c.id or None) for c in message.tool_calls]
        messages.append(
            ChatMessage(
                role,
                parts,
                name=message.name or None,
                tool_calls=calls,
                tool_call_id=message.tool_call_id or None,
                reasoning=message.reasoning or None,
            )
        )
    tools = tuple(
        ToolSpec(t.name, t.description, _json_object(t.parameters_json, f"chat.tools[{i}].parameters_json"))
        for i, t in enumerate(chat.tools)
    )
    effort = chat.reasoning_effort if chat.HasField("reasoning_effort") else None
    return GenerateInput(messages=tuple(messages), tools=tools, reasoning_effort=effort, media=tuple(media), **common)


def delta_message(event: DeltaEvent) -> pb.GenerateResponse:
    delta = pb.Delta(
        token_ids=event.token_ids, text=event.text, channel=_CHANNELS.get(event.channel or "", pb.CHANNEL_UNSPECIFIED)
    )
    if event.tool_call is not None:
        call = event.tool_call
        delta.tool_call.CopyFrom(
            pb.ToolCall(id=call.id, name=call.name, arguments_json=call.arguments, text=call.text or "")
        )
    for lp in event.logprobs:
        top = [pb.TopLogprob(token_id=t, logprob=v, **_token_text(t)) for t, v in lp.top]
        delta.logprobs.append(
            pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=top, **_token_text(lp.token_id))
        )
    return pb.GenerateResponse(delta=delta)


def _token_text(token_id: int) -> dict:
    """A logprob entry's `token` (text; U+FFFD for a partial UTF-8 sequence) and `token_bytes` (exact)."""
    raw = token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "token_bytes": raw}


def final_message(event: FinalEvent) -> pb.GenerateResponse:
    u, t = event.usage, event.timings
    final = pb.Final(
        finish_reason=_FINISH.get(event.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(
            prompt_tokens=u.prompt_tokens,
            cached_tokens=u.cached_tokens,
            cached_tokens_gpu=u.cached_tokens_gpu,
            cached_tokens_redis=u.cached_tokens_redis,
            image_tokens=u.image_tokens,
            audio_tokens=u.audio_tokens,
            completion_tokens=u.completion_tokens,
            reasoning_tokens=u.reasoning_tokens,
            mm_items_cached=u.mm_items_cached,
            mm_items_encoded=u.mm_items_encoded,
            draft_tokens=u.draft_tokens,
            accepted_draft_tokens=u.accepted_draft_tokens,
        ),
        timings=pb.Timings(
            queue_s=t.queue_s, encode_s=t.encode_s, prefill_s=t.prefill_s, ttft_s=t.ttft_s, decode_s=t.decode_s
        ),
        matched_stop=event.matched_stop,
        finish_detail=event.finish_detail,
        prompt_token_ids=event.prompt_token_ids,
    )
    if event.matched_stop_token_id is not None:
        final.matched_stop_token_id = event.matched_stop_token_id
    return pb.GenerateResponse(final=final)


# ---------------------------------------------------------------------------------------------------------
# Servicer


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(
        self,
        service: DecodeService,
        metrics: DecodeMetrics | None = None,
        directory: PrefixDirectory | None = None,
        replica_id: str = "",
    ) -> None:
        self.service = service
        self.metrics = metrics
        self.directory = directory if replica_id else None
        self.replica_id = replica_id
        self._publishing: set[asyncio.Task] = set()

    async def Generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateResponse]:
        failure: BaseException | None = None
        rid = request.request_id
        try:
            inp = generate_input(request, context.time_remaining())
            last_token_at: float | None = None
            async with contextlib.aclosing(self.service.generate(inp)) as events:
                async for event in events:
                    if isinstance(event, FinalEvent):
                        self._observe_final(event)
                        self._publish_prefix(request, event)
                        yield final_message(event)
                        continue
                    if event.token_ids and self.metrics is not None:
                        now = time.monotonic()
                        if last_token_at is not None:
                            self.metrics.itl.observe(now - last_token_at)
                        last_token_at = now
                    yield delta_message(event)
        except (InklingError, TimeoutError, ValueError) as exc:
            failure = exc
        except asyncio.CancelledError:
            self._count("CANCELLED")
            log.info("generate %s cancelled by the client or its deadline", rid)
            raise
        if failure is not None:
            await self._abort(context, rid, failure)
        self._count("OK")

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """The ids found live are aborted; NOT_FOUND when none of the given ids is live (see the proto)."""
        if not request.request_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_ids: at least one id is required")
        aborted = self.service.abort(list(request.request_ids))
        if not aborted:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"request_ids: none of {list(request.request_ids)[:8]} is running or queued on this replica",
            )
        return pb.AbortResponse(aborted_request_ids=aborted)

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.Load:
        load = self.service.load()
        return pb.Load(
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_usage=load.kv_usage,
            free_kv_pages=load.free_kv_pages,
            prefix_cache_hit_rate=load.prefix_cache_hit_rate,
            inflight_encode_items=load.inflight_encode_items,
        )

    async def GetModelInfo(
        self,
        request: pb.ModelInfoRequest,
        context: grpc.aio.ServicerContext,
    ) -> pb.ModelInfo:
        info = self.service.model_info()
        return pb.ModelInfo(
            model_id=info.model_id,
            model_fingerprint=info.model_fingerprint,
            encoder_fingerprint=info.encoder_fingerprint,
            max_context_tokens=info.max_context_tokens,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            image_token_id=info.image_token_id,
            audio_token_id=info.audio_token_id,
            modalities=[modality_to_proto(m) for m in info.modalities],
        )

    async def _abort(self, context: grpc.aio.ServicerContext, request_id: str, exc: BaseException) -> None:
        """The one place where failures become status codes."""
        if isinstance(exc, ValueError) and not isinstance(exc, InklingError):
            exc = InvalidInputError(str(exc))
        code, message = status_for(exc)
        self._count(code.name)
        log.info("generate %s failed: %s %s", request_id, code.name, message)
        dependency = ((UNAVAILABLE_DEPENDENCY_KEY, "encoder"),) if isinstance(exc, EncoderPoolUnavailableError) else ()
        await context.abort(code, message, trailing_metadata=dependency)

    def _publish_prefix(self, request: pb.GenerateRequest, event: FinalEvent) -> None:
        """Tell the router's prefix directory that this replica now caches the request's prompt (best effort,
        in the background: a Redis problem never fails a request)."""
        if self.directory is None or event.finish_reason == "abort" or not self.service.engine.prefix_cache:
            return
        task = asyncio.create_task(self._publish(request_prefix_hashes(request)))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, hashes: list[bytes]) -> None:
        assert self.directory is not None
        try:
            await self.directory.publish(self.replica_id, hashes)
        except (RedisError, OSError) as exc:
            log.warning("prefix directory publish failed: %s: %s", type(exc).__name__, exc)

    def _observe_final(self, event: FinalEvent) -> None:
        if self.metrics is None:
            return
        self.metrics.observe_final(event.usage, event.timings)

    def _count(self, status: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(status).inc()


# ---------------------------------------------------------------------------------------------------------
# Server lifecycle


@dataclass
class DecodeServer:
    server: grpc.aio.Server
    port: int
    health: ServerHealth
    service: DecodeService
    encoder: EncoderClient | None = None
    metrics_server: MetricsServer | None = None
    redis_client: object | None = None  # redis.asyncio client of the prefix directory, closed on stop
    metrics: DecodeMetrics | None = None
    _health_task: asyncio.Future | None = field(default=None, repr=False)  # NOT_SERVING after a lost rank

    async def start(self) -> None:
        """Accept calls at once (health NOT_SERVING), warm the engine up, then report SERVING."""
        await self.server.start()
        await self.health.not_serving()
        if self.encoder is not None:
            await self.encoder.start()
        await self.service.start()
        loop = asyncio.get_running_loop()
        self.service.on_failure = lambda: loop.call_soon_threadsafe(self._lost)
        await self.health.serving()
        log.info("decode replica serving on port %d", self.port)

    def _lost(self) -> None:
        """The service can no longer serve (a tensor-parallel rank died): NOT_SERVING, so the router routes
        around this replica."""
        self._health_task = asyncio.ensure_future(self.health.not_serving())

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING, drain running calls for up to `grace_s`, then release the engine and clients."""
        await graceful_stop(self.server, self.health, grace_s)
        await self.service.close()
        if self.encoder is not None:
            await self.encoder.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.redis_client is not None:
            await self.redis_client.aclose()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def build_server(
    service: DecodeService,
    grpc_settings: GrpcSettings,
    encoder: EncoderClient | None = None,
    metrics: DecodeMetrics | None = None,
    metrics_port: int = 0,
    directory: PrefixDirectory | None = None,
    replica_id: str = "",
) -> DecodeServer:
    """A bound, not yet started server. `metrics_port` > 0 also starts the /metrics exporter; with a
    `directory` and a `replica_id` the replica publishes cached prompts for the router."""
    server = create_server(
        grpc_settings.max_message_bytes,
        server_interceptors(grpc_settings.security),
        max_request_bytes=grpc_settings.max_request_bytes,
    )
    generator_pb2_grpc.add_GeneratorServicer_to_server(
        GeneratorServicer(service, metrics, directory, replica_id), server
    )
    health = ServerHealth(server, [SERVICE_NAME])
    enable_reflection(server, [SERVICE_NAME])
    port = bind_server(server, grpc_settings.host, grpc_settings.port, grpc_settings.security)
    exporter = None
    if metrics is not None:
        metrics.watch_load(service)
        if metrics_port:
            exporter = start_metrics_server(metrics_port, metrics.registry, grpc_settings.host)
    return DecodeServer(
        server, port, health, service, encoder, exporter, directory.client if directory is not None else None, metrics
    )


async def _serve(settings: DecodeSettings) -> None:
    metrics = DecodeMetrics(new_registry(), settings.model_name)
    redis = settings.redis
    prefix_store = None
    if settings.redis_prefix is not None:
        from decode_service.engine.worker.prefix_store import PrefixStore

        assert redis is not None  # DecodeSettings checks it
        prefix_store = PrefixStore.connect(redis, settings.redis_prefix)
    connection = (redis, settings.redis_prefix) if prefix_store is not None else None  # tensor-parallel followers
    engine = await asyncio.to_thread(build_engine, settings.checkpoint, settings.engine, prefix_store, connection)
    # mm_keys need the preprocessing policies and the towers' fingerprint, not the towers: those are loaded
    # only to encode in-process (--local-encode).
    planner = MediaPlanner.for_checkpoint(settings.checkpoint)
    encoder_fingerprint = encoder_fingerprint_of(settings.checkpoint, settings.engine.dtype)
    local = None
    if settings.local_encode:
        from decode_service.local_encoder import LocalEncoder

        local = await asyncio.to_thread(
            LocalEncoder.load, settings.checkpoint, settings.engine.device, settings.engine.dtype
        )
    cache = (
        RedisCache(redis.url, key_prefix=redis.key_prefix, timeout_s=redis.timeout_s, async_writes=False)
        if redis is not None
        else None
    )
    encoder = EncoderClient(
        settings.encoders,
        planner.preprocess_fingerprint,
        cache=cache,
        local=local,
        local_fingerprint=encoder_fingerprint,
        settings=ClientSettings(security=settings.grpc.security),
        observer=metrics,
    )
    from encoder_service.codebook import AudioCodebook  # audio arrives as dMel codes; rows are summed here

    codebook = await asyncio.to_thread(AudioCodebook.load, settings.checkpoint, settings.engine.device)
    service = DecodeService(engine, encoder, settings.limits, model_id=settings.model_name, audio_codebook=codebook)
    directory = None
    if redis is not None and settings.replica_id:
        import redis.asyncio as aioredis

        directory = PrefixDirectory(
            aioredis.from_url(redis.url, socket_timeout=redis.timeout_s, socket_connect_timeout=redis.timeout_s)
        )
    server = build_server(
        service, settings.grpc, encoder, metrics, settings.metrics_port, directory, settings.replica_id
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    waiter = asyncio.create_task(server.wait())
    stopper = asyncio.create_task(stopping.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    log.info("decode replica shutting down (grace %.1fs)", settings.grpc.grace_s)
    await server.stop(settings.grpc.grace_s)
    if local is not None:
        await local.close()
    if cache is not None:
        cache.close()
    stopper.cancel()


def serve(args: argparse.Namespace) -> int:
    """`inkling-epd decode`: load the decoder, connect to the encoders, serve until SIGTERM/SIGINT, drain."""
    settings = decode_settings(args)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(settings))
    return 0
