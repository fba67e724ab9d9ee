"""Uniform decode steps through `DecodeGraphs` (static buffers, buckets, padding rows, device block tables, the
paged kernels): the engine's greedy tokens equal each sequence run alone on the reference path.

On CPU the kernels run in Triton's interpreter and the static-buffer step runs eagerly (no graphs); the GPU test
also captures the graphs and compares them with the same path run eagerly."""

from __future__ import annotations

import pytest
import torch

from decode_service.engine.core.pages import KVAllocator
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import MultimodalItem, Request, SamplingParams
from decode_service.engine.worker.decode_graphs import DecodeGraphs
from decode_service.engine.worker.kv_cache import CacheSpec, KVCache, SequenceView

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
    graphs.run = lambda ids, views, *pending: calls.append(len(ids)) or run(ids, views, *pending)
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


def test_greedy_steps_take_the_graph_argmax(cpu_interpreter, kernel_model, kernel_config):
    """Greedy requests without logprobs, penalties or grammar: every decode step's tokens are the decode graphs'
    argmax (`greedy_tokens`; the host samples only the prompts' first tokens); a request asking for logprobs or
    with a repetition penalty sends every step it is in to the host sampler; the tokens are the same."""
    prompts = [prompt(n, 20 + i) for i, n in enumerate((3, 13, 21))]

    def generate(samplings: list[SamplingParams]) -> tuple[list[list[int]], list[set[str]], list[set[str]]]:
        """Tokens, and the request ids of each step sampled by the graphs' argmax / on the host."""
        # the synchronous steps (async ones sample in `ModelRunner.launch`: test_engine_async.py)
        engine = Engine(kernel_model.with_ops("fast"), kernel_config, settings(async_scheduling=False))
        runner, steps = engine.runner, ([], [])
        greedy_samples, sample = runner._greedy_samples, runner._sample

        def counted(fn, seen: list[set[str]]):
            return lambda chunks, *args: seen.append({c.request_id for c in chunks}) or fn(chunks, *args)

        runner._greedy_samples, runner._sample = counted(greedy_samples, steps[0]), counted(sample, steps[1])
        requests = [Request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))]
        return [o.token_ids for o in engine.generate(requests)], *steps

    fast, argmax_steps, host_steps = generate([GREEDY] * 3)
    assert len(argmax_steps) >= 7 and len(host_steps) <= 3  # 8 tokens each: 7+ decode steps; the prompts' ends
    logprobs = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    tokens, argmax_steps, _ = generate([logprobs] * 3)
    assert tokens == fast and not argmax_steps
    penalty = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.0 + 1e-9)
    tokens, argmax_steps, host_steps = generate([GREEDY, penalty, logprobs])
    assert tokens == fast and all(ids == {"r0"} for ids in argmax_steps)
    assert any(len(ids) == 3 for ids in host_steps)  # a decode step of all three, on the host


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


def sequences_in(cache: KVCache, starts: list[int], width: int) -> list[SequenceView]:
    """Sequences with `starts[i]` committed tokens and the pages of `width` more (their KV and conv states are
    whatever the pools hold)."""
    allocator, views = KVAllocator(cache.config, cache.spec), []
    for start in starts:
        pages = allocator.new_sequence()
        pages.grow(start + width)
        pages.commit(start)  # releases the sliding pages before the window
        view = SequenceView(cache, pages.slot)
        for sliding, update in zip((True, False), pages.take_updates(), strict=True):
            view.update(sliding, update)
        view.num_tokens = start
        views.append(view)
    return views


def pool_tensors(cache: KVCache) -> list[torch.Tensor]:
    return [*cache.k.values(), *cache.v.values(), *(s for states in cache.conv for s in states)]


