"""Paged KV pools (one per layer kind) plus the conv-state slot pool, and the per-sequence views the model writes
through (the data plane; which page or slot belongs to whom is the control plane's `core/pages.py`).

Layout. Each kind's pool stores `k`, `v` as `[layers_of_kind, pages * page_size, nKV, hd]`; a page id indexes the
same page in every layer of that kind. Conv states live in preallocated tensors `[slots, K-1, C]` per layer per
conv; a sequence owns one slot index for its whole life (stable addresses).

For the batched decode path (`PagedDecode`) the cache also implements the model's `PagedPools` and keeps every
slot's block tables on the device (`BlockTables`), and each pool has one scratch page and one scratch conv slot
beyond the allocatable ones: the padding rows of a CUDA-graph batch read and write only those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.config import TextConfig
from common.errors import ConfigError
from decode_service.engine.core.outputs import PageUpdate
from decode_service.engine.core.pages import PoolSizes
from decode_service.model.state import PagedKV

NUM_CONVS = 4  # k, v, attention-output and MLP-output convs of every layer (spec inkling-text 4.1)


@dataclass(frozen=True)
class CacheSpec(PoolSizes):
    """Sizes of the pools and their tensors' dtype and device (a runtime measurement, separate from the model
    config)."""

    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"

    @classmethod
    def from_budget(
        cls,
        config: TextConfig,
        budget_bytes: int,
        *,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
    ) -> CacheSpec:
        """Split a byte budget: conv slots for every sequence first, then sliding pages (capped at twice
        what `max_num_seqs` windows plus a full prefill chunk use: the other half holds prefix-cache windows),
        the rest to global pages."""
        if page_size < 1:
            raise ConfigError(f"kv page_size={page_size}: expected >= 1")
        elt = torch.empty((), dtype=dtype).element_size()
        conv_bytes = max_num_seqs * sum(
            (2 * config.layer_geometry(i).kv_width + 2 * config.hidden_size) * (config.conv_kernel_size - 1) * elt
            for i in range(config.num_layers)
        )
        sliding_page = global_page = 0
        for i in range(config.num_layers):
            cost = 2 * config.layer_geometry(i).kv_width * page_size * elt
            if config.sliding_layers[i]:
                sliding_page += cost
            else:
                global_page += cost
        kv_budget = budget_bytes - conv_bytes
        # One sequence must always be able to run: its window plus a full chunk of sliding pages.
        per_seq_window = math.ceil((config.sliding_window - 1 + max_num_batched_tokens) / page_size) + 1
        if kv_budget < per_seq_window * sliding_page + global_page:
            raise ConfigError(
                f"kv_cache_bytes={budget_bytes} cannot hold {max_num_seqs} conv slots ({conv_bytes} bytes), "
                f"one sequence's sliding window and one global page"
            )
        num_sliding = num_global = 0
        if sliding_page and global_page:
            equal = kv_budget // (sliding_page + global_page)
            num_sliding = max(per_seq_window, min(equal, 2 * max_num_seqs * per_seq_window))
            num_global = (kv_budget - num_sliding * sliding_page) // global_page
        elif sliding_page:
            num_sliding = kv_budget // sliding_page
        else:
            num_global = kv_budget // global_page
        return cls(page_size, num_sliding, num_global, max_num_seqs, dtype, device)


@dataclass(frozen=True)
class ConvSnapshot:
    """Copies of every layer's four conv states at one token boundary."""

    states: tuple[tuple[torch.Tensor, ...], ...]  # [layer][conv] -> [K-1, C]


