"""Data plane: executes a `SchedulerOutput` (tables, loads, conv ops, forward, sampling, snapshots, saves).

The runner keeps what the data plane needs of each request, sent once when it is added (`WorkerRequest`: media
rows, sampling parameters, the generator, the tokens it sampled) and a `SequenceView` per scheduled sequence;
the scheduler output names requests by id only. Order of a step: see `core/outputs.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from decode_service.engine.core.outputs import BEFORE_FORWARD, ScheduledChunk, SchedulerOutput
from decode_service.engine.request import PENDING_TOKEN, MultimodalItem, Request, SamplingParams
from decode_service.engine.worker.decode_graphs import DecodeGraphs, DeviceTokens
from decode_service.engine.worker.kv_cache import KVCache, SequenceView
from decode_service.engine.worker.mtp import DraftInput, DraftModel, Tokens
from decode_service.engine.worker.rejection import verify_draft
from decode_service.engine.worker.sampler import Sampler, SampleResult, argmax_only, samples_on_device, to_device
from decode_service.engine.worker.snapshots import SnapshotStore
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.collectives import SINGLE, TPGroup

if TYPE_CHECKING:
    from decode_service.engine.worker.redis_tier import RedisPrefixTier
    from decode_service.structured.matcher import ConstraintMatcher


class DecoderModel(Protocol):
    """What the runner needs from `decode_service.model.inkling.InklingDecoder`."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(eq=False)
class WorkerRequest:
    """The data plane's copy of a request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_items: tuple[MultimodalItem, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)  # every token sampled for it (kept on preemption)
    generator: torch.Generator | None = None
    constraint: ConstraintMatcher | None = None  # structured output: masks its logits, advanced per token
    speculative: bool = False  # the drafter keeps state for it and proposes its drafts

    @classmethod
    def of(cls, request: Request) -> WorkerRequest:
        return cls(
            request.request_id,
            list(request.prompt_token_ids),
            request.sampling,
            request.mm_items,
            list(request.output_token_ids),
            constraint=request.constraint,
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def build_batch(
    output: SchedulerOutput,
    requests: dict[str, WorkerRequest],
    views: dict[str, SequenceView],
    device: torch.device | str = "cpu",
) -> tuple[ForwardBatch, list[int]]:
    """Pack the scheduled chunks: the batch and the packed row of each chunk's last token.

    Multimodal rows go to the packed rows of their placeholder tokens inside this step's chunk only; a chunk
    may start or end inside a media span, in which case just the overlapping rows are placed.
    """
    token_ids: list[int] = []
    slices: list[SequenceSlice] = []
    last_rows: list[int] = []
    mm_rows: list[torch.Tensor] = []
    mm_index: list[torch.Tensor] = []
    for chunk in output.chunks:
        offset, start, end = len(token_ids), chunk.start, chunk.end
        for item in requests[chunk.request_id].mm_items:
            lo, hi = max(start, item.start), min(end, item.end)
            if lo < hi:
                mm_rows.append(item.rows[lo - item.start : hi - item.start])
                mm_index.append(torch.arange(offset + lo - start, offset + hi - start))
        token_ids.extend(chunk.token_ids)
        slices.append(SequenceSlice(start, len(chunk.token_ids), views[chunk.request_id].layers))
        last_rows.append(len(token_ids) - 1)
    batch = ForwardBatch(torch.tensor(token_ids, dtype=torch.int64, device=device), slices)
    if mm_rows:
        batch.mm_rows = torch.cat(mm_rows).to(device)
        batch.mm_index = torch.cat(mm_index).to(device)
    return batch, last_rows


def decode_width(output: SchedulerOutput, requests: dict[str, WorkerRequest]) -> int | None:
    """The longest chunk's tokens when every chunk is a decode of text tokens (one token, or a verify of the last
    sampled token and its drafts, outside any media span); None for any other step (a prefill chunk, media)."""
    for c in output.chunks:
        if c.num_tokens != c.num_drafts + 1 or any(
            item.start < c.end and c.start < item.end for item in requests[c.request_id].mm_items
        ):
            return None
    return max(c.num_tokens for c in output.chunks)


@dataclass
class RunnerOutput:
    """One step's result: the tokens each sampled request emits (several after a verify: the accepted drafts and
    the bonus token, in order) and the drafter's proposals for the next step."""

    samples: dict[str, list[SampleResult]] = field(default_factory=dict)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(eq=False)
