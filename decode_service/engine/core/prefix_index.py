"""Prefix cache: full KV pages + conv-state snapshots keyed by chained block hashes.

Block hash i = SHA-256(hash i-1 || token ids of block i || extra keys), where extra keys name the media rows
that placeholder tokens stand for as `(mm_key, offset in the item, offset in the block)`, and the chain starts
from a root that covers the model fingerprint and the request's cache salt. So equal hashes mean equal token
and media history.

An entry holds one reference on its global page, on its sliding page while that page is still alive when the
entry is made, and optionally the id of a conv snapshot taken when a computation ended exactly on its boundary
(the data plane holds the states; `SnapshotIds` hands out ids and collects those to drop). The
scheduler cuts prefill chunks at tracked boundaries (every N blocks, the last block start inside each media
span's end, the last full block before the prompt's last token) so those snapshots exist. A hit is usable only
up to a boundary that has a snapshot and whose trailing sliding window pages are held. Unreferenced entries
are evicted least recently used first (the tail of a chain before its head).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from decode_service.engine.core.pages import KVAllocator, SequencePages
from decode_service.engine.request import Request

_ROOT_TAG = b"inkling-epd/prefix-cache/v1"


class SnapshotIds:
    """Conv-snapshot ids: new ones for the data plane to fill, dropped ones for it to free."""

    def __init__(self) -> None:
        self._next = 0
        self._dropped: list[int] = []

    def new(self) -> int:
        self._next += 1
        return self._next

    def drop(self, snapshot_id: int) -> None:
        self._dropped.append(snapshot_id)

    def take_dropped(self) -> list[int]:
        dropped, self._dropped = self._dropped, []
        return dropped


@dataclass
class _Entry:
    global_page: int | None
    sliding_page: int | None
    snapshot: int | None = None  # conv snapshot id


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int
    global_pages: list[int]
    sliding_pages: list[int | None]  # None where the page is outside the window of `num_tokens`
    snapshot: int  # conv snapshot id


@dataclass
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0
    hit_tokens: int = 0
    truncated_no_snapshot: int = 0  # lookups whose longest block match had to be cut back to a snapshot


class PrefixCache:
    def __init__(self, cache: KVAllocator, fingerprint: bytes, snapshot_interval_blocks: int = 16):
        assert snapshot_interval_blocks >= 1
        self.cache = cache
        self.page_size = cache.page_size
        self.fingerprint = fingerprint
        self.interval = snapshot_interval_blocks * cache.page_size
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.stats = PrefixCacheStats()
        self.snapshots = SnapshotIds()

    # -- hashing and boundaries ------------------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The first `num_blocks` chained hashes of the request's tokens (memoised on the request)."""
        hashes, size = request.block_hashes, self.page_size
        assert num_blocks * size <= request.num_tokens - request.num_pending_tokens, "hashing a pending token"
        parent = hashes[-1] if hashes else self._root(request)
        for i in range(len(hashes), num_blocks):
            start, end = i * size, (i + 1) * size
            h = hashlib.sha256(parent)
            h.update(struct.pack(f"<{size}q", *request.token_slice(start, end)))
            for item in request.mm_items:
                lo, hi = max(start, item.start), min(end, item.end)
                if lo < hi:
                    h.update(b"mm" + struct.pack("<q", len(item.mm_key)) + item.mm_key)
                    h.update(struct.pack("<qq", lo - item.start, lo - start))
            parent = h.digest()
            hashes.append(parent)
        return hashes[:num_blocks]

    def _root(self, request: Request) -> bytes:
        salt = (request.cache_salt or "").encode()
        h = hashlib.sha256(_ROOT_TAG)
        for part in (self.fingerprint, salt):
            h.update(struct.pack("<q", len(part)) + part)
        return h.digest()

    def _candidate_boundaries(self, request: Request) -> list[int]:
        size = self.page_size
        points = [((request.num_prompt_tokens - 1) // size) * size]
        points += [(item.end // size) * size for item in request.mm_items]
        return [p for p in points if p > 0]

    def is_tracked(self, request: Request, boundary: int) -> bool:
        return boundary > 0 and (boundary % self.interval == 0 or boundary in self._candidate_boundaries(request))

    def wants_snapshot(self, request: Request, end: int) -> bool:
        """Whether a computation that ends at `end` should keep its conv states (a tracked block boundary)."""
        return end % self.page_size == 0 and self.is_tracked(request, end)

    def next_boundary(self, request: Request, after: int) -> int:
        """The first tracked boundary after `after` (prefill chunks end there so a snapshot is taken)."""
        periodic = (after // self.interval + 1) * self.interval
        return min([periodic] + [p for p in self._candidate_boundaries(request) if p > after])

    # -- lookup / insert / evict -----------------------------------------------------------------------------

    def lookup(self, request: Request) -> PrefixHit | None:
        """Longest usable cached prefix, always leaving at least one token to compute (for the logits)."""
        self.stats.queries += 1
        max_blocks = (request.num_tokens - 1) // self.page_size
        matched: list[_Entry] = []
        for h in self.block_hashes(request, max_blocks):
            entry = self.entries.get(h)
            if entry is None or (self.cache.has_global and entry.global_page is None):
                break
            matched.append(entry)
        for j in range(len(matched), 0, -1):
            if matched[j - 1].snapshot is None:
                continue
            boundary = j * self.page_size
            first_window_block = max(0, boundary - (self.cache.window - 1)) // self.page_size
            if self.cache.has_sliding and any(e.sliding_page is None for e in matched[first_window_block:j]):
                continue
            if j < len(matched):
                self.stats.truncated_no_snapshot += 1
            self._touch(request, j)
            self.stats.hits += 1
            self.stats.hit_tokens += boundary
            sliding = [e.sliding_page if i >= first_window_block else None for i, e in enumerate(matched[:j])]
            return PrefixHit(
                boundary,
                [e.global_page for e in matched[:j]] if self.cache.has_global else [],
                sliding if self.cache.has_sliding else [],
                matched[j - 1].snapshot,
            )
        if matched:
            self.stats.truncated_no_snapshot += 1
        return None

    def _touch(self, request: Request, num_blocks: int) -> None:
        for h in reversed(request.block_hashes[:num_blocks]):  # the head ends most recent: evicted last
            self.entries.move_to_end(h)

    def insert(
        self,
        request: Request,
        handle: SequencePages,
        num_tokens: int,
        snapshot: int | None = None,
        loaded: bool = False,
    ) -> bool:
        """Record the blocks completed by a step that brings `handle` from `handle.num_tokens` to
        `num_tokens`. Call before `handle.commit`, which releases sliding pages that left the window.
        `snapshot`: the id of the conv states at `num_tokens` (planned where `wants_snapshot`). `loaded`: the
        prefix came from another tier; its snapshot makes `num_tokens` a usable boundary even where this request
        does not track one. True when the entry took the snapshot (else the caller drops it)."""
        size = self.page_size
        first, last = handle.num_tokens // size, num_tokens // size
        if first == last:  # no block completed (most decode steps), so no boundary reached either
            return False
        hashes = self.block_hashes(request, last)
        window_start = num_tokens - (self.cache.window - 1)
        for i in range(first, last):
            entry = self.entries.get(hashes[i])
            g_page = handle.tables[False][i] if self.cache.has_global else None
            keep_sliding = self._window_needs(request, i) or (
                loaded and self.cache.has_sliding and (i + 1) * size > window_start
            )
            s_page = handle.tables[True][i] if keep_sliding else None
            if entry is None:
                entry = _Entry(g_page, s_page)
                for sliding, page in ((False, g_page), (True, s_page)):
                    if page is not None:
                        self.cache.pools[sliding].incref(page)
                self.entries[hashes[i]] = entry
            elif entry.sliding_page is None and s_page is not None and entry.global_page == g_page:
                self.cache.pools[True].incref(s_page)
                entry.sliding_page = s_page
            self.entries.move_to_end(hashes[i])
        if snapshot is not None and last > 0 and num_tokens == last * size:
            entry = self.entries[hashes[last - 1]]
            if entry.snapshot is None:
                entry.snapshot = snapshot
                return True
        return False

    def _window_needs(self, request: Request, block: int) -> bool:
        """Whether block `block` lies in the sliding window before the next tracked boundary (the only
        sliding pages a hit can use)."""
        if not self.cache.has_sliding:
            return False
        boundary = self.next_boundary(request, block * self.page_size)
        return (block + 1) * self.page_size > boundary - (self.cache.window - 1)

    def evict(self, need: tuple[int, int]) -> bool:
        """Free pages least recently used first until `need` (sliding, global) pages are free: a missing
        sliding page only drops a sliding page that no sequence shares (the hits whose window covered it become
        unusable); a missing global page drops whole entries that no sequence shares. True if `need` fits."""
        pools = self.cache.pools
        for h in list(self.entries):
            if self.cache.fits(need):
                break
            entry = self.entries[h]
            s_free = entry.sliding_page is None or pools[True].refcount(entry.sliding_page) == 1
            g_free = entry.global_page is None or pools[False].refcount(entry.global_page) == 1
            if need[0] > pools[True].num_free and entry.sliding_page is not None and s_free:
                pools[True].decref(entry.sliding_page)
                entry.sliding_page = None
            if need[1] > pools[False].num_free and g_free and (entry.sliding_page is None or s_free):
                del self.entries[h]
                if entry.snapshot is not None:
                    self.snapshots.drop(entry.snapshot)
                for s, page in ((True, entry.sliding_page), (False, entry.global_page)):
                    if page is not None:
                        pools[s].decref(page)
        return self.cache.fits(need)

    def clear(self) -> None:
        for h in list(self.entries):
            entry = self.entries.pop(h)
            if entry.snapshot is not None:
                self.snapshots.drop(entry.snapshot)
            for s, p in ((True, entry.sliding_page), (False, entry.global_page)):
                if p is not None:
                    self.cache.pools[s].decref(p)
