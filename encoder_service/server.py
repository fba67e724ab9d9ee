"""gRPC front of the encoder: `inkling_epd.v1.Encoder` over `EncoderEngine`, with health, reflection and
metrics.

The servicer is a thin adapter: protobuf -> `MediaInput` at the edge, engine results -> header + chunk
messages (`common.wire`), and every exception -> a status code in `_abort` (via
`common.grpc_util.status_for`).
`build_server` makes a ready-to-start server around an engine (tests use it on port 0); `serve` is the
`inkling-epd encoder` entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from common.auth import bind_server, server_interceptors
from common.grpc_util import ServerHealth, create_server, enable_reflection, graceful_stop, status_for
from common.media import media_from_proto
from common.metrics import EncoderMetrics, MetricsServer, new_registry, start_metrics_server
from common.request_ids import check_request_id
from common.settings import GrpcSettings, encoder_settings
from common.wire import CHUNK_BYTES, EncodedItem, item_messages, modality_to_proto
from encoder_service.service import EncoderEngine, ItemError, load_engine
from proto.inkling_epd.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name


# ---------------------------------------------------------------------------------------------------------
# Servicer


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(
        self, engine: EncoderEngine, metrics: EncoderMetrics | None = None, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes

    async def Encode(
        self,
        request: encoder_pb2.EncodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[encoder_pb2.EncodeChunk]:
        expected = request.expected_encoder_fingerprint
        if expected and expected != self.engine.fingerprint:
            self._count("FAILED_PRECONDITION")
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"encoder fingerprint {self.engine.fingerprint.hex()[:16]}... differs "
                f"from the expected {expected.hex()[:16]}...",
            )
        failure: Exception | None = None
        # Without continue_on_item_error a bad item fails the whole call, so nothing is sent until every item
        # has succeeded: the client never sees embeddings of a call that then fails.
        lenient = request.continue_on_item_error
        held: list[EncodedItem] = []
        try:
            check_request_id(request.request_id)
            items = [media_from_proto(i, m) for i, m in enumerate(request.items)]
            async with contextlib.aclosing(self.engine.encode(items, request.request_id)) as results:
                async for result in results:
                    if isinstance(result, ItemError):
                        if not lenient:
                            raise result.error
                        code, message = status_for(result.error)
                        yield encoder_pb2.EncodeChunk(
                            error=encoder_pb2.ItemError(item_index=result.item_index, code=code.name, message=message)
                        )
                        continue
                    if not lenient:
                        held.append(result)
                        continue
                    for message in item_messages(result, self.chunk_bytes):
                        yield message
                for result in held:
                    for message in item_messages(result, self.chunk_bytes):
                        yield message
        except asyncio.CancelledError:
            self._count("CANCELLED")
            log.info("encode %s cancelled by the client or its deadline", request.request_id)
            raise
        except Exception as exc:  # mapped to a status code in `_abort`
            failure = exc
        if failure is not None:
            await self._abort(context, request.request_id, failure)
        self._count("OK")

    async def GetInfo(
        self, request: encoder_pb2.EncoderInfoRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncoderInfo:
        info = self.engine.info()
        return encoder_pb2.EncoderInfo(
            encoder_fingerprint=info.fingerprint,
            model_id=info.model_id,
            dim=info.dim,
            dtype="bfloat16",
            modalities=[modality_to_proto(m) for m in info.modalities],
            max_items_per_request=info.limits.max_items_per_request,
            max_item_bytes=info.limits.max_item_bytes,
            max_batch_tokens=info.max_batch_tokens,
            inflight_items=self.engine.inflight_items,
        )

    async def _abort(self, context: grpc.aio.ServicerContext, request_id: str, exc: Exception) -> None:
        """The one place where failures become status codes."""
        code, message = status_for(exc)
        self._count(code.name)
        log.info("encode %s failed: %s %s", request_id, code.name, message)
        await context.abort(code, message)

    def _count(self, status: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(status).inc()


# ---------------------------------------------------------------------------------------------------------
# Server lifecycle


@dataclass
class EncoderServer:
    server: grpc.aio.Server
    port: int
    health: ServerHealth
    engine: EncoderEngine
    metrics_server: MetricsServer | None = None

    async def start(self) -> None:
        await self.server.start()
        await self.health.serving()
        log.info("encoder serving on port %d (modalities %s)", self.port, ", ".join(self.engine.modalities))

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING, drain running calls for up to `grace_s`, then release the engine and exporter."""
        await graceful_stop(self.server, self.health, grace_s)
        await self.engine.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def build_server(
    engine: EncoderEngine,
    grpc_settings: GrpcSettings,
    metrics: EncoderMetrics | None = None,
    registry: CollectorRegistry | None = None,
    metrics_port: int = 0,
    chunk_bytes: int = CHUNK_BYTES,
) -> EncoderServer:
    """A bound, not yet started server. `metrics_port` > 0 also starts the /metrics exporter of `registry`."""
    server = create_server(
        grpc_settings.max_message_bytes,
        server_interceptors(grpc_settings.security),
        max_request_bytes=grpc_settings.max_request_bytes,
    )
    encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(engine, metrics, chunk_bytes), server)
    health = ServerHealth(server, [SERVICE_NAME])
    enable_reflection(server, [SERVICE_NAME])
    port = bind_server(server, grpc_settings.host, grpc_settings.port, grpc_settings.security)
    exporter = None
    if metrics_port and registry is not None:
        exporter = start_metrics_server(metrics_port, registry, grpc_settings.host)
    return EncoderServer(server, port, health, engine, exporter)


async def _serve(
    engine: EncoderEngine, grpc_settings: GrpcSettings, metrics: EncoderMetrics, metrics_port: int
) -> None:
    server = build_server(engine, grpc_settings, metrics, metrics.registry, metrics_port)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    waiter = asyncio.create_task(server.wait())
    stopper = asyncio.create_task(stopping.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    log.info("encoder shutting down (grace %.1fs)", grpc_settings.grace_s)
    await server.stop(grpc_settings.grace_s)
    stopper.cancel()


def serve(args: argparse.Namespace) -> int:
    """`inkling-epd encoder`: load the towers, serve until SIGTERM/SIGINT, drain, exit."""
    settings = encoder_settings(args)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = EncoderMetrics(new_registry())
    engine = load_engine(settings, metrics)
    asyncio.run(_serve(engine, settings.grpc, metrics, settings.metrics_port))
    return 0
