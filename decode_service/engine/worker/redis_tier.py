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

Write-behind (`save`, after the forward of a chunk, from the scheduler's `PrefixSave` plan): the global blocks a
prefill step completed inside the prompt and, when the step ended on a tracked boundary, that boundary's window
and conv states are copied to host memory and queued for a writer thread. The queue is bounded in entries and
bytes; a full queue drops the write, it never blocks decoding. Values above `max_value_bytes` are not stored.
SET with a TTL; Redis evicts with allkeys-lru.

Read path (`lookup`, called by the scheduler at admission after the GPU prefix lookup, then `load` from the
step's `PrefixLoad`): one STRLEN script over the candidate keys gives the chain present in Redis; the cost model
picks the boundary with the largest estimated saving (tokens / measured prefill rate minus bytes / measured Redis
throughput); one MGET fetches it; every value is verified and staged. The scheduler allocates pages and records
the blocks in the GPU prefix index; `load` copies the staged payloads into those pages and returns the conv
snapshot (restored into the slot by a conv op). Any failure (Redis down, a value missing, corrupt or from another
model) means recompute from the GPU hit; corrupt values are deleted.

Not yet: the lookup is synchronous on the engine thread (bounded by the Redis timeout and a circuit breaker); on
a GPU the host copies are synchronous too.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from decode_service.engine.core.outputs import PrefixLoad, PrefixSave
from decode_service.engine.core.prefix_tier import TierHit
from decode_service.engine.worker.kv_cache import NUM_CONVS, ConvSnapshot, KVCache
from decode_service.engine.worker.prefix_format import (
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
from decode_service.engine.worker.prefix_store import PrefixStore

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _Plan:
    num_blocks: int  # the boundary to reach, in blocks
    keys: list[str]  # global blocks [start, num_blocks), then the boundary's parts
    ids: list[ValueId]
    sizes: list[int]  # payload bytes of each value
    saved_s: float


class _Staged(NamedTuple):
    plan: _Plan
    payloads: list[memoryview]
    nbytes: int
    seconds: float


class RedisPrefixTier:
    """The data plane's side of the shared prefix tier: lookups for the scheduler (`core.prefix_tier.PrefixTier`),
    then the plan's loads and saves."""

    def __init__(self, cache: KVCache, fingerprint: bytes, store: PrefixStore, cost: CostModel | None = None):
        self.cache = cache
        self.fingerprint = fingerprint
        self.store = store
        self.stats = store.stats
        self.cost = cost or CostModel()
        self.geometry = Geometry.of(cache)
        self.page_size = cache.page_size
        self.elt = torch.empty((), dtype=cache.spec.dtype).element_size()
        self._fp_tag = hashlib.sha256(fingerprint).hexdigest()[:16]
        self._load_ids = itertools.count(1)
        self._staged: dict[int, _Staged] = {}

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

    def save(self, save: PrefixSave) -> None:
        """After the forward of the chunk `save` was planned for: queue its global blocks and boundary."""
        if self.cache.has_global:
            p = self.page_size
            for block in save.blocks:
                rows = slice(block.page * p, (block.page + 1) * p)
                self._queue(
                    [self.key(KIND_GLOBAL, block.block_hash)],
                    [ValueId(KIND_GLOBAL, block.index)],
                    [self.global_bytes()],
                    lambda rows=rows: [self.cache.k[False][:, rows], self.cache.v[False][:, rows]],
                )
        b = save.boundary
        if b is not None:
            tensors = lambda: self._boundary_tensors(b.sliding_pages, b.slot)  # noqa: E731
            self._queue(*self._boundary_values(b.block_hash, b.boundary), tensors)

    def _boundary_tensors(self, pages: Sequence[int], slot: int) -> list[torch.Tensor]:
        out = []
        if pages:
            rows = self._rows(pages)
            out += [self.cache.k[True].index_select(1, rows), self.cache.v[True].index_select(1, rows)]
        return out + [s[slot] for states in self.cache.conv for s in states]

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
        fingerprint, geometry = self.fingerprint, self.geometry

        def encode() -> list[bytes]:
            payload, values, offset = memoryview(to_bytes(host)), [], 0
            for vid, n in zip(ids, sizes, strict=True):
                values.append(encode_value(vid, fingerprint, geometry, payload[offset : offset + n]))
                offset += n
            return values

        self.store.put(keys, encode, sum(sizes))

    # -- read path -------------------------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes], start_block: int) -> TierHit | None:
        """The most worthwhile boundary after `start_block` (a GPU-hit boundary or 0) of the chain in Redis,
        fetched and verified, staged for `load`; None = recompute."""
        if not self.store.available:
            return None
        if not self.cost.ready:
            if not self.cost.redis_bytes_per_s:  # Redis was down at start-up
                self._measure_redis()
            if not self.cost.ready:
                return None
        self.stats.queries += 1
        plan = self._plan(block_hashes, start_block)
        if plan is None:
            return None
        began = time.perf_counter()
        values = self.store.get_many(plan.keys)
        payloads = self._verify(plan, values) if values is not None else None
        if payloads is None:
            return None
        load_id = next(self._load_ids)
        nbytes = sum(len(v) for v in values)
        self._staged[load_id] = _Staged(plan, payloads, nbytes, time.perf_counter() - began)
        return TierHit(load_id, plan.num_blocks)

    def load(self, load: PrefixLoad) -> ConvSnapshot:
        """Copy a staged lookup into the pages the scheduler allocated; the conv snapshot at its boundary."""
        staged = self._staged.pop(load.load_id)
        assert staged.plan.num_blocks == load.end_block, "a load planned past its lookup"
        began = time.perf_counter()
        n_global = load.end_block - load.start_block if self.cache.has_global else 0
        snapshot = self._install(load, staged.payloads[:n_global], b"".join(staged.payloads[n_global:]))
        elapsed = staged.seconds + time.perf_counter() - began
        tokens = (load.end_block - load.start_block) * self.page_size
        self.stats.hits += 1
        self.stats.hit_tokens += tokens
        self.stats.bytes_fetched += staged.nbytes
        self.stats.fetch_seconds += elapsed
        self.stats.saved_seconds_estimate += self.cost.recompute_seconds(tokens) - elapsed
        return snapshot

    def discard_staged(self) -> None:
        """Forget lookups that no load used (the scheduler could not make room for them)."""
        self._staged.clear()

    def _plan(self, hashes: Sequence[bytes], start: int) -> _Plan | None:
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
        fingerprint = self.fingerprint
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

    def _install(self, load: PrefixLoad, blocks: list[memoryview], boundary: bytes) -> ConvSnapshot:
        """Copy the verified payloads into the load's pages (sliding: only those in the window of the boundary);
        returns the conv snapshot at the boundary."""
        cache, p, g = self.cache, self.page_size, self.geometry
        start, end = load.start_block, load.end_block
        if cache.has_global:
            pages = load.global_pages
            shape = (len(pages), 2, g.global_layers, p, g.global_kv_heads, g.global_head_dim)
            kv, _ = self._tensor(b"".join(blocks), 0, shape)  # [blocks, k/v, Lg, P, nKV, hd]
            kv = kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)  # [k/v, Lg, blocks * P, nKV, hd]
            rows = self._rows(pages)
            cache.k[False].index_copy_(1, rows, kv[0])
            cache.v[False].index_copy_(1, rows, kv[1])
        offset = 0
        if cache.has_sliding:
            first, lo = self.window_first_block(end * p), load.sliding_first
            assert lo == max(first, start), "sliding pages of a load do not start at its window"
            shape = (g.sliding_layers, (end - first) * p, g.sliding_kv_heads, g.sliding_head_dim)
            k, offset = self._tensor(boundary, 0, shape)
            v, offset = self._tensor(boundary, offset, shape)
            rows = self._rows(load.sliding_pages)
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
        return ConvSnapshot(tuple(states))
