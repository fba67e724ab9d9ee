"""A tensor-parallel engine (rank 0 here, rank 1 a spawned gloo process) gives the single-process engine's
greedy tokens under preemption, prefix-cache hits, multimodal rows with chunked prefill, and aborts."""

from __future__ import annotations

import pytest

from common.settings import DecodeEngineSettings
from decode_service.engine.build import build_engine
from decode_service.engine.request import Request
from tests.decode_service.engine.parallel_helpers import (
    BASE,
    GREEDY,
    finish_after_abort,
    media_items,
    prompt,
    tp_engine,
)


@pytest.fixture(scope="module")
def single(tp_checkpoint):
    return build_engine(tp_checkpoint, DecodeEngineSettings(kv_cache_bytes=8 << 20, **BASE))


@pytest.fixture(scope="module")
def ranks(tp_checkpoint):
    with tp_engine(tp_checkpoint) as engine:
        yield engine


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
    items = media_items(single.config.text.hidden_size)
    p = prompt(27, 9)
    out = ranks.generate([Request("mm", p, GREEDY, mm_items=items)])[0]
    want = single.generate([Request("mm-ref", p, GREEDY, mm_items=items)])[0]
    assert out.token_ids == want.token_ids


def test_abort_leaves_the_other_requests_exact(single, ranks):
    keep, drop = prompt(21, 30), prompt(25, 31)
    final = finish_after_abort(ranks, [Request("keep", keep, GREEDY), Request("drop", drop, GREEDY)], "drop", steps=3)
    assert final["drop"].finish_reason == "abort"
    assert final["keep"].token_ids == single.generate([Request("keep-ref", keep, GREEDY)])[0].token_ids
    assert not ranks.runner.runner.requests