def test_verify_and_commit_equal_one_token_steps(cpu_interpreter, kernel_model, kernel_config):
    """Three sequences (past the window 8, rel_extent 12 and the tau floor 10) bring 3, 2 and 1 tokens in a
    bucket of four at width 3: each verify row's hidden equals the one-token step at its position, and after
    committing 2, 1 and 1 rows the conv states and the KV of the committed positions equal those after that many
    one-token steps."""
    model = kernel_model.with_ops("fast")
    spec = CacheSpec(4, 24, 24, 4, torch.float32, "cpu")
    caches = [KVCache(kernel_config.text, spec) for _ in range(2)]
    g = torch.Generator().manual_seed(7)
    for a, b in zip(pool_tensors(caches[0]), pool_tensors(caches[1]), strict=True):
        a.copy_(torch.randn(a.shape, generator=g))  # random KV and conv states: the verify must read the states
        b.copy_(a)
    starts, tokens, accepted = [13, 5, 20], [(11, 12, 13), (21, 22), (31,)], [2, 1, 1]
    graphs = DecodeGraphs(model, caches[0], max_num_seqs=4, max_model_len=32, widths=(1, 3))
    plain = DecodeGraphs(model, caches[1], max_num_seqs=4, max_model_len=32)
    views, plain_views = sequences_in(caches[0], starts, 3), sequences_in(caches[1], starts, 3)
    with torch.inference_mode():
        hidden, width = graphs.verify(tokens, views)
        graphs.commit(accepted)
        committed = {}
        for j in range(width):
            now = [i for i, t in enumerate(tokens) if j < len(t)]
            for i in now:
                plain_views[i].num_tokens = starts[i] + j
            rows = plain.run([tokens[i][j] for i in now], [plain_views[i] for i in now])
            for i, row in zip(now, rows, strict=True):
                torch.testing.assert_close(hidden[i * width + j], row, rtol=1e-5, atol=1e-5)
                if accepted[i] == j + 1:
                    committed[i] = caches[1].snapshot_conv(plain_views[i].slot)
    assert width == 3 and hidden.shape == (3 * 3, kernel_config.text.hidden_size)
    for i, view in enumerate(views):
        states = [s for layer in caches[0].snapshot_conv(view.slot).states for s in layer]
        want = [s for layer in committed[i].states for s in layer]
        for a, b in zip(states, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        positions = torch.arange(starts[i], starts[i] + accepted[i])
        for sliding in (True, False):
            pages = torch.tensor([view.tables[sliding][p // 4] for p in positions.tolist()])
            rows = pages * 4 + positions % 4
            for got, ref in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
                torch.testing.assert_close(got[sliding][:, rows], ref[sliding][:, rows], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_verify_graph_replay_equals_the_eager_step(cuda_device, kernel_model, kernel_config):
    """On CUDA: a verify and its commit replayed from their graphs leave the hidden rows, KV and conv states the
    same static-buffer step run eagerly leaves."""
    model = kernel_model.to("cuda").with_ops("auto")
    spec = CacheSpec(4, 24, 24, 4, torch.float32, "cuda")
    caches = [KVCache(kernel_config.text, spec) for _ in range(2)]
    for a, b in zip(pool_tensors(caches[0]), pool_tensors(caches[1]), strict=True):
        a.normal_()
        b.copy_(a)
    starts, tokens, accepted = [13, 5, 20], [(11, 12, 13), (21, 22), (31,)], [2, 1, 1]
    hidden = []
    for cache, graphs in zip(caches, (True, False), strict=True):
        decode = DecodeGraphs(model, cache, max_num_seqs=4, max_model_len=32, use_graphs=graphs, widths=(1, 3))
        assert decode.capture == graphs
        views = sequences_in(cache, starts, 3)
        with torch.inference_mode():
            rows, _ = decode.verify(tokens, views)
            decode.commit(accepted)
        hidden.append(rows.clone())
    kernel_model.to("cpu")
    torch.testing.assert_close(hidden[0], hidden[1], rtol=0, atol=0)
    for a, b in zip(real_rows(caches[0]), real_rows(caches[1]), strict=True):  # scratch writes race
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def real_rows(cache: KVCache) -> list[torch.Tensor]:
    """The pools without their scratch page and scratch conv slot."""
    page = cache.page_size
    kv = [t[:, : cache.scratch_page[sliding] * page] for pools in (cache.k, cache.v) for sliding, t in pools.items()]
    return kv + [s[: cache.scratch_slot] for states in cache.conv for s in states]
