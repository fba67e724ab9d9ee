"""Redis faults (a private redis-server): stopped, restarted empty, corrupted values, full. Every phase must take
the cache-miss path and give exactly the outputs of the warm baseline; nothing hangs; the replica returns to
idle; the service stays SERVING throughout."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.cache_store import RedisCache
from common.settings import RedisSettings
from proto.inkling_epd.v1 import generator_pb2_grpc

log = logging.getLogger(__name__)
KINDS = ("image", "image+audio", "audio")
COUNT = 6


def test_redis_stopped_restarted_corrupted_and_full(
    e2e, tiny_checkpoint, fingerprints, loop_thread, private_redis, record_property
):
    prefix = f"ink:test:{uuid.uuid4().hex[:8]}:"
    decode_cache = RedisCache(
        private_redis.url, key_prefix=prefix, timeout_s=0.25, async_writes=False, retry_after_s=0.5
    )

    async def traffic(stub, tag: str):
        outcomes = await e2e.run_traffic(stub, count=COUNT, concurrency=3, deadline_s=10.0, prefix="redis", kinds=KINDS)
        log.info("redis phase %s: %s", tag, e2e.summarize(outcomes))
        return outcomes

    async def scenario():
        encoder = await e2e.start_encoder(
            tiny_checkpoint, redis=RedisSettings(url=private_redis.url, key_prefix=prefix, timeout_s=0.25)
        )
        decode = None
        phases: dict[str, list] = {}
        try:
            decode = await e2e.start_decode(tiny_checkpoint, fingerprints, [encoder.address], cache=decode_cache)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                phases["baseline"] = await traffic(stub, "baseline")
                await asyncio.to_thread(encoder.engine.cache.l2.flush)
                hits_before = decode_cache.stats.hits
                phases["warm"] = await traffic(stub, "warm")
                warm_hits = decode_cache.stats.hits - hits_before

                private_redis.kill()
                started = time.monotonic()
                phases["stopped"] = await traffic(stub, "stopped")
                stopped_s = time.monotonic() - started
                status_down = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

                private_redis.start()  # empty
                await asyncio.sleep(0.6)  # past the client's retry_after_s
                recovery = await e2e.recovery_time(stub, kind="image", prefix="redis-back")
                phases["restarted_empty"] = await traffic(stub, "restarted_empty")
                await asyncio.to_thread(encoder.engine.cache.l2.flush)

                client = private_redis.client()
                keys = client.keys(prefix + "*")
                for key in keys:  # flip the last payload byte: header intact, CRC-32 wrong
                    value = bytearray(client.get(key))
                    value[-1] ^= 0xFF
                    client.set(key, bytes(value))
                corrupt_before = decode_cache.stats.corrupt
                phases["corrupted"] = await traffic(stub, "corrupted")
                corrupt_seen = decode_cache.stats.corrupt - corrupt_before

                client.config_set("maxmemory-policy", "noeviction")
                client.config_set("maxmemory", "1")  # every write now fails with OOM
                client.delete(*client.keys(prefix + "*"))
                phases["full"] = await traffic(stub, "full")
                client.config_set("maxmemory", "0")
                idle = await e2e.wait_idle(decode)
                status_end = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            return (phases, warm_hits, stopped_s, status_down, recovery, len(keys), corrupt_seen, idle, status_end)
        finally:
            if decode is not None:
                await decode.stop(0.5)
            await encoder.stop(0.5)
            decode_cache.close()

    (phases, warm_hits, stopped_s, status_down, recovery, corrupted_keys, corrupt_seen, idle, status_end) = (
        loop_thread.run(scenario(), timeout_s=240)
    )
    for name, outcomes in phases.items():
        record_property(f"redis_{name}", {"sent": len(outcomes), **e2e.summarize(outcomes)})
    record_property("redis_recovery_s", round(recovery, 2))
    baseline = [o.tokens for o in phases["baseline"]]
    for name, outcomes in phases.items():
        assert [o.status for o in outcomes] == ["OK"] * COUNT, (name, e2e.summarize(outcomes))
        assert [o.tokens for o in outcomes] == baseline, name  # identical outputs on every path
    assert warm_hits == COUNT + COUNT // 3  # image+audio requests have two items
    assert stopped_s < 10.0  # a dead Redis costs at most its short timeout, not the deadline
    assert status_down == status_end == health_pb2.HealthCheckResponse.SERVING
    assert corrupted_keys > 0 and corrupt_seen > 0
    assert not any(idle.values()), idle
