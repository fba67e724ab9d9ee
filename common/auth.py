"""Transport security and per-client admission for every gRPC server and for our own clients.

Server side (`server_interceptors`, `bind_server`):
- malformed requests: bytes that do not parse as the method's message get INVALID_ARGUMENT (not UNKNOWN);
- bearer token: every call must carry `authorization: Bearer <token>` metadata, compared in constant time;
  otherwise UNAUTHENTICATED. `grpc.health.v1` stays open so probes and load balancers need no secret.
- per-client stream limit: at most `max_streams_per_client` concurrent calls per client address (the peer's
  IP, port stripped); more get RESOURCE_EXHAUSTED at once instead of queueing.
- TLS: `bind_server` adds a secure port when a certificate is configured; with a CA bundle too, clients must
  present a certificate signed by it (mTLS).

Client side (`aio_channel`, `sync_channel`): a channel to one of our servers with the same settings: TLS
credentials when a CA or certificate is configured and the token attached to every call by an interceptor
(it works on plaintext channels too, where gRPC's call credentials are refused).

Media are only ever inline bytes: the proto has no URL field and no server fetches anything, so there is no
SSRF surface to guard here.
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from common.errors import ConfigError
from common.grpc_util import add_port
from common.settings import SecuritySettings

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
_HEALTH_PREFIX = f"/{health_pb2.DESCRIPTOR.services_by_name['Health'].full_name}/"

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r}: {exc}") from None


def _exempt(method: str) -> bool:
    return method.startswith(_HEALTH_PREFIX)


def _replace_behavior(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[Callable[..., Any], bool], Callable[..., Any]],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """The same kind of handler (unary/stream in/out, same serializer) around a wrapped behaviour.
    `wrap(behavior, streaming_response)` returns the new behaviour."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
    )
    for attribute, factory, streaming in kinds:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return factory(
                wrap(behavior, streaming),
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise AssertionError("method handler without behaviour")


def _refusal(code: grpc.StatusCode, message: str, streaming: bool) -> Callable[..., Any]:
    if streaming:

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator, as streaming handlers are

        return refuse_stream

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    return refuse


class _Malformed:
    """Stands in for a request whose bytes did not parse (`MalformedRequestInterceptor`)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Request bytes that do not parse as the method's message (truncated, garbage, invalid UTF-8 in a string
    field) get INVALID_ARGUMENT with the parser's message; grpc's default is UNKNOWN plus an error log."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler.request_deserializer is None
            or handler.request_streaming
            or _exempt(handler_call_details.method)
        ):
            return handler
        parse = handler.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # any parser failure is the caller's bad input
                return _Malformed(exc)

        return _replace_behavior(handler, self._guarded, tolerant)

    @staticmethod
    def _guarded(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
        async def refuse(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request could not be parsed: {type(request.error).__name__}: {request.error}",
            )

        if streaming and inspect.isasyncgenfunction(behavior):

            async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                async for response in behavior(request, context):
                    yield response

            return guarded_stream

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            return await behavior(request, context)

        return guarded


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <token>` (health is exempt)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or _exempt(method) or self.authorized(handler_call_details.invocation_metadata):
            return handler
        log.warning("refused %s: missing or wrong bearer token", method)
        return _replace_behavior(
            handler,
            lambda _behavior, streaming: _refusal(
                grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token", streaming
            ),
        )


def client_key(peer: str) -> str:
    """`ipv4:10.0.0.5:4242` / `ipv6:[::1]:4242` -> the address without its port; other forms as they are."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return peer


class StreamLimitInterceptor(grpc.aio.ServerInterceptor):
    """At most `max_per_client` concurrent calls per client address; the next one gets RESOURCE_EXHAUSTED."""

    def __init__(self, max_per_client: int) -> None:
        if max_per_client < 1:
            raise ConfigError(f"max_streams_per_client must be >= 1, got {max_per_client}")
        self.max_per_client = max_per_client
        self.open: dict[str, int] = {}

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or _exempt(handler_call_details.method):
            return handler
        return _replace_behavior(handler, self._limited)

    def _admit(self, context: grpc.aio.ServicerContext) -> str | None:
        key = client_key(context.peer() or "")
        if self.open.get(key, 0) >= self.max_per_client:
            return None
        self.open[key] = self.open.get(key, 0) + 1
        return key

    def _release(self, key: str) -> None:
        left = self.open[key] - 1
        if left:
            self.open[key] = left
        else:
            del self.open[key]

    def _refuse_message(self, context: grpc.aio.ServicerContext) -> str:
        return (
            f"client {client_key(context.peer() or '')} already has {self.max_per_client} concurrent calls "
            "(the per-client limit); retry later"
        )

    def _limited(self, behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
        if streaming:

            async def limited_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                key = self._admit(context)
                if key is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._refuse_message(context))
                try:
                    if inspect.isasyncgenfunction(behavior):
                        async for response in behavior(request, context):
                            yield response
                    else:  # a streaming handler that writes with `context.write`
                        await behavior(request, context)
                finally:
                    self._release(key)

            return limited_stream

        async def limited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            key = self._admit(context)
            if key is None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._refuse_message(context))
            try:
                return await behavior(request, context)
            finally:
                self._release(key)

        return limited


