"""The shared Redis prefix tier of a tensor-parallel replica (issue 14): per-rank KV shards under one key scheme.

Every rank holds only its local KV heads, so every rank stores its own values: rank r of N writes the keys of
`redis_tier.py` under its own fingerprint (`rank_fingerprint`: the model fingerprint plus "rank r of N"), so the
fingerprint tag in each key and the digest in each value header name the rank, and a shard of another rank, of
another TP size or of a single-process replica never verifies. Saves run on every rank from the same
`PrefixSave` plan (each after its own forward).

Reads stay on rank 0, where the scheduler asks: `LeaderPrefixTier.lookup` plans and fetches its own values as
the single-process tier does, then fetches the same values of every other rank in one MGET and verifies them; a
prefix counts only when every rank's shard is there. The followers' payloads are handed to them with the step
that loads them (`ranks.py` scatters them), where `FollowerPrefixTier.receive` stages them for the same `load`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from decode_service.engine.core.outputs import PrefixLoad
from decode_service.engine.core.prefix_tier import TierHit
from decode_service.engine.worker.kv_cache import ConvSnapshot, KVCache
from decode_service.engine.worker.prefix_store import PrefixStore
from decode_service.engine.worker.redis_tier import CostModel, RedisPrefixTier, _Plan, _Staged

# a load handed to a follower: (end block of the lookup, the follower's verified payloads)
Handover = tuple[int, list[bytes]]


def rank_fingerprint(fingerprint: bytes, rank: int, size: int) -> bytes:
    return fingerprint + f"|tensor-parallel rank {rank} of {size}".encode()


class LeaderPrefixTier(RedisPrefixTier):
    """Rank 0's tier: lookups over every rank's shard; the followers' payloads kept until their step."""

    def __init__(
        self, cache: KVCache, fingerprint: bytes, store: PrefixStore, size: int, cost: CostModel | None = None
    ):
        super().__init__(cache, rank_fingerprint(fingerprint, 0, size), store, cost)
        self.peers = [RedisPrefixTier(cache, rank_fingerprint(fingerprint, r, size), store) for r in range(1, size)]
        self._handover: dict[int, list[Handover]] = {}

    def lookup(self, block_hashes: Sequence[bytes], start_block: int) -> TierHit | None:
        hit = super().lookup(block_hashes, start_block)
        if hit is None:
            return None
        plan = self._staged[hit.load_id].plan
        cut = len(self.store.settings.key_prefix) + len(self._fp_tag)
        peer_keys = [
            [self.store.settings.key_prefix + peer._fp_tag + key[cut:] for key in plan.keys] for peer in self.peers
        ]
        values = self.store.get_many([key for keys in peer_keys for key in keys])
        handover = []
        for i, (peer, keys) in enumerate(zip(self.peers, peer_keys, strict=True)):
            mine = values[i * len(keys) : (i + 1) * len(keys)] if values is not None else None
            payloads = peer._verify(dataclasses.replace(plan, keys=keys), mine) if mine is not None else None
            if payloads is None:  # a rank's shard is missing (not written yet, evicted) or corrupt: recompute
                del self._staged[hit.load_id]
                return None
            handover.append((plan.num_blocks, [bytes(p) for p in payloads]))
        self._handover[hit.load_id] = handover
        return hit

    def take_handover(self, load_id: int) -> list[Handover]:
        """Each follower's part of a planned load (in rank order)."""
        return self._handover.pop(load_id)

    def discard_staged(self) -> None:
        super().discard_staged()
        self._handover.clear()


class FollowerPrefixTier(RedisPrefixTier):
    """A follower's tier: saves its shard; loads what rank 0 fetched for it."""

    def __init__(self, cache: KVCache, fingerprint: bytes, store: PrefixStore, rank: int, size: int):
        super().__init__(cache, rank_fingerprint(fingerprint, rank, size), store)

    def receive(self, load_id: int, handover: Handover) -> None:
        num_blocks, payloads = handover
        plan = _Plan(num_blocks, [], [], [], 0.0)
        self._staged[load_id] = _Staged(plan, [memoryview(p) for p in payloads], sum(map(len, payloads)), 0.0)

    def load(self, load: PrefixLoad) -> ConvSnapshot:
        """Install the received payloads (the fetch and its statistics are rank 0's)."""
        staged = self._staged.pop(load.load_id)
        assert staged.plan.num_blocks == load.end_block, "a load planned past its lookup"
        n_global = load.end_block - load.start_block if self.cache.has_global else 0
        return self._install(load, staged.payloads[:n_global], b"".join(staged.payloads[n_global:]))

    def lookup(self, block_hashes: Sequence[bytes], start_block: int) -> TierHit | None:
        raise AssertionError("a follower rank never plans: rank 0's scheduler looks up")
