"""Continuous batching over the paged cache: CPU bookkeeping only, no model, no tensors.

Every step packs the running sequences (decodes and unfinished prefills, in priority/arrival order) and then
admits waiting requests, all under a token budget and a sequence cap. A request is admitted when a conv slot
and the pages for its next chunk are available (after a prefix-cache lookup, optionally extended from the shared
prefix tier, and, if needed, evicting unreferenced prefix entries). When a running sequence cannot grow, the
lowest-priority latest running request is preempted by recompute: its cache is released and it waits again with
its generated tokens kept, to be prefilled as prompt + output. Aborts are applied at the start of the next step.
The result of `schedule` is a plain-data `SchedulerOutput`, the only thing the data plane sees; `commit` records
the step once the data plane has run it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter

from decode_service.engine.core.outputs import (
    DROP,
    RESTORE,
    SNAPSHOT,
    ZERO,
    ConvOp,
    PrefixLoad,
    PrefixSave,
    PrefixTierPlan,
    ScheduledChunk,
    SchedulerOutput,
)
from decode_service.engine.core.pages import KVAllocator
from decode_service.engine.core.prefix_index import PrefixCache
from decode_service.engine.core.prefix_tier import PrefixTier, plan_load, plan_save
from decode_service.engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prefill chunks)
    max_num_seqs: int = 8  # running sequences (= conv slots)
    max_model_len: int = 1 << 62  # positions a sequence may write (verify chunks stay below it)


class _Step:
    """What one `schedule` call accumulates before it is frozen into a `SchedulerOutput`."""

    def __init__(self) -> None:
        self.chunks: list[ScheduledChunk] = []
        self.conv_ops: list[ConvOp] = []
        self.loads: list[PrefixLoad] = []
        self.saves: list[PrefixSave] = []
        self.preempted: list[str] = []
        self.finished: list[str] = []

    def freeze(self, dropped: list[int]) -> SchedulerOutput:
        ops = self.conv_ops + [ConvOp(DROP, None, s) for s in dropped] if dropped else self.conv_ops
        plan = PrefixTierPlan(tuple(self.loads), tuple(self.saves)) if self.loads or self.saves else _NO_TIER_IO
        return SchedulerOutput(tuple(self.chunks), tuple(ops), plan, tuple(self.preempted), tuple(self.finished))


_NO_TIER_IO = PrefixTierPlan()
_SORT_KEY = attrgetter("sort_key")


class Scheduler:
    def __init__(
        self,
        cache: KVAllocator,
        config: SchedulerConfig,
        prefix_cache: PrefixCache | None = None,
        prefix_tier: PrefixTier | None = None,
    ):
        """`prefix_tier`: the shared tier (needs `prefix_cache`): looked up at admission, saved to after chunks."""
        assert config.max_num_seqs <= cache.spec.num_conv_slots, "fewer conv slots than max_num_seqs"
        assert prefix_tier is None or prefix_cache is not None, "the shared prefix tier needs the prefix cache"
        self.cache = cache
        self.config = config
        self.prefix_cache = prefix_cache
        self.prefix_tier = prefix_tier
        self.num_cached_tokens_redis: dict[str, int] = {}  # request id -> prompt tokens fetched from the tier
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.live: dict[str, Request] = {}  # waiting + running by id
        self._aborts: set[str] = set()
        self._dropped: list[int] = []  # snapshot ids to drop with the next output

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        assert request.request_id not in self.live, f"request {request.request_id} is already scheduled"
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.live[request.request_id] = request

    def abort(self, request_id: str) -> None:
        """Takes effect at the next `schedule` (a step boundary)."""
        self._aborts.add(request_id)

    # -- one step --------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step()
        self._apply_aborts(step)
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=_SORT_KEY)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk_size(request, budget)
            drafts = self._drafts(request, n, budget) if request.draft_token_ids else ()
            if drafts and not self._make_room(
                request.handle.pages_needed(request.num_computed_tokens + n + len(drafts))
            ):
                drafts = ()  # speculation never preempts: verify only what fits
            if not self._reserve(request, n + len(drafts), step):
                continue  # `request` itself was preempted or finished; the list shrank
            step.chunks.append(self._scheduled(request, n, step, drafts))
            budget -= n + len(drafts)
            i += 1
        if not step.preempted:
            self._admit(budget, step)
        dropped = self._dropped
        if self.prefix_cache is not None:
            dropped += self.prefix_cache.snapshots.take_dropped()
        self._dropped = []
        return step.freeze(dropped)

    def commit(self, output: SchedulerOutput, accepted: Mapping[str, int] | None = None) -> None:
        """After the data plane ran `output`: the chunks are in the caches (record prefix blocks, advance, trim).
        `accepted`: for verify chunks, how many of their tokens are committed (the rest were rejected drafts); the
        sliding pages a rollback still reads are released only here, after acceptance is known."""
        for chunk in output.chunks:
            request = self.live.get(chunk.request_id)
            if request is None:  # async scheduling: it stopped at the step before, which finished after this one ran
                self.discard((chunk,))
                continue
            n = accepted[chunk.request_id] if chunk.num_drafts and accepted else len(chunk.token_ids)
            seq, end = request.handle, chunk.start + n
            if self.prefix_cache is not None:
                taken = self.prefix_cache.insert(request, seq, end, chunk.snapshot_id)
                if chunk.snapshot_id is not None and not taken:
                    self._dropped.append(chunk.snapshot_id)  # an equal block already had one
            seq.commit(end)
            request.num_computed_tokens = end

    def discard(self, chunks: tuple[ScheduledChunk, ...]) -> None:
        """Chunks that will not be committed (their request finished while they were planned): the snapshots they
        planned are dropped with the next output."""
        self._dropped += [c.snapshot_id for c in chunks if c.snapshot_id is not None]

    @property
    def has_pending_aborts(self) -> bool:
        return bool(self._aborts)

    def abandon(self, output: SchedulerOutput) -> None:
        """The data plane failed to run `output` (its requests are finished by the caller): drop the snapshots
        it planned and, if it loaded prefixes, the prefix index (which may name pages never written)."""
        self._dropped += [c.snapshot_id for c in output.chunks if c.snapshot_id is not None]
        if output.prefix_tier.loads and self.prefix_cache is not None:
            self.prefix_cache.clear()

    def finish(self, request: Request, reason: FinishReason, message: str | None = None) -> None:
        """Terminate a request (stop, length, error) and release its cache."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.live.pop(request.request_id, None)
        self._release(request)
        request.num_pending_tokens = 0  # sampled by a step in flight: discarded
        request.finish(reason, message)

    # -- helpers ---------------------------------------------------------------------------------------------

    def _apply_aborts(self, step: _Step) -> None:
        if not self._aborts:
            return
        for request in self.running + self.waiting:
            if request.request_id in self._aborts:
                self.finish(request, FinishReason.ABORT)
                step.finished.append(request.request_id)
        self._aborts.clear()

    def _chunk_size(self, request: Request, budget: int) -> int:
        computed = request.num_computed_tokens
        n = min(request.num_tokens - computed, budget)
        if self.prefix_cache is not None and n > 1:
            # End prefill chunks on tracked boundaries so the prefix cache gets its conv snapshots.
            n = min(n, self.prefix_cache.next_boundary(request, computed) - computed)
        return n

    def _drafts(self, request: Request, n: int, budget: int) -> tuple[int, ...]:
        """The drafts a decode step of `request` verifies: within the step budget, max_tokens and max_model_len."""
        drafts, request.draft_token_ids = request.draft_token_ids, ()
        if not drafts or n != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return ()
        k = min(len(drafts), budget - 1, self.config.max_model_len - 1 - request.num_computed_tokens)
        if request.sampling.max_tokens is not None:
            k = min(k, request.sampling.max_tokens - len(request.output_token_ids) - 1)
        return drafts[: max(k, 0)]

    def _scheduled(self, request: Request, n: int, step: _Step, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        seq, start = request.handle, request.num_computed_tokens
        end = start + n
        snapshot = None
        if self.prefix_cache is not None and not drafts:  # a verify chunk's end is known only after acceptance
            if self.prefix_cache.wants_snapshot(request, end):
                snapshot = self.prefix_cache.snapshots.new()
                step.conv_ops.append(ConvOp(SNAPSHOT, seq.slot, snapshot))
            if self.prefix_tier is not None:
                save = plan_save(self.prefix_cache, request, seq, end)
                if save is not None:
                    step.saves.append(save)
        is_new = seq.is_new
        sliding, global_ = seq.take_updates()
        tokens = tuple(request.token_slice(start, end))
        if drafts:
            tokens += drafts
        return ScheduledChunk(
            request.request_id,
            seq.slot,
            start,
            tokens,
            end == request.num_tokens,
            sliding,
            global_,
            is_new,
            snapshot,
            len(drafts),
        )

    def _make_room(self, need: tuple[int, int]) -> bool:
        if self.cache.fits(need):
            return True
        return self.prefix_cache is not None and self.prefix_cache.evict(need)

    def _reserve(self, request: Request, n: int, step: _Step) -> bool:
        """Pages for `request`'s next `n` tokens, preempting the tail of `running` while they do not fit."""
        total = request.num_computed_tokens + n
        need = request.handle.pages_needed(total)
        if need == (0, 0):  # most decode steps: the last page has room
            return True
        while not self._make_room(need):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                self.finish(request, FinishReason.ERROR, f"KV cache capacity exceeded at {total} tokens")
                step.finished.append(request.request_id)
                return False
            self._preempt(victim, step)
            if victim is request:
                return False
        request.handle.grow(total)
        return True

    def _preempt(self, request: Request, step: _Step) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        request.draft_token_ids = ()
        self.waiting.append(request)
        step.preempted.append(request.request_id)

    def _release(self, request: Request) -> None:
        if request.handle is not None:
            request.handle.release()
            request.handle = None
        request.num_computed_tokens = 0

    def _admit(self, budget: int, step: _Step) -> None:
        self.waiting.sort(key=_SORT_KEY)
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or not self.cache.num_free_slots:
                return
            if request.num_tokens + 1 > self.cache.max_tokens_per_sequence():
                self.finish(request, FinishReason.ERROR, f"{request.num_tokens} tokens exceed the KV cache capacity")
                step.finished.append(request.request_id)
                continue
            assert not request.num_pending_tokens, f"request {request.request_id} admitted with pending tokens"
            request.handle = seq = self.cache.new_sequence()
            step.conv_ops.append(ConvOp(ZERO, seq.slot))
            hit = self.prefix_cache.lookup(request) if self.prefix_cache is not None else None
            if hit is not None:
                seq.adopt_prefix(hit.num_tokens, hit.global_pages, hit.sliding_pages)
                step.conv_ops.append(ConvOp(RESTORE, seq.slot, hit.snapshot))
                request.num_computed_tokens = hit.num_tokens
            fetched = self._load_from_tier(request, step) if self.prefix_tier is not None else 0
            n = self._chunk_size(request, budget)
            total = request.num_computed_tokens + n
            if not self._make_room(seq.pages_needed(total)):
                self._release(request)
                return  # first come first served: nobody overtakes the head of the queue
            seq.grow(total)
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = request.num_computed_tokens
                if fetched:
                    self.num_cached_tokens_redis[request.request_id] = fetched
            request.status = RequestStatus.RUNNING
            self.waiting.remove(request)
            self.running.append(request)
            step.chunks.append(self._scheduled(request, n, step))
            budget -= n

    def _load_from_tier(self, request: Request, step: _Step) -> int:
        """Extend the admitted sequence with the shared tier's most worthwhile prefix; the tokens added."""
        seq, size = request.handle, self.cache.page_size
        start, max_blocks = seq.num_tokens // size, (request.num_tokens - 1) // size
        if max_blocks <= start:
            return 0
        hit = self.prefix_tier.lookup(self.prefix_cache.block_hashes(request, max_blocks), start)
        load = plan_load(self.prefix_cache, request, seq, hit, self._make_room) if hit is not None else None
        if load is None:
            return 0
        step.loads.append(load)
        step.conv_ops.append(ConvOp(RESTORE, seq.slot, load.snapshot_id))
        request.num_computed_tokens = seq.num_tokens
        return seq.num_tokens - start * size
