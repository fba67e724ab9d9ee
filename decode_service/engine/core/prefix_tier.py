"""The control plane's side of the shared (Redis) prefix tier: what to save after a step, what to load at admission.

The tier's I/O is the data plane's (`worker/redis_tier.py`). At admission the scheduler asks it, through the
`PrefixTier` port, how far the prefix chain after the GPU hit is worth fetching (it probes Redis, applies its
cost model, fetches and verifies the values, and keeps them staged under a `load_id`); the scheduler then
allocates the pages and records the blocks in the prefix index, and the step's plan carries a `PrefixLoad` that
the data plane installs before the forward. After each scheduled chunk the plan carries a `PrefixSave` of the
global blocks it completes inside the prompt and, on a tracked boundary, that boundary's window and conv states.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from decode_service.engine.core.outputs import BlockSave, BoundarySave, PrefixLoad, PrefixSave
from decode_service.engine.core.pages import KVAllocator, SequencePages
from decode_service.engine.core.prefix_index import PrefixCache
from decode_service.engine.request import Request


class TierHit(NamedTuple):
    load_id: int  # the data plane's staged values
    num_blocks: int  # the boundary the values reach, in blocks


class PrefixTier(Protocol):
    def lookup(self, block_hashes: Sequence[bytes], start_block: int) -> TierHit | None:
        """The most worthwhile boundary after `start_block` whose values are fetched and verified; None = none."""
        ...


def window_first_block(cache: KVAllocator, boundary: int) -> int:
    """The first block of the sliding window that a sequence at `boundary` still reads."""
    if not cache.has_sliding:
        return boundary // cache.page_size
    return max(0, boundary - (cache.window - 1)) // cache.page_size


def plan_save(prefix: PrefixCache, request: Request, seq: SequencePages, end: int) -> PrefixSave | None:
    """For a chunk that brings `seq` from `seq.num_tokens` to `end` (pages grown, not committed): the global blocks
    it completes inside the prompt's cacheable part and, on a tracked boundary, that boundary."""
    cache, size = prefix.cache, prefix.page_size
    limit = ((request.num_prompt_tokens - 1) // size) * size  # the last boundary a hit can use
    first, last = seq.num_tokens // size, min(end, limit) // size
    if last <= first:
        return None
    hashes = prefix.block_hashes(request, last)
    blocks = ()
    if cache.has_global:
        blocks = tuple(BlockSave(i, hashes[i], seq.tables[False][i]) for i in range(first, last))
    boundary = None
    if end <= limit and end % size == 0 and prefix.is_tracked(request, end):
        pages = seq.tables[True][window_first_block(cache, end) : last] if cache.has_sliding else []
        if None not in pages:
            boundary = BoundarySave(hashes[last - 1], end, tuple(pages), seq.slot)
    return PrefixSave(request.request_id, blocks, boundary)


def plan_load(
    prefix: PrefixCache,
    request: Request,
    seq: SequencePages,
    hit: TierHit,
    make_room: Callable[[tuple[int, int]], bool],
) -> PrefixLoad | None:
    """Pages for a tier hit that extends `seq` (empty or at a GPU-hit boundary), recorded in the prefix index and
    committed; None when they cannot be made free."""
    cache, size = prefix.cache, prefix.page_size
    start, end = seq.num_tokens // size, hit.num_blocks
    boundary = end * size
    lo = max(window_first_block(cache, boundary), start)
    need = (end - lo if cache.has_sliding else 0, end - start if cache.has_global else 0)
    if not make_room(need):
        return None
    global_pages = cache.pools[False].allocate(need[1])
    sliding_pages = cache.pools[True].allocate(need[0])
    if cache.has_global:
        seq.extend_table(False, global_pages)
    if cache.has_sliding:
        seq.extend_table(True, [None] * (lo - start) + sliding_pages)
    snapshot = prefix.snapshots.new()
    if not prefix.insert(request, seq, boundary, snapshot, loaded=True):
        prefix.snapshots.drop(snapshot)  # after the step's restore of it
    seq.commit(boundary)
    return PrefixLoad(
        hit.load_id, request.request_id, start, end, tuple(global_pages), lo, tuple(sliding_pages), snapshot
    )
