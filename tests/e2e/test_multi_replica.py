"""The cluster as `inkling-epd up` runs it, scaled out: Redis + 2 encoders + 2 decode replicas + the router, all
real processes (`deploy.launch.Cluster`) on the tiny checkpoint, driven over gRPC on 127.0.0.1.

1. Mixed requests all succeed and both decode replicas serve some of them.
2. The same multimodal prompt sent twice lands on the same decode replica (the router's prefix directory) and the
   repeat reports prefix-cache hits (`usage.cached_tokens > 0`).
3. One encoder and one decode replica are SIGKILLed while a stream of requests runs: every request that had not
   started streaming when they died still succeeds (router retry / encoder retry); requests that had started may
   end with UNAVAILABLE; none hangs.

The serving replica is read from the router's `inkling-replica` initial metadata. Embedding-cache keys get a
private prefix (INKLING_REDIS_KEY_PREFIX) and every key the test caused is deleted afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis

from decode_service.router import REPLICA_METADATA_KEY, prefix_directory_key, request_prefix_hashes
from deploy.launch import Cluster, ClusterSpec
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc, media_pb2
from tools.make_sample_media import draw_shapes, png_bytes, sample_media

log = logging.getLogger(__name__)

REDIS_URL = "redis://127.0.0.1:6379/0"
DEADLINE_S = 30.0  # per Generate call; a call still open 5 s after it counts as hung
WAV = sample_media()["tones_16k.wav"]


@dataclass
class Outcome:
    request_id: str
    status: str = "OK"  # "OK", a status code name, or "HUNG"
    replica: str = ""  # from the router's initial metadata
    messages: int = 0  # messages received before the end (0: it never started streaming)
    sent_at: float = 0.0  # monotonic time of the call
    started_at: float | None = None  # monotonic time of the first message
    cached_tokens: int = 0
    details: str = ""


def image(variant: str) -> bytes:
    picture = draw_shapes(64, 48)
    for k, byte in enumerate(variant.encode()[:16]):  # the variant in the top row: a distinct mm_key
        picture.putpixel((k, 0), (byte, 255 - byte, 0))
    return png_bytes(picture)


def chat(request_id: str, variant: str, audio: bool = False, max_tokens: int = 4) -> pb.GenerateRequest:
    parts = [pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=image(variant)))]
    if audio:
        parts.append(pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=WAV)))
    parts.append(pb.ContentPart(text=f"Describe picture {variant}."))
    return pb.GenerateRequest(
        request_id=request_id,
        chat=pb.ChatPrompt(messages=[pb.Message(role=pb.ROLE_USER, content=parts)], reasoning_effort=0.0),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def generate(
    stub: generator_pb2_grpc.GeneratorStub,
    request: pb.GenerateRequest,
    on_first: Callable[[Outcome], None] | None = None,
) -> Outcome:
    outcome = Outcome(request.request_id, sent_at=time.monotonic())

    async def consume() -> None:
        call = stub.Generate(request, timeout=DEADLINE_S)
        try:
            async for message in call:
                if not outcome.messages:
                    outcome.started_at = time.monotonic()
                    outcome.replica = dict(await call.initial_metadata()).get(REPLICA_METADATA_KEY, "")
                    if on_first is not None:
                        on_first(outcome)
                outcome.messages += 1
                if message.HasField("final"):
                    outcome.cached_tokens = message.final.usage.cached_tokens
        finally:
            call.cancel()

    try:
        await asyncio.wait_for(consume(), DEADLINE_S + 5.0)
    except grpc.aio.AioRpcError as exc:
        outcome.status, outcome.details = exc.code().name, exc.details() or ""
    except TimeoutError:
        outcome.status = "HUNG"
    return outcome


@pytest.fixture(scope="module")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2.0)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    yield client
    client.close()


class Harness:
    """The running cluster and every request sent through it (to delete their prefix-directory keys)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.sent: list[pb.GenerateRequest] = []


