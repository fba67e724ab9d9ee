"""MTP speculation on a tensor-parallel replica (rank 0 here, rank 1 a spawned gloo process; make-tiny with its 2
MTP depths, D = 2): greedy tokens equal the replica without MTP and MTP without tensor parallelism, under chunked
prefill, preemption, an opted-out request, prefix hits, media rows and an abort; above temperature 0 the seeded
tokens, the drafts' acceptance and a stop inside an accepted run equal MTP without tensor parallelism (the drafts
the leader samples are the followers' too)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import ConfigError
from common.settings import DecodeEngineSettings
from decode_service.engine.build import build_engine
from decode_service.engine.request import Request, SamplingParams
from tests.decode_service.engine.parallel_helpers import (
    BASE,
    GREEDY,
    finish_after_abort,
    media_items,
    prompt,
    tp_engine,
)
from tools.make_tiny_checkpoint import make_tiny_checkpoint

SAMPLED = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)  # the tiny drafter is often accepted


def crowded() -> list[Request]:
    """Four interleaved requests that preempt each other on the tight budget; one opts out, one wants logprobs."""
    specs = [
        GREEDY,
        dataclasses.replace(GREEDY, logprobs=2),
        dataclasses.replace(GREEDY, speculative=False),
        GREEDY,
    ]
    return [
        Request(f"p{i}", prompt(n, 20 + i), s) for i, (n, s) in enumerate(zip((30, 22, 35, 17), specs, strict=True))
    ]


def sampled(first_seed: int, stop: tuple[int, ...] = ()) -> list[Request]:
    """Three seeded requests above temperature 0; the second one stops at `stop`."""
    return [
        Request(
            f"s{i}",
            prompt(n, first_seed + i),
            dataclasses.replace(SAMPLED, seed=3 + i, stop_token_ids=stop if i == 1 else ()),
        )
        for i, n in enumerate((9, 21, 14))
    ]


@pytest.fixture(scope="module")
def single(tp_checkpoint):
    """MTP without tensor parallelism."""
    return build_engine(tp_checkpoint, DecodeEngineSettings(kv_cache_bytes=8 << 20, mtp_depth=2, **BASE))


@pytest.fixture(scope="module")
def without_mtp(tp_checkpoint) -> list[list[int]]:
    """The crowded requests' tokens on a replica without MTP (closed before `ranks` starts: one replica a process)."""
    with tp_engine(tp_checkpoint) as engine:
        return [out.token_ids for out in engine.generate(crowded())]


@pytest.fixture(scope="module")
def ranks(tp_checkpoint, without_mtp):
    with tp_engine(tp_checkpoint, mtp_depth=2) as engine:
        yield engine


def test_a_depth_beyond_the_checkpoints_is_refused_before_any_rank_starts(tp_checkpoint):
    with pytest.raises(ConfigError, match="--mtp-depth=3: the checkpoint's drafter has 2"):
        build_engine(tp_checkpoint, DecodeEngineSettings(tensor_parallel_size=2, mtp_depth=3, **BASE))