def server_interceptors(security: SecuritySettings) -> list[grpc.aio.ServerInterceptor]:
    """Auth first (an unauthenticated caller takes no stream slot), then the per-client limit, then the
    parse guard (always on)."""
    out: list[grpc.aio.ServerInterceptor] = []
    if security.token:
        out.append(TokenAuthInterceptor(security.token))
    if security.max_streams_per_client:
        out.append(StreamLimitInterceptor(security.max_streams_per_client))
    out.append(MalformedRequestInterceptor())
    return out


def server_credentials(security: SecuritySettings) -> grpc.ServerCredentials | None:
    """TLS credentials of a server (None: plaintext); a CA bundle makes client certificates mandatory."""
    if security.tls_cert is None or security.tls_key is None:
        if security.tls_ca is not None:
            raise ConfigError("--tls-ca on a server needs --tls-cert and --tls-key")
        return None
    ca = _read(security.tls_ca) if security.tls_ca else None
    return grpc.ssl_server_credentials(
        [(_read(security.tls_key), _read(security.tls_cert))], root_certificates=ca, require_client_auth=ca is not None
    )


def bind_server(server: grpc.aio.Server, host: str, port: int, security: SecuritySettings) -> int:
    """Bind a TLS port when a certificate is configured, else a plaintext one; returns the bound port."""
    credentials = server_credentials(security)
    add = server.add_insecure_port if credentials is None else lambda a: server.add_secure_port(a, credentials)
    return add_port(server, f"{host}:{port}", add)


def channel_credentials(security: SecuritySettings) -> grpc.ChannelCredentials | None:
    """TLS credentials of a client (None: plaintext). The certificate, when set, is presented for mTLS."""
    if not security.tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(security.tls_ca) if security.tls_ca else None,
        private_key=_read(security.tls_key) if security.tls_key else None,
        certificate_chain=_read(security.tls_cert) if security.tls_cert else None,
    )


def _with_token(details: Any, token: str, factory: Callable[..., Any]) -> Any:
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != AUTH_HEADER]
    metadata.append((AUTH_HEADER, f"Bearer {token}"))
    return factory(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class _AioTokenBase:
    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return _with_token(details, self.token, grpc.aio.ClientCallDetails)


# grpc.aio files each interceptor under ONE call kind (the first base class it matches), hence four classes.
class _AioTokenUnaryUnary(_AioTokenBase, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _AioTokenUnaryStream(_AioTokenBase, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _AioTokenStreamUnary(_AioTokenBase, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _AioTokenStreamStream(_AioTokenBase, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors adding `authorization: Bearer <token>` to every call of an aio channel."""
    return [
        kind(token) for kind in (_AioTokenUnaryUnary, _AioTokenUnaryStream, _AioTokenStreamUnary, _AioTokenStreamStream)
    ]


class _SyncCallDetails(grpc.ClientCallDetails):
    def __init__(
        self, method: str, timeout: float | None, metadata: Any, credentials: Any, wait_for_ready: bool | None
    ) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready = credentials, wait_for_ready
        self.compression = None


class _SyncTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token to every call of a blocking channel (CLI, benchmarks)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _call(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self.token, _SyncCallDetails), request)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self._call(continuation, client_call_details, request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self._call(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self._call(continuation, client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self._call(continuation, client_call_details, request_iterator)


def _options(security: SecuritySettings, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    out = list(options)
    if security.tls and security.tls_server_name:
        out.append(("grpc.ssl_target_name_override", security.tls_server_name))
    return out


def aio_channel(
    address: str, security: SecuritySettings | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to one of our servers (TLS and token as configured)."""
    security = security or SecuritySettings()
    interceptors = aio_token_interceptors(security.token) if security.token else None
    credentials = channel_credentials(security)
    if credentials is not None:
        return grpc.aio.secure_channel(
            address, credentials, options=_options(security, options), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=_options(security, options), interceptors=interceptors)


def sync_channel(
    address: str, security: SecuritySettings | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to one of our servers (TLS and token as configured)."""
    security = security or SecuritySettings()
    credentials = channel_credentials(security)
    channel = (
        grpc.secure_channel(address, credentials, options=_options(security, options))
        if credentials is not None
        else grpc.insecure_channel(address, options=_options(security, options))
    )
    if security.token:
        channel = grpc.intercept_channel(channel, _SyncTokenInterceptor(security.token))
    return channel