@pytest.fixture(scope="module")
def harness(tiny_checkpoint, redis_client, tmp_path_factory) -> Iterator[Harness]:
    key_prefix = f"ink:test-multi-replica:{uuid.uuid4().hex[:12]}:"
    spec = ClusterSpec(
        checkpoint=tiny_checkpoint,
        encoders=2,
        decoders=2,
        redis=REDIS_URL,
        dtype="float32",
        log_dir=str(tmp_path_factory.mktemp("multi-replica-logs")),
        startup_timeout_s=120.0,
        stop_timeout_s=10.0,
        grace_seconds=1.0,
        extra_args={"decode": ["--kv-budget-mb", "32", "--max-num-seqs", "8"]},
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INKLING_REDIS_KEY_PREFIX", key_prefix)
        harness = Harness(Cluster(spec))
        try:
            harness.cluster.start()  # the children inherit the key prefix
            yield harness
        finally:
            harness.cluster.stop()
            keys = list(redis_client.scan_iter(match=f"{key_prefix}*", count=1000))
            keys += [prefix_directory_key(h) for r in harness.sent for h in request_prefix_hashes(r)]
            if keys:
                redis_client.delete(*keys)


async def _send(
    harness: Harness,
    requests: list[pb.GenerateRequest],
    concurrency: int,
    on_first: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    harness.sent.extend(requests)
    slots = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(harness.cluster.router_address) as channel:
        stub = generator_pb2_grpc.GeneratorStub(channel)

        async def one(request: pb.GenerateRequest) -> Outcome:
            async with slots:
                return await generate(stub, request, on_first)

        return list(await asyncio.gather(*(one(r) for r in requests)))


def send(
    harness: Harness,
    requests: list[pb.GenerateRequest],
    concurrency: int = 1,
    on_first: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    return asyncio.run(_send(harness, requests, concurrency, on_first))


def wait_published(client: redis.Redis, request: pb.GenerateRequest, replica: str, timeout_s: float = 10.0) -> None:
    """Until the replica has published the request's prompt to the prefix directory (done after its Final)."""
    key = prefix_directory_key(request_prefix_hashes(request)[-1])
    deadline = time.monotonic() + timeout_s
    while not client.hexists(key, replica):
        assert time.monotonic() < deadline, f"{replica} did not publish {key} within {timeout_s} s"
        time.sleep(0.05)


def test_requests_spread_over_replicas_and_a_repeated_prompt_hits_its_prefix_cache(harness, redis_client):
    cluster = harness.cluster
    tag = uuid.uuid4().hex[:8]
    mixed = [chat(f"mix-{tag}-{i}", f"{tag}-{i}", audio=i % 2 == 1) for i in range(6)]
    outcomes = send(harness, mixed, concurrency=3)
    assert [o.status for o in outcomes] == ["OK"] * len(mixed), outcomes
    assert {o.replica for o in outcomes} == set(cluster.decoder_addresses), outcomes

    first = send(harness, [chat(f"affinity-{tag}-a", f"{tag}-affinity", audio=True)])[0]
    assert first.status == "OK" and first.replica in cluster.decoder_addresses, first
    repeat_request = chat(f"affinity-{tag}-b", f"{tag}-affinity", audio=True)  # same prompt, new request id
    wait_published(redis_client, repeat_request, first.replica)
    # Without the directory the router would alternate: the other replica is the least-loaded tie-break.
    for attempt in range(2):
        repeat = send(harness, [chat(f"affinity-{tag}-b{attempt}", f"{tag}-affinity", audio=True)])[0]
        assert repeat.status == "OK" and repeat.replica == first.replica, (first, repeat)
        assert repeat.cached_tokens > 0, repeat
    assert not cluster.dead(), [p.name for p in cluster.dead()]


def test_killing_an_encoder_and_a_decode_replica_loses_no_request_that_had_not_started(harness):
    cluster = harness.cluster
    tag = uuid.uuid4().hex[:8]
    requests = [chat(f"kill-{tag}-{i}", f"{tag}-{i}", audio=i % 3 == 0, max_tokens=8) for i in range(16)]
    killed: dict[str, float] = {}
    victim_address: list[str] = []

    def kill_on_third_start(outcome: Outcome) -> None:
        """SIGKILL encoder-0 and the decode replica that just started streaming, mid-stream."""
        nonlocal started
        started += 1
        if started != 3:
            return
        victim = next(p for p in cluster.decoders if p.address == outcome.replica)
        victim_address.append(victim.address)
        for process in (cluster.encoders[0], victim):
            process.popen.kill()
            killed[process.name] = time.monotonic()

    started = 0
    outcomes = send(harness, requests, concurrency=6, on_first=kill_on_third_start)
    assert len(killed) == 2, "the kill never happened"
    kill_time = max(killed.values())
    for o in outcomes:
        log.info(
            "%s %s on %s, %d messages, started %+.2f s after the kill %s",
            o.request_id,
            o.status,
            o.replica,
            o.messages,
            (o.started_at or float("nan")) - kill_time,
            o.details,
        )
    by_status = {o.request_id: o.status for o in outcomes}
    assert "HUNG" not in by_status.values(), outcomes
    for o in outcomes:
        # Messages the victim sent just before SIGKILL can reach the client after `kill_time`: a stream that began
        # on the victim counts as started before the kill whenever its first message arrived.
        started_before_kill = o.started_at is not None and (o.started_at <= kill_time or o.replica in victim_address)
        if not started_before_kill:  # never started, or started on a surviving replica after the kill
            assert o.status == "OK", o
        else:
            assert o.status in ("OK", "UNAVAILABLE"), o
    survivors = [
        o for o in outcomes if o.started_at is not None and o.started_at > kill_time and o.replica not in victim_address
    ]
    caught = [o for o in survivors if o.sent_at < kill_time]  # in flight, not yet streaming, at the kill
    assert caught and all(o.status == "OK" for o in caught), outcomes
    assert len(survivors) >= 8 and all(o.status == "OK" for o in survivors), outcomes
    living = {p.address for p in cluster.decoders if not p.exited()}
    assert len(living) == 1 and {o.replica for o in survivors} == living, (living, outcomes)
    for process in cluster.processes():
        assert process.exited() == (process.name in killed), process.name
