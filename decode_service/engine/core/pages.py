"""Page and conv-slot ids: the pools' free lists and ref counts, and each sequence's block tables.

Sliding and global layers have different KV head counts, so each kind has its own pool of pages; a page id
indexes the same page in every layer of that kind (one block table per kind per sequence). Sliding layers only
keep the last `W-1` tokens: once a step is committed, pages that lie entirely before `num_tokens - (W-1)` are
released. A sequence owns one conv slot for its whole life.

Pages are ref-counted so the prefix cache can share full pages between sequences; a shared page is never
written (sequences only write positions at or after their own computed prefix, which starts on a page boundary).
Only ids live here; the tensors they index are the data plane's (`worker/kv_cache.py`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.config import TextConfig
from decode_service.engine.core.outputs import PageUpdate


@dataclass(frozen=True)
class PoolSizes:
    """How many pages and slots the pools have (the data plane's `CacheSpec` adds dtype and device)."""

    page_size: int
    num_sliding_pages: int
    num_global_pages: int
    num_conv_slots: int


class PagePool:
    """Free list + reference counts of one pool's page ids."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), f"allocating {n} pages with {len(self._free)} free"
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, page: int) -> None:
        assert self._refs[page] > 0, f"page {page} is free"
        self._refs[page] += 1

    def decref(self, page: int) -> None:
        assert self._refs[page] > 0, f"page {page} released twice"
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refs[page]


class KVAllocator:
    """The page pools (True = sliding) and the conv-slot free list. Sequences borrow from here."""

    def __init__(self, config: TextConfig, spec: PoolSizes):
        self.config = config
        self.spec = spec
        self.page_size = spec.page_size
        self.window = config.sliding_window
        self.has_sliding = any(config.sliding_layers[i] for i in range(config.num_layers))
        self.has_global = not all(config.sliding_layers[i] for i in range(config.num_layers))
        self.pools = {
            True: PagePool(spec.num_sliding_pages if self.has_sliding else 0),
            False: PagePool(spec.num_global_pages if self.has_global else 0),
        }
        self._free_slots: deque[int] = deque(range(spec.num_conv_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def num_free_pages(self, sliding: bool) -> int:
        return self.pools[sliding].num_free

    def fits(self, need: tuple[int, int]) -> bool:
        """need = (sliding pages, global pages)."""
        return need[0] <= self.pools[True].num_free and need[1] <= self.pools[False].num_free

    def max_tokens_per_sequence(self) -> int:
        """The longest sequence the global pool can ever hold (sliding layers only need their window)."""
        if not self.has_global:
            return 1 << 62
        return self.pools[False].num_pages * self.page_size

    def new_sequence(self) -> SequencePages:
        """A sequence on a free conv slot (the caller has the data plane zero it)."""
        assert self._free_slots, "no free conv slot"
        return SequencePages(self, self._free_slots.popleft())

    def _release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)


class SequencePages:
    """One sequence's block tables (page ids per layer kind) and conv slot.

    `num_tokens` counts committed positions. The scheduler grows the tables before a step (`grow`) and commits
    afterwards (`commit`), which drops sliding pages outside the window. `take_updates` hands the data plane the
    table entries written and the pages released since the previous call.
    """

    def __init__(self, allocator: KVAllocator, slot: int):
        self.allocator = allocator
        self.slot: int | None = slot
        self.num_tokens = 0
        # Block table per layer kind (True = sliding); None marks a sliding page released out of the window.
        self.tables: dict[bool, list[int | None]] = {True: [], False: []}
        self._reported = {True: 0, False: 0}
        self._freed: dict[bool, list[int]] = {True: [], False: []}
        self._released = 0  # sliding table entries before this index are released
        self.is_new = True  # no update taken yet: the data plane starts a fresh view of this slot
        self._unchanged: dict[bool, PageUpdate | None] = {True: None, False: None}

    @property
    def released(self) -> bool:
        return self.slot is None

    def pages_needed(self, total_tokens: int) -> tuple[int, int]:
        """(sliding, global) pages to allocate so positions `< total_tokens` have a page."""
        allocator, n = self.allocator, -(-total_tokens // self.allocator.page_size)  # pages, rounded up
        sliding = max(0, n - len(self.tables[True])) if allocator.has_sliding else 0
        return sliding, max(0, n - len(self.tables[False])) if allocator.has_global else 0

    def grow(self, total_tokens: int) -> None:
        sliding, global_ = self.pages_needed(total_tokens)
        if sliding:
            self.extend_table(True, self.allocator.pools[True].allocate(sliding))
        if global_:
            self.extend_table(False, self.allocator.pools[False].allocate(global_))

    def extend_table(self, sliding: bool, pages: list[int | None]) -> None:
        """Append already-referenced pages (None = a sliding page outside the window) to a block table."""
        self.tables[sliding].extend(pages)

    def commit(self, num_tokens: int) -> None:
        """Positions `< num_tokens` are now computed; release sliding pages no future query can see."""
        assert num_tokens >= self.num_tokens
        self.num_tokens = num_tokens
        first_visible = num_tokens - (self.allocator.window - 1)
        table, pool = self.tables[True], self.allocator.pools[True]
        end = min(len(table), max(0, first_visible) // self.allocator.page_size)
        for i in range(self._released, end):
            if table[i] is not None:
                pool.decref(table[i])
                if i < self._reported[True]:  # else the data plane gets the entry as None
                    self._freed[True].append(table[i])
                table[i] = None
        self._released = max(self._released, end)

    def adopt_prefix(self, num_tokens: int, global_pages: list[int], sliding_pages: list[int | None]) -> None:
        """Start from a prefix-cache hit: share its pages (one more reference each). The conv states come from
        the hit's snapshot (a `restore` conv op)."""
        assert self.num_tokens == 0 and not self.tables[True] and not self.tables[False]
        for sliding, pages in ((True, sliding_pages), (False, global_pages)):
            for p in pages:
                if p is not None:
                    self.allocator.pools[sliding].incref(p)
            self.extend_table(sliding, list(pages))
        self.num_tokens = num_tokens

    def take_updates(self) -> tuple[PageUpdate, PageUpdate]:
        """(sliding, global) table entries appended and pages released since the last call."""
        self.is_new = False
        return self._take(True), self._take(False)

    def _take(self, sliding: bool) -> PageUpdate:
        first, table, freed = self._reported[sliding], self.tables[sliding], self._freed[sliding]
        if len(table) == first and not freed:  # most decode steps: reuse the empty update
            unchanged = self._unchanged[sliding]
            if unchanged is None or unchanged.first != first:
                unchanged = self._unchanged[sliding] = PageUpdate(first, (), ())
            return unchanged
        self._reported[sliding] = len(table)
        self._freed[sliding] = []
        return PageUpdate(first, tuple(table[first:]), tuple(freed))

    def release(self) -> None:
        """Return every page reference and the conv slot. Idempotent."""
        if self.slot is None:
            return
        for sliding in (True, False):
            for p in self.tables[sliding]:
                if p is not None:
                    self.allocator.pools[sliding].decref(p)
            self.tables[sliding] = []
        self._released = 0
        self.allocator._release_slot(self.slot)
        self.slot = None
