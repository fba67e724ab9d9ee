"""The whole in-process stack (encoder, decode replica, router) with a bearer token AND mutual TLS on every hop:
our own clients authenticate (router -> decode -> encoder, media included), strangers get UNAUTHENTICATED or no
connection, health stays readable with the token missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import aio_channel
from common.settings import SecuritySettings
from proto.inkling_epd.v1 import generator_pb2_grpc

TOKEN = "e2e-token-42"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki-e2e")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=inkling-e2e-ca",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "svc.key", "-out", "svc.csr", "-subj", "/CN=svc")
    openssl(
        "x509",
        "-req",
        "-in",
        "svc.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "svc.pem",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )
    return d


def test_token_and_mtls_on_every_hop(e2e, tiny_checkpoint, fingerprints, loop_thread, pki):
    # One deployment-wide identity: each service presents svc.pem as server AND as client certificate.
    secure = SecuritySettings(
        token=TOKEN, tls_cert=str(pki / "svc.pem"), tls_key=str(pki / "svc.key"), tls_ca=str(pki / "ca.pem")
    )
    no_token = SecuritySettings(tls_cert=str(pki / "svc.pem"), tls_key=str(pki / "svc.key"), tls_ca=str(pki / "ca.pem"))

    async def scenario():
        encoder = await e2e.start_encoder(tiny_checkpoint, security=secure)
        decode = router = None
        try:
            decode = await e2e.start_decode(tiny_checkpoint, fingerprints, [encoder.address], security=secure)
            router = await e2e.start_router([f"127.0.0.1:{decode.port}"], security=secure)
            address = f"127.0.0.1:{router.port}"
            out = {}
            async with aio_channel(address, secure) as channel:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                out["authorized"] = await e2e.generate_once(stub, e2e.chat_request("auth-ok", "image+audio", 3), 30.0)
            async with aio_channel(address, no_token) as channel:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                out["no_token"] = await e2e.generate_once(stub, e2e.chat_request("auth-no", "text"), 10.0)
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                out["health"] = health.status
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                out["plaintext"] = await e2e.generate_once(stub, e2e.chat_request("auth-plain", "text"), 10.0)
            return out
        finally:
            if router is not None:
                await router.stop(0.5)
            if decode is not None:
                await decode.stop(0.5)
            await encoder.stop(0.5)

    out = loop_thread.run(scenario())
    assert out["authorized"].status == "OK" and len(out["authorized"].tokens) == 4
    assert out["no_token"].status == "UNAUTHENTICATED"
    assert out["health"] == health_pb2.HealthCheckResponse.SERVING
    assert out["plaintext"].status == "UNAVAILABLE"  # no TLS handshake, no call
