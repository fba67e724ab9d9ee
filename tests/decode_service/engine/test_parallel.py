"""A tensor-parallel engine (rank 0 here, rank 1 a spawned gloo process) gives the single-process engine's
greedy tokens under preemption, prefix-cache hits, multimodal rows with chunked prefill, and aborts."""

from __future__ import annotations

import pytest
import torch

from common.settings import DecodeEngineSettings
from decode_service.engine.build import build_engine
from decode_service.engine.request import MultimodalItem, Request, SamplingParams
from tools.make_tiny_checkpoint import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BASE = dict(dtype="float32", page_size=4, max_num_seqs=4, max_num_batched_tokens=16, snapshot_interval_blocks=2)
# fp32, page 4, 4 sequences: rank 0's local heads give 17 sliding and 20 global pages (80 tokens) in this budget,
# so four 17..35-token prompts plus 10 tokens each cannot all stay resident
TIGHT_BUDGET = 100_000


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 90000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp-engine"), nvfp4=True, seed=6)


@pytest.fixture(scope="module")
def single(checkpoint):
    return build_engine(checkpoint, DecodeEngineSettings(kv_cache_bytes=8 << 20, **BASE))


@pytest.fixture(scope="module")
def ranks(checkpoint):
    engine = build_engine(checkpoint, DecodeEngineSettings(kv_cache_bytes=TIGHT_BUDGET, tensor_parallel_size=2, **BASE))
    yield engine
    engine.ranks.close()


def test_preemption_gives_the_single_process_tokens(single, ranks):
    prompts = [prompt(n, 20 + i) for i, n in enumerate((30, 22, 35, 17))]
    requests = [Request(f"p{i}", p, GREEDY) for i, p in enumerate(prompts)]
    outs = ranks.generate(requests)
    assert sum(r.num_preemptions for r in requests) > 0
    want = single.generate(Request(f"p{i}-ref", p, GREEDY) for i, p in enumerate(prompts))
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]


def test_prefix_cache_hit_gives_the_single_process_tokens(single, ranks):
    shared = prompt(27, 7)
    first = ranks.generate([Request("a", shared + [11, 12], GREEDY)])[0]
    second = ranks.generate([Request("b", shared + [13, 14, 15], GREEDY)])[0]
    assert second.num_cached_tokens > 0
    want = single.generate([Request("b-ref", shared + [13, 14, 15], GREEDY)])[0]
    assert second.token_ids == want.token_ids
    again = ranks.generate([Request("c", shared + [11, 12], GREEDY)])[0]
    assert again.num_cached_tokens > second.num_cached_tokens and again.token_ids == first.token_ids


def test_multimodal_rows_in_chunks_give_the_single_process_tokens(single, ranks):
    hidden = single.config.text.hidden_size
    g = torch.Generator().manual_seed(5)
    items = (
        MultimodalItem(b"\x07" * 32, 2, torch.randn(9, hidden, generator=g)),
        MultimodalItem(b"\x08" * 32, 15, torch.randn(6, hidden, generator=g)),
    )
    p = prompt(27, 9)
    out = ranks.generate([Request("mm", p, GREEDY, mm_items=items)])[0]
    want = single.generate([Request("mm-ref", p, GREEDY, mm_items=items)])[0]
    assert out.token_ids == want.token_ids


def test_abort_leaves_the_other_requests_exact(single, ranks):
    keep, drop = prompt(21, 30), prompt(25, 31)
    ranks.add_request(Request("keep", keep, GREEDY))
    ranks.add_request(Request("drop", drop, GREEDY))
    for _ in range(3):
        ranks.step()
    ranks.abort("drop")
    final = {}
    while ranks.has_unfinished:
        for out in ranks.step():
            if out.finished:
                final[out.request_id] = out
    assert final["drop"].finish_reason == "abort"
    assert final["keep"].token_ids == single.generate([Request("keep-ref", keep, GREEDY)])[0].token_ids
    assert not ranks.runner.runner.requests
