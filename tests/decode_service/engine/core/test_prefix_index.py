"""Prefix-cache bookkeeping without a model: hashes, usable boundaries, window pages, snapshot ids, eviction."""

from __future__ import annotations

import torch

from decode_service.engine.core.pages import KVAllocator, PoolSizes
from decode_service.engine.core.prefix_index import PrefixCache
from decode_service.engine.request import MultimodalItem, Request

P = 4  # page size; the tiny config's window is 8 (a query sees itself + 7 earlier tokens)


def make(config, pages: int = 64, interval_blocks: int = 2) -> PrefixCache:
    return PrefixCache(KVAllocator(config, PoolSizes(P, pages, pages, 4)), b"model-a", interval_blocks)


def compute(prefix: PrefixCache, request: Request, chunks: list[int]) -> None:
    """Pretend to prefill `request` in the given chunks, recording blocks (and planned snapshot ids) as the scheduler
    does, then free it."""
    handle = prefix.cache.new_sequence()
    done = 0
    for n in chunks:
        handle.grow(done + n)
        snapshot = prefix.snapshots.new() if prefix.wants_snapshot(request, done + n) else None
        taken = prefix.insert(request, handle, done + n, snapshot)
        assert taken == (snapshot is not None)
        handle.commit(done + n)
        done += n
    handle.release()


def tokens(n: int, offset: int = 10) -> list[int]:
    return list(range(offset, offset + n))


def test_hash_chain_covers_tokens_salt_fingerprint_and_media(model_config):
    prefix = make(model_config.text)
    base = prefix.block_hashes(Request("a", tokens(12)), 3)
    assert prefix.block_hashes(Request("b", tokens(12)), 3) == base
    assert prefix.block_hashes(Request("c", tokens(12), cache_salt="x"), 3)[0] != base[0]
    other_model = PrefixCache(prefix.cache, b"model-b", 2)
    assert other_model.block_hashes(Request("d", tokens(12)), 1)[0] != base[0]
    changed = tokens(12)
    changed[5] = 99
    hashes = prefix.block_hashes(Request("e", changed), 3)
    assert hashes[0] == base[0] and hashes[1] != base[1] and hashes[2] != base[2]  # chained

    rows = torch.zeros(4, model_config.text.hidden_size)
    at5 = prefix.block_hashes(Request("f", tokens(12), mm_items=(MultimodalItem(b"k" * 32, 5, rows),)), 3)
    at6 = prefix.block_hashes(Request("g", tokens(12), mm_items=(MultimodalItem(b"k" * 32, 6, rows),)), 3)
    other_key = prefix.block_hashes(Request("h", tokens(12), mm_items=(MultimodalItem(b"j" * 32, 5, rows),)), 3)
    assert at5[0] == base[0] and at5[1] != base[1]  # only blocks from the media on change
    assert at5[1] != at6[1] and at5[1] != other_key[1]


def test_hit_needs_a_snapshot_and_leaves_a_token_to_compute(model_config):
    prefix = make(model_config.text)
    # Chunks end on the tracked boundaries 8, 16 (every 2 blocks) and 20 (the last block start before the
    # prompt's last token), so those get snapshots; 12 is not tracked.
    compute(prefix, Request("a", tokens(23)), [8, 8, 4, 3])
    hit = prefix.lookup(Request("b", tokens(22) + [1, 2, 3]))
    assert hit is not None and hit.num_tokens == 20  # the prompt-end boundary of "a" ((23-1)//4*4)
    assert len(hit.global_pages) == 5
    assert hit.sliding_pages[:3] == [None] * 3 and None not in hit.sliding_pages[3:]  # window of 20: 13..19
    # Diverging at token 13: blocks 0..2 match, but 12 has no snapshot, so the hit falls back to 8.
    diverged = tokens(23)
    diverged[13] = 1
    assert prefix.lookup(Request("c", diverged)).num_tokens == 8
    assert prefix.stats.truncated_no_snapshot == 1
    # Identical prompt: at most num_tokens - 1 may come from the cache.
    assert prefix.lookup(Request("d", tokens(9))).num_tokens == 8
    assert prefix.lookup(Request("e", tokens(8))) is None


def test_hit_needs_the_sliding_window_pages(model_config):
    prefix = make(model_config.text)
    compute(prefix, Request("a", tokens(17)), [8, 8, 1])  # snapshots at 8 and 16
    entries = list(prefix.entries.values())
    pool = prefix.cache.pools[True]
    # Drop the sliding page of block 2 (inside the window of 16): only the boundary 8 stays usable.
    pool.decref(entries[2].sliding_page)
    entries[2].sliding_page = None
    assert prefix.lookup(Request("b", tokens(17))).num_tokens == 8


def test_eviction_is_lru_and_spares_shared_pages(model_config):
    prefix = make(model_config.text, pages=12)
    cache = prefix.cache
    compute(prefix, Request("old", tokens(17, offset=10)), [8, 8, 1])
    compute(prefix, Request("new", tokens(17, offset=40)), [8, 8, 1])
    assert cache.num_free_pages(False) == 12 - 8
    hit = prefix.lookup(Request("user", tokens(17, offset=40)))
    user = cache.new_sequence()
    user.adopt_prefix(hit.num_tokens, hit.global_pages, hit.sliding_pages)
    snapshots = {e.snapshot for e in prefix.entries.values() if e.snapshot is not None}
    assert prefix.evict((0, 9)) is False  # "new" is referenced by "user": only "old" can go
    dropped = prefix.snapshots.take_dropped()
    assert len(dropped) == 2 and set(dropped) < snapshots  # old's snapshots at 8 and 16 go with its entries
    assert prefix.lookup(Request("x", tokens(17, offset=40))).num_tokens == 16
    assert prefix.lookup(Request("y", tokens(17, offset=10))) is None
    user.release()
    assert prefix.evict((0, 12))
    assert not prefix.entries
    assert cache.num_free_pages(True) == 12 and cache.num_free_pages(False) == 12
