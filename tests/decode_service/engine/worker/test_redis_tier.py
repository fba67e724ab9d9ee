"""The shared Redis prefix tier on the real (tiny, random) `InklingDecoder`: replica B reuses what replica A
computed, and every way the stored prefix can be wrong or missing falls back to recomputation with the same
greedy tokens. Uses the Redis at 127.0.0.1:6379, db 15, under a per-test key prefix that is deleted after."""

from __future__ import annotations

import copy
import dataclasses
import uuid

import pytest
import redis
import torch

from common.settings import RedisPrefixSettings
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import MultimodalItem, Request, SamplingParams
from decode_service.engine.worker import prefix_format
from decode_service.engine.worker.prefix_format import (
    KIND_BOUNDARY,
    KIND_GLOBAL,
    CorruptValueError,
    Geometry,
    ValueId,
    decode_value,
    encode_value,
)
from decode_service.engine.worker.prefix_store import PrefixStore
from decode_service.engine.worker.redis_tier import CostModel

REDIS_URL = "redis://127.0.0.1:6379/15"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
ALWAYS_FETCH = CostModel(redis_bytes_per_s=1e9, redis_latency_s=1e-4, prefill_tokens_per_s=1.0)
# Page 4, snapshots every 2 blocks: the 30-token prompt below has tracked boundaries 8 (also the image's end),
# 16, 24 and 28 (the last block start before the prompt's last token).
PROMPT_LEN, IMAGE_START, IMAGE_ROWS = 30, 2, 9


@pytest.fixture
def redis_db():
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = f"test:kvp:{uuid.uuid4().hex[:12]}:"
    yield client, prefix
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


@pytest.fixture
def stores(redis_db):
    client, prefix = redis_db
    made: list[PrefixStore] = []

    def make(**kw) -> PrefixStore:
        base = dict(key_prefix=prefix, ttl_s=300, probe_bytes=1 << 16)
        base.update(kw)
        store = PrefixStore(client, RedisPrefixSettings(**base))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def replica(model, config, store: PrefixStore | None, cost: CostModel | None = ALWAYS_FETCH, **kw) -> Engine:
    base = dict(
        kv_cache_bytes=1 << 22, page_size=4, max_num_seqs=4, max_num_batched_tokens=20, snapshot_interval_blocks=2
    )
    base.update(kw)
    engine = Engine(model, config, EngineSettings(**base), store)
    if cost is not None and engine.redis_prefix is not None:
        engine.redis_prefix.cost = CostModel(cost.redis_bytes_per_s, cost.redis_latency_s, cost.prefill_tokens_per_s)
    return engine


def image(config, key: bytes, seed: int) -> MultimodalItem:
    rows = torch.randn(IMAGE_ROWS, config.text.hidden_size, generator=torch.Generator().manual_seed(seed))
    return MultimodalItem(key * 32, IMAGE_START, rows)


