"""Uniform decode and verify steps over the paged pools, replayed from CUDA graphs.

A step of B sequences each bringing up to W tokens runs in the smallest batch-size bucket >= B and the smallest
configured width >= W (`widths`: 1 for plain decodes, D+1 for the MTP verify of D drafts). Everything the captured
forward reads lives in static device buffers refilled before each replay: token ids, sequence lengths and KV rows
per row (B*W, sequence-major), conv slots per sequence (one host-to-device copy per step), and the block tables,
gathered in-graph from the cache's device `BlockTables` by conv slot. Padding rows of a bucket point at the scratch
conv slot and scratch pages, so they never touch a real sequence; so do the rows a shorter chunk leaves of its
width (their outputs are never read, their conv inputs never committed).

A verify step (W > 1) leaves the conv states untouched and writes each sequence's conv windows (state ++ W inputs,
one static buffer per conv pool); once the sampler knows how many rows each sequence accepted, `commit` installs
the states after exactly those rows (`inkling_kernels.conv_verify.ConvCommit`: every conv in one launch, a graph of
its own per bucket and width). KV of the rejected rows stays in the pool past the sequence's length, where later
steps overwrite it.

Greedy steps (`greedy_tokens`): when every row of a step takes the argmax of its logits (the runner decides), a
second graph per bucket and width runs `model.argmax_logits` (the tokens of `model.logits(...).argmax(-1)`, no
fp32 copy of the logits) over all B*W rows of the step's static hidden, so the host reads B*W token ids instead of
the fp32 logits and their sampling ops. Its product is a temporary of the graphs' pool: the pool holds the largest
bucket's B*W x vocab x 2 bytes (129 MB at 64 sequences x W=5 for Inkling's 201024 columns; none for rows of the
skinny GEMV, whose argmax is fused).

Graphs are captured once per bucket and width (the buckets up to `max_num_seqs`, which is the last one), after an
eager warm-up run on padding rows (Triton compiles there), and share one memory pool. Without CUDA (CPU tests of
this path under the kernels' interpreter), or with graphs off, the same buffers and padding run eagerly. The pinned
host metadata buffer is filled through a numpy view and sent whole (one contiguous copy from pinned memory: a
slice of it would go through pageable and device temporaries); the next step waits for that copy (an event) before
it rewrites the buffer, since under async scheduling the engine fills step N+1 before it reads step N's tokens.

Async scheduling (`run(..., pending=...)`): token ids the host does not know yet (the previous step's samples, still
on the device) are gathered on the device into the uploaded ids, so step N+1 launches without a host round trip;
where each comes from travels in the same metadata copy.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode_service.engine.worker.kv_cache import KVCache, SequenceView
from decode_service.model.batch import ForwardBatch, PagedDecode
from decode_service.model.inkling import InklingDecoder

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Rows of the metadata buffer: per row of the step (B*W) the first four, per sequence (B) the last four (the last
# two: `DeviceTokens`' rows and indices).
_IDS, _SEQ_LENS, _ROWS_SLIDING, _ROWS_GLOBAL, _SLOTS, _ACCEPTED, _PENDING_ROWS, _PENDING_INDEX = range(8)


@dataclass(frozen=True)
class DeviceTokens:
    """Token ids of a step that are still on the device: row `rows[i]` of the step takes `tokens[index[i]]`."""

    tokens: torch.Tensor  # [N] int64, the previous step's samples
    index: list[int]
    rows: list[int]


class DecodeGraphs:
    def __init__(
        self,
        model: InklingDecoder,
        cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool = True,
        widths: Sequence[int] = (1,),
    ):
        self.model = model
        self.cache = cache
        self.max_model_len = max_model_len
        self.tables = cache.enable_block_tables(max_model_len)
        self.buckets = sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs})
        self.widths = sorted(set(widths) | {1})
        device = torch.device(cache.spec.device)
        self.capture = use_graphs and device.type == "cuda"  # else the same static-buffer step runs eagerly
        rows = self.buckets[-1] * self.widths[-1]
        self._host = torch.zeros((_PENDING_INDEX + 1, rows), dtype=torch.int64, pin_memory=self.capture)
        self._host_np = self._host.numpy()  # the same memory: list writes cost a fraction of torch.tensor's
        self._meta = torch.zeros((_PENDING_INDEX + 1, rows), dtype=torch.int64, device=device)
        # Per conv pool [max_num_seqs, K-1+W_max, C]: the verify steps' windows (a W-wide step uses [:B, :K-1+W]).
        k1 = cache.config.conv_kernel_size - 1
        self._windows = [
            [torch.zeros((self.buckets[-1], k1 + self.widths[-1], s.shape[2]), dtype=s.dtype, device=device)
             for s in states]
            for states in cache.conv
        ] if self.widths[-1] > 1 else []  # fmt: skip
        self._commit_all = None  # every window into its pool, one launch (`_commit`)
        if self._windows:
            from inkling_kernels.conv_verify import ConvCommit

            pairs = [(w, s) for windows, states in zip(self._windows, cache.conv, strict=True)
                     for w, s in zip(windows, states, strict=True)]  # fmt: skip
            self._commit_all = ConvCommit(pairs)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._heads: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # -> token ids [B*W]
        self._commits: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._last: tuple[int, int] | None = None  # (bucket, width) of the verify awaiting its commit
        self._stepped: tuple[int, int] | None = None  # (bucket, width) of the last step, for `greedy_tokens`
        self._uploaded = torch.cuda.Event() if self.capture else None  # recorded after each copy out of `_host`

    def bucket(self, batch: int) -> int:
        """The bucket a batch of this size replays in (the scheduler never runs more than max_num_seqs)."""
        assert 0 < batch <= self.buckets[-1], f"decode batch of {batch} outside 1..{self.buckets[-1]}"
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def width(self, tokens: int) -> int | None:
        """The width a step whose longest chunk has this many tokens runs at; None: wider than any graph."""
        i = bisect.bisect_left(self.widths, tokens)
        return self.widths[i] if i < len(self.widths) else None

    def run(self, token_ids: list[int], views: list[SequenceView], pending: DeviceTokens | None = None) -> torch.Tensor:
        """Decode one token for each sequence (its view has the page of the new position) -> final-normed hidden
        `[B, H]`. `pending`: the rows whose token is on the device (their entry in `token_ids` is a placeholder)."""
        return self._step([(t,) for t in token_ids], views, 1, pending)

    def verify(self, token_ids: Sequence[Sequence[int]], views: list[SequenceView]) -> tuple[torch.Tensor, int]:
        """Run each sequence's tokens (1..W: the last sampled token and its drafts; its view has the pages of
        every new position) -> (final-normed hidden `[B*W, H]`, W): sequence i's rows start at i*W. The conv states
        stay as they are until `commit`."""
        width = self.width(max(len(t) for t in token_ids))
        assert width is not None and width > 1, (
            f"verify of {max(len(t) for t in token_ids)} tokens: widths {self.widths}"
        )
        hidden = self._step(token_ids, views, width)
        self._last = (self.bucket(len(token_ids)), width)
        return hidden, width

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """After `run` or `verify`, with the hidden they returned: the argmax of every row's logits `[B*W]` int64 on
        the device (`model.argmax_logits`: the tokens of `model.logits`' argmax), from the head graph of the step's
        bucket and width."""
        assert self._stepped is not None, "greedy_tokens without a step"
        size, width = self._stepped
        if not self.capture:
            return self._greedy(hidden)
        graph, tokens = self._heads[size, width]
        assert hidden.data_ptr() == self._graphs[size, width][1].data_ptr(), "the hidden of another step"
        graph.replay()
        return tokens[: hidden.shape[0]]

    def commit(self, accepted: list[int]) -> None:
        """After `verify`: sequence i keeps its first `accepted[i]` rows (1..its tokens); its conv states become
        those after them."""
        assert self._last is not None, "commit without a verify"
        size, width = self._last
        self._last = None
        assert all(1 <= n <= width for n in accepted), f"accepted rows {accepted} outside 1..{width}"
        self._host_np[_ACCEPTED, :size] = accepted + [1] * (size - len(accepted))
        self._meta[_ACCEPTED, :size].copy_(self._host[_ACCEPTED, :size], non_blocking=self.capture)
        if self.capture:
            self._uploaded.record()
            self._commits[size, width].replay()  # captured with the verify graph
        else:
            self._commit(size, width)

    def capture_all(self) -> None:
        """Record every bucket's graphs now (engine start) rather than on the first step of that size."""
        if self.capture:
            for width in self.widths:
                for size in self.buckets:
                    self._ensure_graphs(size, width)

    def _ensure_graphs(self, size: int, width: int) -> None:
        """The step's graph (and a verify's commit graph) for this bucket and width, captured on first use."""
        if (size, width) not in self._graphs:
            self._graphs[size, width] = self._capture(size, width)
            self._heads[size, width] = self._capture_head(self._graphs[size, width][1])
            if width > 1:
                self._commits[size, width] = self._capture_commit(size, width)

    def _step(
        self,
        token_ids: Sequence[Sequence[int]],
        views: list[SequenceView],
        width: int,
        pending: DeviceTokens | None = None,
    ) -> torch.Tensor:
        batch = len(token_ids)
        size = self.bucket(batch)
        if self.capture:
            self._uploaded.synchronize()  # the previous step's metadata has left the pinned buffer
            self._ensure_graphs(size, width)  # before the fill: a capture runs on padding metadata
        self._fill(token_ids, views, size, width)
        if pending is not None:
            m = len(pending.rows)
            self._host_np[_PENDING_ROWS, :m] = pending.rows
            self._host_np[_PENDING_INDEX, :m] = pending.index
        self._upload()
        if pending is not None:
            rows, index = self._meta[_PENDING_ROWS, :m], self._meta[_PENDING_INDEX, :m]
            self._meta[_IDS].index_copy_(0, rows, pending.tokens.index_select(0, index))
        self._stepped = (size, width)
        if not self.capture:
            return self._forward(size, width)[: batch * width]
        graph, hidden = self._graphs[size, width]
        graph.replay()
        return hidden[: batch * width]

    def _upload(self) -> None:
        """The block-table entries written since the last step, and the whole metadata buffer (module docstring)."""
        self.tables.upload()
        self._meta.copy_(self._host, non_blocking=self.capture)
        if self.capture:
            self._uploaded.record()

    def _fill(self, token_ids: Sequence[Sequence[int]], views: list[SequenceView], size: int, width: int) -> None:
        """Metadata rows for the real sequences (a chunk shorter than the width padded with rows that write the
        scratch pages and see only the chunk's first position), then padding sequences on the scratch slot."""
        page, scratch, host = self.cache.page_size, self.cache.scratch_page, self._host_np
        batch = len(views)
        if width == 1:  # a decode step: one token per sequence, as lists over the batch
            starts = [view.num_tokens for view in views]  # everything before start is committed
            assert not starts or max(starts) < self.max_model_len, f"tokens up to {max(starts) + 1} > max_model_len"
            host[_IDS, :batch] = [tokens[0] for tokens in token_ids]
            host[_SEQ_LENS, :batch] = [start + 1 for start in starts]
            for sliding, row in ((True, _ROWS_SLIDING), (False, _ROWS_GLOBAL)):
                first = scratch[sliding] * page  # no table: no layer of this kind
                host[row, :batch] = [
                    (table[p // page] * page if (table := view.tables[sliding]) else first) + p % page
                    for view, p in zip(views, starts, strict=True)
                ]
        else:
            self._fill_rows(token_ids, views, width)
        host[_SLOTS, :batch] = [view.slot for view in views]
        rows = batch * width
        host[_IDS, rows : size * width] = 0
        host[_SEQ_LENS, rows : size * width] = 1
        host[_ROWS_SLIDING, rows : size * width] = scratch[True] * page
        host[_ROWS_GLOBAL, rows : size * width] = scratch[False] * page
        host[_SLOTS, batch:size] = self.cache.scratch_slot

    def _fill_rows(self, token_ids: Sequence[Sequence[int]], views: list[SequenceView], width: int) -> None:
        """`_fill`'s rows of the real sequences of a verify step (each chunk padded to the width)."""
        page, scratch = self.cache.page_size, self.cache.scratch_page
        ids: list[int] = []
        seq_lens: list[int] = []
        kv_rows: dict[bool, list[int]] = {True: [], False: []}
        for tokens, view in zip(token_ids, views, strict=True):
            start, n = view.num_tokens, len(tokens)  # everything before start is committed
            assert start + n <= self.max_model_len, f"tokens up to {start + n} > max_model_len"
            pad = width - n
            ids.extend(tokens)
            seq_lens.extend(range(start + 1, start + n + 1))
            if pad:
                ids.extend([0] * pad)
                seq_lens.extend([start + 1] * pad)
            for sliding, rows in kv_rows.items():
                table = view.tables[sliding]
                for p in range(start, start + n):  # no table: no layer of this kind
                    rows.append((table[p // page] if table else scratch[sliding]) * page + p % page)
                if pad:
                    rows.extend([scratch[sliding] * page + start % page] * pad)
        if ids:
            self._host_np[: _ROWS_GLOBAL + 1, : len(ids)] = (ids, seq_lens, kv_rows[True], kv_rows[False])

    def _windows_of(self, size: int, width: int) -> dict[tuple[int, int], torch.Tensor]:
        k1 = self.cache.config.conv_kernel_size - 1
        return {
            (layer, index): w[:size, : k1 + width]
            for layer, windows in enumerate(self._windows)
            for index, w in enumerate(windows)
        }

    def _forward(self, size: int, width: int) -> torch.Tensor:
        """The step over the first `size` sequences of the static buffers (what a graph records)."""
        meta = self._meta[:, : size * width]
        slots = self._meta[_SLOTS, :size]
        decode = PagedDecode(
            pools=self.cache,
            seq_lens=meta[_SEQ_LENS].to(torch.int32),
            conv_slots=slots,
            kv_rows={True: meta[_ROWS_SLIDING], False: meta[_ROWS_GLOBAL]},
            block_tables={kind: table.index_select(0, slots) for kind, table in self.tables.device.items()},
            max_seq_len=self.max_model_len,
            width=width,
            conv_windows=self._windows_of(size, width) if width > 1 else None,
        )
        return self.model(ForwardBatch(meta[_IDS], [], decode=decode))

    def _commit(self, size: int, width: int) -> None:
        """Every conv state of the first `size` slots from its window and the accepted rows (what a graph records)."""
        self._commit_all(self._meta[_SLOTS, :size], self._meta[_ACCEPTED, :size])

    def warm_up(self, size: int, width: int = 1) -> None:
        """One step of `size` padding sequences: compiles the kernels, touches only the scratch slot and pages."""
        self._fill([], [], size, width)
        self._upload()
        self._forward(size, width)

    def _capture(self, size: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.warm_up(size, width)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(size, width)
        return graph, hidden

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, H]` final-normed rows -> `[N]` argmax of their logits (what a head graph records)."""
        return self.model.argmax_logits(hidden)

    def _capture_head(self, hidden: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The lm_head + argmax over a step graph's static hidden (warm-up on whatever it holds)."""
        self._greedy(hidden)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            tokens = self._greedy(hidden)
        return graph, tokens

    def _capture_commit(self, size: int, width: int) -> torch.cuda.CUDAGraph:
        self._fill([], [], size, width)
        self._upload()
        self._meta[_ACCEPTED, :size].fill_(1)
        self._commit(size, width)  # warm-up on the scratch slot (compiles the commit kernel)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._commit(size, width)
        return graph
