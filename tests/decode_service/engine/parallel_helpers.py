"""What the tensor-parallel engine tests (test_parallel.py, test_parallel_mtp.py) share: their settings, prompts
and media rows, a replica that closes its ranks, and the abort driver."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from common.settings import DecodeEngineSettings
from decode_service.engine.build import build_engine
from decode_service.engine.engine import Engine, RequestOutput
from decode_service.engine.request import MultimodalItem, Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BASE = dict(dtype="float32", page_size=4, max_num_seqs=4, max_num_batched_tokens=16, snapshot_interval_blocks=2)
# fp32, page 4, 4 sequences: rank 0's local heads give 17 sliding and 20 global pages (80 tokens) in this budget,
# so four 17..35-token prompts plus 10 tokens each cannot all stay resident
TIGHT_BUDGET = 100_000


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 90000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def media_items(hidden: int) -> tuple[MultimodalItem, ...]:
    """Two items of 9 and 6 rows at positions 2 and 15 of a 27-token prompt (the second one across chunks)."""
    g = torch.Generator().manual_seed(5)
    return (
        MultimodalItem(b"\x07" * 32, 2, torch.randn(9, hidden, generator=g)),
        MultimodalItem(b"\x08" * 32, 15, torch.randn(6, hidden, generator=g)),
    )


@contextlib.contextmanager
def tp_engine(checkpoint: Path, **settings) -> Iterator[Engine]:
    """A replica of two ranks (rank 1 a spawned gloo process) on the tight budget; its ranks closed after."""
    settings = DecodeEngineSettings(kv_cache_bytes=TIGHT_BUDGET, tensor_parallel_size=2, **BASE, **settings)
    engine = build_engine(checkpoint, settings)
    try:
        yield engine
    finally:
        engine.ranks.close()


def finish_after_abort(engine: Engine, requests: Sequence[Request], drop: str, steps: int) -> dict[str, RequestOutput]:
    """Add `requests`, run `steps` steps, abort request `drop`, then step until every request finished: the final
    output of each request that finished after the abort, by id."""
    for request in requests:
        engine.add_request(request)
    for _ in range(steps):
        engine.step()
    engine.abort(drop)
    final = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final
