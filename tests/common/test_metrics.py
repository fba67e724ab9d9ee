"""Decode metric set: every series carries model_name; the KV usage gauge, queue / end-to-end histograms,
token counters and the GPU vs Redis split of prefix hits."""

from __future__ import annotations

import pytest

from common.metrics import DecodeMetrics, EncoderMetrics, new_registry
from decode_service.api import LoadSnapshot, Timings, Usage
from decode_service.engine.engine import SpeculationStats


class Service:
    def __init__(self) -> None:
        self.snapshot = LoadSnapshot(running=3, waiting=2, kv_usage=0.25)
        self.stats = SpeculationStats()

    def load(self) -> LoadSnapshot:
        return self.snapshot

    def speculation(self):
        return self.stats.snapshot(3)


def test_decode_metrics_carry_the_model_name_and_split_prefix_hits_by_tier() -> None:
    registry = new_registry()
    metrics = DecodeMetrics(registry, "inkling-tiny")
    service = Service()
    metrics.watch_load(service)
    usage = Usage(prompt_tokens=100, cached_tokens_gpu=48, cached_tokens_redis=32, completion_tokens=7)
    metrics.observe_final(usage, Timings(queue_s=0.02, ttft_s=0.3, decode_s=1.2))
    metrics.observe_final(Usage(prompt_tokens=5), Timings(queue_s=0.01))  # no tokens: no TTFT / e2e sample
    metrics.requests.labels("OK").inc()

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "inkling-tiny", **labels})

    assert sample("inkling_kv_cache_usage") == 0.25
    assert (sample("inkling_requests_running"), sample("inkling_requests_waiting")) == (3, 2)
    service.snapshot = LoadSnapshot(kv_usage=1.5)  # clamped: a fraction of pages
    assert sample("inkling_kv_cache_usage") == 1.0
    assert sample("inkling_queue_time_seconds_count") == 2
    assert sample("inkling_queue_time_seconds_sum") == pytest.approx(0.03)
    assert sample("inkling_e2e_request_latency_seconds_count") == 1
    assert sample("inkling_e2e_request_latency_seconds_sum") == pytest.approx(1.5)
    assert sample("inkling_ttft_seconds_count") == 1
    assert (sample("inkling_prompt_tokens_total"), sample("inkling_completion_tokens_total")) == (105, 7)
    assert sample("inkling_prefix_cache_queries_total") == 105
    assert sample("inkling_prefix_cache_hits_total", tier="gpu") == 48
    assert sample("inkling_prefix_cache_hits_total", tier="redis") == 32
    assert sample("inkling_decode_requests_total", status="OK") == 1
    unlabelled = [
        s.name for family in registry.collect() for s in family.samples if s.labels.get("model_name") != "inkling-tiny"
    ]
    assert unlabelled == []


def test_decode_and_encoder_metrics_share_a_registry_without_collisions() -> None:
    registry = new_registry()
    DecodeMetrics(registry, "m")
    EncoderMetrics(registry)  # an in-process encoder next to the decoder (--local-encode)
    assert registry.get_sample_value("inkling_encoder_inflight_items") == 0


@pytest.mark.parametrize("name", ["", "/models/inkling"])
def test_model_name_is_an_id_not_a_path(name: str) -> None:
    with pytest.raises(ValueError, match="model_name"):
        DecodeMetrics(new_registry(), name)


def test_observer_hooks_count() -> None:
    registry = new_registry()
    metrics = DecodeMetrics(registry, "m")
    metrics.cache_lookup(True)
    metrics.cache_lookup(False)
    metrics.rpc("10.0.0.1:50061", 0.01, "OK")
    metrics.retry()
    metrics.local_fallback()
    m = {"model_name": "m"}
    assert registry.get_sample_value("inkling_embedding_cache_queries_total", m) == 2
    assert registry.get_sample_value("inkling_embedding_cache_hits_total", m) == 1
    rpc = {**m, "encoder": "10.0.0.1:50061", "code": "OK"}
    assert registry.get_sample_value("inkling_encode_rpc_seconds_count", rpc) == 1
    assert registry.get_sample_value("inkling_encode_retries_total", m) == 1
    assert registry.get_sample_value("inkling_encode_fallback_local_total", m) == 1


def test_speculation_counters_and_accepted_length_histogram_follow_the_engine_stats() -> None:
    registry = new_registry()
    metrics = DecodeMetrics(registry, "m")
    service = Service()
    metrics.watch_load(service)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert sample("inkling_spec_decode_num_draft_tokens_total") == 0  # series exist before the first round
    assert sample("inkling_spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0
    assert sample("inkling_spec_decode_accepted_length_bucket", le="3.0") == 0
    for drafts, accepted in [(3, 0), (3, 3), (3, 1), (2, 2), (3, 1)]:  # (2, 2): max_tokens left room for 2
        service.stats.record(drafts, accepted)
    assert sample("inkling_spec_decode_num_drafts_total") == 5
    assert sample("inkling_spec_decode_num_draft_tokens_total") == 14
    assert sample("inkling_spec_decode_num_accepted_tokens_total") == 7
    per_pos = [sample("inkling_spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) for k in range(3)]
    assert per_pos == [4, 2, 1]
    buckets = [
        sample("inkling_spec_decode_accepted_length_bucket", le=le) for le in ("0.0", "1.0", "2.0", "3.0", "+Inf")
    ]
    assert buckets == [1, 3, 4, 5, 5]
    assert sample("inkling_spec_decode_accepted_length_count") == 5
    assert sample("inkling_spec_decode_accepted_length_sum") == 7
