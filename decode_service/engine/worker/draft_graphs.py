"""The MTP draft chain over the depths' paged pools, one batched step per depth row, replayed from CUDA graphs.

Pools. The depths keep their KV in paged pools of their own geometry (a `KVCache` built from the drafter's
`depth_config`, one "layer" per depth, pages handed out by a private `KVAllocator`) and their conv states in
`[slots, K-1, C]` pools like the trunk's; a speculating request owns one conv slot and one block table per kind
for its whole life (`DepthSequence`). Paged rather than per-slot fixed buffers: the global depths keep every
position, so a fixed buffer per slot would reserve max_model_len positions for every slot.

A round (`MTPSpeculator` semantics, worker/mtp.py). With K known tokens, depth j's committed rows end at
`c_j = K-1-j` (or later, after a reset) and its provisional rows are `c_j .. K-2` (`n_j = K-1-c_j <= j` of them),
row p pairing the depth-(j-1) hidden at p with draft `d_{p+j+2-K}`. The committed rows run first: in a verify
round (at most D + 1 new rows per sequence and depth) here, `catch_up`, as one-row paged steps of each depth over
the whole batch, cell (j, m) being row `start_j + m` of every sequence, its hidden the row the depth queued
(`pending`) or depth j-1's cell for that row; on the sequences' own conv slots and KV rows (cells past a
sequence's row count on the scratch ones). Larger rounds (prefill) run one packed forward per depth over every
request (`PagedMTPSpeculator._packed_catch_up`). The provisional triangle then runs here too (`run`):

    d_1 = sample(logits(g_0(K-2)))
    for j in 1..D-1, for p in c_j..K-2 (offset o = K-2-p from j-1 down to 0):
        g_j(p) = depth_j(g_{j-1}(p), d_{j-o})          # one row per sequence: a paged decode step of depth j
    d_{j+1} = sample(logits(g_j(K-2)))

`g_{j-1}(p)` is the committed output (an input buffer) for `p < c_{j-1}`, else the triangle's own cell. Cells of
a sequence outside its `n_j` (short or freshly reset sequences) write the scratch page and a scratch conv slot.
Provisional rows never touch a request's conv slot: the chain first copies the committed conv states of its
sequences into working slots and convolves those, so nothing is restored afterwards; their KV rows are written
at the provisional positions, which the next round's committed rows overwrite before any query reads them.

Sampling inside the graph, without device asserts: greedy rows take the argmax; a row at temperature T takes
`argmax(q / E)` with `q = softmax(logits / T)` and `E ~ Exp(1)` per vocabulary entry drawn outside the graph from
the request's generator (the exponential race, i.e. Gumbel-max: a draw from q). `q` is returned for rejection
sampling.

One graph per (batch bucket, D) for the triangle and per (bucket, depths, rows) for the committed rows: every
input lives in static buffers refilled before a replay. Without CUDA, or with graphs off, the same buffers run
eagerly (the CPU tests, under the kernels' interpreter).
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from decode_service.engine.core.pages import KVAllocator, SequencePages
from decode_service.engine.worker.decode_graphs import BUCKETS
from decode_service.engine.worker.kv_cache import NUM_CONVS, CacheSpec, KVCache, SequenceView
from decode_service.model.batch import ForwardBatch, PagedDecode
from decode_service.model.mtp import MTPDrafter

_KNOWN, _SLOT = 0, 1  # rows of the integer metadata; row 2 + j: n_j, the provisional rows of depth j


class DepthLayer:
    """`LayerCache` of one depth of one request over the depths' pools (each depth continues at its own row)."""

    def __init__(self, view: SequenceView, depth: int):
        self.view, self.depth = view, depth

    def append_kv(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.view.num_tokens = start  # the view's position is per call: the depths commit different row counts
        return self.view.append_kv(self.depth, k, v, start)

    def conv_state(self, index: int) -> torch.Tensor:
        return self.view.cache.conv[self.depth][index][self.view.slot]

    def set_conv_state(self, index: int, state: torch.Tensor) -> None:
        self.view.cache.conv[self.depth][index][self.view.slot].copy_(state)


class DepthSequence:
    """One request's pages, conv slot and per-depth `LayerCache`s in the depths' pools."""

    def __init__(self, pools: DepthPools):
        self.pools = pools
        self.pages: SequencePages = pools.allocator.new_sequence()
        self.view = SequenceView(pools.cache, self.pages.slot)
        self.layers = [DepthLayer(self.view, d) for d in range(pools.cache.config.num_layers)]
        pools.cache.zero_conv(self.pages.slot)

    @property
    def slot(self) -> int:
        return self.view.slot

    def fits(self, num_tokens: int) -> bool:
        return self.pools.allocator.fits(self.pages.pages_needed(num_tokens))

    def grow(self, num_tokens: int, committed: int) -> None:
        """Pages for positions `< num_tokens`; sliding pages no row from `committed` on can see are released."""
        self.pages.grow(num_tokens)
        self.pages.commit(max(committed, self.pages.num_tokens))
        for sliding, update in zip((True, False), self.pages.take_updates(), strict=True):
            if update.pages or update.freed:
                self.view.update(sliding, update)

    def release(self) -> None:
        self.pages.release()


class DepthPools:
    """The depths' KV pools, conv slots and device block tables, sized by the caller (`CacheSpec`), for the first
    `num_depths` depths (all by default)."""

    def __init__(self, drafter: MTPDrafter, spec: CacheSpec, max_model_len: int, num_depths: int | None = None):
        config = drafter.config
        n = num_depths or drafter.num_depths  # the first n depths (those the speculator drafts with)
        config = dataclasses.replace(
            config, num_layers=n, sliding_layers=config.sliding_layers[:n], dense_layers=config.dense_layers[:n]
        )
        self.cache = KVCache(config, spec)
        self.allocator = KVAllocator(config, spec)
        self.cache.enable_block_tables(max_model_len)

    def new_sequence(self) -> DepthSequence | None:
        """A request's depth state, or None when no conv slot is free."""
        return DepthSequence(self) if self.allocator.num_free_slots else None


class _ChainPools:
    """The depths' KV pools with the chain's working conv slots in place of the requests' slots."""

    def __init__(self, cache: KVCache, work: list[tuple[torch.Tensor, ...]]):
        self.page_size, self.cache, self.work = cache.page_size, cache, work

    def kv_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        return self.cache.kv_pool(layer)

    def conv_pool(self, layer: int, index: int) -> torch.Tensor:
        return self.work[layer][index]


class DraftGraphs:
    """The provisional triangle and the D draft samples of B sequences, per (bucket, D) one CUDA graph."""

    def __init__(
        self, drafter: MTPDrafter, pools: DepthPools, max_num_seqs: int, max_model_len: int, use_graphs: bool = True
    ):
        self.drafter, self.pools, self.cache = drafter, pools, pools.cache
        self.max_model_len = max_model_len
        self.tables = self.cache.block_tables
        self.buckets = sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs})
        device = torch.device(self.cache.spec.device)
        self.capture = use_graphs and device.type == "cuda"
        self.num_depths = n = self.cache.config.num_layers  # the depths the pools hold
        width = self.buckets[-1]
        h, vocab = drafter.config.hidden_size, drafter.config.unpadded_vocab_size
        dtype = drafter.embed.weight.dtype
        self._host = torch.empty((2 + n, width), dtype=torch.int64, pin_memory=self.capture)
        self._meta = torch.empty((2 + n, width), dtype=torch.int64, device=device)
        self._host_t = torch.empty(width, dtype=torch.float32, pin_memory=self.capture)
        self.fixed = torch.zeros((n, n, width, h), dtype=dtype, device=device)  # [j, o]: g_{j-1}(K-2-o) committed
        self.temperature = torch.ones(width, dtype=torch.float32, device=device)  # 0 = greedy
        self.noise = torch.ones((n, width, vocab), dtype=torch.float32, device=device)  # Exp(1) draws
        self.drafts = torch.zeros((n, width), dtype=torch.int64, device=device)
        self.q = torch.zeros((n, width, vocab), dtype=torch.float32, device=device)
        k1 = self.cache.config.conv_kernel_size - 1
        self.work = [
            tuple(torch.zeros((width + 1,) + tuple(c.shape[1:]), dtype=c.dtype, device=device) for c in convs)
            for convs in self.cache.conv
        ]  # the last row: the scratch working slot
        assert all(w.shape[1] == k1 for convs in self.work for w in convs) and len(self.work[0]) == NUM_CONVS
        self.max_rows = n + 2  # committed rows per sequence and depth a graphed catch-up takes (a verify: <= D + 1)
        r = self.max_rows
        self._host_c = torch.empty((3 * n + 1 + n * r, width), dtype=torch.int64, pin_memory=self.capture)
        self._meta_c = torch.empty((3 * n + 1 + n * r, width), dtype=torch.int64, device=device)
        self.cfixed = torch.zeros((n, r, width, h), dtype=dtype, device=device)  # [j, m]: cell inputs from the host
        self.cout = torch.zeros((n, r, width, h), dtype=dtype, device=device)  # [j, m]: cell outputs
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def bucket(self, batch: int) -> int:
        assert 0 < batch <= self.buckets[-1], f"draft batch of {batch} outside 1..{self.buckets[-1]}"
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def run(
        self,
        depth: int,
        known: list[int],
        provisional: list[list[int]],
        slots: list[int],
        temperatures: list[float],
        generators: list[torch.Generator | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft `depth` tokens for each sequence; `self.fixed[j, o, i]` holds sequence i's committed inputs (filled
        by the caller), `known[i]` its K, `provisional[i][j]` its `n_j`, `slots[i]` its depth conv slot. -> drafts
        `[depth, B]` and the draft distributions `[depth, B, V]` (meaningful for the rows at temperature > 0)."""
        batch = len(known)
        size = self.bucket(batch)
        if self.capture and (size, depth) not in self._graphs:
            self._graphs[size, depth] = self._capture(size, depth)
        self._fill(known, provisional, slots, size, temperatures)
        for i, (t, g) in enumerate(zip(temperatures, generators, strict=True)):
            if t > 0:
                self.noise[:depth, i].exponential_(generator=g)
        self._upload(size)
        if self.capture:
            self._graphs[size, depth].replay()
        else:
            self._forward(size, depth)
        return self.drafts[:depth, :batch], self.q[:depth, :batch]

    @torch.inference_mode()
    def capture_all(self, depths: list[int]) -> None:
        """Record every (bucket, D) graph now (engine start)."""
        if self.capture:
            for size in self.buckets:
                for depth in depths:
                    if (size, depth) not in self._graphs:
                        self._graphs[size, depth] = self._capture(size, depth)

    def _fill(
        self, known: list[int], provisional: list[list[int]], slots: list[int], size: int, temperatures: list[float]
    ) -> None:
        n, pad = self.num_depths, size - len(known)
        self._host_t[:size] = torch.tensor(list(temperatures) + [0.0] * pad, dtype=torch.float32)
        rows = [list(known) + [n + 1] * pad, list(slots) + [self.cache.scratch_slot] * pad]
        for j in range(n):
            rows.append([counts[j] if j < len(counts) else 0 for counts in provisional] + [0] * pad)
        self._host[:, :size] = torch.tensor(rows, dtype=torch.int64)

    def _upload(self, size: int) -> None:
        self.tables.upload()
        self._meta[:, :size].copy_(self._host[:, :size], non_blocking=self.capture)
        self.temperature[:size].copy_(self._host_t[:size], non_blocking=self.capture)

    def _sample(self, j: int, hidden: torch.Tensor, size: int) -> torch.Tensor:
        """Draft `d_{j+1}` from depth j's row K-2, `[size, H]` -> `[size]` (greedy or the exponential race)."""
        logits = self.drafter.logits(hidden)  # [size, V] fp32
        t = self.temperature[:size]
        sampled = t > 0
        q = torch.softmax(logits / torch.where(sampled, t, 1.0)[:, None], -1)  # spec 7.4: the request's scaled logits
        self.q[j, :size].copy_(q)
        token = torch.where(sampled, (q / self.noise[j, :size]).argmax(-1), logits.argmax(-1))
        self.drafts[j, :size].copy_(token)
        return token

    def _forward(self, size: int, depth: int) -> None:
        """The chain over the first `size` rows of the static buffers (what a graph records)."""
        meta, page = self._meta[:, :size], self.cache.page_size
        known, slots, counts = meta[_KNOWN], meta[_SLOT], meta[2:]
        tables = {kind: table.index_select(0, slots) for kind, table in self.tables.device.items()}
        scratch_rows = {kind: p * page for kind, p in self.cache.scratch_page.items()}
        for j in range(1, depth):  # the working conv slots start from the committed states
            for work, pool in zip(self.work[j], self.cache.conv[j], strict=True):
                work[:size].copy_(pool.index_select(0, slots))
        rows = torch.arange(size, device=slots.device)
        pools = _ChainPools(self.cache, self.work)
        tokens = [self._sample(0, self.fixed[0, 0, :size], size)]
        above: dict[int, torch.Tensor] = {}  # depth j-1's cells by offset
        for j in range(1, depth):
            cells: dict[int, torch.Tensor] = {}
            for o in range(j - 1, -1, -1):
                p = (known - 2 - o).clamp(min=0)  # [size] the row's position
                active = o < counts[j]
                hidden = self.fixed[j, o, :size]
                if o < j - 1:
                    hidden = torch.where((o < counts[j - 1])[:, None], above[o], hidden)
                kv_rows = {}  # the pool row of position p, or the scratch page's for a cell outside n_j
                for kind, table in tables.items():
                    row = table.gather(1, (p // page)[:, None])[:, 0] * page + p % page
                    kv_rows[kind] = torch.where(active, row, scratch_rows[kind])
                decode = PagedDecode(
                    pools=pools,
                    seq_lens=(p + 1).to(torch.int32),
                    conv_slots=torch.where(active, rows, self.work[0][0].shape[0] - 1),
                    kv_rows=kv_rows,
                    block_tables=tables,
                    max_seq_len=self.max_model_len,
                )
                batch = ForwardBatch(tokens[j - 1 - o], [], decode=decode)
                cells[o] = self.drafter(j, hidden, batch)  # [size, H]
            tokens.append(self._sample(j, cells[0], size))
            above = cells

    def catch_up(
        self,
        depths: int,
        rows: int,
        start: list[list[int]],
        count: list[list[int]],
        shift: list[list[int]],
        tokens: list[list[list[int]]],
        slots: list[int],
    ) -> None:
        """The committed rows of depths 0..`depths`-1 of B sequences as one-row paged steps, `rows` steps per
        depth: cell (j, m) of sequence i is its row `start[i][j] + m` when `m < count[i][j]`, with token
        `tokens[i][j][m]` and as hidden `self.cfixed[j, m, i]` (filled by the caller) for `m < shift[i][j]`, else
        depth j-1's cell `m - shift[i][j]`; outputs land in `self.cout[j, m, i]`. The conv states and KV rows are
        the sequences' own (committed rows); cells past a sequence's count write the scratch page and slot."""
        batch = len(slots)
        size = self.bucket(batch)
        key = ("catch", size, depths, rows)
        if self.capture and key not in self._graphs:
            self._graphs[key] = self._capture_with(key, lambda: self._catch_up_forward(size, depths, rows))
        n, r, pad = self.num_depths, self.max_rows, size - batch
        meta = []
        for field, fill in ((start, 0), (count, 0), (shift, 0)):
            for j in range(n):
                meta.append([v[j] if j < len(v) else fill for v in field] + [fill] * pad)
        meta.append(list(slots) + [self.cache.scratch_slot] * pad)
        for j in range(n):
            for m in range(r):
                meta.append([t[j][m] if j < len(t) and m < len(t[j]) else 0 for t in tokens] + [0] * pad)
        self._host_c[:, :size] = torch.tensor(meta, dtype=torch.int64)
        self.tables.upload()
        self._meta_c[:, :size].copy_(self._host_c[:, :size], non_blocking=self.capture)
        if self.capture:
            self._graphs[key].replay()
        else:
            self._catch_up_forward(size, depths, rows)

    def _catch_up_forward(self, size: int, depths: int, rows: int) -> None:
        n, page = self.num_depths, self.cache.page_size
        meta = self._meta_c[:, :size]
        start, count, shift, slots = meta[:n], meta[n : 2 * n], meta[2 * n : 3 * n], meta[3 * n]
        tables = {kind: table.index_select(0, slots) for kind, table in self.tables.device.items()}
        scratch_rows = {kind: p * page for kind, p in self.cache.scratch_page.items()}
        lanes = torch.arange(size, device=slots.device)
        for j in range(depths):
            for m in range(rows):
                p = start[j] + m  # [size] the row's position
                active = m < count[j]
                hidden = self.cfixed[j, m, :size]
                if j:
                    above = self.cout[j - 1, :, :size][(m - shift[j]).clamp(0, self.max_rows - 1), lanes]
                    hidden = torch.where((m >= shift[j])[:, None], above, hidden)
                kv_rows = {}
                for kind, table in tables.items():
                    row = table.gather(1, (p // page)[:, None])[:, 0] * page + p % page
                    kv_rows[kind] = torch.where(active, row, scratch_rows[kind])
                decode = PagedDecode(
                    pools=self.cache,
                    seq_lens=(p + 1).to(torch.int32),
                    conv_slots=torch.where(active, slots, self.cache.scratch_slot),
                    kv_rows=kv_rows,
                    block_tables=tables,
                    max_seq_len=self.max_model_len,
                )
                token = meta[3 * n + 1 + j * self.max_rows + m]
                self.cout[j, m, :size].copy_(self.drafter(j, hidden, ForwardBatch(token, [], decode=decode)))

    def _capture_with(self, key: tuple, forward) -> torch.cuda.CUDAGraph:
        """Warm up (padding rows only: the scratch slot and pages) and record `forward`."""
        size = key[1]
        self._host_c[:, :size] = 0
        n = self.num_depths
        self._host_c[3 * n, :size] = self.cache.scratch_slot
        self.tables.upload()
        self._meta_c[:, :size].copy_(self._host_c[:, :size])
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            forward()
        return graph

    def warm_up(self, size: int, depth: int) -> None:
        """One chain of `size` padding rows (compiles the kernels; touches only scratch pages and slots)."""
        self._fill([], [], [], size, [])
        self._upload(size)
        self._forward(size, depth)

    def _capture(self, size: int, depth: int) -> torch.cuda.CUDAGraph:
        self.warm_up(size, depth)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(size, depth)
        return graph
