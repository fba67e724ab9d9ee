"""EncoderClient against in-process fake Encoder servers: cache first, rendezvous + load cap, retry on the next
replica, checksum verification, circuit breaker, health Watch, item errors, local fallback."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.cache_store import Entry, LruCache
from common.errors import InvalidInputError, UnavailableError
from common.hashing import mm_key
from common.media import MediaInput
from common.targets import parse_targets, rendezvous_order
from common.wire import KIND_DMEL_CODES, KIND_EMBEDDINGS, EncodedItem, Span, item_messages
from decode_service.encoder_client import ClientSettings, EncoderClient
from proto.inkling_epd.v1 import encoder_pb2, encoder_pb2_grpc

pytestmark = pytest.mark.anyio

FINGERPRINT = hashlib.sha256(b"fake encoder").digest()
DIM = 4
PREPROCESS = {"version": "test"}


@pytest.fixture
def anyio_backend():
    return "asyncio"


def rows_for(data: bytes) -> tuple[int, bytes]:
    rows = 1 + len(data) % 3
    return rows, (hashlib.sha256(data).digest() * 4)[: rows * DIM * 2]


class FakeEncoder(encoder_pb2_grpc.EncoderServicer):
    """mode: ok | unavailable | garble | invalid (an ItemError for data b"bad")."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls = 0
        self.items = 0

    async def Encode(self, request, context):
        self.calls += 1
        self.items += len(request.items)
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        for i, media in enumerate(request.items):
            if media.data == b"bad":
                yield encoder_pb2.EncodeChunk(
                    error=encoder_pb2.ItemError(
                        item_index=i, code="INVALID_ARGUMENT", message=f"item {i} (image): cannot decode"
                    )
                )
                continue
            rows, payload = rows_for(media.data)
            key = mm_key("image", media.data, PREPROCESS, FINGERPRINT)
            messages = list(item_messages(EncodedItem(i, key, "image", rows, DIM, payload, (Span("image", rows),))))
            if self.mode == "garble":
                messages[1].data.payload = bytes(b ^ 0xFF for b in messages[1].data.payload)
            for message in messages:
                yield message

    async def GetInfo(self, request, context):
        return encoder_pb2.EncoderInfo(encoder_fingerprint=FINGERPRINT, dim=DIM, dtype="bfloat16")


@pytest.fixture
async def pool():
    servers, fakes, healths = [], [], []
    for _ in range(2):
        server = grpc.aio.server()
        fake = FakeEncoder()
        encoder_pb2_grpc.add_EncoderServicer_to_server(fake, server)
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servers.append((server, port))
        fakes.append(fake)
        healths.append(servicer)
    addresses = [f"127.0.0.1:{port}" for _, port in servers]
    yield addresses, dict(zip(addresses, fakes, strict=True)), dict(zip(addresses, healths, strict=True))
    for server, _ in servers:
        await server.stop(0)


class Counting:
    def __init__(self) -> None:
        self.retries = self.hits = self.lookups = self.fallbacks = 0

    def cache_lookup(self, hit: bool) -> None:
        self.lookups += 1
        self.hits += hit

    def rpc(self, address: str, seconds: float, code: str) -> None:
        pass

    def retry(self) -> None:
        self.retries += 1

    def local_fallback(self) -> None:
        self.fallbacks += 1


async def started(addresses, **kw) -> EncoderClient:
    settings = kw.pop("settings", ClientSettings(ready_wait_s=5.0, breaker_open_s=60.0))
    client = EncoderClient(addresses, lambda media, item: PREPROCESS, settings=settings, **kw)
    await client.start()
    for _ in range(250):
        if len(client.healthy()) == len(addresses):
            return client
        await asyncio.sleep(0.02)
    raise AssertionError("the replicas never became healthy")


def images(*payloads: bytes) -> list[MediaInput]:
    return [MediaInput("image", p) for p in payloads]


def key_of(data: bytes) -> bytes:
    return mm_key("image", data, PREPROCESS, FINGERPRINT)


