"""Page and slot ids without tensors: ref counts, the sliding window's releases, the updates the data plane gets."""

from __future__ import annotations

import pytest

from decode_service.engine.core.pages import KVAllocator, PagePool, PoolSizes


def make_allocator(config, pages: int = 32, slots: int = 2, page_size: int = 4) -> KVAllocator:
    return KVAllocator(config, PoolSizes(page_size, pages, pages, slots))


def test_sliding_pages_are_released_outside_the_window(model_config):
    config = model_config.text  # window 8, page 4: a sequence keeps at most 7 past tokens (+ the current)
    cache = make_allocator(config, pages=16, page_size=4)
    handle = cache.new_sequence()
    for total in range(1, 41):
        handle.grow(total)
        handle.commit(total)
        held = [p for p in handle.tables[True] if p is not None]
        assert len(held) <= 3  # ceil((7 + 1) / 4) + a partially covered one
        assert len(handle.tables[False]) == -(-total // 4)  # global layers keep everything
    assert cache.num_free_pages(True) == 16 - len([p for p in handle.tables[True] if p is not None])
    handle.release()
    assert cache.num_free_pages(True) == 16 and cache.num_free_pages(False) == 16
    assert cache.num_free_slots == 2
    handle.release()  # idempotent
    assert cache.num_free_slots == 2


def test_updates_replay_the_tables(model_config):
    """Applying every `take_updates` in order rebuilds the block tables, released sliding pages included."""
    config = model_config.text
    cache = make_allocator(config, pages=16, page_size=4)
    seq = cache.new_sequence()
    mirror: dict[bool, list[int | None]] = {True: [], False: []}
    for total in (5, 6, 13, 14, 27, 28, 29):
        seq.grow(total)
        for sliding, update in zip((True, False), seq.take_updates(), strict=True):
            assert update.first == len(mirror[sliding])
            mirror[sliding] = [None if p in update.freed else p for p in mirror[sliding]] + list(update.pages)
        assert mirror[False] == seq.tables[False]
        assert mirror[True] == seq.tables[True]  # including the pages the previous commit released
        seq.commit(total)
    assert not seq.is_new
    assert any(p is None for p in seq.tables[True]), "the window released pages"


def test_page_pool_refcounts():
    pool = PagePool(3)
    (p,) = pool.allocate(1)
    pool.incref(p)
    pool.decref(p)
    assert pool.num_free == 2
    pool.decref(p)
    assert pool.num_free == 3
    with pytest.raises(AssertionError):
        pool.decref(p)
