"""Shared e2e fixtures: a tiny checkpoint, an event loop on a background thread, in-process servers built with
the services' own factories, mixed request builders and a bounded traffic runner.

Servers run on `LoopThread`; test code (hypothesis included) stays synchronous and either runs coroutines on
that loop or talks to the servers over real sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

import grpc
import pytest

from common.auth import bind_server, server_interceptors
from common.cache_store import EmbeddingCache
from common.grpc_util import ServerHealth, create_server, enable_reflection
from common.settings import (
    DecodeEngineSettings,
    EncoderLimits,
    EncoderSettings,
    GrpcSettings,
    RedisSettings,
    SecuritySettings,
)
from decode_service.api import ServiceLimits
from decode_service.encoder_client import ClientSettings, EncoderClient
from decode_service.engine.build import build_engine
from decode_service.local_encoder import LocalEncoder
from decode_service.router import Router, RouterConfig
from decode_service.server import DecodeServer
from decode_service.server import build_server as build_decode_server
from decode_service.service import DecodeService
from encoder_service.codebook import AudioCodebook
from encoder_service.server import SERVICE_NAME as ENCODER_SERVICE
from encoder_service.server import EncoderServer, EncoderServicer
from encoder_service.service import EncoderEngine, load_engine
from proto.inkling_epd.v1 import encoder_pb2_grpc, generator_pb2, media_pb2
from tools.make_sample_media import draw_shapes, png_bytes, sample_media
from tools.make_tiny_checkpoint import make_tiny_checkpoint

T = TypeVar("T")
MEDIA = sample_media()


class LoopThread:
    """An asyncio loop running on a daemon thread; `run` executes a coroutine on it and waits (bounded)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="e2e-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_rest(), 10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        self.loop.close()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-e2e"), nvfp4=True, seed=0))


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    try:
        yield thread
    finally:
        thread.close()


# ---------------------------------------------------------------------------------------------------------
# In-process servers


@dataclass
class InProcessEncoder:
    server: EncoderServer
    servicer: EncoderServicer

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def engine(self) -> EncoderEngine:
        return self.server.engine

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)


async def start_encoder(
    checkpoint: str,
    servicer_cls: type[EncoderServicer] = EncoderServicer,
    limits: EncoderLimits | None = None,
    l1_cache_bytes: int = 0,
    security: SecuritySettings | None = None,
    redis: RedisSettings | None = None,
    **servicer_kwargs: Any,
) -> InProcessEncoder:
    """An encoder as `encoder_service.server.build_server` makes it, optionally with a fault-injecting
    servicer subclass (kept reachable as `.servicer`)."""
    security = security or SecuritySettings()
    engine = await asyncio.to_thread(
        load_engine,
        EncoderSettings(
            checkpoint=checkpoint,
            l1_cache_bytes=l1_cache_bytes,
            limits=limits or EncoderLimits(),
            preprocess_workers=2,
            redis=redis,
        ),
    )
    server = create_server(interceptors=server_interceptors(security))
    servicer = servicer_cls(engine, None, 64 << 10, **servicer_kwargs)
    encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server)
    health = ServerHealth(server, [ENCODER_SERVICE])
    enable_reflection(server, [ENCODER_SERVICE])
    port = bind_server(server, "127.0.0.1", 0, security)
    encoder = InProcessEncoder(EncoderServer(server, port, health, engine), servicer)
    await encoder.server.start()
    return encoder


@dataclass
class FingerprintSource:
    """The preprocessing fingerprint function the encoder client needs (loaded once per session)."""

    local: LocalEncoder


@pytest.fixture(scope="session")
def fingerprints(tiny_checkpoint) -> FingerprintSource:
    return FingerprintSource(LocalEncoder.load(tiny_checkpoint, dtype="float32"))


async def start_decode(
    checkpoint: str,
    fingerprints: FingerprintSource,
    encoders: Sequence[str],
    cache: EmbeddingCache | None = None,
    prefix_cache: bool = False,
    limits: ServiceLimits | None = None,
    client: ClientSettings | None = None,
    grace_s: float = 5.0,
    security: SecuritySettings | None = None,
) -> DecodeServer:
    engine = await asyncio.to_thread(
        build_engine,
        checkpoint,
        DecodeEngineSettings(
            dtype="float32",
            kv_cache_bytes=16 << 20,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            enable_prefix_cache=prefix_cache,
        ),
    )
    security = security or SecuritySettings()
    encoder = EncoderClient(
        list(encoders),
        fingerprints.local.preprocess_fingerprint,
        cache=cache,
        settings=client or ClientSettings(security=security, ready_wait_s=2.0),
    )
    codebook = AudioCodebook.load(checkpoint)
    service = DecodeService(engine, encoder, limits or ServiceLimits(), model_id="tiny", audio_codebook=codebook)
    server = build_decode_server(service, GrpcSettings(port=0, grace_s=grace_s, security=security), encoder)
    await server.start()
    return server


async def start_router(decoders: Sequence[str], security: SecuritySettings | None = None) -> Router:
    grpc_settings = GrpcSettings(port=0, grace_s=2.0, security=security or SecuritySettings())
    router = Router(RouterConfig(decoders=tuple(decoders), grpc=grpc_settings, poll_interval_s=0.1, rpc_timeout_s=1.0))
    await router.start()
    return router