async def test_items_come_back_in_order_spread_over_replicas(pool):
    addresses, fakes, _ = pool
    client = await started(addresses)
    try:
        data = [f"image-{i}".encode() for i in range(12)]
        out = await client.encode(images(*data), "r1", timeout_s=10)
        assert [o.item_index for o in out] == list(range(12))
        for item, d in zip(out, data, strict=True):
            rows, payload = rows_for(d)
            assert (item.rows, item.payload, item.mm_key, item.cache_hit) == (rows, payload, key_of(d), False)
        assert all(f.items > 0 for f in fakes.values())  # rendezvous + the load cap use both replicas
        assert client.inflight_items == 0
    finally:
        await client.close()


async def test_dns_target_resolves_to_the_replicas(pool):
    addresses, fakes, _ = pool
    port = addresses[0].rsplit(":", 1)[1]
    assert parse_targets(f"dns:///localhost:{port}, {addresses[1]}", "--encoders") == (
        f"dns:///localhost:{port}",
        addresses[1],
    )
    client = await started([f"dns:///127.0.0.1:{port}"])
    try:
        assert [r.address for r in client.healthy()] == [addresses[0]]
        await client.encode(images(b"via-dns"), "r7", timeout_s=10)
        assert fakes[addresses[0]].calls == 1
    finally:
        await client.close()


async def test_cache_hit_skips_the_encoders(pool):
    addresses, fakes, _ = pool
    cache = LruCache(1 << 20)
    rows, payload = rows_for(b"cached")
    cache.put(key_of(b"cached"), Entry("image", rows, DIM, payload, (Span("image", rows),)))
    observer = Counting()
    client = await started(addresses, cache=cache, observer=observer)
    try:
        out = await client.encode(images(b"cached", b"fresh"), "r2", timeout_s=10)
        assert out[0].cache_hit and out[0].payload == payload and not out[1].cache_hit
        assert sum(f.items for f in fakes.values()) == 1
        assert (observer.lookups, observer.hits) == (2, 1)
    finally:
        await client.close()


async def test_cached_audio_codes_come_back_as_codes_beside_encoded_images(pool):
    """Audio is cached as dMel codes; a hit keeps the payload kind, codes per row and tower dtype."""
    addresses, fakes, _ = pool
    cache = LruCache(1 << 20)
    codes = bytes(i % 16 for i in range(30 * 80))
    entry = Entry("audio", 30, DIM, codes, (Span("audio", 30),), "uint8", KIND_DMEL_CODES, 80, "bfloat16")
    cache.put(mm_key("audio", b"clip", PREPROCESS, FINGERPRINT), entry)
    client = await started(addresses, cache=cache)
    try:
        out = await client.encode([MediaInput("image", b"fresh"), MediaInput("audio", b"clip")], "r2a", timeout_s=10)
        assert [i.kind for i in out] == [KIND_EMBEDDINGS, KIND_DMEL_CODES]
        audio = out[1]
        assert audio.cache_hit and audio.item_index == 1 and audio.payload == codes
        assert (audio.rows, audio.dim, audio.codes_per_row, audio.tower_dtype) == (30, DIM, 80, "bfloat16")
        assert sum(f.items for f in fakes.values()) == 1
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["unavailable", "garble"])
async def test_failed_call_is_retried_on_the_next_replica_then_the_breaker_opens(pool, mode):
    addresses, fakes, _ = pool
    first = rendezvous_order(key_of(b"x"), addresses)[0]
    fakes[first].mode = mode
    observer = Counting()
    client = await started(addresses, observer=observer)
    try:
        for attempt in range(5):
            out = await client.encode(images(b"x"), f"r{attempt}", timeout_s=10)
            assert out[0].payload == rows_for(b"x")[1]
        # Three failures open the breaker: later requests go straight to the healthy replica.
        assert fakes[first].calls == 3 and observer.retries == 3
        assert fakes[next(a for a in addresses if a != first)].calls == 5
    finally:
        await client.close()


async def test_item_error_is_invalid_input_naming_the_request_item(pool):
    addresses, _, _ = pool
    client = await started(addresses)
    try:
        with pytest.raises(InvalidInputError) as err:
            await client.encode(images(b"fine", b"bad"), "r3", timeout_s=10)
        assert str(err.value) == "media[1] (image): cannot decode"  # the encoder's "item 0 (image): " replaced
    finally:
        await client.close()


