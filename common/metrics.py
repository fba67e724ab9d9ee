"""Prometheus helpers: one registry per service, an HTTP exporter, and the metric sets of the services.

Each server builds its own `CollectorRegistry` (so tests can run several servers in one process) and passes
it to the metric classes below; `start_metrics_server` exposes it on `/metrics`. Decode metrics carry a
`model_name` label (the served model id, never a path) so one dashboard can tell models apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


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


class ModelLabelled:
    """A labelled metric with its leading `model_name` label fixed: `.labels(*rest)` as on the metric itself."""

    def __init__(self, metric: Counter | Gauge | Histogram, model_name: str) -> None:
        self._metric, self._model_name = metric, model_name

    def labels(self, *values: str) -> Any:
        return self._metric.labels(self._model_name, *values)


class LoadSource(Protocol):
    def load(self) -> Any: ...  # decode_service.api.LoadSnapshot: running, waiting, kv_usage
    def speculation(self) -> Any: ...  # decode_service.engine.engine.SpeculationSnapshot


class SpeculationCollector(Collector):
    """MTP acceptance read from the engine's counters at scrape time (the engine imports no prometheus).
    Names follow vLLM's (`spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
    `..._num_accepted_tokens_per_pos` with a 0-based `position`), plus the accepted-length histogram: per
    verify round, the number of drafts accepted (0..D; the round also emits its bonus token)."""

    def __init__(self, source: LoadSource, model_name: str) -> None:
        self.source, self.model_name = source, model_name

    def _families(self, snap: Any) -> Iterator[Metric]:
        m = ["model_name"]
        rounds = CounterMetricFamily("inkling_spec_decode_num_drafts", "MTP verify rounds (one per sequence)", labels=m)
        drafts = CounterMetricFamily("inkling_spec_decode_num_draft_tokens", "MTP draft tokens verified", labels=m)
        accepted = CounterMetricFamily("inkling_spec_decode_num_accepted_tokens", "MTP draft tokens accepted", labels=m)
        per_pos = CounterMetricFamily(
            "inkling_spec_decode_num_accepted_tokens_per_pos",
            "Rounds that accepted the draft at this 0-based position (and every one before it)",
            labels=[*m, "position"],
        )
        length = HistogramMetricFamily(
            "inkling_spec_decode_accepted_length", "Drafts accepted per MTP verify round", labels=m
        )
        if snap is not None:
            rounds.add_metric([self.model_name], snap.num_rounds)
            drafts.add_metric([self.model_name], snap.num_draft_tokens)
            accepted.add_metric([self.model_name], snap.num_accepted_tokens)
            for position, count in enumerate(snap.accepted_at):
                per_pos.add_metric([self.model_name, str(position)], count)
            cumulative, buckets = 0, []
            for upper, count in enumerate(snap.accepted_lengths):
                cumulative += count
                buckets.append((str(float(upper)), cumulative))
            buckets.append(("+Inf", snap.num_rounds))
            length.add_metric([self.model_name], buckets, snap.num_accepted_tokens)
        yield from (rounds, drafts, accepted, per_pos, length)

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.source.speculation())


class DecodeMetrics:
    """Metrics of one decode replica (names follow serving spec 3.7), each labelled with `model_name`; also the
    encoder client's observer (`cache_lookup`, `rpc`, `retry`, `local_fallback`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        if not model_name or model_name.startswith("/"):
            raise ValueError(f"model_name: expected a model id (not a path), got {model_name!r}")
        self.registry, self.model_name = registry, model_name
        m = ["model_name"]

        def one(kind: Callable[..., Any], name: str, doc: str, **kw: Any) -> Any:
            return kind(name, doc, m, registry=registry, **kw).labels(model_name)

        def labelled(kind: Callable[..., Any], name: str, doc: str, labels: list[str], **kw: Any) -> ModelLabelled:
            return ModelLabelled(kind(name, doc, m + labels, registry=registry, **kw), model_name)

        self.requests = labelled(Counter, "inkling_decode_requests", "Generate calls by outcome", ["status"])
        self.ttft = one(Histogram, "inkling_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS)
        self.itl = one(Histogram, "inkling_itl_seconds", "Inter-token latency", buckets=_LATENCY_BUCKETS)
        self.queue_time = one(
            Histogram, "inkling_queue_time_seconds", "Arrival to first scheduling", buckets=_REQUEST_BUCKETS
        )
        self.e2e = one(
            Histogram,
            "inkling_e2e_request_latency_seconds",
            "Arrival to the last token (requests that produced tokens)",
            buckets=_REQUEST_BUCKETS,
        )
        self.prompt_tokens = one(Counter, "inkling_prompt_tokens", "Prompt tokens of finished requests")
        self.completion_tokens = one(Counter, "inkling_completion_tokens", "Completion tokens of finished requests")
        self.running = one(Gauge, "inkling_requests_running", "Requests in the running batch")
        self.waiting = one(Gauge, "inkling_requests_waiting", "Requests queued for admission")
        self.kv_usage = one(Gauge, "inkling_kv_cache_usage", "Fraction of KV-cache pages in use (0..1)")
        self.prefix_queries = one(
            Counter, "inkling_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = labelled(
            Counter, "inkling_prefix_cache_hits", "Prompt tokens served by the prefix cache, by tier", ["tier"]
        )
        self.mm_queries = one(
            Counter, "inkling_embedding_cache_queries", "Media items looked up in the shared embedding cache"
        )
        self.mm_hits = one(Counter, "inkling_embedding_cache_hits", "Media items served by the shared embedding cache")
        self.encode_rpc = labelled(
            Histogram,
            "inkling_encode_rpc_seconds",
            "Encode call latency",
            ["encoder", "code"],
            buckets=_LATENCY_BUCKETS,
        )
        self.encode_retries = one(Counter, "inkling_encode_retries", "Encode calls retried on another replica")
        self.fallbacks = one(Counter, "inkling_encode_fallback_local", "Requests encoded in-process")

    def watch_load(self, service: LoadSource) -> None:
        self.running.set_function(lambda: service.load().running)
        self.waiting.set_function(lambda: service.load().waiting)
        self.kv_usage.set_function(lambda: min(1.0, max(0.0, service.load().kv_usage)))
        self.registry.register(SpeculationCollector(service, self.model_name))

    def observe_final(self, usage: Any, timings: Any) -> None:
        """A finished request's `decode_service.api.Usage` and `Timings`."""
        if usage.completion_tokens:
            self.ttft.observe(timings.ttft_s)
            self.e2e.observe(timings.ttft_s + timings.decode_s)
        self.queue_time.observe(timings.queue_s)
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.prefix_queries.inc(usage.prompt_tokens)
        self.prefix_hits.labels("gpu").inc(usage.cached_tokens_gpu)
        self.prefix_hits.labels("redis").inc(usage.cached_tokens_redis)

    # encoder client observer
    def cache_lookup(self, hit: bool) -> None:
        self.mm_queries.inc()
        if hit:
            self.mm_hits.inc()

    def rpc(self, address: str, seconds: float, code: str) -> None:
        self.encode_rpc.labels(address, code).observe(seconds)

    def retry(self) -> None:
        self.encode_retries.inc()

    def local_fallback(self) -> None:
        self.fallbacks.inc()
