"""Fixtures of the HTTP front's tests: the front served by uvicorn on a free port (in a thread), a scripted
fake Generator upstream for the fast tests, and the e2e cluster fixtures re-exported for the real-cluster tests.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode_service.http_api.app import build_app
from decode_service.http_api.config import ApiSettings
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc
from tests.e2e.conftest import e2e, fingerprints, loop_thread, tiny_checkpoint  # noqa: F401  (fixtures)


class ApiThread:
    """`build_app(settings)` served by uvicorn on 127.0.0.1 (port 0) in a daemon thread."""

    def __init__(self, settings: ApiSettings, **app_kwargs) -> None:
        config = uvicorn.Config(build_app(settings, **app_kwargs), host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)


@pytest.fixture(scope="module")
def api_thread():
    """A factory: `api_thread(settings, **build_app_kwargs)` -> a running ApiThread, closed after the module."""
    started: list[ApiThread] = []

    def start(settings: ApiSettings, **kwargs) -> ApiThread:
        started.append(ApiThread(settings, **kwargs))
        return started[-1]

    yield start
    for api in started:
        api.close()


# ---------------------------------------------------------------------------------------------------------
# A scripted upstream


def _usage(**kw) -> pb.Usage:
    return pb.Usage(prompt_tokens=kw.get("prompt", 7), cached_tokens=kw.get("cached", 3), completion_tokens=3)


def _delta(text: str = "", channel: int = pb.CHANNEL_CONTENT, ids=(1,), **kw) -> pb.GenerateResponse:
    return pb.GenerateResponse(delta=pb.Delta(token_ids=list(ids), text=text, channel=channel, **kw))


def _logprob(token_id: int, text: str, logprob: float, *top: tuple[int, str, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        token=text,
        token_bytes=text.encode(),
        top=[pb.TopLogprob(token_id=i, logprob=v, token=t, token_bytes=t.encode()) for i, t, v in top],
    )


SCRIPTS = {
    "no token text": [
        _delta("a", logprobs=[pb.TokenLogprob(token_id=1, logprob=-0.1)]),
        pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=_usage())),
    ],
    # last user text -> the responses (or an abort) the fake streams
    "no final": [_delta("partial")],  # a broken upstream: the stream ends without its Final
    "no reason": [_delta("partial"), pb.GenerateResponse(final=pb.Final(usage=_usage()))],  # Final, reason unset
    "hello": [
        _delta("Let me think.", pb.CHANNEL_REASONING, ids=(10, 11)),
        _delta("Hello", ids=(12,), logprobs=[_logprob(12, "Hello", -0.5, (12, "Hello", -0.5), (14, "Hi", -1.5))]),
        _delta(" world", ids=(13,), logprobs=[_logprob(13, " world", -0.25, (13, " world", -0.25))]),
        # a token that is half of a UTF-8 character: its text is U+FFFD, its bytes exact
        _delta(
            "", ids=(15,), logprobs=[pb.TokenLogprob(token_id=15, logprob=-2.0, token="\ufffd", token_bytes=b"\xc3")]
        ),
        pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=_usage(), matched_stop="")),
    ],
    "weather?": [
        _delta("Need the tool.", pb.CHANNEL_REASONING, ids=(20,)),
        _delta(
            "",
            pb.CHANNEL_TOOL_CALL,
            ids=(21, 22),
            tool_call=pb.ToolCall(id="functions.get_weather:0", name="get_weather", arguments_json='{"city": "Paris"}'),
        ),
        pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_TOOL_CALLS, usage=_usage())),
    ],
}


@dataclass
class FakeGenerator(generator_pb2_grpc.GeneratorServicer):
    """Streams `SCRIPTS[last user text]` (a text prompt: SCRIPTS[its text]); "status CODE message" aborts with
    that code; "slow" streams a delta every 20 ms for 60 s and records when its call is cancelled."""

    requests: list = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def Generate(self, request, context):
        self.requests.append(request)
        kind = request.WhichOneof("prompt")
        text = {"chat": lambda: request.chat.messages[-1].content[-1].text, "text": lambda: request.text.text}.get(
            kind, lambda: "tokens"
        )()
        if text.startswith("status "):
            _, code, message = text.split(" ", 2)
            context.abort(grpc.StatusCode[code], message)
        if text == "slow":
            context.add_callback(self.cancelled.set)
            for _ in range(3000):
                if not context.is_active():
                    return
                yield _delta("x")
                time.sleep(0.02)
            return
        if text == "tokens":
            yield _delta("abc", ids=(5, 6))
            yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH, usage=_usage()))
            return
        yield from SCRIPTS[text]

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_id="fake-inkling")


@dataclass
class FakeUpstream:
    address: str
    servicer: FakeGenerator
    health: health.HealthServicer


class _RequireToken(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <token>` (health stays open)."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}"

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        if handler_call_details.method.startswith("/grpc.health") or metadata.get("authorization") == self.expected:
            return continuation(handler_call_details)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        return grpc.unary_unary_rpc_method_handler(refuse)


def start_fake(token: str | None = None, credentials=None) -> tuple[grpc.Server, FakeUpstream]:
    """A scripted Generator + health server on a free port; with `token`, every non-health call needs it; with
    `credentials` (grpc.ServerCredentials) it listens with TLS."""
    interceptors = [_RequireToken(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=interceptors)
    servicer = FakeGenerator()
    generator_pb2_grpc.add_GeneratorServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    server.start()
    return server, FakeUpstream(f"127.0.0.1:{port}", servicer, health_servicer)


@pytest.fixture(scope="module")
def fake_upstream() -> Iterator[FakeUpstream]:
    server, upstream = start_fake()
    try:
        yield upstream
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def fake_upstream_with_token() -> Iterator[FakeUpstream]:
    server, upstream = start_fake(token="upstream-secret")
    try:
        yield upstream
    finally:
        server.stop(0)


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA plus server (127.0.0.1) and client certificates signed by it."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=inkling-test-ca")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(d, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}")  # fmt: skip
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return d


@pytest.fixture(scope="module")
def fake_upstream_mtls(pki) -> Iterator[FakeUpstream]:
    """The scripted upstream behind mTLS: clients must present a certificate signed by the test CA."""
    credentials = grpc.ssl_server_credentials(
        [((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())],
        root_certificates=(pki / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    server, upstream = start_fake(credentials=credentials)
    try:
        yield upstream
    finally:
        server.stop(0)
