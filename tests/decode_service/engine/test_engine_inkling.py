"""The engine on the real `InklingDecoder` (tiny, random weights): paged, batched, chunked, prefix-cached and
preempted generation gives the greedy tokens of each sequence run alone on the contiguous `SequenceState`."""

from __future__ import annotations

import torch

from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import MultimodalItem, Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings(**kw) -> EngineSettings:
    base = dict(
        kv_cache_bytes=1 << 22, page_size=4, max_num_seqs=4, max_num_batched_tokens=20, snapshot_interval_blocks=2
    )
    base.update(kw)
    return EngineSettings(**base)


def test_interleaved_requests_equal_each_request_alone(inkling_model, model_config, reference):
    prompts = [prompt(n, i) for i, n in enumerate((3, 26, 13, 37, 8))]  # window 8, rel_extent 12, n_floor 10
    engine = Engine(inkling_model, model_config, settings(enable_prefix_cache=False))
    outs = engine.generate(Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
    for out, p in zip(outs, prompts, strict=True):
        assert out.token_ids == reference(inkling_model, model_config.text, p, 10)


def test_prefix_cache_hit_gives_identical_output(inkling_model, model_config, reference):
    engine = Engine(inkling_model, model_config, settings())
    shared = prompt(27, 7)
    first = engine.generate([Request("a", shared + [11, 12], GREEDY)])[0]
    second = engine.generate([Request("b", shared + [13, 14, 15], GREEDY)])[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 24
    assert second.token_ids == reference(inkling_model, model_config.text, shared + [13, 14, 15], 10)
    again = engine.generate([Request("c", shared + [11, 12], GREEDY)])[0]
    assert again.num_cached_tokens == 28 and again.token_ids == first.token_ids


def test_preemption_under_a_tiny_budget_completes_every_request(inkling_model, model_config, reference):
    prompts = [prompt(n, 20 + i) for i, n in enumerate((30, 22, 35, 17))]
    # fp32: 4 conv slots take 13056 bytes, a sliding + global page pair 1280 bytes; 20 pages of each.
    engine = Engine(inkling_model, model_config, settings(kv_cache_bytes=13056 + 20 * 1280))
    assert engine.cache.pools[False].num_pages == 20
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    outs = engine.generate(requests)
    assert sum(r.num_preemptions for r in requests) > 0
    for out, p in zip(outs, prompts, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == reference(inkling_model, model_config.text, p, 10)


def test_multimodal_chunks_and_prefix_hits(inkling_model, model_config, reference):
    hidden = model_config.text.hidden_size
    g = torch.Generator().manual_seed(5)
    items = (
        MultimodalItem(b"\x07" * 32, 2, torch.randn(9, hidden, generator=g)),
        MultimodalItem(b"\x08" * 32, 15, torch.randn(6, hidden, generator=g)),
    )
    p = prompt(27, 9)
    engine = Engine(inkling_model, model_config, settings(max_num_batched_tokens=5))
    out = engine.generate([Request("mm", p, GREEDY, mm_items=items)])[0]
    want = reference(inkling_model, model_config.text, p, 10, mm=items)
    assert out.token_ids == want
    again = engine.generate([Request("mm-again", p, GREEDY, mm_items=items)])[0]
    assert again.num_cached_tokens > 0 and again.token_ids == want
