"""What `bench.bench_mtp` times, built as the engine runs it: B sequences in the engine's paged cache and their
plain or verify step from its CUDA graphs (`graph_step`), the draft chain per request and eagerly (`DraftChain`)
or through `PagedMTPSpeculator` from the chain's CUDA graph (`GraphedChain`), and the host time before a graph's
replay (`host_before_replay_ms`)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from bench.proxy import PAGE
from decode_service.engine.core.pages import KVAllocator
from decode_service.engine.worker.decode_graphs import DecodeGraphs
from decode_service.engine.worker.draft_graphs import DepthPools, DraftGraphs
from decode_service.engine.worker.kv_cache import CacheSpec, KVCache, SequenceView
from decode_service.engine.worker.mtp import DraftInput, PagedMTPSpeculator, Tokens
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter


def paged_sequences(
    model: InklingDecoder, batch: int, ctx: int, width: int, graph_widths: Sequence[int] = ()
) -> tuple[list[SequenceView], DecodeGraphs | None]:
    """B sequences with `ctx` committed tokens of random K/V in the engine's paged cache, with the pages of `width`
    new tokens each; `graph_widths`: also the engine's `DecodeGraphs` of those widths over the same cache."""
    config, device = model.config, model.embed.weight.device
    window_pages = math.ceil((config.sliding_window + width) / PAGE) + 2
    ctx_pages = math.ceil((ctx + width) / PAGE)
    spec = CacheSpec(PAGE, batch * window_pages + ctx_pages, batch * ctx_pages, batch, model.dtype, device)
    cache, allocator = KVCache(config, spec), KVAllocator(config, spec)
    for pool in (*cache.k.values(), *cache.v.values()):
        pool.normal_()
    graphs = None
    if graph_widths:  # block tables before the sequences' pages
        graphs = DecodeGraphs(model, cache, max_num_seqs=batch, max_model_len=ctx + width, widths=graph_widths)
    handles = []
    for _ in range(batch):
        pages = allocator.new_sequence()
        pages.grow(ctx + width)
        pages.commit(ctx)  # drops the sliding pages before the window
        handle = SequenceView(cache, pages.slot)
        for sliding, update in zip((True, False), pages.take_updates(), strict=True):
            handle.update(sliding, update)
        handle.num_tokens = ctx
        handles.append(handle)
    return handles, graphs


def paged_batch(model: InklingDecoder, batch: int, ctx: int, width: int) -> ForwardBatch:
    """The packed batch that brings `width` new tokens to each of `paged_sequences` (re-running it rewrites the
    same slots)."""
    handles, _ = paged_sequences(model, batch, ctx, width)
    seqs = [SequenceSlice(ctx, width, handle.layers) for handle in handles]
    tokens = torch.randint(0, model.config.unpadded_vocab_size, (batch * width,), device=model.embed.weight.device)
    return ForwardBatch(tokens, seqs)


def graph_step(model: InklingDecoder, batch: int, ctx: int, width: int) -> Callable[[], list[int]]:
    """The engine's step of B sequences at `ctx` with `width` tokens each from its CUDA graph (`DecodeGraphs`):
    width 1 the plain decode, else the verify of width-1 drafts followed by the conv commit of its accepted rows
    (all of them: the commit costs the same whatever it keeps); plus the greedy tokens of the B*width rows (the
    lm_head and argmax from the head graph, the ids read on the host), as the engine runs greedy rows."""
    handles, graphs = paged_sequences(model, batch, ctx, width, graph_widths=(width,))
    tokens = torch.randint(0, model.config.unpadded_vocab_size, (batch, width)).tolist()

    def step() -> list[int]:
        with torch.inference_mode():
            if width == 1:
                return graphs.greedy_tokens(graphs.run([t[0] for t in tokens], handles)).tolist()
            hidden, _ = graphs.verify(tokens, handles)
            ids = graphs.greedy_tokens(hidden).tolist()
            graphs.commit([width] * batch)
            return ids

    return step  # its first run captures the graphs


def trunk_step(model: InklingDecoder, fb: ForwardBatch) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model.logits(model(fb))

    return run


