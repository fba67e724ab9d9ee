"""The prefill rate of this replica's model, which the shared prefix tier's cost model weighs fetches against."""

from __future__ import annotations

import time

import torch

from decode_service.engine.core.outputs import ZERO, ConvOp, ScheduledChunk, SchedulerOutput
from decode_service.engine.core.pages import KVAllocator
from decode_service.engine.request import SamplingParams
from decode_service.engine.worker.runner import ModelRunner, WorkerRequest

_PROBE = "prefill-rate-probe"


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
