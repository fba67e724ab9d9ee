"""The decode engine: requests in, token deltas out. Synchronous; the service drives `step` from its loop.

    engine = Engine(model, model_config, EngineSettings(...))
    engine.add_request(Request("a", prompt_ids, SamplingParams(temperature=0, max_tokens=32)))
    while engine.has_unfinished:
        for out in engine.step(): ...

Every request ends FINISHED with a reason (stop, length, abort, error:<msg>); a failing forward finishes the
requests of that step with an error and leaves the engine usable.

The engine wires the two planes: the control plane (`core/`: scheduler, page ids, prefix index) plans each step as
a plain-data `SchedulerOutput`; the data plane (`worker/`: tensors, runner, sampler, Redis I/O) executes it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from common.config import ModelConfig
from common.errors import ConfigError, InvalidInputError, ResourceExhaustedError
from common.fingerprint import config_fingerprint
from common.settings import DEFAULT_MTP_DRAFT_HEAD, MTP_AUTO, VLLM_MTP_ACCEPTANCE
from decode_service.engine.core.outputs import SchedulerOutput
from decode_service.engine.core.pages import KVAllocator
from decode_service.engine.core.prefix_index import PrefixCache
from decode_service.engine.core.scheduler import Scheduler, SchedulerConfig
from decode_service.engine.core.speculation import DepthTable
from decode_service.engine.core.stop import check_stop
from decode_service.engine.request import PENDING_TOKEN, FinishReason, Request, TokenLogprobs
from decode_service.engine.worker.calibrate import measure_prefill_rate, measure_speculation_costs
from decode_service.engine.worker.decode_graphs import BUCKETS, DecodeGraphs
from decode_service.engine.worker.kv_cache import CacheSpec, KVCache
from decode_service.engine.worker.mtp import DraftModel, MTPSpeculator, PagedMTPSpeculator
from decode_service.engine.worker.prefix_store import PrefixStore
from decode_service.engine.worker.ranks import RankFailure, RankLeader
from decode_service.engine.worker.redis_tier import RedisPrefixTier
from decode_service.engine.worker.runner import DecoderModel, ModelRunner, PendingStep, WorkerRequest
from decode_service.engine.worker.sampler import Sampler
from decode_service.model import fast_path
from decode_service.model.collectives import SINGLE
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    kv_cache_bytes: int = 1 << 30
    page_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings (and the KV capacity)
    enable_prefix_cache: bool = True
    snapshot_interval_blocks: int = 16  # conv snapshots for the prefix cache every N blocks (plus media/prompt ends)
    cache_dtype: torch.dtype | None = None  # default: the model's dtype
    device: str = "cpu"
    seed: int = 0  # seeds the generators of requests without their own seed
    model_fingerprint: bytes | None = None  # build_engine: common.fingerprint.model_fingerprint; else config + dtype
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (fast path on CUDA); False: the same path eagerly
    mtp_depth: int | str = 0  # MTP speculation: drafts per step from the checkpoint's first D depths (0 = off);
    # MTP_AUTO: per batch bucket from step costs measured at start and `mtp_acceptance` (core/speculation.py)
    mtp_acceptance: tuple[float, ...] = VLLM_MTP_ACCEPTANCE  # cumulative acceptance of draft positions 1, 2, ...
    mtp_draft_head: str = DEFAULT_MTP_DRAFT_HEAD  # the lm_head a tensor-parallel rank builds its drafter with
    async_scheduling: bool = True  # pure decode steps launch before the previous step's tokens are read (`step`)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    num_tokens: int  # tokens generated so far (`token_ids`)
    finished: bool
    finish_reason: str | None  # stop, length, abort, error:<msg>
    num_prompt_tokens: int
    num_cached_tokens: int  # = num_cached_tokens_gpu + num_cached_tokens_redis
    num_mm_tokens: int
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens_gpu: int = 0  # prompt tokens from this replica's prefix cache
    num_cached_tokens_redis: int = 0  # prompt tokens fetched from the shared Redis prefix tier
    num_draft_tokens: int = 0  # MTP drafts verified for this request so far
    num_accepted_draft_tokens: int = 0  # of which accepted
    generated: list[int] = field(default_factory=list, repr=False)  # the request's own list (append-only)

    @property
    def token_ids(self) -> list[int]:
        """Every token generated up to this output, copied when asked: a step's outputs do not copy each request's
        whole history (4.7 ms a step at 256 requests of 2000 tokens on a CPU core)."""
        return self.generated[: self.num_tokens]


@dataclass
class SpeculationStats:
    """MTP acceptance since the engine started (verify steps only)."""

    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # [a]: rounds that accepted exactly a drafts
    accepted_at: list[int] = field(default_factory=list)  # [k]: rounds that accepted draft k+1 (and all before it)

    def record(self, num_drafts: int, accepted: int) -> None:
        self.accepted_lengths += [0] * max(0, num_drafts + 1 - len(self.accepted_lengths))
        self.accepted_at += [0] * max(0, num_drafts - len(self.accepted_at))
        self.num_rounds += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        self.accepted_lengths[accepted] += 1
        for k in range(accepted):
            self.accepted_at[k] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the bonus token)."""
        return 1.0 + self.num_accepted_tokens / self.num_rounds if self.num_rounds else 0.0

    def snapshot(self, depth: int) -> SpeculationSnapshot:
        """A frozen copy for other threads (the metrics exporter), its per-length and per-position lists padded
        to `depth` drafts so the exported series exist from the first scrape on."""
        lengths = self.accepted_lengths + [0] * max(0, depth + 1 - len(self.accepted_lengths))
        at = self.accepted_at + [0] * max(0, depth - len(self.accepted_at))
        return SpeculationSnapshot(
            self.num_rounds, self.num_draft_tokens, self.num_accepted_tokens, tuple(lengths), tuple(at)
        )


