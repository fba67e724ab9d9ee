"""Embedding cache keyed by `mm_key`: an in-process byte-budget LRU (L1) and a shared Redis tier (L2).

Both tiers store an `Entry` (the encoded item without its request-specific index). Redis holds ONE key per
item, `{prefix}{mm_key hex}`, whose value is a versioned binary header followed by the raw payload:

    magic b"INKE" | u16 format version | u8 dtype code | u8 modality code | u32 rows | u32 dim
    | u32 crc32(payload) | u32 span count | u8 payload kind code | u16 codes per row | u8 tower dtype code
    | span count x (u8 modality code, u32 rows)
    | payload (rows * dim * 2 bytes, little-endian bf16; or rows * codes per row bytes of uint8 dMel codes)

all integers little-endian (format version 2; version 1 held only bf16 rows, without the kind, codes per
row and tower dtype fields, and now reads as corrupt). A value that fails any check (magic, version, sizes,
spans, checksum) is treated as a miss and deleted. Redis being down or slow is a miss too: errors are logged
and counted, never raised, and after an error the tier is skipped for `retry_after_s` so requests do not each
pay the timeout.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import redis

from common.wire import (
    DTYPE_BF16,
    DTYPE_UINT8,
    KIND_DMEL_CODES,
    KIND_EMBEDDINGS,
    Span,
    WireError,
    checksum,
    payload_layout,
)
from common.write_behind import WriteBehind

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
_MAGIC = b"INKE"
_HEADER = struct.Struct("<4sHBBIIIIBHB")
_SPAN = struct.Struct("<BI")
_DTYPE_CODES = {DTYPE_BF16: 1, DTYPE_UINT8: 2}
_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_KIND_CODES = {KIND_EMBEDDINGS: 1, KIND_DMEL_CODES: 2}
_KINDS = {v: k for k, v in _KIND_CODES.items()}
_TOWER_DTYPE_CODES = {"": 0, "bfloat16": 1, "float32": 2}
_TOWER_DTYPES = {v: k for k, v in _TOWER_DTYPE_CODES.items()}
_MODALITY_CODES = {"image": 1, "audio": 2, "video": 3}
_MODALITIES = {v: k for k, v in _MODALITY_CODES.items()}


@dataclass(frozen=True)
class Entry:
    """One cached tower output (or, for audio, its dMel codes: see `common.wire`)."""

    modality: str
    rows: int
    dim: int  # width of the rows the item becomes
    payload: bytes  # raw little-endian bf16 [rows, dim], or uint8 codes [rows, codes_per_row]
    spans: tuple[Span, ...]
    dtype: str = DTYPE_BF16
    kind: str = KIND_EMBEDDINGS
    codes_per_row: int = 0
    tower_dtype: str = ""

    @property
    def nbytes(self) -> int:
        return len(self.payload)


class CorruptEntryError(ValueError):
    """A stored value does not decode to a consistent entry."""


def serialize_entry(entry: Entry) -> bytes:
    header = _HEADER.pack(
        _MAGIC,
        FORMAT_VERSION,
        _DTYPE_CODES[entry.dtype],
        _MODALITY_CODES[entry.modality],
        entry.rows,
        entry.dim,
        checksum(entry.payload),
        len(entry.spans),
        _KIND_CODES[entry.kind],
        entry.codes_per_row,
        _TOWER_DTYPE_CODES[entry.tower_dtype],
    )
    spans = b"".join(_SPAN.pack(_MODALITY_CODES[s.modality], s.rows) for s in entry.spans)
    return header + spans + entry.payload


def deserialize_entry(value: bytes) -> Entry:
    """Parse and verify a stored value; raises `CorruptEntryError` on any inconsistency."""
    if len(value) < _HEADER.size:
        raise CorruptEntryError(f"value of {len(value)} bytes is shorter than the header")
    fields = _HEADER.unpack_from(value)
    magic, version, dtype_code, modality_code, rows, dim, crc, n_spans, kind_code, per_row, tower_code = fields
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise CorruptEntryError(f"unknown magic/version {magic!r}/{version}")
    if dtype_code not in _DTYPES or modality_code not in _MODALITIES:
        raise CorruptEntryError(f"unknown dtype code {dtype_code} or modality code {modality_code}")
    if kind_code not in _KINDS or tower_code not in _TOWER_DTYPES:
        raise CorruptEntryError(f"unknown payload kind code {kind_code} or tower dtype code {tower_code}")
    kind, tower_dtype = _KINDS[kind_code], _TOWER_DTYPES[tower_code]
    try:
        dtype, nbytes = payload_layout(kind, rows, dim, per_row, tower_dtype)
    except WireError as exc:
        raise CorruptEntryError(str(exc)) from None
    if dtype != _DTYPES[dtype_code]:
        raise CorruptEntryError(f"dtype {_DTYPES[dtype_code]} does not fit a {kind} payload")
    offset = _HEADER.size + n_spans * _SPAN.size
    expected = offset + nbytes
    if len(value) != expected:
        raise CorruptEntryError(f"value has {len(value)} bytes, header implies {expected}")
    spans = []
    for i in range(n_spans):
        code, span_rows = _SPAN.unpack_from(value, _HEADER.size + i * _SPAN.size)
        if code not in _MODALITIES:
            raise CorruptEntryError(f"unknown span modality code {code}")
        spans.append(Span(_MODALITIES[code], span_rows))
    if sum(s.rows for s in spans) != rows:
        raise CorruptEntryError(f"spans cover {sum(s.rows for s in spans)} rows, header says {rows}")
    payload = value[offset:]
    if checksum(payload) != crc:
        raise CorruptEntryError("payload checksum mismatch")
    return Entry(_MODALITIES[modality_code], rows, dim, payload, tuple(spans), dtype, kind, per_row, tower_dtype)


# ----------------------------------------------------------------------------------------------------------
# Observation hooks


class CacheObserver(Protocol):
    """Metric hooks (see `common.metrics.PrometheusCacheObserver`); `tier` is "l1" or "l2"."""

    def lookup(self, tier: str, modality: str | None, hit: bool) -> None: ...

    def error(self, tier: str, op: str) -> None: ...

    def corrupt(self, tier: str) -> None: ...

    def evicted(self, tier: str, count: int) -> None: ...

    def size(self, tier: str, nbytes: int, entries: int) -> None: ...


class NullObserver:
    def lookup(self, tier: str, modality: str | None, hit: bool) -> None:
        pass

    def error(self, tier: str, op: str) -> None:
        pass

    def corrupt(self, tier: str) -> None:
        pass

    def evicted(self, tier: str, count: int) -> None:
        pass

    def size(self, tier: str, nbytes: int, entries: int) -> None:
        pass


@dataclass
class CacheStats:
    queries: int = 0
    hits: int = 0
    errors: int = 0
    corrupt: int = 0
    dropped_writes: int = 0


class EmbeddingCache(Protocol):
    """What the engines use. Implementations never raise on backend failure; a failed lookup is a miss."""

    stats: CacheStats

    def get(self, key: bytes) -> Entry | None: ...

    def get_many(self, keys: Sequence[bytes]) -> list[Entry | None]: ...

    def put(self, key: bytes, entry: Entry) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------------------
# In-process LRU


class LruCache:
    """Thread-safe LRU bounded by payload bytes; entries above `max_entry_fraction` of the budget are refused
    (one huge video must not flush everything else)."""

    tier = "l1"

    def __init__(
        self, budget_bytes: int, max_entry_fraction: float = 0.25, observer: CacheObserver | None = None
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.max_entry_bytes = int(budget_bytes * max_entry_fraction)
        self.observer = observer or NullObserver()
        self.stats = CacheStats()
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            self.stats.queries += 1
            self.stats.hits += entry is not None
        self.observer.lookup(self.tier, entry.modality if entry else None, entry is not None)
        return entry

    def get_many(self, keys: Sequence[bytes]) -> list[Entry | None]:
        return [self.get(k) for k in keys]

    def put(self, key: bytes, entry: Entry) -> None:
        if entry.nbytes > self.max_entry_bytes:
            return
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.budget_bytes:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.nbytes
                evicted += 1
            nbytes, count = self._bytes, len(self._entries)
        if evicted:
            self.observer.evicted(self.tier, evicted)
        self.observer.size(self.tier, nbytes, count)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------------------
# Redis


def connect_redis(url: str, timeout_s: float) -> redis.Redis:
    """A client that fails fast: a slow or absent Redis must cost a cache miss, not a stalled request."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False)


