from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from decode_service.engine.kv_cache import CacheSpec, KVCache, PagePool
from decode_service.model.state import SequenceState


def make_cache(config, pages: int = 32, slots: int = 2, page_size: int = 4) -> KVCache:
    return KVCache(config, CacheSpec(page_size, pages, pages, slots, torch.float64))


def random_kv(config, layer: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    geo = config.layer_geometry(layer)
    shape = (n, geo.num_kv_heads, geo.head_dim)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("chunks", [[21, 1, 1, 1, 5, 1], [1] * 13, [3, 9, 2, 7]])
def test_paged_layers_return_what_the_contiguous_cache_returns(model_config, chunks):
    """Every layer sees the same visible rows (from its start position on) as the reference cache."""
    config = model_config.text
    cache = make_cache(config)
    handle = cache.new_handle()
    reference = SequenceState.fresh(config, conv_dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    start = 0
    for n in chunks:
        handle.grow(start + n)
        for layer in range(config.num_layers):
            k, v = random_kv(config, layer, n, g)
            ref_k, ref_v, ref_first = reference.layers[layer].append_kv(k, v, start)
            got_k, got_v, got_first = handle.layers[layer].append_kv(k, v, start)
            # The paged cache may return more history than needed; the tail from the reference start must match.
            assert got_first <= ref_first
            skip = ref_first - got_first
            torch.testing.assert_close(got_k[skip:], ref_k, rtol=0, atol=0)
            torch.testing.assert_close(got_v[skip:], ref_v, rtol=0, atol=0)
            if config.sliding_layers[layer]:
                assert start + n - got_first <= config.sliding_window - 1 + n
        handle.commit(start + n)
        start += n


def test_sliding_pages_are_released_outside_the_window(model_config):
    config = model_config.text  # window 8, page 4: a sequence keeps at most 7 past tokens (+ the current)
    cache = make_cache(config, pages=16, page_size=4)
    handle = cache.new_handle()
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


def test_conv_slots_are_stable_zeroed_and_isolated(model_config):
    config = model_config.text
    cache = make_cache(config, slots=2)
    a, b = cache.new_handle(), cache.new_handle()
    assert a.slot != b.slot
    state = torch.full((config.conv_kernel_size - 1, config.hidden_size), 2.0, dtype=torch.float64)
    a.layers[2].set_conv_state(3, state)
    address = a.layers[2].conv_state(3).data_ptr()
    assert torch.equal(a.layers[2].conv_state(3), state)
    assert not b.layers[2].conv_state(3).any()
    a.layers[2].set_conv_state(3, state * 3)
    assert a.layers[2].conv_state(3).data_ptr() == address  # written in place: CUDA-graph safe
    snap, a_slot = a.snapshot_conv(), a.slot
    a.release()
    c = cache.new_handle()  # reuses a's slot, which must come back zeroed
    assert c.slot == a_slot
    assert not c.layers[2].conv_state(3).any()
    c.restore_conv(snap)
    assert torch.equal(c.layers[2].conv_state(3), state * 3)


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


def test_budget_split(model_config):
    config = model_config.text
    spec = CacheSpec.from_budget(
        config, 1 << 20, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, dtype=torch.float32
    )
    # Sliding pages are capped at twice what two windows plus a full chunk use; the rest goes to global pages.
    assert spec.num_sliding_pages == 2 * 2 * (-(-(8 - 1 + 16) // 4) + 1)
    assert spec.num_global_pages > spec.num_sliding_pages
    with pytest.raises(ConfigError):
        CacheSpec.from_budget(config, 100, page_size=4, max_num_seqs=2, max_num_batched_tokens=16)