@dataclass(frozen=True)
class SpeculationSnapshot:
    """`SpeculationStats` at one moment: `accepted_lengths[a]` rounds accepted exactly a drafts,
    `accepted_at[k]` rounds accepted draft k+1 (cumulative per position, vLLM's `..._per_pos`)."""

    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_lengths: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()


class Engine:
    def __init__(
        self,
        model: DecoderModel,
        config: ModelConfig,
        settings: EngineSettings,
        prefix_store: PrefixStore | None = None,
        drafter: MTPDrafter | DraftModel | None = None,
        ranks: RankLeader | None = None,
    ):
        """`prefix_store`: the shared Redis prefix tier (needs the prefix cache); its cost model is measured here.
        `drafter`: the checkpoint's MTP drafter (or a `DraftModel`), used when `settings.mtp_depth` > 0.
        `ranks`: the followers of a tensor-parallel replica (`engine/parallel.py`); every step goes to them first,
        and the KV pools hold the model's local heads (`model.config`)."""
        self.config = config
        self.settings = settings
        self.ranks = ranks
        text = model.config if isinstance(model, InklingDecoder) else config.text
        dtype = settings.cache_dtype or getattr(model, "dtype", torch.float32)
        spec = CacheSpec.from_budget(
            text,
            settings.kv_cache_bytes,
            page_size=settings.page_size,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            dtype=dtype,
            device=settings.device,
        )
        self.cache = KVAllocator(text, spec)  # control plane: page and slot ids
        self.kv = KVCache(text, spec)  # data plane: the tensors they index
        self.prefix_cache: PrefixCache | None = None
        fingerprint = settings.model_fingerprint or config_fingerprint(config.fingerprint_fields(), str(dtype))
        if settings.enable_prefix_cache:
            self.prefix_cache = PrefixCache(self.cache, fingerprint, settings.snapshot_interval_blocks)
        self.redis_prefix: RedisPrefixTier | None = None
        if prefix_store is not None and self.prefix_cache is not None:
            self.redis_prefix = (
                RedisPrefixTier(self.kv, fingerprint, prefix_store)
                if ranks is None
                else ranks.prefix_tier(self.kv, fingerprint, prefix_store)  # covers every rank's KV shard
            )
        self.max_model_len = min(
            settings.max_model_len or text.max_position_embeddings, self.cache.max_tokens_per_sequence()
        )
        self.scheduler = Scheduler(
            self.cache,
            SchedulerConfig(settings.max_num_batched_tokens, settings.max_num_seqs, self.max_model_len),
            self.prefix_cache,
            self.redis_prefix,
        )
        self.speculator = _speculator(drafter, model, settings, spec, self.max_model_len)
        self.depth_table: DepthTable | None = None  # --mtp-depth auto: the chosen depth per batch bucket
        self.speculation = SpeculationStats()
        if isinstance(self.speculator, MTPSpeculator) and self.prefix_cache is not None and self.kv.has_global:
            self.speculator.enable_prefix_rows(spec.num_global_pages, spec.page_size)
        drafts = self.speculator.num_depths if self.speculator is not None else 0
        decode_graphs = build_decode_graphs(model, self.kv, settings, self.max_model_len, drafts)
        self.runner = ModelRunner(
            model,
            self.kv,
            Sampler(settings.seed, settings.max_num_seqs, settings.device),
            settings.device,
            decode_graphs,
            self.redis_prefix,
            self.speculator,
            model.tp if isinstance(model, InklingDecoder) else SINGLE,
        )
        if ranks is not None:
            self.runner = ranks.lead(self.runner)
        if self.redis_prefix is not None and ranks is None:  # tensor parallel: once the followers run (parallel.py)
            self.calibrate_prefix_tier()
        if settings.mtp_depth == MTP_AUTO:
            self.calibrate_speculation()
        self.requests: dict[str, Request] = {}
        self._pending: tuple[SchedulerOutput, PendingStep, list[Request]] | None = None  # async: the step in flight
        self.num_steps = {"sync": 0, "async": 0}  # steps run each way (`step`)

    def calibrate_prefix_tier(self) -> None:
        """Measure the prefill rate the Redis prefix tier weighs fetches against (one scratch prefill chunk)."""
        chunk = min(self.settings.max_num_batched_tokens, 256)
        self.redis_prefix.calibrate(measure_prefill_rate(self.runner, self.cache, chunk))

    def calibrate_speculation(self) -> None:
        """`--mtp-depth auto`: measure the step costs of every batch bucket and choose its depth (logged)."""
        n = self.settings.max_num_seqs
        buckets = sorted({b for b in BUCKETS if b < n} | {n})  # the decode graphs' buckets
        rates = self.settings.mtp_acceptance
        costs = measure_speculation_costs(self.runner, self.cache, self.speculator, buckets, rates)
        if not costs:
            raise ConfigError("--mtp-depth auto: no free slot or pages to measure the speculation step costs")
        self.depth_table = DepthTable.choose(costs, rates)
        self.speculator.depth_for = self.depth_table.depth_for
        for line in self.depth_table.lines():
            logger.info("--mtp-depth auto: %s", line)

    @property
    def speculation_depth(self) -> int:
        """The most drafts one step proposes (0 without speculation)."""
        return self.speculator.num_depths if self.speculator is not None else 0

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidInputError(f"request id {request.request_id!r} is already in flight")
        request.validate(self.config.text.unpadded_vocab_size, self.config.text.hidden_size)
        covered = {i for item in request.mm_items for i in range(item.start, item.end)}
        placeholders = {self.config.image_token_id, self.config.audio_token_id}
        stray = [i for i, t in enumerate(request.prompt_token_ids) if t in placeholders and i not in covered]
        if stray:
            raise InvalidInputError(
                f"request {request.request_id}: media placeholder tokens at positions {stray[:5]} have no encoder rows"
            )
        limit = self.settings.max_model_len or self.config.text.max_position_embeddings
        if request.num_prompt_tokens >= limit:
            raise InvalidInputError(
                f"request {request.request_id}: {request.num_prompt_tokens} prompt tokens leave no room below "
                f"max_model_len={limit}"
            )
        if request.num_prompt_tokens >= self.max_model_len:
            raise ResourceExhaustedError(
                f"request {request.request_id}: {request.num_prompt_tokens} prompt tokens leave no room in the "
                f"KV cache ({self.max_model_len} tokens)"
            )
        self.requests[request.request_id] = request
        worker = WorkerRequest.of(request)
        worker.speculative = self.speculator is not None and request.sampling.speculative
        self.runner.add_request(worker)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        """Ends the request at the next step boundary (its final output reports `abort`)."""
        if request_id in self.requests:
            self.scheduler.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs of requests that got tokens or finished.

        With `async_scheduling`, a step the runner can overlap (`ModelRunner.overlappable`: every chunk a one-token
        decode through the decode graphs, sampled on the device alone) is launched before the tokens of the step in
        flight are read: the scheduler planned it with one pending token per request in flight, whose ids the
        device takes from that step's samples. Then the step in flight is read, checked for stops and emitted, and
        the new one committed; it is in flight until the next call. A request that stopped has its chunk of the new
        step discarded (its pages are released at the stop; the device's writes to them precede any reuse in stream
        order). Every other step (prefill chunks, MTP verify, grammar, logprobs, penalties, media, prefix-tier I/O)
        first reads the step in flight and then runs synchronously; so does a step after an abort, so an aborted
        request still gets the tokens it was sampled. `num_steps` counts both kinds."""
        deltas: dict[str, tuple[Request, list[int], list[TokenLogprobs]]] = {}
        if self._pending is not None and self.scheduler.has_pending_aborts:
            self._resolve(deltas)
        output = self.scheduler.schedule()
        assert output.chunks or output.finished or not self.has_unfinished, "scheduler made no progress"
        for rid in output.finished:
            _merge(deltas, self.requests[rid], [], [])
        if self.settings.async_scheduling and self.ranks is None and self.runner.overlappable(output):
            self.num_steps["async"] += 1
            return self._overlap(output, deltas)
        self.num_steps["sync"] += 1
        if self._pending is not None:
            self._resolve(deltas)
            output = self._known(output)
        try:
            results = self.runner.execute(output)
        except RankFailure:
            raise  # a tensor-parallel rank is gone: the replica cannot serve (the service fails every stream)
        except Exception as exc:  # the step's requests fail; the engine and the other requests carry on
            self._fail(output, exc, deltas)
            return self._emit(deltas)
        accepted: dict[str, int] = {}
        stopped: list[tuple[Request, FinishReason]] = []
        for chunk in output.chunks:
            request = self.requests[chunk.request_id]
            samples = results.samples.get(request.request_id)
            if not samples:
                continue
            accepted[request.request_id] = len(samples)  # a verify chunk commits the rows of its emitted tokens
            if chunk.num_drafts:
                self.speculation.record(chunk.num_drafts, len(samples) - 1)
                request.num_draft_tokens += chunk.num_drafts
                request.num_accepted_draft_tokens += len(samples) - 1
            new_ids, new_logprobs = [], []
            for result in samples:  # a stop inside an accepted run cuts exactly there
                request.output_token_ids.append(result.token_id)
                new_ids.append(result.token_id)
                if result.logprobs is not None:
                    request.output_logprobs.append(result.logprobs)
                    new_logprobs.append(result.logprobs)
                reason = check_stop(request, self.config.eos_token_ids, self.max_model_len, result.constraint_finished)
                if reason is not None:
                    stopped.append((request, reason))
                    accepted[request.request_id] = min(len(samples), len(new_ids))
                    break
            else:
                request.draft_token_ids = results.drafts.get(request.request_id, ())
            _merge(deltas, request, new_ids, new_logprobs)
        self.scheduler.commit(output, accepted)
        for request, reason in stopped:
            self.scheduler.finish(request, reason)
        return self._emit(deltas)

    def _overlap(self, output: SchedulerOutput, deltas: dict) -> list[RequestOutput]:
        """Launch `output`, then read, stop-check and emit the step in flight; `output` is in flight after."""
        previous = self._pending
        try:
            launched = self.runner.launch(output, previous[1] if previous is not None else None)
        except RankFailure:
            raise
        except Exception as exc:
            if previous is not None:
                self._resolve(deltas)
            self._fail(output, exc, deltas)
            return self._emit(deltas)
        self._pending = (output, launched, [self.requests[c.request_id] for c in output.chunks])
        for request in self._pending[2]:
            request.num_pending_tokens += 1
        if previous is not None:
            self._resolve(deltas, previous)
        self.scheduler.commit(output)  # its input tokens are all known now; chunks of stopped requests are skipped
        if all(r.is_finished for r in self._pending[2]):
            self._pending = None  # nothing left to read (its device work is queued before any later step)
        return self._emit(deltas)

    def _resolve(self, deltas: dict, pending: tuple | None = None) -> None:
        """Read the tokens of the step in flight (`pending`: the one before it), append them, check stops."""
        if pending is None:
            pending, self._pending = self._pending, None
        _, launched, requests = pending
        results = self.runner.collect(launched)
        for request in requests:
            if request.is_finished:  # stopped at the step before: this token is discarded
                continue
            (result,) = results.samples[request.request_id]
            request.num_pending_tokens -= 1
            request.output_token_ids.append(result.token_id)
            _merge(deltas, request, [result.token_id], [])
            reason = check_stop(request, self.config.eos_token_ids, self.max_model_len)
            if reason is not None:
                self.scheduler.finish(request, reason)

    def _known(self, output: SchedulerOutput) -> SchedulerOutput:
        """After `_resolve`: `output` with its pending token ids filled in and without the chunks of requests that
        stopped (their snapshots dropped)."""
        chunks, stopped = [], []
        for c in output.chunks:
            request = self.requests[c.request_id]
            if request.is_finished:
                stopped.append(c)
            elif PENDING_TOKEN in c.token_ids:
                chunks.append(c._replace(token_ids=tuple(request.token_slice(c.start, c.end))))
            else:
                chunks.append(c)
        self.scheduler.discard(tuple(stopped))
        return replace(output, chunks=tuple(chunks))

    def _fail(self, output: SchedulerOutput, exc: Exception, deltas: dict) -> None:
        logger.exception("forward step failed; finishing its %d requests", len(output.chunks))
        self.scheduler.abandon(output)
        for chunk in output.chunks:
            request = self.requests[chunk.request_id]
            if not request.is_finished:
                self.scheduler.finish(request, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
            _merge(deltas, request, [], [])

    def _emit(self, deltas: dict[str, tuple[Request, list[int], list[TokenLogprobs]]]) -> list[RequestOutput]:
        outputs = []
        for request, new_ids, new_logprobs in deltas.values():
            redis_tokens = self.scheduler.num_cached_tokens_redis.get(request.request_id, 0)
            if request.is_finished:
                self.requests.pop(request.request_id, None)
                self.runner.remove_request(request.request_id)
                self.scheduler.num_cached_tokens_redis.pop(request.request_id, None)
            outputs.append(
                RequestOutput(
                    request.request_id,
                    new_ids,
                    len(request.output_token_ids),
                    request.is_finished,
                    request.finish_reason_text,
                    request.num_prompt_tokens,
                    request.num_cached_tokens,
                    sum(item.length for item in request.mm_items) if request.mm_items else 0,
                    new_logprobs,
                    request.num_cached_tokens - redis_tokens,
                    redis_tokens,
                    request.num_draft_tokens,
                    request.num_accepted_draft_tokens,
                    request.output_token_ids,
                )
            )
        return outputs

    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Run the given requests to completion; the final output of each, in the order given."""
        order = []
        for request in requests:
            self.add_request(request)
            order.append(request.request_id)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished:
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in order]