class RedisCache:
    """Shared embedding cache in Redis. Reads are synchronous with short timeouts; writes go through a bounded
    background queue (dropped when full) unless `async_writes=False`."""

    tier = "l2"

    def __init__(
        self,
        url: str,
        key_prefix: str = "ink:emb:",
        timeout_s: float = 0.25,
        ttl_s: int | None = None,
        max_value_bytes: int = 64 << 20,
        async_writes: bool = True,
        write_queue: int = 64,
        retry_after_s: float = 1.0,
        observer: CacheObserver | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self.retry_after_s = retry_after_s
        self.observer = observer or NullObserver()
        self.stats = CacheStats()
        self._client = client or connect_redis(url, timeout_s)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._writer: WriteBehind[tuple[bytes, bytes]] | None = None
        if async_writes:
            self._writer = WriteBehind("redis-cache-writer", lambda job: self._write(*job), write_queue)

    def redis_key(self, key: bytes) -> str:
        return self.key_prefix + key.hex()

    # -- failure handling ----------------------------------------------------------------------------------

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, exc: Exception) -> None:
        with self._lock:
            first = self._available()
            self._down_until = time.monotonic() + self.retry_after_s
            self.stats.errors += 1
        self.observer.error(self.tier, op)
        if first:
            log.warning(
                "redis %s failed (%s: %s); treating as a miss for %.1fs",
                op,
                type(exc).__name__,
                exc,
                self.retry_after_s,
            )

    # -- reads ---------------------------------------------------------------------------------------------

    def get(self, key: bytes) -> Entry | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[Entry | None]:
        if not keys:
            return []
        with self._lock:
            self.stats.queries += len(keys)
        if not self._available():
            for _ in keys:
                self.observer.lookup(self.tier, None, False)
            return [None] * len(keys)
        try:
            values = self._client.mget([self.redis_key(k) for k in keys])
        except redis.RedisError as exc:
            self._failed("get", exc)
            values = [None] * len(keys)
        out: list[Entry | None] = []
        for key, value in zip(keys, values, strict=True):
            entry = self._decode(key, value) if value is not None else None
            out.append(entry)
            self.observer.lookup(self.tier, entry.modality if entry else None, entry is not None)
        with self._lock:
            self.stats.hits += sum(e is not None for e in out)
        return out

    def _decode(self, key: bytes, value: bytes) -> Entry | None:
        try:
            return deserialize_entry(value)
        except CorruptEntryError as exc:
            with self._lock:
                self.stats.corrupt += 1
            self.observer.corrupt(self.tier)
            log.warning("corrupt cache value for %s (%s); deleting it", key.hex(), exc)
            try:
                self._client.delete(self.redis_key(key))
            except redis.RedisError as del_exc:
                self._failed("delete", del_exc)
            return None

    # -- writes --------------------------------------------------------------------------------------------

    def put(self, key: bytes, entry: Entry) -> None:
        value = serialize_entry(entry)
        if len(value) > self.max_value_bytes:
            return
        if self._writer is None:
            self._write(key, value)
        elif not self._writer.submit((key, value)):
            with self._lock:
                self.stats.dropped_writes += 1

    def _write(self, key: bytes, value: bytes) -> None:
        if not self._available():
            with self._lock:
                self.stats.dropped_writes += 1
            return
        try:
            self._client.set(self.redis_key(key), value, ex=self.ttl_s)
        except redis.RedisError as exc:
            self._failed("put", exc)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued writes are done (tests, shutdown); False on timeout."""
        return self._writer is None or self._writer.flush(timeout_s)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._client.close()


# ----------------------------------------------------------------------------------------------------------
# Tiers together


class TieredCache:
    """L1 in front of an optional L2: lookups try L1 then L2 (promoting L2 hits), writes go to both."""

    def __init__(self, l1: LruCache | None, l2: RedisCache | None) -> None:
        self.l1 = l1
        self.l2 = l2
        self.stats = CacheStats()

    def get(self, key: bytes) -> Entry | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[Entry | None]:
        out: list[Entry | None] = self.l1.get_many(keys) if self.l1 is not None else [None] * len(keys)
        missing = [i for i, e in enumerate(out) if e is None]
        if missing and self.l2 is not None:
            for i, entry in zip(missing, self.l2.get_many([keys[i] for i in missing]), strict=True):
                if entry is not None:
                    out[i] = entry
                    if self.l1 is not None:
                        self.l1.put(keys[i], entry)
        self.stats.queries += len(keys)
        self.stats.hits += sum(e is not None for e in out)
        return out

    def put(self, key: bytes, entry: Entry) -> None:
        if self.l1 is not None:
            self.l1.put(key, entry)
        if self.l2 is not None:
            self.l2.put(key, entry)

    def close(self) -> None:
        for tier in (self.l1, self.l2):
            if tier is not None:
                tier.close()
