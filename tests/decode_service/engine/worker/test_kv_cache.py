from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from decode_service.engine.core.pages import KVAllocator, SequencePages
from decode_service.engine.worker.kv_cache import BlockTables, CacheSpec, KVCache, SequenceView
from decode_service.model.state import SequenceState


def make_cache(config, pages: int = 32, slots: int = 2, page_size: int = 4) -> tuple[KVAllocator, KVCache]:
    spec = CacheSpec(page_size, pages, pages, slots, torch.float64)
    return KVAllocator(config, spec), KVCache(config, spec)


def sync(seq: SequencePages, view: SequenceView) -> None:
    """What the runner does with a chunk's page updates."""
    sliding, global_ = seq.take_updates()
    view.update(True, sliding)
    view.update(False, global_)
    view.num_tokens = seq.num_tokens


def random_kv(config, layer: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    geo = config.layer_geometry(layer)
    shape = (n, geo.num_kv_heads, geo.head_dim)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("chunks", [[21, 1, 1, 1, 5, 1], [1] * 13, [3, 9, 2, 7]])
def test_paged_layers_return_what_the_contiguous_cache_returns(model_config, chunks):
    """Every layer sees the same visible rows (from its start position on) as the reference cache."""
    config = model_config.text
    allocator, cache = make_cache(config)
    seq = allocator.new_sequence()
    view = SequenceView(cache, seq.slot)
    reference = SequenceState.fresh(config, conv_dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    start = 0
    for n in chunks:
        seq.grow(start + n)
        sync(seq, view)
        for layer in range(config.num_layers):
            k, v = random_kv(config, layer, n, g)
            ref_k, ref_v, ref_first = reference.layers[layer].append_kv(k, v, start)
            got_k, got_v, got_first = view.layers[layer].append_kv(k, v, start)
            # The paged cache may return more history than needed; the tail from the reference start must match.
            assert got_first <= ref_first
            skip = ref_first - got_first
            torch.testing.assert_close(got_k[skip:], ref_k, rtol=0, atol=0)
            torch.testing.assert_close(got_v[skip:], ref_v, rtol=0, atol=0)
            if config.sliding_layers[layer]:
                assert start + n - got_first <= config.sliding_window - 1 + n
        seq.commit(start + n)  # releases sliding pages; the view learns with the next chunk's update
        start += n


def test_conv_slots_are_stable_zeroed_and_isolated(model_config):
    config = model_config.text
    allocator, cache = make_cache(config, slots=2)
    a_seq, b_seq = allocator.new_sequence(), allocator.new_sequence()
    assert a_seq.slot != b_seq.slot
    a, b = SequenceView(cache, a_seq.slot), SequenceView(cache, b_seq.slot)
    state = torch.full((config.conv_kernel_size - 1, config.hidden_size), 2.0, dtype=torch.float64)
    a.layers[2].set_conv_state(3, state)
    address = a.layers[2].conv_state(3).data_ptr()
    assert torch.equal(a.layers[2].conv_state(3), state)
    assert not b.layers[2].conv_state(3).any()
    a.layers[2].set_conv_state(3, state * 3)
    assert a.layers[2].conv_state(3).data_ptr() == address  # written in place: CUDA-graph safe
    snap, a_slot = cache.snapshot_conv(a.slot), a.slot
    a_seq.release()
    c_seq = allocator.new_sequence()  # reuses a's slot; the scheduler's `zero` op clears it
    assert c_seq.slot == a_slot
    cache.zero_conv(c_seq.slot)
    c = SequenceView(cache, c_seq.slot)
    assert not c.layers[2].conv_state(3).any()
    cache.restore_conv(c.slot, snap)
    assert torch.equal(c.layers[2].conv_state(3), state * 3)


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


def test_block_tables_upload_the_entries_written_since_the_last_upload():
    """Each upload sends what was written since the previous one (the last write of an entry wins, a released
    page reads as the kind's scratch page); nothing else of the device tables changes."""
    tables = BlockTables(num_slots=3, max_pages=5, scratch={True: 90, False: 91}, device="cpu")
    want = {kind: torch.full((4, 5), page, dtype=torch.int32) for kind, page in ((True, 90), (False, 91))}
    tables.upload()  # nothing written
    for kind in want:
        assert torch.equal(tables.device[kind], want[kind])
    rounds = [
        [(0, True, 0, [3, 4]), (2, False, 0, [7]), (0, True, 1, [5])],  # entry (0, 1) written twice
        [(1, False, 2, [8, 9, 10]), (0, True, 0, [None])],  # a released sliding page
        [(2, True, 4, [11])],  # one kind only
    ]
    for writes in rounds:
        for slot, sliding, first, pages in writes:
            tables.write(slot, sliding, first, pages)
            for i, page in enumerate(pages):
                want[sliding][slot, first + i] = 90 if page is None else page
        tables.upload()
        for kind in want:
            assert torch.equal(tables.device[kind], want[kind])
