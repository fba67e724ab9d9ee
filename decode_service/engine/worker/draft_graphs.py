"""The MTP draft chain over the depths' paged pools: a drafting round as one multi-row paged step per depth,
replayed from CUDA graphs.

Pools. The depths keep their KV in paged pools of their own geometry (a `KVCache` built from the drafter's
`depth_config`, one "layer" per depth, pages handed out by a private `KVAllocator`) and their conv states in
`[slots, K-1, C]` pools like the trunk's; a speculating request owns one conv slot and one block table per kind
for its whole life (`DepthSequence`). Paged rather than per-slot fixed buffers: the global depths keep every
position, so a fixed buffer per slot would reserve max_model_len positions for every slot.

A round (`MTPSpeculator` semantics, worker/mtp.py). With K known tokens, depth j's committed rows end at
`c_j = K-1-j` (or later, after a reset) and its provisional rows are `c_j .. K-2` (`n_j = K-1-c_j <= j` of them),
row p pairing the depth-(j-1) hidden at p with the token at p + j + 1: known below K, else draft
`d_{p+j+2-K}`. Depth j's rows of a round are therefore its rows from where it stopped (`start_j`) through K-2,
the committed ones first, and one step runs all of them:

    for j in 0..D-1:
        g_j(p) = depth_j(g_{j-1}(p), token(p + j + 1))   for p in start_j..K-2   # one multi-row paged step
        d_{j+1} = sample(logits(g_j(K-2)))

(`run`, one CUDA graph per (batch bucket, D, R)). Row m of depth j's step is position `start_j + m`; its input is
a row the host queued (`pending`: committed rows of depth j-1 the depth had not committed yet, or depth 0's
trunk rows) or depth j-1's row of this round at the same position; each depth takes `R + j` rows per sequence
(a verify round accepting a drafts brings `a + 1 + j` to depth j; R is the round's largest `rows - j`). Rows past
a sequence's own (short, freshly reset or less accepting sequences) write the scratch page and are never
committed. Larger rounds (prefill chunks, a depth catching up its queue) run one packed forward per depth over
every request (`PagedMTPSpeculator._packed_catch_up`), then the same graph with R = 0 for the provisional rows
(no depth-0 rows: its row K-2 is given).

A multi-row step (`_step`) is the trunk's verify step over the depth: attention with the rows of a sequence in
one program (`rows_per_seq`, each row seeing the keys through its own position, all rows' KV written first) and
the per-row conv windows of `inkling_kernels.conv_verify`, which read a sequence's conv states and write its window
(state ++ its inputs, `windows`) without touching the states; `ConvCommit` then installs `window[n : n+K-1]`
for the n rows the sequence committed at that depth (0 for a provisional-only step). So a request's conv states
never see a provisional row and nothing is restored afterwards. Provisional KV rows are written at their
positions, which the next round's committed rows overwrite before any query reads them. One step reads the
depth's weights once for all its rows (one-row steps read them once per row).

Sampling inside the graph, without device asserts: greedy rows take the argmax; a row at temperature T takes
`argmax(q / E)` with `q = softmax(logits / T)` and `E ~ Exp(1)` per vocabulary entry drawn outside the graph (the
exponential race, i.e. Gumbel-max: a draw from q): from a seeded request's own generator, for the other sampled rows
one draw per round from the chain's generator. `q` is returned for rejection sampling. A round whose every row is
greedy replays a graph of its own (the `greedy` variant of the key): the argmax of the logits alone
(`MTPDrafter.argmax_logits`, no fp32 logits on the bf16 head), no softmax and no `q` (the verifier reads `q` only
for rows at temperature > 0).

Every input of a graph lives in static buffers refilled before a replay. Without CUDA, or with graphs off, the
same buffers run eagerly (the CPU tests, under the kernels' interpreter).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from decode_service.engine.core.pages import KVAllocator, SequencePages
from decode_service.engine.worker.decode_graphs import BUCKETS
from decode_service.engine.worker.kv_cache import NUM_CONVS, CacheSpec, KVCache, SequenceView
from decode_service.model.batch import ForwardBatch, PagedDecode
from decode_service.model.mtp import MTPDrafter

_KNOWN, _SLOT, _FIELDS = 0, 1, ("start", "count", "total", "shift")  # integer metadata: K, slot, then per depth
# each of `RoundRows`'s fields, then the tokens per depth and row


@dataclass(frozen=True)
class RoundRows:
    """The rows of a drafting round of B sequences, per sequence i and depth j < D: positions `start[i, j] ..
    start[i, j] + total[i, j] - 1` (through K-2), of which the first `count[i, j]` are committed (their conv states
    kept); row m's input is `inputs[j, m, i]` (from the host) for `m < shift[i, j]`, else depth j-1's row
    `m - shift[i, j]` of this round; its token `tokens[i, j, m]` when known (position + j + 1 < K), else 0 (the
    round's draft for that position, filled in on the device). int64 arrays, one row per sequence."""

    known: np.ndarray  # [B] K
    start: np.ndarray  # [B, D]
    count: np.ndarray  # [B, D]
    total: np.ndarray  # [B, D]
    shift: np.ndarray  # [B, D]
    tokens: np.ndarray  # [B, D, max_rows]


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


# Pages a depth sequence takes past what a round needs, and sliding pages it keeps past its window: most rounds
# then neither allocate nor release, and a full `DepthSequence.grow` (~15 us of page bookkeeping a request) runs
# about once every (AHEAD_PAGES + 1) * page_size / rows-per-round rounds for each of the two (decisions.md, issue 16).
AHEAD_PAGES = 2


class DepthSequence:
    """One request's pages, conv slot and per-depth `LayerCache`s in the depths' pools."""

    def __init__(self, pools: DepthPools):
        self.pools = pools
        self.pages: SequencePages = pools.allocator.new_sequence()
        self.view = SequenceView(pools.cache, self.pages.slot)
        self.layers = [DepthLayer(self.view, d) for d in range(pools.cache.config.num_layers)]
        pools.cache.zero_conv(self.pages.slot)
        allocator = pools.allocator
        self._kinds = [s for s, has in ((True, allocator.has_sliding), (False, allocator.has_global)) if has]
        self._max_tokens = pools.cache.block_tables.max_pages * allocator.page_size
        # Most rounds neither need a page nor free one: positions below `_paged` have pages of every kind, and no
        # sliding page is released until the committed rows reach `_release_at` (both set by the last full `grow`).
        self._paged, self._release_at = 0, 0

    @property
    def slot(self) -> int:
        return self.view.slot

    def grow(self, num_tokens: int, committed: int) -> bool:
        """Pages for positions `< num_tokens` (and `AHEAD_PAGES` more where the pools have them); sliding pages no
        row from `committed` on can see are released, `AHEAD_PAGES` + 1 at a time. False, and nothing changed,
        when the pools cannot give the pages needed."""
        pages = self.pages
        committed = max(committed, pages.num_tokens)
        if num_tokens <= self._paged and committed < self._release_at:  # nothing to allocate or release
            pages.num_tokens = committed
            return True
        allocator, page = pages.allocator, pages.allocator.page_size
        if num_tokens > self._paged:
            if not allocator.fits(pages.pages_needed(num_tokens)):
                return False
            ahead = max(num_tokens, min(num_tokens + AHEAD_PAGES * page, self._max_tokens))
            pages.grow(ahead if allocator.fits(pages.pages_needed(ahead)) else num_tokens)
        pages.commit(committed)
        for sliding, update in zip((True, False), pages.take_updates(), strict=True):
            if update.pages or update.freed:
                self.view.update(sliding, update)
        self._paged = min(len(pages.tables[sliding]) * page for sliding in self._kinds) if self._kinds else 1 << 62
        # `commit` releases the sliding pages before (committed - (window - 1)) // page: the next full call when
        # AHEAD_PAGES + 1 more are releasable.
        released = max(0, committed - (allocator.window - 1)) // page
        self._release_at = (
            (released + 1 + AHEAD_PAGES) * page + allocator.window - 1 if allocator.has_sliding else 1 << 62
        )
        return True

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


class DraftGraphs:
    """A drafting round of B sequences (every depth's rows, committed and provisional, and the D draft samples),
    one multi-row paged step per depth, per (batch bucket, D, R, greedy) one CUDA graph (`greedy`: every row
    greedy, no draft distributions)."""

    def __init__(
        self,
        drafter: MTPDrafter,
        pools: DepthPools,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool = True,
        seed: int = 0,
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
        self.max_first = n + 2  # R a graphed round takes: rows of depth 0 (a verify: <= D + 1)
        self.max_rows = r = self.max_first + n - 1  # rows of a depth's step (R + j)
        self._tokens = 2 + len(_FIELDS) * n  # the metadata row of depth 0's row-0 tokens
        self._host = torch.empty((self._tokens + n * r, width), dtype=torch.int64, pin_memory=self.capture)
        self._meta = torch.empty((self._tokens + n * r, width), dtype=torch.int64, device=device)
        self._host_t = torch.empty(width, dtype=torch.float32, pin_memory=self.capture)
        self._host_np, self._host_t_np = self._host.numpy(), self._host_t.numpy()  # views of the same memory
        self._padding = np.zeros(self._tokens + n * r, dtype=np.int64)  # a padding sequence's metadata
        self._padding[_KNOWN], self._padding[_SLOT] = n + 1, self.cache.scratch_slot
        self.temperature = torch.ones(width, dtype=torch.float32, device=device)  # 0 = greedy
        self.noise = torch.ones((n, width, vocab), dtype=torch.float32, device=device)  # Exp(1) draws
        self.generator = torch.Generator(device).manual_seed(seed)  # the noise of rows without their own generator
        self.drafts = torch.zeros((n, width), dtype=torch.int64, device=device)
        self.q = torch.zeros((n, width, vocab), dtype=torch.float32, device=device)
        # [j, m]: the rows' inputs from the host, then their outputs, in one buffer: `flat` row
        # `(j * r + m) * width + i` is the input of row m of depth j of sequence i, `output_rows` later its output.
        rows = torch.zeros((2, n, r, width, h), dtype=dtype, device=device)
        self.inputs, self.outputs, self.flat, self.output_rows = rows[0], rows[1], rows.view(-1, h), n * r * width
        # Per (depth, conv) `[width, K-1+rows, C]`: the windows (state ++ the step's rows) of the multi-row steps.
        k1 = self.cache.config.conv_kernel_size - 1
        self.windows = {
            (j, i): torch.zeros((width, k1 + r) + tuple(pool.shape[2:]), dtype=pool.dtype, device=device)
            for j, convs in enumerate(self.cache.conv)
            for i, pool in enumerate(convs)
        }
        assert all(len(convs) == NUM_CONVS for convs in self.cache.conv)
        from inkling_kernels.conv_verify import ConvCommit

        # per depth, its convs' states from their windows in one launch (`_commit`)
        self._commits = [
            ConvCommit([(self.windows[j, i], pool) for i, pool in enumerate(convs)])
            for j, convs in enumerate(self.cache.conv)
        ]
        self._graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def bucket(self, batch: int) -> int:
        assert 0 < batch <= self.buckets[-1], f"draft batch of {batch} outside 1..{self.buckets[-1]}"
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def run(self, depth: int, first: int, rows: RoundRows, slots: list[int], temperatures: list[float],
            generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Draft `depth` tokens for each sequence (`rows`: the round's rows, `slots[i]` sequence i's depth conv slot),
        depth j running `first + j` rows per sequence (`first` = 0: no depth-0 rows, its output row K-2 already in
        `outputs[0, 0, i]`); `inputs[j, m, i]` holds the host's inputs (filled by the caller). -> drafts
        `[depth, B]` and the draft distributions `[depth, B, V]` (meaningful for the rows at temperature > 0; None
        when every row is greedy)."""
        batch = len(slots)
        size = self.bucket(batch)
        greedy = not any(t > 0 for t in temperatures)
        key = (size, depth, first, greedy)
        if self.capture and key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        self._fill(rows, slots, size, temperatures)
        self._draw_noise(depth, temperatures, generators)
        self._upload(size)
        if self.capture:
            self._graphs[key].replay()
        else:
            self._forward(size, depth, first, greedy)
        return self.drafts[:depth, :batch], None if greedy else self.q[:depth, :batch]

    def _draw_noise(self, depth: int, temperatures: list[float], generators: list[torch.Generator | None]) -> None:
        """Exp(1) noise for the sampled rows' `depth` drafts: one draw over the round's rows from `self.generator`
        when a sampled row brings no generator of its own, then each row with its own generator (a seeded request)
        from that, so a seeded request's drafts depend on its seed alone."""
        batch = len(temperatures)
        if any(t > 0 and g is None for t, g in zip(temperatures, generators, strict=True)):
            self.noise[:depth, :batch].exponential_(generator=self.generator)
        for i, (t, g) in enumerate(zip(temperatures, generators, strict=True)):
            if t > 0 and g is not None:
                self.noise[:depth, i].exponential_(generator=g)

    @torch.inference_mode()
    def capture_all(self, depths: list[int], firsts: list[int]) -> None:
        """Record the (bucket, D, R) graphs of these D and R now, both variants (engine start)."""
        if self.capture:
            for size in self.buckets:
                for depth in depths:
                    for first in firsts:
                        for greedy in (True, False):
                            key = (size, depth, first, greedy)
                            if key not in self._graphs:
                                self._graphs[key] = self._capture(*key)

    def _fill(self, rows: RoundRows | None, slots: list[int], size: int, temperatures: list[float]) -> None:
        """The metadata column of each sequence (K, slot, each field per depth, the tokens per depth and row; zeros
        past the round's depths), then the padding sequences', into the pinned host buffers."""
        n, r, batch, host = self.num_depths, self.max_rows, len(slots), self._host_np
        self._host_t_np[:batch] = temperatures
        self._host_t_np[batch:size] = 0.0
        host[:, batch:size] = self._padding[:, None]
        if not batch:
            return
        depth = rows.start.shape[1]
        host[_KNOWN, :batch] = rows.known
        host[_SLOT, :batch] = slots
        for f, field in enumerate(_FIELDS):
            host[2 + f * n : 2 + f * n + depth, :batch] = getattr(rows, field).T
            host[2 + f * n + depth : 2 + (f + 1) * n, :batch] = 0
        host[self._tokens : self._tokens + depth * r, :batch] = rows.tokens.reshape(batch, depth * r).T
        host[self._tokens + depth * r :, :batch] = 0

    def _upload(self, size: int) -> None:
        self.tables.upload()
        self._meta[:, :size].copy_(self._host[:, :size], non_blocking=self.capture)
        self.temperature[:size].copy_(self._host_t[:size], non_blocking=self.capture)

    def _sample(self, j: int, hidden: torch.Tensor, size: int, greedy: bool) -> torch.Tensor:
        """Draft `d_{j+1}` from depth j's row K-2, `[size, H]` -> `[size]` (greedy or the exponential race;
        `greedy`: every row greedy, the argmax alone)."""
        if greedy:
            token = self.drafter.argmax_logits(hidden)
            self.drafts[j, :size].copy_(token)
            return token
        logits = self.drafter.logits(hidden)  # [size, V] fp32
        t = self.temperature[:size]
        sampled = t > 0
        q = torch.softmax(logits / torch.where(sampled, t, 1.0)[:, None], -1)  # spec 7.4: the request's scaled logits
        self.q[j, :size].copy_(q)
        token = torch.where(sampled, (q / self.noise[j, :size]).argmax(-1), logits.argmax(-1))
        self.drafts[j, :size].copy_(token)
        return token

    def _forward(self, size: int, depth: int, first: int, greedy: bool) -> None:
        """The round over the first `size` sequences of the static buffers (what a graph records)."""
        n, r = self.num_depths, self.max_rows
        meta = self._meta[:, :size]
        known, slots = meta[_KNOWN], meta[_SLOT]
        start, count, total, shift = meta[2 : self._tokens].view(len(_FIELDS), n, size)
        tables = self._tables(slots)
        drafts = []  # d_1 .. d_j, `[size]` each
        for j in range(depth):
            rows = first + j
            if rows:
                m = torch.arange(rows, device=slots.device)
                hidden = self.inputs[j, :rows, :size].transpose(0, 1)  # [size, rows, H]
                if j:  # rows from shift on: depth j-1's rows of this round
                    cell = (m - shift[j][:, None]).clamp(0, r - 1)  # [size, rows]
                    above = self.outputs[j - 1, :, :size].transpose(0, 1).gather(1, self._rows(cell))
                    hidden = torch.where((m >= shift[j][:, None])[..., None], above, hidden)
                p = start[j][:, None] + m  # [size, rows] the rows' positions
                token = meta[self._tokens + j * r : self._tokens + j * r + rows].t()  # [size, rows] known tokens
                if j:  # the token at position p + j + 1 >= K is draft d_{p+j+2-K}
                    t = p + j + 1 - known[:, None]
                    guess = torch.stack(drafts, 1).gather(1, t.clamp(0, j - 1))
                    token = torch.where(t >= 0, guess, token)
                out = self._step(j, hidden, token, p, m < total[j][:, None], slots, tables)  # [size, rows, H]
                self._commit(j, slots, count[j])
                self.outputs[j, :rows, :size].copy_(out.transpose(0, 1))
            last = (total[j] - 1).clamp(0, max(rows, 1) - 1)[:, None]  # the row at K-2
            drafts.append(
                self._sample(
                    j, self.outputs[j, :, :size].transpose(0, 1).gather(1, self._rows(last))[:, 0], size, greedy
                )
            )

    def _tables(self, slots: torch.Tensor) -> dict[bool, torch.Tensor]:
        return {kind: table.index_select(0, slots) for kind, table in self.tables.device.items()}

    def _rows(self, index: torch.Tensor) -> torch.Tensor:
        """`[size, W]` row indices -> the index `gather(1, .)` takes to pick those rows of a `[size, R, H]` tensor."""
        return index[..., None].expand(-1, -1, self.drafter.config.hidden_size)

    def _step(
        self,
        depth: int,
        hidden: torch.Tensor,
        token: torch.Tensor,
        p: torch.Tensor,
        active: torch.Tensor,
        slots: torch.Tensor,
        tables: dict[bool, torch.Tensor],
    ) -> torch.Tensor:
        """One multi-row paged step of `depth`: hidden `[size, W, H]`, tokens and positions `p` `[size, W]` (row m of
        a sequence at its position; the `active` rows come first) -> `[size, W, H]`. Rows past a sequence's active
        ones write the scratch page and see only its first row's keys; the conv states are read, never written:
        `self.windows` receives each sequence's window (state ++ its W inputs) for `_commit`."""
        size, width = p.shape
        page, k1 = self.cache.page_size, self.cache.config.conv_kernel_size - 1
        p = torch.where(active, p, p[:, :1])  # a padding row: the first row's position (within the tables)
        kv_rows = {}
        for kind, table in tables.items():
            row = table.gather(1, p // page) * page + p % page
            kv_rows[kind] = torch.where(active, row, self.cache.scratch_page[kind] * page).reshape(-1)
        decode = PagedDecode(
            pools=self.cache,
            seq_lens=(p + 1).reshape(-1).to(torch.int32),
            conv_slots=slots,
            kv_rows=kv_rows,
            block_tables=tables,
            max_seq_len=self.max_model_len,
            width=width,
            conv_windows={(depth, i): self.windows[depth, i][:size, : k1 + width] for i in range(NUM_CONVS)},
        )
        batch = ForwardBatch(token.reshape(-1), [], decode=decode)
        return self.drafter(depth, hidden.reshape(size * width, -1), batch).view(size, width, -1)

    def _commit(self, depth: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Depth `depth`'s conv states after the first `rows[b]` (0..W) rows of its last `_step` (every conv in one
        launch)."""
        self._commits[depth](slots, rows)

    def warm_up(self, size: int, depth: int, first: int, greedy: bool) -> None:
        """One round of `size` padding sequences (compiles the kernels; touches only scratch pages and slots)."""
        self._fill(None, [], size, [])
        self._upload(size)
        self._forward(size, depth, first, greedy)

    def _capture(self, size: int, depth: int, first: int, greedy: bool) -> torch.cuda.CUDAGraph:
        self.warm_up(size, depth, first, greedy)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(size, depth, first, greedy)
        return graph