async def test_not_serving_replicas_are_skipped_and_none_left_is_unavailable(pool):
    addresses, fakes, healths = pool
    client = await started(addresses, settings=ClientSettings(ready_wait_s=0.3))
    try:
        await healths[addresses[0]].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        for _ in range(100):
            if len(client.healthy()) == 1:
                break
            await asyncio.sleep(0.02)
        assert [r.address for r in client.healthy()] == [addresses[1]]
        await client.encode(images(*(f"i{i}".encode() for i in range(6))), "r4", timeout_s=10)
        assert fakes[addresses[0]].calls == 0
        await healths[addresses[1]].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        for _ in range(100):
            if not client.healthy():
                break
            await asyncio.sleep(0.02)
        with pytest.raises(UnavailableError):
            await client.encode(images(b"y"), "r5", timeout_s=10)
    finally:
        await client.close()


async def test_cached_media_is_served_with_every_encoder_down_and_misses_fail_fast(pool):
    addresses, fakes, healths = pool
    cache = LruCache(1 << 20)
    rows, payload = rows_for(b"cached")
    cache.put(key_of(b"cached"), Entry("image", rows, DIM, payload, (Span("image", rows),)))
    client = await started(addresses, cache=cache, settings=ClientSettings(ready_wait_s=5.0))
    try:
        for address in addresses:
            await healths[address].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        for _ in range(100):
            if not client.healthy():
                break
            await asyncio.sleep(0.02)
        assert not client.healthy()
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        out = await client.encode(images(b"cached"), "r7", timeout_s=10)
        assert out[0].cache_hit and out[0].payload == payload
        with pytest.raises(UnavailableError, match="no healthy encoder replica"):
            await client.encode(images(b"cached", b"uncached"), "r8", timeout_s=10)
        assert loop.time() - started_at < 1.0  # no wait for a replica that the pool already saw go down
        assert sum(f.calls for f in fakes.values()) == 0
    finally:
        await client.close()


async def test_a_replica_back_before_its_health_watch_reconnects_serves_at_once(pool):
    """The watches reconnect with backoff: a replica SERVING again is found by one direct check, not failed fast."""
    addresses, fakes, healths = pool
    client = await started(addresses, settings=ClientSettings(ready_wait_s=5.0))
    try:
        for replica in client.replicas.values():  # what the client believes while its watches are backing off
            client._set_serving(replica, False)
        assert not client.healthy()
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        out = await client.encode(images(b"back"), "r9", timeout_s=10)
        assert len(out) == 1 and sum(f.calls for f in fakes.values()) == 1
        assert loop.time() - started_at < 1.0 and client.healthy()
        for address in addresses:  # really down: the check answers NOT_SERVING and the miss still fails fast
            await healths[address].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        for replica in client.replicas.values():
            client._set_serving(replica, False)
        with pytest.raises(UnavailableError, match="no healthy encoder replica"):
            await client.encode(images(b"gone"), "r10", timeout_s=10)
    finally:
        await client.close()


async def test_local_fallback_when_no_encoder_is_reachable():
    class Local:
        def __init__(self) -> None:
            self.calls = 0

        async def encode(self, items, request_id, timeout_s=None):
            self.calls += 1
            return [
                EncodedItem(i, b"k" * 32, "image", 1, DIM, bytes(DIM * 2), (Span("image", 1),))
                for i, _ in enumerate(items)
            ]

    local, observer = Local(), Counting()
    client = EncoderClient(
        ["127.0.0.1:1"],
        lambda media, item: PREPROCESS,
        local=local,
        local_fingerprint=FINGERPRINT,
        settings=ClientSettings(ready_wait_s=0.1),
        observer=observer,
    )
    await client.start()
    try:
        out = await client.encode(images(b"z"), "r6", timeout_s=5)
        assert local.calls == 1 and observer.fallbacks == 1 and out[0].rows == 1
    finally:
        await client.close()
