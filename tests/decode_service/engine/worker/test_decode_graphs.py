"""Uniform decode steps through `DecodeGraphs` (static buffers, buckets, padding rows, device block tables, the
paged kernels): the engine's greedy tokens equal each sequence run alone on the reference path.

On CPU the kernels run in Triton's interpreter and the static-buffer step runs eagerly (no graphs); the GPU test
also captures the graphs and compares them with the same path run eagerly."""

from __future__ import annotations

import pytest
import torch

from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import MultimodalItem, Request, SamplingParams
from decode_service.engine.worker.decode_graphs import DecodeGraphs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings(**kw) -> EngineSettings:
    base = dict(kv_cache_bytes=1 << 22, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    return EngineSettings(**{**base, **kw})


def test_buckets_end_at_max_num_seqs(kernel_model, kernel_config):
    engine = Engine(kernel_model, kernel_config, settings(max_num_seqs=6))
    graphs = DecodeGraphs(kernel_model, engine.kv, max_num_seqs=6, max_model_len=64)
    assert graphs.buckets == [1, 2, 4, 6]
    assert [graphs.bucket(b) for b in (1, 3, 5, 6)] == [1, 4, 6, 6]
    with pytest.raises(AssertionError):
        graphs.bucket(7)


def test_reference_engine_keeps_the_packed_path(kernel_model, kernel_config):
    assert Engine(kernel_model, kernel_config, settings()).runner.decode_graphs is None  # CPU, mode auto


def test_batched_decode_equals_each_sequence_alone(cpu_interpreter, kernel_model, kernel_config, reference):
    """Three sequences in the bucket of four (one padding row), past the window (8), rel_extent (12) and the tau
    floor (10); a prefix-cache hit and a media span in the prompt; then a step of padding rows only writes the
    scratch pages and the scratch conv slot."""
    text = kernel_config.text
    g = torch.Generator().manual_seed(3)
    media = MultimodalItem(b"\x05" * 32, 2, torch.randn(5, text.hidden_size, generator=g))
    prompts = [prompt(n, i) for i, n in enumerate((3, 13, 21))]
    engine = Engine(kernel_model.with_ops("fast"), kernel_config, settings())
    graphs = engine.runner.decode_graphs
    assert graphs is not None and not graphs.capture
    calls = []
    run = graphs.run
    graphs.run = lambda ids, views: calls.append(len(ids)) or run(ids, views)
    requests = [Request(f"r{i}", p, GREEDY, mm_items=(media,) if i == 2 else ()) for i, p in enumerate(prompts)]
    outs = engine.generate(requests)
    again = engine.generate([Request("again", prompts[1] + [7, 8, 9, 10], GREEDY)])[0]
    assert 3 in calls and again.num_cached_tokens > 0
    for out, p, request in zip(outs, prompts, requests, strict=True):
        assert out.token_ids == reference(kernel_model, text, p, 8, mm=request.mm_items)
    assert again.token_ids == reference(kernel_model, text, prompts[1] + [7, 8, 9, 10], 8)

    cache = engine.kv
    for t in (*cache.k.values(), *cache.v.values(), *(s for c in cache.conv for s in c)):
        t[..., 0].fill_(-1.0)  # the padding step's writes show even where they repeat earlier ones
    before = [t.clone() for t in (*cache.k.values(), *cache.v.values(), *(s for c in cache.conv for s in c))]
    with torch.inference_mode():
        graphs.warm_up(4)
    after = [*cache.k.values(), *cache.v.values(), *(s for c in cache.conv for s in c)]
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        changed = (a != b).flatten(2).any(-1) if i < 4 else (a != b).flatten(1).any(-1)  # [layers, rows] / [slots]
        rows = changed.nonzero()[:, -1].unique().tolist()
        if i < 4:  # KV pools: only rows of the scratch page
            page = cache.scratch_page[i % 2 == 0]
            assert rows and all(r // cache.page_size == page for r in rows)
        else:
            assert rows == [cache.scratch_slot]


@pytest.mark.gpu
def test_graph_replay_equals_the_eager_step(cuda_device, kernel_model, kernel_config):
    """On CUDA: the same requests with graphs captured and with the static-buffer step run eagerly."""
    model = kernel_model.to("cuda").with_ops("auto")  # built on the CPU with reference ops
    prompts = [prompt(n, i) for i, n in enumerate((3, 13, 21, 30, 5))]
    tokens = {}
    for graphs in (True, False):
        engine = Engine(model, kernel_config, settings(device="cuda", max_num_seqs=8, cuda_graphs=graphs))
        assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.capture == graphs
        outs = engine.generate(Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
        tokens[graphs] = [o.token_ids for o in outs]
    kernel_model.to("cpu")
    assert tokens[True] == tokens[False]
