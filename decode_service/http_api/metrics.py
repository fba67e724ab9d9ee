"""Prometheus metrics of the HTTP front, with vLLM's metric names under the `inkling_api_` prefix where vLLM
has one (`time_to_first_token_seconds`, `inter_token_latency_seconds`, `e2e_request_latency_seconds`, ...)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto.inkling_epd.v1 import generator_pb2 as pb

PREFIX = "inkling_api"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class ApiMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests by route and status", ["route", "status"], registry=registry
        )
        self.running = Gauge(f"{PREFIX}_num_requests_running", "Generate calls in flight upstream", registry=registry)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Request received -> first token",
            buckets=_LATENCY,
            registry=registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between output tokens", buckets=_ITL, registry=registry
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Request received -> Final", buckets=_LATENCY, registry=registry
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.cached_tokens = Counter(
            f"{PREFIX}_prompt_tokens_cached", "Prompt tokens served from a prefix cache", registry=registry
        )
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Completion tokens", registry=registry)
        self.success = Counter(
            f"{PREFIX}_request_success", "Finished requests by finish reason", ["finished_reason"], registry=registry
        )
        self.disconnects = Counter(
            f"{PREFIX}_client_disconnects", "Requests aborted upstream because the client went away", registry=registry
        )


class RequestTimer:
    """Feeds one request's token timings to `ApiMetrics` as the Generate stream goes by."""

    def __init__(self, metrics: ApiMetrics) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        self._last: float | None = None

    def feed(self, response: pb.GenerateResponse) -> None:
        now = time.monotonic()
        if response.WhichOneof("response") == "final":
            final = response.final
            self.metrics.e2e.observe(now - self.started)
            self.metrics.prompt_tokens.inc(final.usage.prompt_tokens)
            self.metrics.cached_tokens.inc(final.usage.cached_tokens)
            self.metrics.generation_tokens.inc(final.usage.completion_tokens)
            reason = pb.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
            self.metrics.success.labels(reason).inc()
            return
        count = len(response.delta.token_ids)
        if not count:
            return
        if self._last is None:
            self.metrics.ttft.observe(now - self.started)
        else:
            gap = (now - self._last) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        self._last = now