class BlockTables:
    """Every conv slot's block table per layer kind, `[slots + 1, max_pages]` int32 on the device (the last row is
    the scratch slot's); the host keeps the entries written since the last upload, which sends them (one
    host-to-device copy, one scatter per kind). Entries no visible position uses (released sliding pages,
    pages past the end) hold the kind's scratch page."""

    def __init__(self, num_slots: int, max_pages: int, scratch: dict[bool, int], device: str):
        self.max_pages = max_pages
        self.device = {
            kind: torch.full((num_slots + 1, max_pages), page, dtype=torch.int32, device=device)
            for kind, page in scratch.items()
        }
        self._scratch = scratch
        self._pin = torch.device(device).type == "cuda"
        self._written: dict[bool, dict[int, int]] = {kind: {} for kind in scratch}  # flat entry -> page, unsent

    def write(self, slot: int, sliding: bool, first: int, pages: list[int | None]) -> None:
        """Table entries `first..first+len(pages)-1` of `slot` (None = a released page)."""
        assert first + len(pages) <= self.max_pages, f"block table of {first + len(pages)} pages > {self.max_pages}"
        if pages:
            row = [self._scratch[sliding] if p is None else p for p in pages]
            base = slot * self.max_pages + first
            self._written[sliding].update(zip(range(base, base + len(row)), row, strict=True))

    def upload(self) -> None:
        """Send the entries written since the last upload to the device (before a step that reads them)."""
        kinds = [(kind, written) for kind, written in self._written.items() if written]
        if not kinds:
            return
        flat = [e for _, written in kinds for e in written] + [p for _, written in kinds for p in written.values()]
        host = torch.tensor(flat, dtype=torch.int64)
        host = host.pin_memory() if self._pin else host
        sent = host.to(next(iter(self.device.values())).device, non_blocking=True)
        n = len(flat) // 2
        at = 0
        for kind, written in kinds:
            index, pages = sent[at : at + len(written)], sent[n + at : n + at + len(written)]
            self.device[kind].view(-1).index_copy_(0, index, pages.to(torch.int32))
            at += len(written)
            written.clear()


class KVCache:
    """The pools' tensors: KV pages per layer kind, conv slots per layer, one scratch page and slot each."""

    def __init__(self, config: TextConfig, spec: CacheSpec):
        self.config = config
        self.spec = spec
        self.page_size = spec.page_size
        self.window = config.sliding_window
        # layer -> (is_sliding, index among the layers of its kind)
        self.layer_kind: list[tuple[bool, int]] = []
        counts = {True: 0, False: 0}
        for i in range(config.num_layers):
            sliding = config.sliding_layers[i]
            self.layer_kind.append((sliding, counts[sliding]))
            counts[sliding] += 1
        self.has_sliding, self.has_global = counts[True] > 0, counts[False] > 0
        num_pages = {
            True: spec.num_sliding_pages if self.has_sliding else 0,
            False: spec.num_global_pages if self.has_global else 0,
        }
        self.k: dict[bool, torch.Tensor] = {}
        self.v: dict[bool, torch.Tensor] = {}
        self.scratch_page = dict(num_pages)  # the page past the last
        self.scratch_slot = spec.num_conv_slots
        for sliding in (True, False):
            geo = config.geometry(sliding)
            rows = (num_pages[sliding] + 1) * spec.page_size
            shape = (counts[sliding], rows, geo.num_kv_heads, geo.head_dim)
            self.k[sliding] = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
            self.v[sliding] = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        k1 = config.conv_kernel_size - 1
        self.conv: list[tuple[torch.Tensor, ...]] = []
        for i in range(config.num_layers):
            kv = config.layer_geometry(i).kv_width
            widths = (kv, kv, config.hidden_size, config.hidden_size)
            self.conv.append(
                tuple(torch.zeros(spec.num_conv_slots + 1, k1, c, dtype=spec.dtype, device=spec.device) for c in widths)
            )
        self.block_tables: BlockTables | None = None
        self._tables_written = False  # some view has table entries (block tables must exist before that)

    # -- the model's view (`PagedPools`) ---------------------------------------------------------------------

    def kv_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        sliding, index = self.layer_kind[layer]
        return self.k[sliding][index], self.v[sliding][index], sliding

    def conv_pool(self, layer: int, index: int) -> torch.Tensor:
        return self.conv[layer][index]

    def enable_block_tables(self, max_tokens: int) -> BlockTables:
        """Keep device block tables for sequences of up to `max_tokens` positions (the batched decode path); before
        any sequence holds pages, since tables are written as pages are handed out."""
        if self.block_tables is None:
            assert not self._tables_written, "block tables enabled with live sequences"
            max_pages = math.ceil(max_tokens / self.page_size)
            self.block_tables = BlockTables(self.spec.num_conv_slots, max_pages, self.scratch_page, self.spec.device)
        return self.block_tables

    # -- conv slots ------------------------------------------------------------------------------------------

    def zero_conv(self, slot: int) -> None:
        for states in self.conv:
            for s in states:
                s[slot].zero_()

    def snapshot_conv(self, slot: int) -> ConvSnapshot:
        return ConvSnapshot(tuple(tuple(s[slot].clone() for s in states) for states in self.conv))

    def restore_conv(self, slot: int, snapshot: ConvSnapshot) -> None:
        for states, saved in zip(self.conv, snapshot.states, strict=True):
            for s, value in zip(states, saved, strict=True):
                s[slot].copy_(value)


