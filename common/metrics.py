"""Prometheus helpers: one registry per service, an HTTP exporter, and the metric sets shared by services.

Each server builds its own `CollectorRegistry` (so tests can run several servers in one process) and passes
it to the metric classes below; `start_metrics_server` exposes it on `/metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class MetricsServer:
    """A running exporter; `port` is the bound port (useful when started on port 0)."""

    server: WSGIServer
    port: int

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str) -> MetricsServer:
    """Serve `registry` on http://addr:port/metrics in a daemon thread (port 0 picks a free port). `addr` is the
    server's --host: no default, so an exporter never binds wider than its gRPC port."""
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, server.server_port)


class PrometheusCacheObserver:
    """`common.cache_store.CacheObserver` backed by Prometheus metrics with a service prefix."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "inkling_encoder") -> None:
        self.queries = Counter(f"{prefix}_cache_queries", "Embedding cache lookups", ["tier"], registry=registry)
        self.hits = Counter(f"{prefix}_cache_hits", "Embedding cache hits", ["tier", "modality"], registry=registry)
        self.errors = Counter(
            f"{prefix}_cache_errors", "Cache backend errors (counted as misses)", ["tier", "op"], registry=registry
        )
        self.corrupted = Counter(
            f"{prefix}_cache_corrupt", "Cached values that failed verification", ["tier"], registry=registry
        )
        self.evictions = Counter(f"{prefix}_cache_evictions", "Entries evicted", ["tier"], registry=registry)
        self.bytes = Gauge(f"{prefix}_cache_bytes", "Payload bytes held", ["tier"], registry=registry)
        self.entries = Gauge(f"{prefix}_cache_entries", "Entries held", ["tier"], registry=registry)

    def lookup(self, tier: str, modality: str | None, hit: bool) -> None:
        self.queries.labels(tier).inc()
        if hit:
            self.hits.labels(tier, modality or "unknown").inc()

    def error(self, tier: str, op: str) -> None:
        self.errors.labels(tier, op).inc()

    def corrupt(self, tier: str) -> None:
        self.corrupted.labels(tier).inc()

    def evicted(self, tier: str, count: int) -> None:
        self.evictions.labels(tier).inc(count)

    def size(self, tier: str, nbytes: int, entries: int) -> None:
        self.bytes.labels(tier).set(nbytes)
        self.entries.labels(tier).set(entries)


class EncoderMetrics:
    """Metrics of the encoder engine (names follow serving spec 3.7)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("inkling_encoder_requests", "Encode calls by outcome", ["status"], registry=registry)
        self.items = Counter(
            "inkling_encoder_items", "Media items by modality and outcome", ["modality", "status"], registry=registry
        )
        self.queue_wait = Histogram(
            "inkling_encoder_queue_wait_seconds", "Wait for a tower batch", buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.preprocess = Histogram(
            "inkling_encoder_preprocess_seconds",
            "CPU preprocessing per item",
            ["modality"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.forward = Histogram(
            "inkling_encoder_forward_seconds",
            "Tower forward per batch",
            ["tower"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.items_per_batch = Histogram(
            "inkling_encoder_items_per_batch",
            "Items coalesced per tower batch",
            ["tower"],
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.inflight = Gauge("inkling_encoder_inflight_items", "Items accepted and not finished", registry=registry)
        self.cache = PrometheusCacheObserver(registry, "inkling_encoder")
