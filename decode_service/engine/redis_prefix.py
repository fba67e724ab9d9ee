"""Shared prefix tier in Redis: KV blocks and conv snapshots computed by one decode replica, reused by another.

Keys are the GPU prefix cache's chained block hashes (token ids, `(mm_key, offset)` of media rows, model
fingerprint, cache salt), so equal keys mean equal history. A prefix boundary `b` (a multiple of the page size
P that is a tracked boundary of the replica that computed it) is stored as

    {prefix}{fp}:g:{hash of block i}       for every block i < b/P: K and V of the global layers in that block
    {prefix}{fp}:b{j}:{hash of block b/P-1}  part j of: K and V of the sliding layers in the blocks of b's window
                                           (the last W-1 positions, rounded out to blocks) + all conv states at b;
                                           parts of at most BOUNDARY_PART_BYTES (Inkling's window is ~220 MiB)

one Redis string each: a versioned header (magic, format, kind, dtype, fingerprint digest, page size, layer
geometry, position, window blocks, part, parts, CRC-32, payload length) followed by the raw little-endian
payload; no pickle. A boundary is usable only when all its parts and every `g` value before it are present and
verify, so a prefix is never used past the last boundary that has a conv snapshot.

Write-behind (`publish`, engine thread, after the step's blocks are in the GPU prefix cache): the global blocks a
prefill step completed inside the prompt and, when the step ended on a tracked boundary, that boundary's window
and conv states are copied to host memory and queued for a writer thread. The queue is bounded in entries and
bytes; a full queue drops the write, it never blocks decoding. Values above `max_value_bytes` are not stored.
SET with a TTL; Redis evicts with allkeys-lru.

Read path (`fetch`, at admission after the GPU prefix lookup): one STRLEN script over the candidate keys
gives the chain present in Redis; the cost model picks the boundary with the largest estimated saving (tokens /
measured prefill rate minus bytes / measured Redis throughput); one MGET fetches it; every value is verified,
then copied into newly allocated pages and the request's conv slot and recorded in the GPU prefix cache. Any
failure (Redis down, a value missing, corrupt or from another model) means recompute from the GPU hit; corrupt
values are deleted.

Not yet: the fetch is synchronous on the engine thread (bounded by the Redis timeout and a circuit breaker); on
a GPU the host copies are synchronous too.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis
import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.cache_store import connect_redis
from common.settings import RedisPrefixSettings, RedisSettings
from common.wire import checksum
from common.write_behind import WriteBehind
from decode_service.engine.kv_cache import NUM_CONVS, CacheHandle, ConvSnapshot, KVCache
from decode_service.engine.prefix_cache import PrefixCache
from decode_service.engine.prefix_format import (
    HEADER_BYTES,
    KIND_BOUNDARY,
    KIND_GLOBAL,
    CorruptValueError,
    Geometry,
    ValueId,
    decode_value,
    encode_value,
    part_sizes,
    to_bytes,
)
from decode_service.engine.request import Request

if TYPE_CHECKING:
    from decode_service.engine.runner import ModelRunner

log = logging.getLogger(__name__)

# STRLEN of many keys in one command (a pipeline of hundreds of STRLENs costs milliseconds of client time)
_STRLEN_MANY = "local n = {} for i, key in ipairs(KEYS) do n[i] = redis.call('STRLEN', key) end return n"


# ----------------------------------------------------------------------------------------------------------
# Redis I/O


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


# ----------------------------------------------------------------------------------------------------------
# Cost model


@dataclass
class CostModel:
    """Fetch vs recompute, from rates measured on this replica (0 = not measured: never fetch)."""

    redis_bytes_per_s: float = 0.0
    redis_latency_s: float = 0.0
    prefill_tokens_per_s: float = 0.0

    @property
    def ready(self) -> bool:
        return self.redis_bytes_per_s > 0 and self.prefill_tokens_per_s > 0

    def fetch_seconds(self, nbytes: int) -> float:
        return 2 * self.redis_latency_s + nbytes / self.redis_bytes_per_s  # STRLEN probe + MGET

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s


@torch.inference_mode()
def measure_prefill_rate(cache: KVCache, runner: ModelRunner, num_tokens: int, repeats: int = 2) -> float:
    """Tokens/s of one prefill chunk of `num_tokens` on this replica's model (a scratch sequence whose pages
    and conv slot are released afterwards); 0.0 when no conv slot or pages are free."""
    from decode_service.engine.scheduler import ScheduledSequence, SchedulerOutput

    times = []
    for _ in range(repeats + 1):  # the first run warms up
        handle = cache.new_handle() if cache.num_free_slots else None
        if handle is None or not cache.fits(handle.pages_needed(num_tokens)):
            if handle is not None:
                handle.release()
            return 0.0
        handle.grow(num_tokens)
        probe = Request("prefill-rate-probe", [0] * num_tokens)
        start = time.perf_counter()
        runner.execute(SchedulerOutput([ScheduledSequence(probe, handle, probe.prompt_token_ids, 0, False)]))
        if cache.k[False].is_cuda:
            torch.cuda.synchronize(cache.k[False].device)
        times.append(time.perf_counter() - start)
        handle.release()
    return num_tokens / min(times[1:])


# ----------------------------------------------------------------------------------------------------------
# The tier


@dataclass(frozen=True)
class _Plan:
    num_blocks: int  # the boundary to reach, in blocks
    keys: list[str]  # global blocks [start, num_blocks), then the boundary's parts
    ids: list[ValueId]
    sizes: list[int]  # payload bytes of each value
    saved_s: float


class RedisPrefixTier:
    """The engine side of the shared prefix tier; called by the scheduler on the engine thread."""

    def __init__(self, cache: KVCache, prefix_cache: PrefixCache, store: PrefixStore, cost: CostModel | None = None):
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.store = store
        self.stats = store.stats
        self.cost = cost or CostModel()
        self.geometry = Geometry.of(cache)
        self.page_size = cache.page_size
        self.elt = torch.empty((), dtype=cache.spec.dtype).element_size()
        self._fp_tag = hashlib.sha256(prefix_cache.fingerprint).hexdigest()[:16]

    # -- layout ----------------------------------------------------------------------------------------------

    def key(self, kind: int, block_hash: bytes, part: int = 0) -> str:
        tag = "g" if kind == KIND_GLOBAL else f"b{part}"
        return f"{self.store.settings.key_prefix}{self._fp_tag}:{tag}:{block_hash.hex()}"

    def window_first_block(self, boundary: int) -> int:
        if not self.cache.has_sliding:
            return boundary // self.page_size
        return max(0, boundary - (self.cache.window - 1)) // self.page_size

    def global_bytes(self) -> int:
        g = self.geometry
        return 2 * g.global_layers * self.page_size * g.global_kv_heads * g.global_head_dim * self.elt

    def boundary_bytes(self, boundary: int) -> int:
        g = self.geometry
        blocks = boundary // self.page_size - self.window_first_block(boundary)
        sliding = 2 * g.sliding_layers * blocks * self.page_size * g.sliding_kv_heads * g.sliding_head_dim
        conv = sum(s.shape[-2] * s.shape[-1] for states in self.cache.conv for s in states)
        return (sliding + conv) * self.elt

    def _boundary_values(self, block_hash: bytes, boundary: int) -> tuple[list[str], list[ValueId], list[int]]:
        blocks = boundary // self.page_size - self.window_first_block(boundary)
        sizes = part_sizes(self.boundary_bytes(boundary))
        keys = [self.key(KIND_BOUNDARY, block_hash, j) for j in range(len(sizes))]
        return keys, [ValueId(KIND_BOUNDARY, boundary, blocks, j, len(sizes)) for j in range(len(sizes))], sizes

    def _rows(self, pages: Sequence[int]) -> torch.Tensor:
        p = self.page_size
        return torch.cat([torch.arange(page * p, (page + 1) * p) for page in pages]).to(self.cache.spec.device)

    # -- calibration -----------------------------------------------------------------------------------------

    def calibrate(self, prefill_tokens_per_s: float) -> CostModel:
        """Measure Redis throughput now; the prefill rate comes from `measure_prefill_rate`."""
        self.cost.prefill_tokens_per_s = prefill_tokens_per_s
        self._measure_redis()
        log.info(
            "prefix tier cost model: redis %.1f MB/s + %.2f ms, prefill %.0f tokens/s",
            self.cost.redis_bytes_per_s / 1e6,
            self.cost.redis_latency_s * 1e3,
            prefill_tokens_per_s,
        )
        return self.cost

    def _measure_redis(self) -> None:
        measured = self.store.measure(f"{self.store.settings.key_prefix}probe:{uuid.uuid4().hex[:12]}")
        if measured is not None:
            self.cost.redis_bytes_per_s, self.cost.redis_latency_s = measured

    # -- write path ------------------------------------------------------------------------------------------

    def publish(self, request: Request, handle: CacheHandle, end: int) -> None:
        """After the step that brought `handle` to `end` (before `handle.commit`): queue the global blocks it
        completed inside the prompt's cacheable part and, on a tracked boundary, that boundary."""
        size = self.page_size
        limit = ((request.num_prompt_tokens - 1) // size) * size  # the last boundary a hit can use
        first, last = handle.num_tokens // size, min(end, limit) // size
        if last <= first:
            return
        hashes = self.prefix_cache.block_hashes(request, last)
        if self.cache.has_global:
            p = size
            for i in range(first, last):
                page = handle.tables[False][i]
                assert page is not None
                rows = slice(page * p, (page + 1) * p)
                self._queue(
                    [self.key(KIND_GLOBAL, hashes[i])],
                    [ValueId(KIND_GLOBAL, i)],
                    [self.global_bytes()],
                    lambda rows=rows: [self.cache.k[False][:, rows], self.cache.v[False][:, rows]],
                )
        if end <= limit and end % size == 0 and self.prefix_cache.is_tracked(request, end):
            pages = handle.tables[True][self.window_first_block(end) : last] if self.cache.has_sliding else []
            if None not in pages:
                self._queue(
                    *self._boundary_values(hashes[last - 1], end), lambda: self._boundary_tensors(pages, handle)
                )

    def _boundary_tensors(self, pages: Sequence[int], handle: CacheHandle) -> list[torch.Tensor]:
        out = []
        if pages:
            rows = self._rows(pages)
            out += [self.cache.k[True].index_select(1, rows), self.cache.v[True].index_select(1, rows)]
        return out + [s[handle.slot] for states in self.cache.conv for s in states]

    def _queue(
        self, keys: list[str], ids: list[ValueId], sizes: list[int], tensors: Callable[[], list[torch.Tensor]]
    ) -> None:
        if max(sizes) + HEADER_BYTES > self.store.settings.max_value_bytes:
            self.stats.oversize += 1
            return
        if not self.store.available:
            self.stats.dropped_writes += 1
            return
        host = [t.to("cpu", copy=True) for t in tensors()]  # the pages may be reused before the writer runs
        fingerprint, geometry = self.prefix_cache.fingerprint, self.geometry

        def encode() -> list[bytes]:
            payload, values, offset = memoryview(to_bytes(host)), [], 0
            for vid, n in zip(ids, sizes, strict=True):
                values.append(encode_value(vid, fingerprint, geometry, payload[offset : offset + n]))
                offset += n
            return values

        self.store.put(keys, encode, sum(sizes))

    # -- read path -------------------------------------------------------------------------------------------

    def fetch(self, request: Request, handle: CacheHandle, make_room: Callable[[tuple[int, int]], bool]) -> int:
        """Extend `handle` (at a GPU-hit boundary or empty) with the most worthwhile prefix in Redis; the number
        of tokens added (0 = recompute)."""
        size = self.page_size
        start = handle.num_tokens // size
        max_blocks = (request.num_tokens - 1) // size
        if max_blocks <= start or not self.store.available:
            return 0
        if not self.cost.ready:
            if not self.cost.redis_bytes_per_s:  # Redis was down at start-up
                self._measure_redis()
            if not self.cost.ready:
                return 0
        self.stats.queries += 1
        plan = self._plan(self.prefix_cache.block_hashes(request, max_blocks), start)
        if plan is None:
            return 0
        began = time.perf_counter()
        values = self.store.get_many(plan.keys)
        payloads = self._verify(plan, values) if values is not None else None
        if payloads is None:
            return 0
        boundary = plan.num_blocks * size
        lo = max(self.window_first_block(boundary), start)
        need = (
            plan.num_blocks - lo if self.cache.has_sliding else 0,
            plan.num_blocks - start if self.cache.has_global else 0,
        )
        if not make_room(need):
            return 0
        n_global = plan.num_blocks - start if self.cache.has_global else 0
        snapshot = self._install(handle, payloads[:n_global], b"".join(payloads[n_global:]), start, plan.num_blocks)
        self.prefix_cache.insert(request, handle, boundary, snapshot)
        handle.commit(boundary)
        elapsed = time.perf_counter() - began
        tokens = boundary - start * size
        self.stats.hits += 1
        self.stats.hit_tokens += tokens
        self.stats.bytes_fetched += sum(len(v) for v in values)
        self.stats.fetch_seconds += elapsed
        self.stats.saved_seconds_estimate += self.cost.recompute_seconds(tokens) - elapsed
        return tokens

    def _plan(self, hashes: list[bytes], start: int) -> _Plan | None:
        """The boundary with the largest estimated saving among those whose whole chain is in Redis (probing
        the first part of each boundary; the other parts are checked when fetched)."""
        has_global, candidates = self.cache.has_global, hashes[start:]
        g_keys = [self.key(KIND_GLOBAL, h) for h in candidates] if has_global else []
        sizes = self.store.sizes(g_keys + [self.key(KIND_BOUNDARY, h) for h in candidates])
        if sizes is None:
            return None
        g_present, b_present = sizes[: len(g_keys)], sizes[len(g_keys) :]
        best: _Plan | None = None
        for n, block_hash in enumerate(candidates):
            if has_global and not g_present[n]:
                break
            if not b_present[n]:
                continue
            boundary = (start + n + 1) * self.page_size
            keys, ids, part_bytes = self._boundary_values(block_hash, boundary)
            g_bytes = [self.global_bytes()] * (n + 1 if has_global else 0)
            nbytes = sum(g_bytes) + sum(part_bytes) + HEADER_BYTES * (len(g_bytes) + len(part_bytes))
            saved = self.cost.recompute_seconds((n + 1) * self.page_size) - self.cost.fetch_seconds(nbytes)
            if best is None or saved > best.saved_s:
                g_ids = [ValueId(KIND_GLOBAL, start + i) for i in range(len(g_bytes))]
                best = _Plan(start + n + 1, g_keys[: len(g_bytes)] + keys, g_ids + ids, g_bytes + part_bytes, saved)
        decision = "miss" if best is None else "fetch" if best.saved_s > 0 else "recompute"
        self.stats.decisions[decision] += 1
        return best if decision == "fetch" else None

    def _verify(self, plan: _Plan, values: list[bytes | None]) -> list[memoryview] | None:
        payloads = []
        fingerprint = self.prefix_cache.fingerprint
        for key, value, vid, nbytes in zip(plan.keys, values, plan.ids, plan.sizes, strict=True):
            if value is None:  # evicted since the probe, or a part that was never written
                return None
            try:
                payloads.append(decode_value(value, vid, fingerprint, self.geometry, nbytes))
            except CorruptValueError as exc:
                self.stats.corrupt += 1
                log.warning("corrupt prefix value %s (%s); deleting it", key, exc)
                self.store.delete(key)
                return None
        return payloads

    def _tensor(self, payload: bytes | memoryview, offset: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        n = self.elt * int(torch.Size(shape).numel())
        raw = torch.frombuffer(bytearray(payload[offset : offset + n]), dtype=torch.uint8)
        return raw.view(self.cache.spec.dtype).reshape(shape).to(self.cache.spec.device), offset + n

    def _install(
        self, handle: CacheHandle, blocks: list[memoryview], boundary: bytes, start: int, end: int
    ) -> ConvSnapshot:
        """Allocate pages for blocks [start, end) (sliding: only those in the window of the boundary), copy the
        verified payloads in and restore the conv states; returns the conv snapshot at the boundary."""
        cache, p, g = self.cache, self.page_size, self.geometry
        if cache.has_global:
            pages = cache.pools[False].allocate(end - start)
            handle.extend_table(False, pages)
            shape = (len(pages), 2, g.global_layers, p, g.global_kv_heads, g.global_head_dim)
            kv, _ = self._tensor(b"".join(blocks), 0, shape)  # [blocks, k/v, Lg, P, nKV, hd]
            kv = kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)  # [k/v, Lg, blocks * P, nKV, hd]
            rows = self._rows(pages)
            cache.k[False].index_copy_(1, rows, kv[0])
            cache.v[False].index_copy_(1, rows, kv[1])
        offset = 0
        if cache.has_sliding:
            first = self.window_first_block(end * p)
            lo = max(first, start)
            shape = (g.sliding_layers, (end - first) * p, g.sliding_kv_heads, g.sliding_head_dim)
            k, offset = self._tensor(boundary, 0, shape)
            v, offset = self._tensor(boundary, offset, shape)
            pages = cache.pools[True].allocate(end - lo)
            handle.extend_table(True, [None] * (lo - start) + pages)
            rows = self._rows(pages)
            cache.k[True].index_copy_(1, rows, k[:, (lo - first) * p :])
            cache.v[True].index_copy_(1, rows, v[:, (lo - first) * p :])
        states = []
        for layer_states in cache.conv:
            layer = []
            for s in layer_states:
                state, offset = self._tensor(boundary, offset, tuple(s.shape[1:]))
                layer.append(state)
            states.append(tuple(layer))
        assert offset == len(boundary) and all(len(s) == NUM_CONVS for s in states)
        snapshot = ConvSnapshot(tuple(states))
        handle.restore_conv(snapshot)
        return snapshot


# ----------------------------------------------------------------------------------------------------------
# Metrics


class PrefixCacheCollector:
    """Prometheus collector over both prefix tiers (register it on the service's registry); reads the stats
    counters at scrape time, so the engine thread never touches Prometheus."""

    def __init__(self, gpu: PrefixCache | None, redis_tier: RedisPrefixTier | None) -> None:
        self.gpu = gpu
        self.redis_tier = redis_tier

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        queries = CounterMetricFamily("inkling_prefix_cache_queries", "Prefix cache lookups", labels=["tier"])
        hits = CounterMetricFamily("inkling_prefix_cache_hits", "Prefix cache hits", labels=["tier"])
        tokens = CounterMetricFamily("inkling_prefix_cache_hit_tokens", "Prompt tokens served", labels=["tier"])
        if self.gpu is not None:
            queries.add_metric(["gpu"], self.gpu.stats.queries)
            hits.add_metric(["gpu"], self.gpu.stats.hits)
            tokens.add_metric(["gpu"], self.gpu.stats.hit_tokens)
            truncated = CounterMetricFamily(
                "inkling_prefix_hit_truncated", "Hits cut back to a conv snapshot", labels=["reason"]
            )
            truncated.add_metric(["no_conv_snapshot"], self.gpu.stats.truncated_no_snapshot)
            yield truncated
        if self.redis_tier is not None:
            s = self.redis_tier.stats
            queries.add_metric(["redis"], s.queries)
            hits.add_metric(["redis"], s.hits)
            tokens.add_metric(["redis"], s.hit_tokens)
            decisions = CounterMetricFamily(
                "inkling_prefix_redis_decisions", "Fetch vs recompute decisions", labels=["decision"]
            )
            for name, count in s.decisions.items():
                decisions.add_metric([name], count)
            yield decisions
            for name, value, doc in (
                ("bytes_fetched", s.bytes_fetched, "Bytes fetched from the Redis prefix tier"),
                ("saved_seconds_estimate", s.saved_seconds_estimate, "Estimated prefill time saved by fetching"),
                ("corrupt", s.corrupt, "Values that failed verification (deleted)"),
                ("errors", s.errors, "Redis errors (treated as misses)"),
                ("published_bytes", s.published_bytes, "Bytes written to the Redis prefix tier"),
                ("dropped_writes", s.dropped_writes, "Writes dropped under pressure or while Redis was down"),
                ("oversize", s.oversize, "Values not stored because they exceed max_value_bytes"),
            ):
                yield CounterMetricFamily(f"inkling_prefix_redis_{name}", doc, value=value)
            yield GaugeMetricFamily(
                "inkling_prefix_redis_throughput_bytes_per_second",
                "Measured Redis fetch throughput",
                value=self.redis_tier.cost.redis_bytes_per_s,
            )
        yield queries
        yield hits
        yield tokens
