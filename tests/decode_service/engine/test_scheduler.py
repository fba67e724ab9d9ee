"""Scheduler bookkeeping without any model: each step 'computes' the scheduled tokens and samples token 1."""

from __future__ import annotations

import torch

from decode_service.engine.kv_cache import CacheSpec, KVCache
from decode_service.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from decode_service.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def make(config, *, pages: int = 64, budget: int = 16, seqs: int = 4, page_size: int = 4) -> Scheduler:
    cache = KVCache(config, CacheSpec(page_size, pages, pages, seqs, torch.float32))
    return Scheduler(cache, SchedulerConfig(budget, seqs))


def request(rid: str, n: int, max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(
        rid, list(range(10, 10 + n)), SamplingParams(temperature=0.0, max_tokens=max_tokens), priority=priority
    )


def fake_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.commit(out)
    for seq in out.sequences:
        if seq.needs_logits:
            seq.request.output_token_ids.append(1)
            if len(seq.request.output_token_ids) >= seq.request.sampling.max_tokens:
                s.finish(seq.request, FinishReason.LENGTH)
    return out


def run_all(s: Scheduler, limit: int = 500) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished:
        outs.append(fake_step(s))
        assert len(outs) < limit, "scheduler made no progress"
    return outs


def assert_cache_empty(s: Scheduler) -> None:
    cache = s.cache
    assert cache.num_free_pages(True) == cache.pools[True].num_pages
    assert cache.num_free_pages(False) == cache.pools[False].num_pages
    assert cache.num_free_slots == cache.spec.num_conv_slots


def test_budget_mixes_decodes_with_chunked_prefill(model_config):
    s = make(model_config.text, budget=16)
    reqs = [request(r, 10) for r in "abc"]
    for r in reqs:
        s.add(r)
    outs = run_all(s)
    assert all(o.num_tokens <= 16 for o in outs)
    first = outs[0]
    assert [(q.request.request_id, q.num_tokens, q.start_position) for q in first.sequences] == [
        ("a", 10, 0),
        ("b", 6, 0),
    ]
    assert first.sequences[0].needs_logits and not first.sequences[1].needs_logits
    second = outs[1]
    assert [(q.request.request_id, q.num_tokens, q.start_position) for q in second.sequences] == [
        ("a", 1, 10),
        ("b", 4, 6),
        ("c", 10, 0),
    ]
    assert all(r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert_cache_empty(s)


def test_max_num_seqs_and_priority(model_config):
    s = make(model_config.text, budget=64, seqs=2)
    late_urgent = request("urgent", 4, priority=-1)
    for r in [request("a", 4), request("b", 4), late_urgent]:
        s.add(r)
    out = fake_step(s)
    assert [q.request.request_id for q in out.sequences] == ["urgent", "a"]
    assert len(s.running) == 2 and [r.request_id for r in s.waiting] == ["b"]
    run_all(s)
    assert_cache_empty(s)


def test_abort_takes_effect_at_the_step_boundary(model_config):
    s = make(model_config.text, budget=64, seqs=1)
    running, waiting = request("run", 4, max_tokens=50), request("wait", 4)
    s.add(running)
    s.add(waiting)
    fake_step(s)
    s.abort("run")
    s.abort("wait")
    assert running.status is RequestStatus.RUNNING  # nothing happens until the next schedule
    out = s.schedule()
    assert {r.request_id for r in out.finished} == {"run", "wait"}
    assert running.finish_reason_text == "abort" and waiting.finish_reason_text == "abort"
    assert not out.sequences and not s.has_unfinished
    assert_cache_empty(s)


def test_preemption_by_recompute_under_a_tiny_budget(model_config):
    # 8 global pages of 4 tokens = 32 tokens of history for everybody together.
    s = make(model_config.text, pages=8, budget=16, seqs=4)
    reqs = [request(f"r{i}", 7, max_tokens=9) for i in range(4)]
    for r in reqs:
        s.add(r)
    outs = run_all(s)
    assert sum(len(o.preempted) for o in outs) > 0
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 9
    preempted = next(r for r in reqs if r.num_preemptions)
    # After preemption the request recomputes prompt + generated tokens from position 0.
    recompute = next(
        q for o in outs for q in o.sequences if q.request is preempted and q.start_position == 0 and q.token_ids[7:]
    )
    assert recompute.token_ids[:7] == preempted.prompt_token_ids
    assert set(recompute.token_ids[7:]) == {1}
    assert_cache_empty(s)


def test_request_larger_than_the_cache_finishes_with_an_error(model_config):
    s = make(model_config.text, pages=4, budget=16, seqs=2)  # 16 tokens of global history at most
    too_long = request("long", 20)
    grows_too_long = request("grow", 10, max_tokens=50)
    s.add(too_long)
    s.add(grows_too_long)
    run_all(s)
    assert too_long.finish_reason_text.startswith("error:")
    assert grows_too_long.finish_reason_text.startswith("error:") and grows_too_long.output_token_ids
    assert_cache_empty(s)
