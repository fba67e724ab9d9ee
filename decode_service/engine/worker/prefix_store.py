"""Redis access for the shared prefix tier: size probes, MGET, deletes, a write-behind thread, a throughput probe.

What the values hold and how keys are named: `redis_tier.py`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis

from common.cache_store import connect_redis
from common.settings import RedisPrefixSettings, RedisSettings
from common.wire import checksum
from common.write_behind import WriteBehind

log = logging.getLogger(__name__)

# STRLEN of many keys in one command (a pipeline of hundreds of STRLENs costs milliseconds of client time)
_STRLEN_MANY = "local n = {} for i, key in ipairs(KEYS) do n[i] = redis.call('STRLEN', key) end return n"


@dataclass
class PrefixTierStats:
    queries: int = 0  # admissions that asked Redis for a further chain
    hits: int = 0
    hit_tokens: int = 0
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    saved_seconds_estimate: float = 0.0  # estimated recompute time of the fetched tokens minus the fetch time
    decisions: dict[str, int] = field(default_factory=lambda: {"fetch": 0, "recompute": 0, "miss": 0})
    corrupt: int = 0
    errors: int = 0
    published_values: int = 0
    published_bytes: int = 0
    dropped_writes: int = 0
    oversize: int = 0


class PrefixStore:
    """Redis access for the prefix tier: size probes, MGET, deletes, and a write-behind thread.
    Never raises on Redis failure: errors are counted and the store is skipped for `retry_after_s`. Pass the
    service's shared `redis.Redis` client (the one the embedding cache uses) or build one with `connect`."""

    def __init__(self, client: redis.Redis, settings: RedisPrefixSettings | None = None) -> None:
        self.client = client
        self._strlen = client.register_script(_STRLEN_MANY)
        self.settings = settings or RedisPrefixSettings()
        self.stats = PrefixTierStats()
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._writer: WriteBehind[tuple[list[str], Callable[[], list[bytes]]]] = WriteBehind(
            "redis-prefix-writer", self._write, self.settings.write_queue, self.settings.max_pending_bytes
        )

    @classmethod
    def connect(cls, redis_settings: RedisSettings, settings: RedisPrefixSettings | None = None) -> PrefixStore:
        return cls(connect_redis(redis_settings.url, redis_settings.timeout_s), settings)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, op: str, exc: Exception) -> None:
        with self._lock:
            first = self.available
            self._down_until = time.monotonic() + self.settings.retry_after_s
            self.stats.errors += 1
        if first:
            log.warning(
                "redis prefix %s failed (%s: %s); skipping the tier for %.1fs",
                op,
                type(exc).__name__,
                exc,
                self.settings.retry_after_s,
            )

    def sizes(self, keys: Sequence[str]) -> list[int] | None:
        """Byte length of each key's value (0 = absent) in one command; None when Redis failed."""
        try:
            return [int(n) for n in self._strlen(keys=list(keys))]
        except redis.RedisError as exc:
            self.failed("probe", exc)
            return None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None] | None:
        try:
            return self.client.mget(keys)
        except redis.RedisError as exc:
            self.failed("get", exc)
            return None

    def delete(self, key: str) -> None:
        try:
            self.client.delete(key)
        except redis.RedisError as exc:
            self.failed("delete", exc)

    def put(self, keys: list[str], encode: Callable[[], list[bytes]], nbytes: int) -> bool:
        """Queue a write of one value per key (`encode` runs on the writer thread); False when dropped."""
        if self.available and self._writer.submit((keys, encode), nbytes):
            return True
        with self._lock:
            self.stats.dropped_writes += 1
        return False

    def _write(self, job: tuple[list[str], Callable[[], list[bytes]]]) -> None:
        keys, encode = job
        if not self.available:
            with self._lock:
                self.stats.dropped_writes += 1
            return
        try:
            values = encode()
            pipe = self.client.pipeline(transaction=False)
            for key, value in zip(keys, values, strict=True):
                pipe.set(key, value, ex=self.settings.ttl_s)
            pipe.execute()
        except redis.RedisError as exc:
            self.failed("put", exc)
            return
        with self._lock:
            self.stats.published_values += len(values)
            self.stats.published_bytes += sum(len(v) for v in values)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for queued writes (tests, benchmarks, shutdown); False on timeout."""
        return self._writer.flush(timeout_s)

    def close(self) -> None:
        """Finish queued writes and stop the writer; the client stays open (it may be shared)."""
        self._writer.close()

    def measure(self, probe_key: str) -> tuple[float, float] | None:
        """(bytes/s of GET + checksum on a `probe_bytes` value, round-trip latency in s); None if Redis failed."""
        probe = bytes(range(256)) * (self.settings.probe_bytes // 256)
        try:
            self.client.set(probe_key, probe, ex=60)
            self.client.set(probe_key + ":small", b"x", ex=60)
            latency = bandwidth = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                self.client.get(probe_key + ":small")
                latency = min(latency, time.perf_counter() - start)
                start = time.perf_counter()
                checksum(self.client.get(probe_key))
                bandwidth = min(bandwidth, time.perf_counter() - start)
            self.client.delete(probe_key, probe_key + ":small")
        except redis.RedisError as exc:
            self.failed("measure", exc)
            return None
        return len(probe) / max(bandwidth - latency, 1e-9), latency