class SequenceView:
    """One sequence's slot and block tables as the data plane mirrors them from the scheduler's `PageUpdate`s;
    `layers` are its LayerCaches. `num_tokens` is the position its next chunk starts at."""

    def __init__(self, cache: KVCache, slot: int):
        self.cache = cache
        self.slot = slot
        self.num_tokens = 0
        self.tables: dict[bool, list[int | None]] = {True: [], False: []}
        self.layers = [_PagedLayer(self, i) for i in range(cache.config.num_layers)]
        self._index: dict[bool, tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]] = {}
        self._first_live = 0  # sliding table entries before this one are released

    def update(self, sliding: bool, update: PageUpdate) -> None:
        """Apply the scheduler's table entries (written at `update.first`) and released pages."""
        table = self.tables[sliding]
        assert update.first <= len(table), f"table update at {update.first} past {len(table)} entries"
        if update.pages:
            self._first_live = min(self._first_live, update.first)
            del table[update.first :]
            table.extend(update.pages)
            self.cache._tables_written = True
            if self.cache.block_tables is not None:
                self.cache.block_tables.write(self.slot, sliding, update.first, list(update.pages))
        if update.freed:  # always the earliest live sliding pages: scan on from the last one released
            freed, i = set(update.freed), self._first_live
            while freed:
                if table[i] in freed:
                    freed.discard(table[i])
                    table[i] = None
                i += 1
            self._first_live = i

    def _pages_for(self, total_tokens: int) -> int:
        return math.ceil(total_tokens / self.cache.page_size)

    def _indices(self, sliding: bool, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Flat pool slots to write `[start, start+n)` and to read every visible position, the first visible
        position and the visible pages (from its page on); memoised per step because every layer of a kind uses
        the same ones."""
        cached = self._index.get(sliding)
        if cached is not None and cached[0] == (start, n):
            return cached[1]
        page_size, table = self.cache.page_size, self.tables[sliding]
        first = max(0, start - (self.cache.window - 1)) if sliding else 0
        positions = torch.arange(first, start + n)
        pages = [table[p] for p in range(first // page_size, self._pages_for(start + n))]
        assert None not in pages, "a visible sliding page was released"
        assert len(pages) == self._pages_for(start + n) - first // page_size, "KV written past the allocated pages"
        page_ids = torch.tensor(pages, dtype=torch.int64)
        slots = page_ids[positions // page_size - first // page_size] * page_size + positions % page_size
        device = torch.device(self.cache.spec.device)
        host = torch.cat([slots, page_ids])  # one upload, from pinned memory on CUDA (no wait on the queue)
        host = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        slots, page_ids = host[: slots.shape[0]], host[slots.shape[0] :]
        indices = (slots[start - first :], slots, first, page_ids)
        self._index[sliding] = ((start, n), indices)
        return indices

    def append_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        k_pool, v_pool, _, read, first = self._write_kv(layer, k, v, start)
        return k_pool.index_select(0, read), v_pool.index_select(0, read), first

    def append_kv_paged(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> PagedKV:
        k_pool, v_pool, pages, _, first = self._write_kv(layer, k, v, start)
        return PagedKV(k_pool, v_pool, pages, self.cache.page_size, first)

    def _write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k, v `[n, nKV, hd]` at `start..` -> (k pool, v pool, visible pages, visible slots, first)."""
        assert start == self.num_tokens, f"KV append at {start} but the chunk starts at {self.num_tokens}"
        sliding, index = self.cache.layer_kind[layer]
        write, read, first, pages = self._indices(sliding, start, k.shape[0])
        k_pool, v_pool = self.cache.k[sliding][index], self.cache.v[sliding][index]  # [slots, nKV, hd]
        k_pool.index_copy_(0, write, k.to(k_pool.dtype))
        v_pool.index_copy_(0, write, v.to(v_pool.dtype))
        return k_pool, v_pool, pages, read, first


class _PagedLayer:
    """`LayerCache` view of one layer of a `SequenceView`."""

    def __init__(self, view: SequenceView, layer: int):
        self.view = view
        self.layer = layer

    def append_kv(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.view.append_kv(self.layer, k, v, start)

    def append_kv_paged(self, k: torch.Tensor, v: torch.Tensor, start: int) -> PagedKV:
        return self.view.append_kv_paged(self.layer, k, v, start)

    def conv_state(self, index: int) -> torch.Tensor:
        return self.view.cache.conv[self.layer][index][self.view.slot]

    def set_conv_state(self, index: int, state: torch.Tensor) -> None:
        self.view.cache.conv[self.layer][index][self.view.slot].copy_(state)