def _merge(deltas: dict, request: Request, ids: list[int], logprobs: list[TokenLogprobs]) -> None:
    """Add a request's new tokens to this call's outputs (a call may read two steps)."""
    if request.request_id in deltas:
        _, old_ids, old_logprobs = deltas[request.request_id]
        ids, logprobs = old_ids + ids, old_logprobs + logprobs
    deltas[request.request_id] = (request, ids, logprobs)


def _speculator(
    drafter: MTPDrafter | DraftModel | None,
    model: DecoderModel,
    settings: EngineSettings,
    spec: CacheSpec,
    max_model_len: int,
) -> DraftModel | None:
    """The checkpoint drafter's speculator (batched over paged depth pools when the trunk runs the paged decode
    kernels, else per request) or the given `DraftModel`; `auto`: every depth the acceptance table covers."""
    depth = settings.mtp_depth
    if depth == MTP_AUTO:
        if not isinstance(drafter, MTPDrafter):
            raise ConfigError("mtp_depth=auto: needs the checkpoint's MTP drafter")
        depth = min(drafter.num_depths, len(settings.mtp_acceptance))
    if depth < 0:
        raise ConfigError(f"mtp_depth={depth}: expected >= 0")
    if depth == 0:
        return None
    if drafter is None:
        raise ConfigError(f"mtp_depth={depth}: the engine was given no MTP drafter (the checkpoint has none?)")
    if isinstance(drafter, MTPDrafter):
        batched = isinstance(model, InklingDecoder) and fast_path.supports_batched_decode(model)
        if batched and drafter.tp.size == 1:  # under TP the drafts are the leader's picks (`_leader_picks`)
            return PagedMTPSpeculator.build(
                drafter, depth, spec, settings.max_num_batched_tokens, max_model_len, settings.cuda_graphs,
                settings.seed,
            )  # fmt: skip
        return MTPSpeculator(drafter, depth)
    if drafter.num_depths != depth:
        raise ConfigError(f"mtp_depth={depth}: the drafter proposes {drafter.num_depths} tokens")
    return drafter


def build_decode_graphs(
    model: DecoderModel, cache: KVCache, settings: EngineSettings, max_model_len: int, max_drafts: int = 0
) -> DecodeGraphs | None:
    """The batched paged decode path when the model runs it (the one place the engine asks `fast_path`); with MTP
    it also runs the verify steps of up to `max_drafts` drafts (width max_drafts + 1; fewer drafts are padded)."""
    if not (isinstance(model, InklingDecoder) and fast_path.supports_batched_decode(model)):
        return None
    widths = (1, max_drafts + 1)
    graphs = DecodeGraphs(
        model, cache, settings.max_num_seqs, max_model_len, use_graphs=settings.cuda_graphs, widths=widths
    )
    graphs.capture_all()
    return graphs
