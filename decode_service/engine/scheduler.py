"""Continuous batching over the paged cache: CPU bookkeeping only, no model.

Every step packs the running sequences (decodes and unfinished prefills, in priority/arrival order) and then
admits waiting requests, all under a token budget and a sequence cap. A request is admitted when a conv slot
and the pages for its next chunk are available (after a prefix-cache lookup, optionally extended from the shared
Redis tier of `redis_prefix.py`, and, if needed, evicting unreferenced prefix entries). When a running sequence
cannot grow, the lowest-priority latest running request is preempted by recompute: its cache is released and it
waits again with its generated tokens kept, to be prefilled as prompt + output. Aborts are applied at the start
of the next step. The result of `schedule` is a `SchedulerOutput`, the only thing the runner sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from decode_service.engine.kv_cache import CacheHandle, KVCache
from decode_service.engine.prefix_cache import PrefixCache
from decode_service.engine.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from decode_service.engine.redis_prefix import RedisPrefixTier


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prefill chunks)
    max_num_seqs: int = 8  # running sequences (= conv slots)


@dataclass
class ScheduledSequence:
    request: Request
    handle: CacheHandle
    token_ids: list[int]  # the tokens computed this step
    start_position: int  # absolute position of token_ids[0]
    needs_logits: bool  # the chunk reaches the end of the known tokens: sample the next one

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # released this step, back in the queue
    finished: list[Request] = field(default_factory=list)  # terminated while scheduling (abort, cannot fit)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


class Scheduler:
    def __init__(
        self,
        cache: KVCache,
        config: SchedulerConfig,
        prefix_cache: PrefixCache | None = None,
        redis_prefix: RedisPrefixTier | None = None,
    ):
        assert config.max_num_seqs <= cache.spec.num_conv_slots, "fewer conv slots than max_num_seqs"
        self.cache = cache
        self.config = config
        self.prefix_cache = prefix_cache
        self.redis_prefix = redis_prefix  # shared tier: fetched after a GPU lookup, published after prefill
        self.num_cached_tokens_redis: dict[str, int] = {}  # request id -> prompt tokens fetched from Redis
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._aborts: set[str] = set()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Takes effect at the next `schedule` (a step boundary)."""
        self._aborts.add(request_id)

    # -- one step --------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._apply_aborts(out)
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: r.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk_size(request, budget)
            if not self._reserve(request, n, out):
                continue  # `request` itself was preempted or finished; the list shrank
            out.sequences.append(self._scheduled(request, n))
            budget -= n
            i += 1
        if not out.preempted:
            self._admit(budget, out)
        return out

    def commit(self, output: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens are in the caches (record prefix blocks, advance, trim)."""
        for seq in output.sequences:
            request, end = seq.request, seq.start_position + seq.num_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.insert(request, seq.handle, end)
            if self.redis_prefix is not None:
                self.redis_prefix.publish(request, seq.handle, end)
            seq.handle.commit(end)
            request.num_computed_tokens = end

    def finish(self, request: Request, reason: FinishReason, message: str | None = None) -> None:
        """Terminate a request (stop, length, error) and release its cache."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.finish(reason, message)

    # -- helpers ---------------------------------------------------------------------------------------------

    def _apply_aborts(self, out: SchedulerOutput) -> None:
        if not self._aborts:
            return
        for request in self.running + self.waiting:
            if request.request_id in self._aborts:
                self.finish(request, FinishReason.ABORT)
                out.finished.append(request)
        self._aborts.clear()

    def _chunk_size(self, request: Request, budget: int) -> int:
        computed = request.num_computed_tokens
        n = min(request.num_tokens - computed, budget)
        if self.prefix_cache is not None and n > 1:
            # End prefill chunks on tracked boundaries so the prefix cache gets its conv snapshots.
            n = min(n, self.prefix_cache.next_boundary(request, computed) - computed)
        return n

    def _scheduled(self, request: Request, n: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        return ScheduledSequence(
            request,
            request.handle,
            request.token_slice(start, start + n),
            start,
            start + n == request.num_tokens,
        )

    def _make_room(self, need: tuple[int, int]) -> bool:
        if self.cache.fits(need):
            return True
        return self.prefix_cache is not None and self.prefix_cache.evict(need)

    def _reserve(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Pages for `request`'s next `n` tokens, preempting the tail of `running` while they do not fit."""
        total = request.num_computed_tokens + n
        while not self._make_room(request.handle.pages_needed(total)):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                self.finish(request, FinishReason.ERROR, f"KV cache capacity exceeded at {total} tokens")
                out.finished.append(request)
                return False
            self._preempt(victim, out)
            if victim is request:
                return False
        request.handle.grow(total)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.append(request)
        out.preempted.append(request)

    def _release(self, request: Request) -> None:
        if request.handle is not None:
            request.handle.release()
            request.handle = None
        request.num_computed_tokens = 0

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        self.waiting.sort(key=lambda r: r.sort_key)
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or not self.cache.num_free_slots:
                return
            if request.num_tokens + 1 > self.cache.max_tokens_per_sequence():
                self.finish(request, FinishReason.ERROR, f"{request.num_tokens} tokens exceed the KV cache capacity")
                out.finished.append(request)
                continue
            request.handle = self.cache.new_handle()
            hit = self.prefix_cache.lookup(request) if self.prefix_cache is not None else None
            if hit is not None:
                request.handle.adopt_prefix(hit.num_tokens, hit.global_pages, hit.sliding_pages, hit.snapshot)
                request.num_computed_tokens = hit.num_tokens
            fetched = 0
            if self.redis_prefix is not None:
                fetched = self.redis_prefix.fetch(request, request.handle, self._make_room)
                request.num_computed_tokens = request.handle.num_tokens
            n = self._chunk_size(request, budget)
            total = request.num_computed_tokens + n
            if not self._make_room(request.handle.pages_needed(total)):
                self._release(request)
                return  # first come first served: nobody overtakes the head of the queue
            request.handle.grow(total)
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = request.num_computed_tokens
                if fetched:
                    self.num_cached_tokens_redis[request.request_id] = fetched
            request.status = RequestStatus.RUNNING
            self.waiting.remove(request)
            self.running.append(request)
            out.sequences.append(self._scheduled(request, n))
            budget -= n
