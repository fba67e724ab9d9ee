"""Uniform decode steps (one new token per sequence) over the paged pools, replayed from CUDA graphs.

A step of B sequences runs in the smallest batch-size bucket >= B. Everything the captured forward reads lives in
static device buffers refilled before each replay: token ids, sequence lengths, conv slots and KV rows (one
host-to-device copy per step), and the block tables, gathered in-graph from the cache's device `BlockTables` by
conv slot. Padding rows of a bucket point at the scratch conv slot and scratch pages, so they never touch a real
sequence. Graphs are captured once per bucket (the buckets up to `max_num_seqs`, which is the last one), after
an eager warm-up run on padding rows (Triton compiles there), and share one memory pool.

Without CUDA (CPU tests of this path under the kernels' interpreter), or with graphs off, the same buffers and
padding run eagerly. The pinned host buffers (metadata, block-table mirror) are copied asynchronously and rewritten
by the next step: the engine reads each step's sampled tokens back (a sync) before it schedules the next one.
"""

from __future__ import annotations

import bisect

import torch

from decode_service.engine.worker.kv_cache import KVCache, SequenceView
from decode_service.model.batch import ForwardBatch, PagedDecode
from decode_service.model.inkling import InklingDecoder

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_IDS, _SEQ_LENS, _SLOTS, _ROWS_SLIDING, _ROWS_GLOBAL = range(5)  # rows of the metadata buffer


class DecodeGraphs:
    def __init__(
        self, model: InklingDecoder, cache: KVCache, max_num_seqs: int, max_model_len: int, use_graphs: bool = True
    ):
        self.model = model
        self.cache = cache
        self.max_model_len = max_model_len
        self.tables = cache.enable_block_tables(max_model_len)
        self.buckets = sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs})
        device = torch.device(cache.spec.device)
        self.capture = use_graphs and device.type == "cuda"  # else the same static-buffer step runs eagerly
        width = self.buckets[-1]
        self._host = torch.empty((5, width), dtype=torch.int64, pin_memory=self.capture)
        self._meta = torch.empty((5, width), dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def bucket(self, batch: int) -> int:
        """The bucket a batch of this size replays in (the scheduler never runs more than max_num_seqs)."""
        assert 0 < batch <= self.buckets[-1], f"decode batch of {batch} outside 1..{self.buckets[-1]}"
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def run(self, token_ids: list[int], views: list[SequenceView]) -> torch.Tensor:
        """Decode one token for each sequence (its view has the page of the new position) -> final-normed hidden
        `[B, H]`."""
        batch = len(token_ids)
        size = self.bucket(batch)
        if self.capture and size not in self._graphs:
            self._graphs[size] = self._capture(size)
        self._fill(token_ids, views, size)
        self._upload(size)
        if not self.capture:
            return self._forward(size)[:batch]
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden[:batch]

    def capture_all(self) -> None:
        """Record every bucket's graph now (engine start) rather than on the first step of that size."""
        if self.capture:
            for size in self.buckets:
                if size not in self._graphs:
                    self._graphs[size] = self._capture(size)

    def _upload(self, size: int) -> None:
        self.tables.upload()
        self._meta[:, :size].copy_(self._host[:, :size], non_blocking=self.capture)

    def _fill(self, token_ids: list[int], views: list[SequenceView], size: int) -> None:
        """Metadata rows for the real sequences, then padding rows on the scratch slot and pages."""
        page, scratch = self.cache.page_size, self.cache.scratch_page
        rows: list[list[int]] = [[], [], [], [], []]
        for token, view in zip(token_ids, views, strict=True):
            position = view.num_tokens  # the new token's position: everything before it is committed
            assert position < self.max_model_len, f"decode at position {position} >= max_model_len"
            rows[_IDS].append(token)
            rows[_SEQ_LENS].append(position + 1)
            rows[_SLOTS].append(view.slot)
            for sliding, row in ((True, _ROWS_SLIDING), (False, _ROWS_GLOBAL)):
                table = view.tables[sliding]
                physical = table[position // page] if table else scratch[sliding]
                rows[row].append(physical * page + position % page)
        padding = (0, 1, self.cache.scratch_slot, scratch[True] * page, scratch[False] * page)
        for row, value in zip(rows, padding, strict=True):
            row.extend([value] * (size - len(token_ids)))
        self._host[:, :size] = torch.tensor(rows, dtype=torch.int64)

    def _forward(self, size: int) -> torch.Tensor:
        """The step over the first `size` rows of the static buffers (what a graph records)."""
        meta = self._meta[:, :size]
        slots = meta[_SLOTS]
        decode = PagedDecode(
            pools=self.cache,
            seq_lens=meta[_SEQ_LENS].to(torch.int32),
            conv_slots=slots,
            kv_rows={True: meta[_ROWS_SLIDING], False: meta[_ROWS_GLOBAL]},
            block_tables={kind: table.index_select(0, slots) for kind, table in self.tables.device.items()},
            max_seq_len=self.max_model_len,
        )
        return self.model(ForwardBatch(meta[_IDS], [], decode=decode))

    def warm_up(self, size: int) -> None:
        """One step of `size` padding rows: compiles the kernels, touches only the scratch slot and pages."""
        self._fill([], [], size)
        self._upload(size)
        self._forward(size)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.warm_up(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(size)
        return graph, hidden
