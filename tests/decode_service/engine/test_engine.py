"""The engine end to end on the fake decoder: paged + batched + chunked + cached == one sequence alone."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from common.errors import InvalidInputError, ResourceExhaustedError
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import MultimodalItem, Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT_LENGTHS = (5, 17, 30, 9, 41, 1)


def prompt(n: int, seed: int, vocab: int = 90) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings(**kw) -> EngineSettings:
    base = dict(
        kv_cache_bytes=1 << 22, page_size=4, max_num_seqs=4, max_num_batched_tokens=24, snapshot_interval_blocks=2
    )
    base.update(kw)
    return EngineSettings(**base)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_interleaved_requests_equal_each_request_alone(fake_model, model_config, reference, prefix_cache):
    engine = Engine(fake_model, model_config, settings(enable_prefix_cache=prefix_cache))
    prompts = [prompt(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    outs = engine.generate(Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
    for out, p in zip(outs, prompts, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == reference(fake_model, model_config.text, p, 12)
    assert engine.cache.num_free_slots == 4


def test_prefix_cache_hit_reuses_pages_and_gives_identical_output(fake_model, model_config, reference):
    engine = Engine(fake_model, model_config, settings())
    shared = prompt(26, 0)
    first = engine.generate([Request("a", shared + [5, 6, 7], GREEDY)])[0]
    second = engine.generate([Request("b", shared + [8, 9], GREEDY)])[0]
    # Tracked boundaries every 2 blocks of 4: the hit stops at 24 (the last snapshot inside the shared part).
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 24
    assert second.token_ids == reference(fake_model, model_config.text, shared + [8, 9], 12)
    calls = fake_model.calls
    again = engine.generate([Request("c", shared + [5, 6, 7], GREEDY)])[0]
    assert again.num_cached_tokens == 28  # the last full block before the prompt's last token is tracked
    assert again.token_ids == first.token_ids
    assert fake_model.calls - calls == 12  # one single-chunk prefill of the last token + 11 decodes
    # A different salt or model fingerprint shares nothing.
    salted = engine.generate([Request("d", shared + [5, 6, 7], GREEDY, cache_salt="tenant-2")])[0]
    assert salted.num_cached_tokens == 0 and salted.token_ids == first.token_ids


def test_preemption_under_a_tiny_budget_keeps_every_output(fake_model, model_config, reference):
    # 4 conv slots (26112 bytes in fp64) + 20 pages per pool: 80 tokens of global history for 4 sequences
    # that reach 29..53 tokens each, and sliding pages for about two prefill chunks.
    engine = Engine(fake_model, model_config, settings(kv_cache_bytes=26112 + 20 * 2560, enable_prefix_cache=False))
    assert engine.cache.pools[False].num_pages == 20
    prompts = [prompt(n, 10 + i) for i, n in enumerate((30, 25, 41, 17))]
    requests = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    outs = engine.generate(requests)
    assert sum(r.num_preemptions for r in requests) > 0
    for out, p in zip(outs, prompts, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == reference(fake_model, model_config.text, p, 12)


def test_multimodal_rows_survive_chunks_that_cut_a_media_span(fake_model, model_config, reference):
    hidden = model_config.text.hidden_size
    g = torch.Generator().manual_seed(3)
    items = (
        MultimodalItem(b"\x01" * 32, 3, torch.randn(10, hidden, generator=g, dtype=torch.float64)),
        MultimodalItem(b"\x02" * 32, 20, torch.randn(7, hidden, generator=g, dtype=torch.float64)),
    )
    p = prompt(33, 4)
    for item in items:
        p[item.start : item.end] = [model_config.image_token_id % 90] * item.length
    engine = Engine(fake_model, model_config, settings(max_num_batched_tokens=6))  # chunks of <= 6 tokens
    out = engine.generate([Request("mm", p, GREEDY, mm_items=items)])[0]
    assert out.num_mm_tokens == 17
    expected = reference(fake_model, model_config.text, p, 12, mm=items)
    assert out.token_ids == expected
    assert out.token_ids != reference(fake_model, model_config.text, p, 12)  # the rows do matter
    # The same placeholders with another mm_key must not hit the cache inside the span.
    other = (MultimodalItem(b"\x03" * 32, 3, items[0].rows), items[1])
    again = engine.generate([Request("mm2", p, GREEDY, mm_items=other)])[0]
    assert again.num_cached_tokens == 0
    same = engine.generate([Request("mm3", p, GREEDY, mm_items=items)])[0]
    assert same.num_cached_tokens > 0 and same.token_ids == expected


def test_seeded_sampling_does_not_depend_on_the_batch(fake_model, model_config):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    p = prompt(12, 5)
    alone = Engine(fake_model, model_config, settings()).generate([Request("s", p, params)])[0]
    crowd = [Request(f"o{i}", prompt(7 + i, 20 + i), SamplingParams(temperature=1.0, max_tokens=10)) for i in range(3)]
    batched = Engine(fake_model, model_config, settings(seed=4)).generate([*crowd, Request("s", p, params)])[-1]
    assert alone.token_ids == batched.token_ids


def test_eos_abort_and_errors_end_every_request(fake_model, model_config):
    engine = Engine(fake_model, model_config, settings())
    probe = engine.generate([Request("probe", prompt(6, 1), GREEDY)])[0]
    stop_on_first = Request("stop", prompt(6, 1), SamplingParams(temperature=0.0, stop_token_ids=probe.token_ids[:1]))
    assert engine.generate([stop_on_first])[0].finish_reason == "stop"

    engine.add_request(Request("x", prompt(8, 2), SamplingParams(max_tokens=100)))
    engine.add_request(Request("y", prompt(8, 3), SamplingParams(max_tokens=100)))
    engine.step()
    engine.abort("x")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["x"].finished and outs["x"].finish_reason == "abort"
    assert not outs["y"].finished

    fake_model.fail_next = True
    outs = {o.request_id: o for o in engine.step()}
    assert outs["y"].finished and outs["y"].finish_reason.startswith("error:RuntimeError")
    assert not engine.has_unfinished
    assert engine.cache.num_free_slots == 4
    # The engine still works after a failed step.
    assert engine.generate([Request("z", prompt(6, 1), GREEDY)])[0].token_ids == probe.token_ids

    with pytest.raises(InvalidInputError):
        engine.add_request(Request("bad", [10_000]))
    with pytest.raises(InvalidInputError):
        engine.add_request(Request("empty", []))
    with pytest.raises(InvalidInputError, match="max_model_len"):
        Engine(fake_model, model_config, settings(max_model_len=8)).add_request(Request("long", prompt(8, 0)))
    with pytest.raises(ResourceExhaustedError):
        engine.add_request(Request("huge", prompt(engine.max_model_len, 0)))
    with pytest.raises(InvalidInputError, match="placeholder"):
        placeholder = dataclasses.replace(model_config, image_token_id=7)
        Engine(fake_model, placeholder, settings()).add_request(Request("img", [5, 7, 7, 6]))


def test_the_data_plane_runs_plans_that_crossed_a_process_boundary(fake_model, model_config, reference):
    """Every step's SchedulerOutput is pickled and unpickled before the runner sees it; prefix hits (snapshots by
    id) and chunked prefill still give each request's own tokens."""
    engine = Engine(fake_model, model_config, settings())
    execute = engine.runner.execute
    engine.runner.execute = lambda output: execute(pickle.loads(pickle.dumps(output)))
    shared = prompt(26, 0)
    prompts = [shared + [5, 6, 7], shared + [8, 9], prompt(30, 1), prompt(17, 2)]
    outs = engine.generate(Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
    for out, p in zip(outs, prompts, strict=True):
        assert out.token_ids == reference(fake_model, model_config.text, p, 12)
    again = engine.generate([Request("again", shared + [5, 6, 7], GREEDY)])[0]
    assert again.num_cached_tokens > 0 and again.token_ids == outs[0].token_ids
