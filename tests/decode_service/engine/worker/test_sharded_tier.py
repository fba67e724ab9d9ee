"""The Redis prefix tier under tensor parallelism: each of 2 gloo ranks writes its own KV shard under one key
scheme; a second TP replica fetches every rank's shard and gives the single-process tokens; a prefix whose
follower shard is missing is recomputed, never half-used."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import redis
import torch

from common.settings import DecodeEngineSettings, RedisPrefixSettings, RedisSettings
from decode_service.engine.build import build_engine
from decode_service.engine.request import Request, SamplingParams
from decode_service.engine.worker.prefix_store import PrefixStore
from decode_service.engine.worker.redis_tier import CostModel
from decode_service.engine.worker.sharded_tier import rank_fingerprint
from tools.make_tiny_checkpoint import make_tiny_checkpoint

REDIS_URL = "redis://127.0.0.1:6379/15"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BASE = dict(dtype="float32", kv_cache_bytes=8 << 20, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
PROMPT = torch.randint(4, 90000, (30,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture
def connection():
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = f"test:kvp-tp:{uuid.uuid4().hex[:12]}:"
    yield client, (RedisSettings(REDIS_URL, timeout_s=1.0), RedisPrefixSettings(prefix, ttl_s=300, probe_bytes=1 << 16))
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


def run_replica(checkpoint, connection, mtp_depth: int = 0) -> tuple[list[int], int]:
    """A fresh TP=2 replica (empty GPU prefix cache) runs the prompt: (tokens, prompt tokens from Redis); its
    followers finish their writes when it closes."""
    store = PrefixStore.connect(*connection)
    settings = DecodeEngineSettings(tensor_parallel_size=2, mtp_depth=mtp_depth, **BASE)
    engine = build_engine(checkpoint, settings, store, connection)
    try:
        engine.redis_prefix.cost = CostModel(redis_bytes_per_s=1e9, redis_latency_s=1e-4, prefill_tokens_per_s=1.0)
        out = engine.generate([Request("p", PROMPT, GREEDY)])[0]
    finally:
        engine.ranks.close()
        store.close()
    return out.token_ids, out.num_cached_tokens_redis


def test_tp_replicas_share_prefixes_through_per_rank_shards(tmp_path, connection):
    client, settings = connection
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", nvfp4=False, seed=8)
    single = build_engine(checkpoint, DecodeEngineSettings(**BASE))
    want = single.generate([Request("ref", PROMPT, GREEDY)])[0]

    cold, fetched = run_replica(checkpoint, settings)
    assert (cold, fetched) == (want.token_ids, 0)
    prefix = settings[1].key_prefix
    keys = {k.decode() for k in client.scan_iter(match=prefix + "*")}
    tags = {key[len(prefix) :].split(":")[0] for key in keys}
    assert len(tags) == 2, tags  # one fingerprint tag per rank, the same blocks under each
    by_tag = {
        tag: sorted(k.split(":", 1)[1] for k in (key[len(prefix) :] for key in keys) if k.startswith(tag))
        for tag in tags
    }
    assert len({tuple(v) for v in by_tag.values()}) == 1

    warm, fetched = run_replica(checkpoint, settings)
    assert fetched > 0 and warm == want.token_ids

    # the follower's shard gone: the whole prefix is recomputed (and written again)
    follower_tag = hashlib.sha256(rank_fingerprint(single.prefix_cache.fingerprint, 1, 2)).hexdigest()[:16]
    assert follower_tag in tags
    for key in keys:
        if key[len(prefix) :].startswith(follower_tag):
            client.delete(key)
    again, fetched = run_replica(checkpoint, settings)
    assert (again, fetched) == (want.token_ids, 0)
    again, fetched = run_replica(checkpoint, settings)
    assert fetched > 0 and again == want.token_ids


def test_a_speculating_replica_fetches_shards_and_drafts_after_them(tmp_path, connection):
    """With MTP (D = 2) the fetched pages carry no trunk rows: every rank's depths start after them alike, and
    the tokens stay the single process's."""
    _, settings = connection
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", nvfp4=False, seed=8)
    want = build_engine(checkpoint, DecodeEngineSettings(**BASE)).generate([Request("ref", PROMPT, GREEDY)])[0]
    cold, fetched = run_replica(checkpoint, settings, mtp_depth=2)
    assert (cold, fetched) == (want.token_ids, 0)
    warm, fetched = run_replica(checkpoint, settings, mtp_depth=2)
    assert fetched > 0 and warm == want.token_ids