def prompt() -> list[int]:
    return torch.randint(4, 90, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()


def run(engine: Engine, request_id: str, item: MultimodalItem):
    return engine.generate([Request(request_id, prompt(), GREEDY, mm_items=(item,))])[0]


def run_with_logprobs(engine: Engine, request_id: str, item: MultimodalItem):
    request = Request(request_id, prompt(), GREEDY, mm_items=(item,))
    out = engine.generate([request])[0]
    return out, torch.tensor([lp.logprob for lp in request.output_logprobs])


def published(engine: Engine, item: MultimodalItem, kind: int) -> list[str]:
    """The keys the tier uses for the prompt's blocks (index i: the block ending at 4*(i+1))."""
    tier = engine.redis_prefix
    request = Request("keys", prompt(), GREEDY, mm_items=(item,))
    return [tier.key(kind, h) for h in engine.prefix_cache.block_hashes(request, PROMPT_LEN // 4)]


@pytest.fixture
def computed_by_a(inkling_model, model_config, stores, reference):
    """Replica A has run the image prompt and written its prefix to Redis; its cold output."""
    item = image(model_config, b"\x07", 5)
    a = replica(inkling_model, model_config, stores())
    out, logprobs = run_with_logprobs(a, "a", item)
    assert a.redis_prefix.store.flush()
    want = reference(inkling_model, model_config.text, prompt(), GREEDY.max_tokens, mm=(item,))
    assert out.token_ids == want and out.num_cached_tokens == 0 and len(logprobs) == GREEDY.max_tokens
    return a, item, (want, logprobs)


def test_replica_b_reuses_the_multimodal_prefix_of_replica_a(computed_by_a, inkling_model, model_config, stores):
    a, item, (want, cold_logprobs) = computed_by_a
    assert a.redis_prefix.stats.published_values > 0 and a.redis_prefix.stats.dropped_writes == 0
    b = replica(inkling_model, model_config, stores())
    out, logprobs = run_with_logprobs(b, "b", item)
    assert out.token_ids == want
    assert (out.num_cached_tokens_redis, out.num_cached_tokens_gpu, out.num_cached_tokens) == (28, 0, 28)
    assert torch.allclose(logprobs, cold_logprobs, atol=1e-4)  # the same state, not just the same argmax
    stats = b.redis_prefix.stats
    assert stats.hits == 1 and stats.decisions["fetch"] == 1 and stats.bytes_fetched > 0
    # The fetched blocks are now in B's GPU prefix cache.
    again = run(b, "b2", item)
    assert again.token_ids == want
    assert (again.num_cached_tokens_gpu, again.num_cached_tokens_redis) == (28, 0)


def test_a_different_image_at_the_same_positions_is_a_miss(
    computed_by_a, inkling_model, model_config, stores, reference
):
    other = image(model_config, b"\x08", 6)
    b = replica(inkling_model, model_config, stores())
    out = run(b, "b", other)
    assert out.num_cached_tokens == 0 and b.redis_prefix.stats.decisions == {"fetch": 0, "recompute": 0, "miss": 1}
    assert out.token_ids == reference(inkling_model, model_config.text, prompt(), GREEDY.max_tokens, mm=(other,))


def test_a_corrupt_value_is_deleted_and_the_prefix_recomputed(computed_by_a, inkling_model, model_config, stores):
    a, item, (want, _) = computed_by_a
    client = a.redis_prefix.store.client
    key = published(a, item, KIND_GLOBAL)[3]
    original = client.get(key)
    value = bytearray(original)
    value[-5] ^= 0x40
    client.set(key, bytes(value))
    b = replica(inkling_model, model_config, stores())
    out = run(b, "b", item)
    assert out.token_ids == want and out.num_cached_tokens == 0
    assert b.redis_prefix.stats.corrupt == 1
    b.redis_prefix.store.flush()
    assert client.get(key) == original  # deleted, then written again by B's recomputation


def test_an_evicted_middle_block_limits_the_hit_to_the_boundary_before_it(
    computed_by_a, inkling_model, model_config, stores
):
    a, item, (want, _) = computed_by_a
    a.redis_prefix.store.client.delete(published(a, item, KIND_GLOBAL)[5])  # block [20, 24)
    b = replica(inkling_model, model_config, stores())
    out = run(b, "b", item)
    assert out.token_ids == want and out.num_cached_tokens_redis == 16


def test_a_missing_conv_snapshot_is_never_used_past_the_last_snapshotted_boundary(
    computed_by_a, inkling_model, model_config, stores
):
    a, item, (want, _) = computed_by_a
    client = a.redis_prefix.store.client
    boundaries = published(a, item, KIND_BOUNDARY)
    assert all(client.exists(boundaries[b // 4 - 1]) for b in (8, 16, 24, 28))
    assert not client.exists(boundaries[12 // 4 - 1])  # 12 is not a tracked boundary: no snapshot
    client.delete(boundaries[28 // 4 - 1])
    b = replica(inkling_model, model_config, stores())
    assert run(b, "b", item).num_cached_tokens_redis == 24
    b.redis_prefix.store.flush()
    assert client.exists(boundaries[28 // 4 - 1])  # B computed 24..28 and published that boundary again
    client.delete(*(boundaries[b // 4 - 1] for b in (16, 24, 28)))
    c = replica(inkling_model, model_config, stores())
    out = run(c, "c", item)
    assert out.token_ids == want and out.num_cached_tokens_redis == 8


def test_another_model_never_uses_the_prefix(computed_by_a, inkling_model, model_config, stores, reference):
    a, item, _ = computed_by_a
    other_model = copy.deepcopy(inkling_model)  # other weights, same config
    with torch.no_grad():
        other_model.unembed.weight.mul_(-1.0)
    b = replica(other_model, model_config, stores(), model_fingerprint=b"other weights")
    out = run(b, "b", item)
    assert out.num_cached_tokens == 0 and b.redis_prefix.stats.decisions["miss"] == 1
    assert out.token_ids == reference(other_model, model_config.text, prompt(), GREEDY.max_tokens, mm=(item,))
    # A value whose header names another model under the right key (a tampered or colliding entry) is rejected.
    client = a.redis_prefix.store.client
    key = published(a, item, KIND_BOUNDARY)[28 // 4 - 1]
    value = bytearray(client.get(key))
    value[8:40] = bytes(32)
    client.set(key, bytes(value))
    c = replica(inkling_model, model_config, stores())
    out = run(c, "c", item)
    assert c.redis_prefix.stats.corrupt == 1 and out.num_cached_tokens == 0


def test_redis_down_means_recompute(inkling_model, model_config, reference):
    client = redis.Redis.from_url("redis://127.0.0.1:1/15", socket_timeout=0.2, socket_connect_timeout=0.2)
    down = PrefixStore(client, RedisPrefixSettings(retry_after_s=0.0))  # no breaker: every call fails
    try:
        item = image(model_config, b"\x07", 5)
        want = reference(inkling_model, model_config.text, prompt(), GREEDY.max_tokens, mm=(item,))
        a = replica(inkling_model, model_config, down, cost=None)
        assert not a.redis_prefix.cost.ready  # the throughput could not be measured
        a.redis_prefix.cost = CostModel(1e9, 1e-4, 1.0)
        out = run(a, "a", item)
        down.flush()
        assert out.token_ids == want and out.num_cached_tokens == 0
        assert a.redis_prefix.stats.queries == 1 and a.redis_prefix.stats.hits == 0
        assert down.stats.errors >= 3 and down.stats.published_values == 0  # measure, probe, writes
    finally:
        down.close()


def test_the_measured_cost_model_decides(computed_by_a, inkling_model, model_config, stores):
    _, item, (want, _) = computed_by_a
    b = replica(inkling_model, model_config, stores(), cost=None)
    cost = b.redis_prefix.cost
    assert cost.ready and cost.redis_bytes_per_s > 0 and cost.redis_latency_s > 0 and cost.prefill_tokens_per_s > 0
    b.redis_prefix.cost = CostModel(cost.redis_bytes_per_s, cost.redis_latency_s, 1e12)  # recompute is free
    out = run(b, "b", item)
    assert out.token_ids == want and out.num_cached_tokens == 0
    assert b.redis_prefix.stats.decisions["recompute"] == 1


def test_oversize_values_are_not_stored_and_pressure_drops_writes(inkling_model, model_config, stores, reference):
    item = image(model_config, b"\x07", 5)
    want = reference(inkling_model, model_config.text, prompt(), GREEDY.max_tokens, mm=(item,))
    a = replica(inkling_model, model_config, stores(max_value_bytes=200))
    assert run(a, "a", item).token_ids == want
    a.redis_prefix.store.flush()
    assert a.redis_prefix.stats.oversize > 0 and a.redis_prefix.stats.published_values == 0
    b = replica(inkling_model, model_config, stores(max_pending_bytes=1))
    assert run(b, "b", item).token_ids == want
    assert b.redis_prefix.stats.dropped_writes > 0 and b.redis_prefix.stats.published_values == 0


def test_value_header_checks(model_config, inkling_model):
    geometry = Geometry.of(replica(inkling_model, model_config, None).kv)
    vid = ValueId(KIND_BOUNDARY, 28, 2, 1, 3)
    payload = bytes(range(64))
    value = encode_value(vid, b"model", geometry, payload)
    assert bytes(decode_value(value, vid, b"model", geometry, 64)) == payload
    other_dtype = dataclasses.replace(geometry, dtype_code=1)
    other_window = dataclasses.replace(geometry, window=16)
    wrong = [
        (value, ValueId(KIND_GLOBAL, 28, 2, 1, 3), b"model", geometry, 64),
        (value, ValueId(KIND_BOUNDARY, 24, 2, 1, 3), b"model", geometry, 64),
        (value, ValueId(KIND_BOUNDARY, 28, 2, 2, 3), b"model", geometry, 64),
        (value, vid, b"other model", geometry, 64),
        (value, vid, b"model", other_dtype, 64),
        (value, vid, b"model", other_window, 64),
        (value, vid, b"model", geometry, 63),
        (value[:-1], vid, b"model", geometry, 64),
        (value[:-1] + b"\x00", vid, b"model", geometry, 64),
        (value[:10], vid, b"model", geometry, 64),
    ]
    for args in wrong:
        with pytest.raises(CorruptValueError):
            decode_value(*args)


def test_boundaries_are_split_into_parts(inkling_model, model_config, stores, reference, monkeypatch):
    monkeypatch.setattr(prefix_format, "BOUNDARY_PART_BYTES", 1000)
    item = image(model_config, b"\x07", 5)
    a = replica(inkling_model, model_config, stores())
    want, cold_logprobs = run_with_logprobs(a, "a", item)
    a.redis_prefix.store.flush()
    parts = prefix_format.part_sizes(a.redis_prefix.boundary_bytes(28))
    assert len(parts) > 2 and max(parts) == 1000
    b = replica(inkling_model, model_config, stores())
    out, logprobs = run_with_logprobs(b, "b", item)
    assert out.num_cached_tokens_redis == 28 and out.token_ids == want.token_ids
    assert torch.allclose(logprobs, cold_logprobs, atol=1e-4)
    # A boundary with a part missing is not used.
    client = a.redis_prefix.store.client
    request = Request("keys", prompt(), GREEDY, mm_items=(item,))
    last_block = a.prefix_cache.block_hashes(request, 7)[6]
    client.delete(a.redis_prefix.key(KIND_BOUNDARY, last_block, len(parts) - 1))
    c = replica(inkling_model, model_config, stores())
    out = run(c, "c", item)
    assert out.token_ids == want.token_ids and out.num_cached_tokens_redis != 28