def engine_idle(server: DecodeServer) -> dict[str, int]:
    """Counters that must be back at their idle values once no request is live (prefix cache off)."""
    engine = server.service.engine
    cache = engine.cache
    busy_pages = sum(p.num_pages - p.num_free for p in cache.pools.values())
    load = server.service.load()
    return {
        "requests": len(engine.requests),
        "running": load.running,
        "waiting": load.waiting,
        "busy_conv_slots": cache.spec.num_conv_slots - cache.num_free_slots,
        "busy_kv_pages": busy_pages if engine.prefix_cache is None else 0,
        "live": len(server.service._live),
        "inflight_encode_items": load.inflight_encode_items,
    }


async def wait_idle(server: DecodeServer, timeout_s: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = engine_idle(server)
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------------------------------------
# Requests


def image_bytes(variant: int) -> bytes:
    """A distinct small PNG per variant (distinct mm_keys: no cache hits across variants)."""
    image = draw_shapes(64, 48)
    for k in range(4):  # the variant's bytes in the first pixels of the top row
        image.putpixel((k, 0), ((variant >> (8 * k)) & 255, 0, 0))
    return png_bytes(image)


def chat_request(request_id: str, kind: str, variant: int = 0, max_tokens: int = 4) -> generator_pb2.GenerateRequest:
    """kind: "text", "image", "audio" or "image+audio"; greedy, fixed length."""
    parts = []
    if "image" in kind:
        parts.append(
            generator_pb2.ContentPart(
                media=media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=image_bytes(variant))
            )
        )
    if "audio" in kind:
        parts.append(
            generator_pb2.ContentPart(
                media=media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=MEDIA["tones_16k.wav"])
            )
        )
    parts.append(generator_pb2.ContentPart(text=f"Describe item {variant}."))
    return generator_pb2.GenerateRequest(
        request_id=request_id,
        chat=generator_pb2.ChatPrompt(
            messages=[generator_pb2.Message(role=generator_pb2.ROLE_USER, content=parts)], reasoning_effort=0.0
        ),
        sampling=generator_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


MIX = ("text", "image", "audio", "image+audio")


@dataclass
class Outcome:
    request_id: str
    status: str  # "OK", a status code name, or "HUNG"
    seconds: float
    tokens: list[int] = field(default_factory=list)
    details: str = ""
    ended: float = field(default_factory=time.monotonic)


async def generate_once(
    stub: Any, request: generator_pb2.GenerateRequest, deadline_s: float, on_first: Callable[[], None] | None = None
) -> Outcome:
    """One Generate call; never waits longer than its deadline + 5 s (then it is recorded as HUNG)."""
    started = time.monotonic()
    tokens: list[int] = []
    finals = 0

    async def consume() -> None:
        nonlocal finals
        call = stub.Generate(request, timeout=deadline_s)
        try:
            async for message in call:
                if message.HasField("delta"):
                    if not tokens and message.delta.token_ids and on_first is not None:
                        on_first()
                    tokens.extend(message.delta.token_ids)
                else:
                    finals += 1
        finally:
            call.cancel()

    try:
        await asyncio.wait_for(consume(), deadline_s + 5.0)
    except grpc.aio.AioRpcError as exc:
        return Outcome(request.request_id, exc.code().name, time.monotonic() - started, tokens, exc.details() or "")
    except TimeoutError:
        return Outcome(request.request_id, "HUNG", time.monotonic() - started, tokens)
    status = "OK" if finals == 1 else f"BAD_STREAM({finals} finals)"
    return Outcome(request.request_id, status, time.monotonic() - started, tokens)


async def run_traffic(
    stub: Any,
    count: int,
    concurrency: int,
    deadline_s: float,
    prefix: str,
    kinds: Sequence[str] = MIX,
    max_tokens: int = 4,
    on_first: Callable[[], None] | None = None,
) -> list[Outcome]:
    """`count` mixed requests with at most `concurrency` in flight (bounded in count and time)."""
    slots = asyncio.Semaphore(concurrency)
    base = zlib.crc32(prefix.encode()) % 997 * 100

    async def one(i: int) -> Outcome:
        async with slots:
            request = chat_request(f"{prefix}-{i}", kinds[i % len(kinds)], variant=base + i, max_tokens=max_tokens)
            return await generate_once(stub, request, deadline_s, on_first)

    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def recovery_time(stub: Any, kind: str = "image", timeout_s: float = 30.0, prefix: str = "recover") -> float:
    """Seconds until a fresh request succeeds (polling); raises AssertionError when it never does."""
    started = time.monotonic()
    attempt = 0
    last = None
    while time.monotonic() - started < timeout_s:
        last = await generate_once(stub, chat_request(f"{prefix}-{attempt}", kind, variant=5000 + attempt), 10.0)
        if last.status == "OK":
            return time.monotonic() - started
        attempt += 1
        await asyncio.sleep(0.1)
    raise AssertionError(f"no successful request within {timeout_s}s; last outcome {last}")


def summarize(outcomes: Sequence[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    return counts


@pytest.fixture(scope="session")
def e2e() -> SimpleNamespace:
    """The helpers of this file for the test modules (a fixture, so that test modules never import each other)."""
    return SimpleNamespace(
        start_encoder=start_encoder,
        start_decode=start_decode,
        start_router=start_router,
        wait_idle=wait_idle,
        engine_idle=engine_idle,
        chat_request=chat_request,
        image_bytes=image_bytes,
        generate_once=generate_once,
        run_traffic=run_traffic,
        recovery_time=recovery_time,
        summarize=summarize,
        MIX=MIX,
    )
