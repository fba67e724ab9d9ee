"""Costs measured on this replica's model at engine start: the prefill rate (which the shared prefix tier's cost
model weighs fetches against) and the speculation step costs (`--mtp-depth auto`, `core/speculation.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from decode_service.engine.core.outputs import ZERO, ConvOp, ScheduledChunk, SchedulerOutput
from decode_service.engine.core.pages import KVAllocator
from decode_service.engine.core.speculation import StepCosts, expected_tokens
from decode_service.engine.request import SamplingParams
from decode_service.engine.worker.kv_cache import SequenceView
from decode_service.engine.worker.mtp import DraftInput, MTPSpeculator
from decode_service.engine.worker.runner import ModelRunner, WorkerRequest
from decode_service.model.batch import ForwardBatch, SequenceSlice

_PROBE = "prefill-rate-probe"
_MTP_PROBE = "mtp-cost-probe-"


def measure_prefill_rate(runner: ModelRunner, allocator: KVAllocator, num_tokens: int, repeats: int = 2) -> float:
    """Tokens/s of one prefill chunk of `num_tokens` (a scratch sequence whose pages and conv slot are released
    afterwards); 0.0 when no conv slot or pages are free."""
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        if not allocator.num_free_slots:
            return 0.0
        seq = allocator.new_sequence()
        if not allocator.fits(seq.pages_needed(num_tokens)):
            seq.release()
            return 0.0
        seq.grow(num_tokens)
        sliding, global_ = seq.take_updates()
        tokens = (0,) * num_tokens
        chunk = ScheduledChunk(_PROBE, seq.slot, 0, tokens, False, sliding, global_, True)
        runner.add_request(WorkerRequest(_PROBE, list(tokens), SamplingParams()))
        start = time.perf_counter()
        runner.execute(SchedulerOutput((chunk,), (ConvOp(ZERO, seq.slot),)))
        if runner.cache.k[False].is_cuda:
            torch.cuda.synchronize(runner.cache.k[False].device)
        times.append(time.perf_counter() - start)
        runner.remove_request(_PROBE)
        seq.release()
    return num_tokens / min(times[1:])


def _elapsed_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times[1:])


@torch.inference_mode()
def measure_speculation_costs(
    runner: ModelRunner,
    allocator: KVAllocator,
    speculator: MTPSpeculator,
    buckets: list[int],
    rates: tuple[float, ...],
    repeats: int = 2,
) -> dict[int, StepCosts]:
    """Per batch bucket B: the plain decode step, the verify step of D drafts (the trunk over D+1 rows per sequence
    and their logits, the runner's paths) and the drafter's round of D drafts (`speculator.extend` over the rows a
    round verifies, 1 + the drafts `rates` expect accepted, rounded), for D = 1..`num_depths`; on B scratch
    sequences at a short context (trunk pages and slots released, the speculator's scratch requests removed).
    Buckets beyond the free slots or pages are not measured."""
    costs: dict[int, StepCosts] = {}
    for b in buckets:
        trunk = _trunk_costs(runner, allocator, b, speculator.num_depths, repeats)
        if trunk is None:
            break
        costs[b] = StepCosts(*trunk, _chain_costs(runner, speculator, b, rates, repeats))
    return costs


def _trunk_costs(
    runner: ModelRunner, allocator: KVAllocator, b: int, depth_max: int, repeats: int
) -> tuple[float, tuple[float, ...]] | None:
    """(plain step, verify steps of 1..depth_max drafts) of b scratch sequences; None when they do not fit."""
    if allocator.num_free_slots < b:
        return None
    model, cache = runner.model, runner.cache
    device = cache.k[False].device
    seqs = [allocator.new_sequence() for _ in range(b)]
    try:
        if not all(allocator.fits(s.pages_needed(depth_max + 1)) for s in seqs):
            return None
        views = []
        for s in seqs:
            s.grow(depth_max + 1)
            view = SequenceView(cache, s.slot)
            for sliding, update in zip((True, False), s.take_updates(), strict=True):
                view.update(sliding, update)
            cache.zero_conv(s.slot)
            views.append(view)
        graphs = runner.decode_graphs
        if graphs is not None:
            plain = _elapsed_ms(lambda: model.logits(graphs.run([0] * b, views)), device, repeats)
        else:
            plain = _elapsed_ms(_packed_step(model, views, 1, device), device, repeats)
        verify = tuple(
            _elapsed_ms(_packed_step(model, views, d + 1, device), device, repeats) for d in range(1, depth_max + 1)
        )
        return plain, verify
    finally:
        for s in seqs:
            s.release()


def _packed_step(model, views: list[SequenceView], width: int, device: torch.device) -> Callable[[], object]:
    """The trunk over `width` rows of every view, from position 0, and the logits of every row."""
    slices = [SequenceSlice(0, width, view.layers) for view in views]
    batch = ForwardBatch(torch.zeros(len(views) * width, dtype=torch.int64, device=device), slices)
    return lambda: model.logits(model.forward(batch))


def _chain_costs(
    runner: ModelRunner, speculator: MTPSpeculator, b: int, rates: tuple[float, ...], repeats: int
) -> tuple[float, ...]:
    """The drafter's round of 1..num_depths drafts over b scratch requests."""
    cache, depth_max = runner.cache, speculator.num_depths
    device, dtype, width = cache.k[False].device, cache.spec.dtype, cache.config.hidden_size
    tokens = {f"{_MTP_PROBE}{i}": [0] * (depth_max + 3) for i in range(b)}
    rows = dict.fromkeys(tokens, depth_max + 2)
    choose = speculator.depth_for
    try:
        for rid, known in tokens.items():
            speculator.reset(rid, 0, known, [])
        speculator.extend(
            [DraftInput(rid, 0, torch.randn(rows[rid], width, dtype=dtype, device=device), known, False)
             for rid, known in tokens.items()]
        )  # fmt: skip

        def round_of_drafts(verified: int) -> None:
            inputs = []
            for rid, known in tokens.items():
                known += [0] * verified
                hidden = torch.randn(verified, width, dtype=dtype, device=device)
                inputs.append(DraftInput(rid, rows[rid], hidden, list(known), True))
                rows[rid] += verified
            speculator.extend(inputs)

        chain = []
        for d in range(1, depth_max + 1):
            speculator.depth_for = lambda _, d=d: d
            verified = round(expected_tokens(d, rates))
            chain.append(_elapsed_ms(lambda verified=verified: round_of_drafts(verified), device, repeats))
        return tuple(chain)
    finally:
        speculator.depth_for = choose
        for rid in tokens:
            speculator.remove(rid)