def test_greedy_tokens_equal_the_replica_without_mtp_and_mtp_without_tp(single, without_mtp, ranks):
    requests = crowded()
    outs = ranks.generate(requests)
    assert sum(r.num_preemptions for r in requests) > 0
    assert [o.token_ids for o in outs] == without_mtp
    reference = crowded()
    assert [o.token_ids for o in single.generate(reference)] == without_mtp
    assert outs[2].num_draft_tokens == 0 and all(o.num_draft_tokens > 0 for i, o in enumerate(outs) if i != 2)
    for got, want in zip(requests[1].output_logprobs, reference[1].output_logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_sampled_drafts_are_the_leaders_on_every_rank(single, ranks):
    """Step by step, the leader's drafts and the distributions it sampled them from equal MTP without tensor
    parallelism (a follower feeding its own picks to the depths' provisional rows moves q by percents: the tiny
    model's flat distributions hide that in the tokens)."""
    want, got = sampled(40), sampled(40)
    for a, b in zip(want, got, strict=True):
        single.add_request(a)
        ranks.add_request(b)
    verified = 0
    while single.has_unfinished or ranks.has_unfinished:
        single.step()
        ranks.step()
        for a, b in zip(want, got, strict=True):
            assert b.draft_token_ids == a.draft_token_ids and b.output_token_ids == a.output_token_ids
            q, p = ranks.speculator.draft_probs(b.request_id), single.speculator.draft_probs(a.request_id)
            assert (q is None) == (p is None)
            if q is not None:
                torch.testing.assert_close(q, p, rtol=1e-4, atol=0.0)
                verified += 1
    assert verified > 0 and all(b.num_accepted_draft_tokens > 0 for b in got)
    assert [b.num_accepted_draft_tokens for b in got] == [a.num_accepted_draft_tokens for a in want]


def test_a_stop_inside_an_accepted_run_cuts_there_as_mtp_without_tp(single, ranks):
    free = single.generate(sampled(50))
    assert free[1].num_accepted_draft_tokens == free[1].num_draft_tokens  # s1 emits 1 token, then runs of 3
    stop = (free[1].token_ids[4],)  # the first of its third run: the two after it are cut
    want = single.generate(sampled(50, stop))
    got = ranks.generate(sampled(50, stop))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].token_ids == free[1].token_ids[:5] and got[1].finish_reason == "stop"


def test_prefix_hit_media_rows_and_abort_equal_mtp_without_tp(single, ranks):
    items = media_items(single.config.text.hidden_size)
    shared, media = prompt(27, 7), prompt(27, 9)
    first = ranks.generate([Request("a", shared + [11, 12], GREEDY), Request("mm", media, GREEDY, mm_items=items)])
    hit, drop = Request("hit", shared + [13, 14, 15], GREEDY), Request("drop", prompt(25, 31), GREEDY)
    final = finish_after_abort(ranks, [hit, drop], "drop", steps=4)
    assert final["drop"].finish_reason == "abort" and final["hit"].num_cached_tokens > 0
    want = single.generate(
        [
            Request("a-ref", shared + [11, 12], GREEDY),
            Request("mm-ref", media, GREEDY, mm_items=items),
            Request("hit-ref", shared + [13, 14, 15], GREEDY),
        ]
    )
    assert [o.token_ids for o in first] + [final["hit"].token_ids] == [o.token_ids for o in want]
    assert not ranks.runner.runner.requests and not ranks.speculator.states


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL broadcasts of the leader's tokens)")
def test_nccl_ranks_with_mtp_give_the_tokens_without_mtp(tmp_path):
    """Unverified on this project's CI (no GPUs): TP=2 on GPUs 0 and 1 with D = 2, the leader's emitted tokens and
    drafts broadcast over NCCL. fp32 greedy tokens equal the replica without MTP; bf16 with the decode graphs (their
    captured all-reduces between verify steps) runs every request to its length with drafts verified."""
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", nvfp4=True, seed=6)

    def run(dtype: str, depth: int) -> list:
        settings = DecodeEngineSettings(
            device="cuda", dtype=dtype, kv_cache_bytes=64 << 20, max_num_seqs=4, max_num_batched_tokens=64,
            tensor_parallel_size=2, mtp_depth=depth,
        )  # fmt: skip
        engine = build_engine(checkpoint, settings)
        try:
            return engine.generate(
                [Request(f"g{i}", prompt(n, 60 + i), GREEDY) for i, n in enumerate((5, 23, 14))]
                + [Request("s", prompt(9, 70), dataclasses.replace(SAMPLED, seed=1))]
            )
        finally:
            engine.ranks.close()

    plain, spec = run("float32", 0), run("float32", 2)
    assert [o.token_ids for o in spec[:3]] == [o.token_ids for o in plain[:3]]
    assert all(o.num_draft_tokens > 0 for o in spec)
    graphs = run("bfloat16", 2)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in graphs)
    assert sum(o.num_accepted_draft_tokens for o in graphs) > 0
