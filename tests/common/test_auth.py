"""Bearer-token auth, per-client stream limit and (m)TLS on a real in-process Encoder server; Redis ACL users."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import StreamLimitInterceptor, aio_channel, client_key, sync_channel
from common.cache_store import Entry, RedisCache
from common.errors import ConfigError
from common.settings import GrpcSettings, RedisSettings, SecuritySettings, add_security_args, security_settings
from common.wire import Span
from encoder_service.server import build_server
from encoder_service.service import EncoderEngine
from proto.inkling_epd.v1 import encoder_pb2, encoder_pb2_grpc, media_pb2
from tools.healthcheck import check

TOKEN = "s3cret-token"


class BlockingEngine(EncoderEngine):
    """No towers; `encode` waits until released (a long-lived stream for the limit tests)."""

    def __init__(self) -> None:
        super().__init__(vision=None, audio=None, dim=8, fingerprint=b"\x01" * 32)
        self.release = asyncio.Event()
        self.started = 0

    async def encode(self, items, request_id=""):
        self.started += 1
        await self.release.wait()
        if False:  # pragma: no cover - an async generator that yields nothing
            yield None


def _run(security: SecuritySettings, scenario, engine: EncoderEngine | None = None):
    async def main():
        server = build_server(engine or BlockingEngine(), GrpcSettings(port=0, security=security))
        await server.start()
        try:
            return await scenario(server)
        finally:
            await server.stop(0.2)

    return asyncio.run(main())


async def _info(channel: grpc.aio.Channel) -> encoder_pb2.EncoderInfo:
    return await encoder_pb2_grpc.EncoderStub(channel).GetInfo(encoder_pb2.EncoderInfoRequest(), timeout=5)


async def _health(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status


def test_token_required_except_for_health():
    async def scenario(server):
        address = f"127.0.0.1:{server.port}"
        codes = {}
        for name, security in (
            ("none", SecuritySettings()),
            ("wrong", SecuritySettings(token="nope")),
            ("good", SecuritySettings(token=TOKEN)),
        ):
            async with aio_channel(address, security) as channel:
                assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
                try:
                    info = await _info(channel)
                    codes[name] = ("OK", info.dim)
                except grpc.aio.AioRpcError as exc:
                    codes[name] = (exc.code().name, exc.details())
                # A streaming method is refused the same way (before any message).
                stream = encoder_pb2_grpc.EncoderStub(channel).Encode(encoder_pb2.EncodeRequest(), timeout=5)
                try:
                    async for _ in stream:
                        pass
                    codes[name + "-stream"] = "OK"
                except grpc.aio.AioRpcError as exc:
                    codes[name + "-stream"] = exc.code().name
        return codes

    engine = EncoderEngine(vision=None, audio=None, dim=8, fingerprint=b"\x01" * 32)
    codes = _run(SecuritySettings(token=TOKEN), scenario, engine)
    assert codes["none"][0] == codes["wrong"][0] == "UNAUTHENTICATED"
    assert "token" in codes["none"][1]
    assert codes["good"] == ("OK", 8)
    assert codes["none-stream"] == codes["wrong-stream"] == "UNAUTHENTICATED"
    assert codes["good-stream"] == "INVALID_ARGUMENT"  # past auth: the empty request itself is refused


def test_sync_channel_carries_the_token():
    async def scenario(server):
        def call(security):
            with sync_channel(f"127.0.0.1:{server.port}", security) as channel:
                try:
                    encoder_pb2_grpc.EncoderStub(channel).GetInfo(encoder_pb2.EncoderInfoRequest(), timeout=5)
                    return "OK"
                except grpc.RpcError as exc:
                    return exc.code().name

        return await asyncio.to_thread(call, SecuritySettings(token=TOKEN)), await asyncio.to_thread(
            call, SecuritySettings()
        )

    assert _run(SecuritySettings(token=TOKEN), scenario) == ("OK", "UNAUTHENTICATED")


def test_streams_per_client_are_bounded_and_released():
    engine = BlockingEngine()

    async def scenario(server):
        async with aio_channel(f"127.0.0.1:{server.port}") as channel:
            stub = encoder_pb2_grpc.EncoderStub(channel)
            request = encoder_pb2.EncodeRequest(
                items=[media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=b"x")]
            )
            first = stub.Encode(request, timeout=10)
            second = stub.Encode(request, timeout=10)
            drained = asyncio.gather(*(asyncio.create_task(_drain(c)) for c in (first, second)))
            deadline = time.monotonic() + 5
            while engine.started < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            third = await _drain(stub.Encode(request, timeout=10))
            unary_while_full = await _code(_info(channel))
            engine.release.set()
            await drained
            after = await _code(_info(channel))
            return engine.started, third, unary_while_full, after

    started, third, unary_while_full, after = _run(SecuritySettings(max_streams_per_client=2), scenario, engine)
    assert started == 2
    assert third == unary_while_full == "RESOURCE_EXHAUSTED"
    assert after == "OK"  # slots are given back when calls end


async def _drain(call) -> str:
    try:
        async for _ in call:
            pass
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


async def _code(awaitable) -> str:
    try:
        await awaitable
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


def test_client_key_strips_the_port():
    assert client_key("ipv4:10.1.2.3:4567") == "10.1.2.3"
    assert client_key("ipv6:[::1]:4567") == "::1"
    assert client_key("unix:/tmp/x") == "unix:/tmp/x"
    with pytest.raises(ConfigError):
        StreamLimitInterceptor(0)


# ---------------------------------------------------------------------------------------------------------
# TLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl(
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
        "/CN=inkling-test-ca",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            cwd=d,
        )
    return d


def test_mutual_tls_and_token(pki):
    server_side = SecuritySettings(
        token=TOKEN, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_ca=str(pki / "ca.pem")
    )
    clients = {
        "mtls": SecuritySettings(
            token=TOKEN, tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"), tls_ca=str(pki / "ca.pem")
        ),
        "no-client-cert": SecuritySettings(token=TOKEN, tls_ca=str(pki / "ca.pem")),
        "plaintext": SecuritySettings(token=TOKEN),
        "mtls-no-token": SecuritySettings(
            tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"), tls_ca=str(pki / "ca.pem")
        ),
    }

    async def scenario(server):
        out = {}
        for name, security in clients.items():
            async with aio_channel(f"127.0.0.1:{server.port}", security) as channel:
                out[name] = await _code(_info(channel))
        address = f"127.0.0.1:{server.port}"  # the probe of containers and the launcher: TLS, no token
        out["probe-tls"] = await asyncio.to_thread(check, address, "", 5.0, clients["mtls-no-token"])
        out["probe-plain"] = await asyncio.to_thread(check, address, "", 5.0)
        return out

    codes = _run(server_side, scenario)
    assert codes == {
        "mtls": "OK",
        "no-client-cert": "UNAVAILABLE",
        "plaintext": "UNAVAILABLE",
        "mtls-no-token": "UNAUTHENTICATED",
        "probe-tls": "SERVING",
        "probe-plain": "UNREACHABLE",
    }


def test_security_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_security_args(parser)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    settings = security_settings(parser.parse_args(["--auth-token-file", str(token_file)]))
    assert settings.token == TOKEN and not settings.tls and TOKEN not in repr(settings)
    assert security_settings(parser.parse_args([])) == SecuritySettings()
    with pytest.raises(ConfigError, match="not both"):
        security_settings(parser.parse_args(["--auth-token-file", str(token_file), "--auth-token", "x"]))
    with pytest.raises(ConfigError, match="together"):
        security_settings(parser.parse_args(["--tls-cert", str(token_file)]))
    with pytest.raises(ConfigError, match="readable"):
        security_settings(parser.parse_args(["--tls-ca", str(tmp_path / "missing.pem")]))
    with pytest.raises(ConfigError, match="whitespace"):
        SecuritySettings(token="two words")


# ---------------------------------------------------------------------------------------------------------
# Redis with an ACL user (own redis-server on a free port; never the shared one)


@contextlib.contextmanager
def acl_redis(tmp_path: Path):
    from deploy.launch import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
            "--user",
            "default",
            "off",
            "--user",
            "inkling",
            "on",
            ">pw-ok",
            "~ink:*",
            "+@all",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, username="inkling", password="pw-ok").ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_acl_user_and_wrong_password_is_a_miss(tmp_path):
    entry = Entry("image", 2, 4, bytes(range(16)), (Span("image", 2),))
    with acl_redis(tmp_path) as port:
        good = RedisCache(f"redis://inkling:pw-ok@127.0.0.1:{port}/0", key_prefix="ink:test:", async_writes=False)
        bad = RedisCache(f"redis://inkling:wrong@127.0.0.1:{port}/0", key_prefix="ink:test:", async_writes=False)
        outside = RedisCache(f"redis://inkling:pw-ok@127.0.0.1:{port}/0", key_prefix="other:", async_writes=False)
        try:
            good.put(b"k" * 32, entry)
            assert good.get(b"k" * 32) == entry
            assert bad.get(b"k" * 32) is None and bad.stats.errors == 1  # refused: a miss, not a crash
            outside.put(b"k" * 32, entry)  # the ACL's key pattern forbids it: dropped, not raised
            assert outside.get(b"k" * 32) is None and outside.stats.errors >= 1
        finally:
            for cache in (good, bad, outside):
                cache.close()
    assert RedisSettings(url="rediss://inkling:pw@redis.internal:6380/0").url.startswith("rediss://")
    with pytest.raises(ConfigError):
        RedisSettings(url="http://redis.internal:6379")
