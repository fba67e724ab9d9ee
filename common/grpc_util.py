"""gRPC plumbing shared by the encoder, decode and router servers.

- `create_server`: a `grpc.aio` server with explicit max message sizes and keepalive settings that
  tolerate long silent streams;
- `ServerHealth`: a `grpc.health.v1` servicer (its `Watch` streams every status change and ends at graceful
  shutdown) registered with the server, plus helpers to flip all services between SERVING and NOT_SERVING;
- `enable_reflection`, `bind` / `add_port` (exclusive binds; a taken port is a `ConfigError` naming it);
- `graceful_stop`: NOT_SERVING first (watchers and load balancers drain), then `server.stop(grace)`;
- `status_for`: THE mapping from project exceptions to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from common.errors import ConfigError, InvalidInputError, ResourceExhaustedError, UnavailableError
from common.settings import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Trailing metadata of an UNAVAILABLE from a healthy decode replica whose dependency (the shared encoder pool)
# cannot serve: the router neither retries on another replica nor marks this one down.
UNAVAILABLE_DEPENDENCY_KEY = "inkling-unavailable-dependency"


def server_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> list[tuple[str, int]]:
    """Server side: sends at most `max_message_bytes` (streamed chunks), accepts requests up to
    `max_request_bytes` (media travels inline)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max(max_request_bytes, max_message_bytes)),
        # Long generations can be silent for a while: accept client pings without data and never answer them
        # with GOAWAY(too_many_pings).
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        # Bind exclusively: with SO_REUSEPORT a second server on a used port silently shares (and splits) it.
        ("grpc.so_reuseport", 0),
    ]


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> list[tuple[str, int]]:
    """Client-side counterpart (use for every channel to our servers): receives responses up to
    `max_message_bytes`, sends requests up to `max_request_bytes`. Reconnects back off from 0.2 s to at most
    2 s (gRPC's default grows to 120 s: a pool member back from a long outage would stay unseen for minutes)."""
    return [
        ("grpc.max_send_message_length", max(max_request_bytes, max_message_bytes)),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def create_server(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> grpc.aio.Server:
    return grpc.aio.server(
        options=server_options(max_message_bytes, max_request_bytes), interceptors=list(interceptors)
    )


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind an insecure port; returns the real port (port 0 picks a free one)."""
    return add_port(server, f"{host}:{port}", server.add_insecure_port)


def add_port(server: grpc.aio.Server, address: str, add: Callable[[str], int]) -> int:
    """`add(address)` (an `add_*_port` of `server`), with a failure to bind (the port is taken, the host is not
    local) raised as a `ConfigError` naming the address."""
    try:
        bound = add(address)
    except RuntimeError:  # grpc's own message only points at GRPC_VERBOSITY
        bound = 0
    if bound == 0:
        raise ConfigError(f"cannot bind gRPC server to {address}: port in use or address not local")
    return bound


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.aio.Server, service_full_names: Sequence[str]) -> None:
    """Server reflection as `grpc.reflection.v1` (what current grpcurl / grpcui / Postman ask for first) and
    `grpc.reflection.v1alpha`. grpcio-reflection ships only v1alpha; v1 is the same protocol under a new package
    name (identical messages and field numbers), so the same servicer answers both."""
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    names = (*service_full_names, health_name, REFLECTION_V1, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    for service in (REFLECTION_V1, reflection.SERVICE_NAME):
        handlers = {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


class HealthServicer(health_pb2_grpc.HealthServicer):
    """`grpc.health.v1` with a streaming `Watch`, like grpc's reference servicer, except that once graceful
    shutdown starts every Watch stream sends NOT_SERVING and then ENDS. (The reference servicer keeps them open,
    so each watcher, e.g. every decode replica following an encoder, held `server.stop(grace)` for the whole
    grace period even after the last real call had finished.)"""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": SERVING}
        self._changed = asyncio.Condition()
        self._shutting_down = False

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            async with self._changed:
                status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                ending = self._shutting_down
                if status == last and not ending:
                    await self._changed.wait()
                    continue
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if ending:
                return

    async def set(self, service: str, status: int) -> None:
        """Ignored once graceful shutdown started."""
        if self._shutting_down:
            return
        async with self._changed:
            self._status[service] = status
            self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        async with self._changed:
            self._shutting_down = True
            for service in self._status:
                self._status[service] = NOT_SERVING
            self._changed.notify_all()


class ServerHealth:
    """Health of a server: the overall status ("") and one entry per named service move together."""

    def __init__(self, server: grpc.aio.Server, service_full_names: Sequence[str]) -> None:
        self.servicer = HealthServicer()
        self.services = ("", *service_full_names)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_all(self, status: int) -> None:
        for name in self.services:
            await self.servicer.set(name, status)

    async def serving(self) -> None:
        await self.set_all(SERVING)

    async def not_serving(self) -> None:
        await self.set_all(NOT_SERVING)

    async def shutting_down(self) -> None:
        """NOT_SERVING for good: later `set` calls are ignored."""
        await self.servicer.enter_graceful_shutdown()


async def graceful_stop(
    server: grpc.aio.Server, health_state: ServerHealth | None, grace_s: float, drain_notice_s: float = 0.0
) -> None:
    """Report NOT_SERVING (Watch streams see it), optionally give balancers `drain_notice_s` to react,
    then stop accepting calls and let running ones finish within `grace_s` before cancelling them."""
    if health_state is not None:
        await health_state.shutting_down()
    if drain_notice_s > 0:
        await asyncio.sleep(drain_notice_s)
    await server.stop(grace_s)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception raised below a servicer to the status code the client sees."""
    if isinstance(exc, InvalidInputError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ResourceExhaustedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