class DraftChain:
    """B sequences' drafter states, each depth prefilled with `ctx` rows; `run(depth, rows)` times one round's
    chain: depths 0..D-1 each over `rows` new rows per sequence, then the draft logits of each sequence's last row.
    The states grow by the timed rows (a few per call, against `ctx` of history)."""

    def __init__(self, drafter: MTPDrafter, batch: int, ctx: int):
        self.drafter, self.batch = drafter, batch
        self.device = drafter.embed.weight.device
        self.states = [drafter.new_state() for _ in range(batch)]
        self.positions = [ctx] * drafter.num_depths  # each depth's next row
        with torch.inference_mode():
            for depth in range(drafter.num_depths):
                self._forward(depth, 0, ctx)

    def _forward(self, depth: int, start: int, rows: int) -> torch.Tensor:
        h, vocab = self.drafter.config.hidden_size, self.drafter.config.unpadded_vocab_size
        tokens = torch.randint(0, vocab, (self.batch * rows,), device=self.device)
        slices = [SequenceSlice(start, rows, state.layers) for state in self.states]
        hidden = torch.randn(self.batch * rows, h, device=self.device, dtype=self.drafter.embed.weight.dtype)
        return self.drafter(depth, hidden, ForwardBatch(tokens, slices))

    def step(self, depths: int, rows: int) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                for depth in range(depths):
                    out = self._forward(depth, self.positions[depth], rows)
                    self.drafter.logits(out.view(self.batch, rows, -1)[:, -1]).argmax(-1)
                    self.positions[depth] += rows

        return run


class GraphedChain:
    """The same B sequences as the engine keeps them (`PagedMTPSpeculator`: the depths' paged pools), each depth
    prefilled with `ctx` rows; `step(depth, rows)` times one round as the engine runs it: `rows` verified trunk rows
    per sequence through every depth with the provisional rows and the D drafts, replayed from the chain's CUDA
    graph for (B's bucket, D, rows). The inputs arrive as the runner hands them over: each sequence's rows a slice
    of one trunk output for the batch, its tokens its prompt and output lists as `Tokens` (the appended tokens
    drawn before the timed calls), so the figure is the speculator's cost alone. The sequences grow by the timed
    rows (`growth`)."""

    def __init__(self, drafter: MTPDrafter, batch: int, ctx: int, growth: int, use_graphs: bool = True):
        config, device = drafter.config, drafter.embed.weight.device
        self.hidden, self.vocab = config.hidden_size, config.unpadded_vocab_size
        pages = batch * math.ceil((ctx + growth) / PAGE)
        spec = CacheSpec(PAGE, pages, pages, batch, drafter.embed.weight.dtype, str(device))
        pools = DepthPools(drafter, spec, ctx + growth)
        self.depth = drafter.num_depths  # the prefill runs every depth
        graphs = DraftGraphs(drafter, pools, batch, ctx + growth, use_graphs)
        self.graphs = graphs
        self.speculator = PagedMTPSpeculator(drafter, drafter.num_depths, pools, graphs, lambda _: self.depth)
        self.device, self.dtype = device, drafter.embed.weight.dtype
        self.tokens = {f"s{i}": torch.randint(0, self.vocab, (ctx + 1,)).tolist() for i in range(batch)}
        self.output: dict[str, list[int]] = {rid: [] for rid in self.tokens}  # the tokens the rounds appended
        self.rows = dict.fromkeys(self.tokens, ctx)
        self.new_tokens = torch.randint(0, self.vocab, (growth + 1,)).tolist()  # the tokens the rounds append
        with torch.inference_mode():
            for rid, tokens in self.tokens.items():
                self.speculator.reset(rid, 0, tokens, [])
            self.speculator.extend([DraftInput(rid, 0, self._hidden(ctx), t, False) for rid, t in self.tokens.items()])

    def _hidden(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.hidden, device=self.device, dtype=self.dtype)

    def step(self, depth: int, rows: int) -> Callable[[], None]:
        trunk = self._hidden(len(self.tokens) * rows)  # the verify step's output rows, `rows` per sequence

        def run() -> None:
            self.depth = depth
            inputs = []
            for i, (rid, prompt) in enumerate(self.tokens.items()):
                output = self.output[rid]
                at = len(output) % (len(self.new_tokens) - rows)
                output += self.new_tokens[at : at + rows]
                hidden = trunk[i * rows : (i + 1) * rows]
                inputs.append(DraftInput(rid, self.rows[rid], hidden, Tokens(prompt, output), True))
                self.rows[rid] += rows
            with torch.inference_mode():
                self.speculator.extend(inputs)

        return run


def host_before_replay_ms(fn: Callable[[], None], reps: int) -> float:
    """Median host time from the call of `fn` (the device idle) to its first CUDA graph replay: what the device
    waits through before the round starts."""
    replay, marks = torch.cuda.CUDAGraph.replay, []

    def timed(graph: torch.cuda.CUDAGraph) -> None:
        marks.append(time.perf_counter())
        replay(graph)

    times = []
    torch.cuda.CUDAGraph.replay = timed
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            marks.clear()
            start = time.perf_counter()
            fn()
            times.append((marks[0] - start) * 1e3)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    return statistics.median(times)