class PendingStep:
    """A decode step launched on the device whose tokens the host has not read (`ModelRunner.launch`)."""

    chunks: tuple[ScheduledChunk, ...]
    requests: list[WorkerRequest]  # the chunks' requests when it launched
    tokens: torch.Tensor  # [B] int64 on the device: chunk i's sampled token, the next step's input
    host: torch.Tensor  # [B] its copy on the host (pinned on CUDA), complete once `ready` has passed
    ready: torch.cuda.Event | None


class ModelRunner:
    """`decode_graphs`: decode and verify steps of text tokens go there (batched paged path, CUDA graphs); the
    rest (prefill chunks, media rows) is packed.
    `prefix_tier`: executes the plan's loads and saves (None without the shared tier). `sampler` None: a
    follower rank of a tensor-parallel replica (`ranks.py`), which computes the logits (their all-gather is a
    collective) and samples nothing. `drafter`: MTP speculation (chunks with `num_drafts` are verified, the
    committed rows extend the drafter's state). `tp`: the model's group on a tensor-parallel rank; with a drafter,
    the tokens rank 0 sampled reach the followers through it within the step (their replay and depths need them)."""

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        sampler: Sampler | None,
        device: torch.device | str = "cpu",
        decode_graphs: DecodeGraphs | None = None,
        prefix_tier: RedisPrefixTier | None = None,
        drafter: DraftModel | None = None,
        tp: TPGroup = SINGLE,
    ):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = device
        self.decode_graphs = decode_graphs
        self.prefix_tier = prefix_tier
        self.drafter = drafter
        self.tp = tp
        self.snapshots = SnapshotStore(cache)
        self.requests: dict[str, WorkerRequest] = {}
        self.views: dict[str, SequenceView] = {}
        self._host_tokens: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # `launch`'s two, used in turn

    def add_request(self, request: WorkerRequest) -> None:
        self.requests[request.request_id] = request

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.views.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.remove(request_id)

    def overlappable(self, output: SchedulerOutput) -> bool:
        """Whether `launch` runs this step: every chunk a one-token decode through the decode graphs whose token the
        device alone samples (`samples_on_device`), no conv slot zeroed or restored, no prefix-tier I/O, one rank,
        no drafter. Any other step runs through `execute` (the engine's per-step rule, engine.py)."""
        if self.decode_graphs is None or self.drafter is not None or self.sampler is None or self.tp.size > 1:
            return False
        if not output.chunks or output.prefix_tier.loads or output.prefix_tier.saves:
            return False
        if any(op.kind in BEFORE_FORWARD for op in output.conv_ops):
            return False
        for c in output.chunks:
            if c.num_tokens != 1 or c.num_drafts or not c.needs_logits or c.new_sequence:
                return False
            request = self.requests[c.request_id]
            if not samples_on_device(request):
                return False
            if request.mm_items and any(i.start < c.end and c.start < i.end for i in request.mm_items):
                return False
        return True

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput, previous: PendingStep | None = None) -> PendingStep:
        """Run an `overlappable` step up to its sampled tokens without reading them: chunks whose token is
        `PENDING_TOKEN` take `previous`'s sample of their request on the device. `collect` reads the tokens."""
        try:
            self._prepare(output)
            chunks = output.chunks
            ids = [c.token_ids[0] for c in chunks]
            pending = self._device_tokens(chunks, ids, previous)
            hidden = self.decode_graphs.run(ids, [self.views[c.request_id] for c in chunks], pending)  # [B, H]
            requests = [self.requests[c.request_id] for c in chunks]
            if self._argmax_only(chunks):
                tokens = self.decode_graphs.greedy_tokens(hidden).clone()  # the head graph's buffer is reused
            else:
                tokens = self.sampler.choose(self.model.logits(hidden).float(), requests)
            if output.conv_ops:
                self.snapshots.after_forward(output.conv_ops)
                self.snapshots.drop(output.conv_ops)
        finally:
            if self.prefix_tier is not None:
                self.prefix_tier.discard_staged()
        if tokens.device.type != "cuda":
            return PendingStep(chunks, requests, tokens, tokens, None)
        host, ready = self._next_host_tokens(tokens.dtype)
        host = host[: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        ready.record()
        return PendingStep(chunks, requests, tokens, host, ready)

    def _next_host_tokens(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer of max_num_seqs tokens and its event, two in turn: when a step launches, only the step
        before it may be unread (the engine reads it next), so the one before that has left its buffer."""
        if not self._host_tokens:
            n = self.decode_graphs.buckets[-1]
            self._host_tokens = [(torch.empty(n, dtype=dtype, pin_memory=True), torch.cuda.Event()) for _ in range(2)]
        self._host_tokens.reverse()
        host, ready = self._host_tokens[0]
        assert host.dtype == dtype, f"sampled tokens of {dtype}, buffers of {host.dtype}"
        return host, ready

    def collect(self, step: PendingStep) -> RunnerOutput:
        """Wait for a launched step's tokens and record them (the step's one sync)."""
        if step.ready is not None:
            step.ready.synchronize()
        samples = {}
        for c, request, token in zip(step.chunks, step.requests, step.host.tolist(), strict=True):
            request.output_token_ids.append(token)
            samples[c.request_id] = [SampleResult(token)]
        return RunnerOutput(samples)

    def _device_tokens(
        self, chunks: tuple[ScheduledChunk, ...], ids: list[int], previous: PendingStep | None
    ) -> DeviceTokens | None:
        """Where each `PENDING_TOKEN` of this step is in `previous`'s samples."""
        rows = [i for i, t in enumerate(ids) if t == PENDING_TOKEN]
        if not rows:
            return None
        assert previous is not None, "a pending token without a step in flight"
        at = {c.request_id: i for i, c in enumerate(previous.chunks)}
        return DeviceTokens(previous.tokens, [at[chunks[i].request_id] for i in rows], rows)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Run one step; every scheduled sequence's cache advances (a verify chunk's by its accepted rows); the
        emitted tokens and next drafts keyed by request id."""
        if self.prefix_tier is None:
            return self._execute(output)
        try:
            return self._execute(output)
        finally:
            self.prefix_tier.discard_staged()  # lookups the scheduler could not make room for

    def _execute(self, output: SchedulerOutput) -> RunnerOutput:
        self._prepare(output)
        results = self._forward(output) if output.chunks else RunnerOutput()
        if output.conv_ops:
            self.snapshots.after_forward(output.conv_ops)
        if self.prefix_tier is not None:
            for save in output.prefix_tier.saves:
                self.prefix_tier.save(save)
        if output.conv_ops:
            self.snapshots.drop(output.conv_ops)
        return results

    def _prepare(self, output: SchedulerOutput) -> None:
        views = self.views
        for chunk in output.chunks:
            view = views.get(chunk.request_id)
            if chunk.new_sequence or view is None:
                assert chunk.new_sequence, f"request {chunk.request_id} continues a sequence this runner never saw"
                views[chunk.request_id] = view = SequenceView(self.cache, chunk.slot)
            if chunk.sliding_pages.pages or chunk.sliding_pages.freed:
                view.update(True, chunk.sliding_pages)
            if chunk.global_pages.pages:
                view.update(False, chunk.global_pages)
            view.num_tokens = chunk.start
        if self.prefix_tier is not None:
            for load in output.prefix_tier.loads:
                self.snapshots.put(load.snapshot_id, self.prefix_tier.load(load))
                if self.drafter is not None:
                    self.drafter.forget(load.global_pages)
        if self.drafter is not None:
            for chunk in output.chunks:
                request = self.requests[chunk.request_id]
                if chunk.new_sequence and request.speculative:
                    pages = views[chunk.request_id].tables[False]
                    self.drafter.reset(chunk.request_id, chunk.start, request.all_token_ids, pages)
        if output.conv_ops:
            self.snapshots.before_forward(op for op in output.conv_ops if op.kind in BEFORE_FORWARD)

    def _forward(self, output: SchedulerOutput) -> RunnerOutput:
        chunks, graphs = output.chunks, self.decode_graphs
        width = decode_width(output, self.requests) if graphs is not None else None
        if width is not None and graphs.width(width) is not None:
            hidden, first_rows, samples = self._forward_graphs(chunks, width)
        else:
            hidden, first_rows, samples = self._forward_packed(output)
        drafts = self._draft(chunks, hidden, first_rows, samples) if self.drafter is not None else {}
        return RunnerOutput(samples, drafts)

    def _forward_graphs(
        self, chunks: tuple[ScheduledChunk, ...], width: int
    ) -> tuple[torch.Tensor, list[int], dict[str, list[SampleResult]]]:
        """A decode or verify step from the decode graphs; a verify commits the conv states of the accepted rows
        (`DecodeGraphs.commit`), so no replay is needed."""
        views = [self.views[c.request_id] for c in chunks]
        greedy = self._argmax_only(chunks)
        if width == 1:
            hidden = self.decode_graphs.run([c.token_ids[0] for c in chunks], views)  # [B, H]
            first_rows = list(range(len(chunks)))
            samples = self._greedy_samples(chunks, hidden, 1) if greedy else self._emitted(chunks, hidden, first_rows)
            return hidden, first_rows, samples
        hidden, width = self.decode_graphs.verify([c.token_ids for c in chunks], views)  # [B*W, H]
        first_rows = [i * width for i in range(len(chunks))]
        samples = self._greedy_samples(chunks, hidden, width) if greedy else self._emitted(chunks, hidden, first_rows)
        self.decode_graphs.commit([len(samples[c.request_id]) if c.num_drafts else c.num_tokens for c in chunks])
        return hidden, first_rows, samples

    def _argmax_only(self, chunks: tuple[ScheduledChunk, ...]) -> bool:
        """Whether this rank samples every chunk of the step as the argmax of its logits and nothing else (greedy,
        unconstrained, no penalties, no logprobs: `sampler.argmax_only`), so the decode graph's argmax stands in
        for `_sample` (one rank: under tensor parallelism the logits are gathered outside the graphs)."""
        if self.sampler is None or self.tp.size > 1:
            return False
        return all(c.needs_logits and argmax_only(self.requests[c.request_id]) for c in chunks)

    def _greedy_samples(
        self, chunks: tuple[ScheduledChunk, ...], hidden: torch.Tensor, width: int
    ) -> dict[str, list[SampleResult]]:
        """`_sample` for an `_argmax_only` step from the decode graph's token ids (`[B*W]`, read as B*W ints):
        a verify chunk emits its rows' argmaxes while they equal the drafts, then the first that does not."""
        ids = self.decode_graphs.greedy_tokens(hidden).tolist()
        samples: dict[str, list[SampleResult]] = {}
        for i, c in enumerate(chunks):
            emitted = []
            for j in range(c.num_drafts + 1):  # row i*W + j: the token after the chunk's j-th
                emitted.append(ids[i * width + j])
                if j == c.num_drafts or emitted[-1] != c.token_ids[j + 1]:
                    break
            self.requests[c.request_id].output_token_ids.extend(emitted)
            samples[c.request_id] = [SampleResult(t) for t in emitted]
        return samples

    def _forward_packed(self, output: SchedulerOutput) -> tuple[torch.Tensor, list[int], dict[str, list[SampleResult]]]:
        """Any step through the packed path; verify chunks restore their conv states and run their accepted rows
        again when a draft was rejected (decisions.md)."""
        chunks = output.chunks
        before = {c.request_id: self.cache.snapshot_conv(c.slot) for c in chunks if c.num_drafts}
        batch, last_rows = build_batch(output, self.requests, self.views, self.device)
        hidden = self.model.forward(batch)  # [T, H]
        first_rows = [row - c.num_tokens + 1 for c, row in zip(chunks, last_rows, strict=True)]
        samples = self._emitted(chunks, hidden, first_rows)
        rejected = [c for c in chunks if c.num_drafts and len(samples[c.request_id]) < c.num_tokens]
        if rejected:
            self._replay(output, rejected, samples, before)
        return hidden, first_rows, samples

    def _emitted(
        self, chunks: tuple[ScheduledChunk, ...], hidden: torch.Tensor, first_rows: list[int]
    ) -> dict[str, list[SampleResult]]:
        """`_sample`, and under tensor parallelism with a drafter the leader's tokens on every rank (a follower
        commits, replays and drafts from exactly the rows the leader accepted)."""
        samples = self._sample(chunks, hidden, first_rows)
        if self.drafter is not None and self.tp.size > 1:
            samples = self._leader_samples(chunks, samples, hidden.device)
        return samples

    def _sample(
        self, chunks: tuple[ScheduledChunk, ...], hidden: torch.Tensor, first_rows: list[int]
    ) -> dict[str, list[SampleResult]]:
        """Sample each chunk's next token; a verify chunk's rows one after another while the draft that follows is
        kept: drafts without a distribution (greedy) while the sampled token equals them, so every emitted token is
        drawn from the target given the tokens before it (penalties, constraints, logprobs and seeded generators
        see what a non-speculative run does); sampled drafts by rejection sampling against their `q`."""
        rows, index = [], {}  # logits row of (request id, verify offset)
        for c, first in zip(chunks, first_rows, strict=True):
            if c.needs_logits:
                for j in range(c.num_drafts + 1):
                    index[c.request_id, j] = len(rows)
                    rows.append(first + c.num_tokens - 1 - c.num_drafts + j)
        if not rows:
            return {}
        # Host indices reach the device without a sync (sampler.to_device): up to the read of the tokens nothing
        # waits for the forward, so sampling's host work (the grammar masks) is enqueued while it runs.
        logits = self.model.logits(hidden.index_select(0, to_device(rows, hidden.device)))  # [N, V] fp32
        if self.sampler is None:
            return {}
        samples: dict[str, list[SampleResult]] = {}
        q = {c.request_id: self._draft_probs(c) for c in chunks if c.num_drafts}
        active = [(c, 0) for c in chunks if c.needs_logits]
        while active:
            plain = [(c, j) for c, j in active if j == c.num_drafts or q.get(c.request_id) is None]
            emitted: list[tuple[ScheduledChunk, int, SampleResult, bool]] = []  # (chunk, offset, result, go on)
            if plain:
                reqs = [self.requests[c.request_id] for c, _ in plain]
                picks = to_device([index[c.request_id, j] for c, j in plain], logits.device)
                for (c, j), result in zip(plain, self.sampler.sample(logits.index_select(0, picks), reqs), strict=True):
                    emitted.append((c, j, result, j < c.num_drafts and result.token_id == c.token_ids[j + 1]))
            for c, j in active:
                if j < c.num_drafts and q.get(c.request_id) is not None:  # rejection sampling (worker/rejection.py)
                    request, row = self.requests[c.request_id], logits[index[c.request_id, j]][None]
                    p = self.sampler.target_probs(row, [request])[0]
                    generator = self.sampler.generator(request, logits.device)
                    ok, token = verify_draft(p, q[c.request_id][j], c.token_ids[j + 1], generator)
                    emitted.append((c, j, self.sampler.emit(row, [request], [token])[0], ok))
            active = []
            for c, j, result, go_on in emitted:
                self.requests[c.request_id].output_token_ids.append(result.token_id)
                samples.setdefault(c.request_id, []).append(result)
                if go_on and not result.constraint_finished:
                    active.append((c, j + 1))
        return samples

    def _leader_samples(
        self, chunks: tuple[ScheduledChunk, ...], samples: dict[str, list[SampleResult]], device: torch.device
    ) -> dict[str, list[SampleResult]]:
        """The tokens rank 0 emitted this step, on every rank of a tensor-parallel replica: a follower replays the
        rows they accept and extends its depths over them, so it records them as the leader's `_sample` did."""
        sampled = [c for c in chunks if c.needs_logits]
        if not sampled:
            return samples
        ids = torch.full((len(sampled), 1 + max(c.num_drafts for c in sampled)), -1, dtype=torch.int64)  # [C, 1+D]
        if self.sampler is not None:
            for i, c in enumerate(sampled):
                emitted = [r.token_id for r in samples[c.request_id]]
                ids[i, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
        rows = self.tp.from_leader(ids.to(device)).tolist()
        if self.sampler is not None:
            return samples
        received = {}
        for c, row in zip(sampled, rows, strict=True):
            emitted = [t for t in row if t >= 0]  # -1 past the emitted tokens
            self.requests[c.request_id].output_token_ids.extend(emitted)
            received[c.request_id] = [SampleResult(t) for t in emitted]
        return received

    def _draft_probs(self, chunk: ScheduledChunk) -> torch.Tensor | None:
        """The verify chunk's draft distributions `[num_drafts, V]` when its drafts were sampled (temperature > 0)."""
        if self.drafter is None or self.requests[chunk.request_id].sampling.greedy:
            return None
        probs = self.drafter.draft_probs(chunk.request_id)
        return None if probs is None else probs[: chunk.num_drafts]

    def _replay(
        self,
        output: SchedulerOutput,
        rejected: list[ScheduledChunk],
        samples: dict[str, list[SampleResult]],
        before: dict,
    ) -> None:
        """Rejected drafts: the conv states go back to before the verify and the accepted rows run again (their
        KV is rewritten in place; the rejected positions are overwritten by later steps)."""
        accepted = []
        for c in rejected:
            self.cache.restore_conv(c.slot, before[c.request_id])
            self.views[c.request_id].num_tokens = c.start
            accepted.append(c._replace(token_ids=c.token_ids[: len(samples[c.request_id])]))
        replay = SchedulerOutput(tuple(accepted))
        batch, _ = build_batch(replay, self.requests, self.views, self.device)
        self.model.forward(batch)

    def _draft(
        self,
        chunks: tuple[ScheduledChunk, ...],
        hidden: torch.Tensor,
        first_rows: list[int],
        samples: dict[str, list[SampleResult]],
    ) -> dict[str, tuple[int, ...]]:
        inputs, remembered = [], []
        for c, first in zip(chunks, first_rows, strict=True):
            request = self.requests[c.request_id]
            emitted = samples.get(c.request_id)
            n = len(emitted) if c.num_drafts else c.num_tokens  # the rows this step commits
            remembered.append((self.views[c.request_id].tables[False], c.start, first, n))
            if not request.speculative:
                continue
            rows = hidden[first : first + n]
            # A follower picks no drafts of its own: the leader's reach it inside the chain (worker/mtp.py).
            t = request.sampling.temperature if self.sampler is not None else 0.0
            # A seeded request's drafts come from its own generator; the others' from the chain's (one draw a round).
            seeded = emitted and t > 0 and request.sampling.seed is not None
            generator = self.sampler.generator(request, hidden.device) if seeded else None
            tokens = Tokens(request.prompt_token_ids, request.output_token_ids)  # read in the call, not copied
            inputs.append(DraftInput(c.request_id, c.start, rows, tokens, bool(emitted), t, generator))
        self.drafter.remember(hidden, remembered)
        return self.drafter.extend(inputs) if inputs else {}
