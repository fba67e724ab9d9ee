"""Embedding cache: serialization, LRU budget, real Redis (db 15, unique prefix), corruption, Redis down."""

import hashlib
import uuid

import pytest
import redis

from common.cache_store import (
    CorruptEntryError,
    Entry,
    LruCache,
    RedisCache,
    TieredCache,
    deserialize_entry,
    serialize_entry,
)
from common.wire import DTYPE_UINT8, KIND_DMEL_CODES, Span

REDIS_URL = "redis://127.0.0.1:6379/15"


def _entry(rows: int = 3, dim: int = 4, fill: int = 7, modality: str = "image") -> Entry:
    return Entry(
        modality=modality, rows=rows, dim=dim, payload=bytes([fill]) * (rows * dim * 2), spans=(Span("image", rows),)
    )


def _key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def test_serialize_round_trip_and_checks():
    video = Entry("video", 5, 2, bytes(range(20)), (Span("image", 2), Span("image", 2), Span("audio", 1)))
    assert deserialize_entry(serialize_entry(video)) == video
    value = serialize_entry(video)
    with pytest.raises(CorruptEntryError, match="checksum"):
        deserialize_entry(value[:-1] + bytes([value[-1] ^ 1]))
    with pytest.raises(CorruptEntryError, match="bytes"):
        deserialize_entry(value[:-2])
    with pytest.raises(CorruptEntryError, match="magic"):
        deserialize_entry(b"XXXX" + value[4:])
    with pytest.raises(CorruptEntryError, match="shorter"):
        deserialize_entry(b"INKE")


def _codes_entry(frames: int = 5, mels: int = 80) -> Entry:
    payload = bytes(i % 16 for i in range(frames * mels))
    return Entry("audio", frames, 64, payload, (Span("audio", frames),), DTYPE_UINT8, KIND_DMEL_CODES, mels, "float32")


def test_codes_entry_round_trip_and_checks():
    """Audio is cached as its dMel codes (format version 2): rows x codes_per_row bytes, the tower dtype kept."""
    codes = _codes_entry()
    value = serialize_entry(codes)
    assert len(value) == 28 + 5 + 5 * 80  # header, one span, one byte per code
    assert deserialize_entry(value) == codes
    with pytest.raises(CorruptEntryError, match="bytes"):
        deserialize_entry(value[:-1])
    version_1 = value[:4] + (1).to_bytes(2, "little") + value[6:]
    with pytest.raises(CorruptEntryError, match="version"):
        deserialize_entry(version_1)
    no_tower = bytearray(value)
    no_tower[27] = 0  # tower dtype code: none
    with pytest.raises(CorruptEntryError, match="tower_dtype"):
        deserialize_entry(bytes(no_tower))
    bf16_dtype = bytearray(value)
    bf16_dtype[6] = 1  # element dtype code: bf16, which a codes payload never has
    with pytest.raises(CorruptEntryError, match="does not fit"):
        deserialize_entry(bytes(bf16_dtype))


def test_lru_byte_budget_and_refusal():
    cache = LruCache(budget_bytes=100, max_entry_fraction=0.5)
    small = _entry(rows=1, dim=10)  # 20 bytes
    for i in range(5):
        cache.put(_key(str(i)), small)
    assert cache.nbytes == 100 and len(cache) == 5
    assert cache.get(_key("0")) == small  # refresh 0: 1 becomes the oldest
    cache.put(_key("5"), small)
    assert cache.get(_key("1")) is None and cache.get(_key("0")) == small
    cache.put(_key("big"), _entry(rows=2, dim=20))  # 80 bytes > 50% of the budget: refused
    assert cache.get(_key("big")) is None
    assert cache.stats.queries == 4 and cache.stats.hits == 2


@pytest.fixture
def redis_cache():
    prefix = f"test:emb:{uuid.uuid4().hex}:"
    cache = RedisCache(REDIS_URL, key_prefix=prefix, async_writes=True)
    client = redis.Redis.from_url(REDIS_URL)
    yield cache, client
    cache.close()
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_redis_round_trip_one_key_per_item(redis_cache):
    cache, client = redis_cache
    entry = _entry()
    assert cache.get(_key("a")) is None
    cache.put(_key("a"), entry)
    assert cache.flush()
    assert client.exists(cache.redis_key(_key("a"))) == 1
    assert client.get(cache.redis_key(_key("a"))) == serialize_entry(entry)
    assert cache.get_many([_key("a"), _key("b")]) == [entry, None]
    assert (cache.stats.queries, cache.stats.hits) == (3, 1)


def test_redis_round_trip_of_codes(redis_cache):
    cache, _ = redis_cache
    cache.put(_key("clip"), _codes_entry(frames=200))
    assert cache.flush()
    assert cache.get(_key("clip")) == _codes_entry(frames=200)


def test_redis_corrupt_value_is_a_miss_and_deleted(redis_cache):
    cache, client = redis_cache
    value = bytearray(serialize_entry(_entry()))
    value[-1] ^= 0xFF
    client.set(cache.redis_key(_key("bad")), bytes(value))
    assert cache.get(_key("bad")) is None
    assert client.exists(cache.redis_key(_key("bad"))) == 0
    assert cache.stats.corrupt == 1


def test_redis_down_is_a_miss_and_never_raises():
    cache = RedisCache(
        "redis://127.0.0.1:1/15", key_prefix="test:down:", timeout_s=0.1, async_writes=False, retry_after_s=30.0
    )
    try:
        assert cache.get(_key("a")) is None
        cache.put(_key("a"), _entry())
        assert cache.get_many([_key("a"), _key("b")]) == [None, None]
        assert cache.stats.errors == 1  # later calls skip Redis until retry_after_s
        assert cache.stats.dropped_writes == 1
    finally:
        cache.close()


def test_tiered_promotes_l2_hits(redis_cache):
    l2, _ = redis_cache
    l2.put(_key("x"), _entry(fill=1))
    assert l2.flush()
    tiered = TieredCache(LruCache(1 << 20), l2)
    assert tiered.get(_key("x")) == _entry(fill=1)
    assert tiered.l1.get(_key("x")) == _entry(fill=1)
    tiered.put(_key("y"), _entry(fill=2))
    assert l2.flush()
    assert l2.get(_key("y")) == _entry(fill=2)
    assert tiered.get_many([_key("x"), _key("y"), _key("z")])[2] is None
