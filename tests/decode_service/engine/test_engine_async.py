"""Async scheduling (`EngineSettings.async_scheduling`): the same requests, arrivals and aborts give exactly the
tokens and finish reasons of the synchronous engine, every request ends once, and no page or slot is left behind.

On CPU the decode graphs' step runs eagerly with the kernels in Triton's interpreter (the async steps need the decode
graphs); the GPU test replays the CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import Request, SamplingParams


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings(**kw) -> EngineSettings:
    base = dict(kv_cache_bytes=1 << 22, page_size=4, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64)
    return EngineSettings(**{**base, **kw})


GREEDY_PROMPT = prompt(5, 1)
GREEDY = dict(temperature=0.0, max_tokens=12)


def greedy_stop(model, config, **kw) -> tuple[int, int]:
    """(stop id, its position): the first token of the greedy request alone on this engine path, from its 5th of
    8 on, that appears there for the first time (and is not EOS), so that a stop on it ends the request mid-stream.
    Taken from the model's own bits rather than hard-coded (a kernel that rounds differently changes the random
    model's tokens)."""
    request = Request("probe", list(GREEDY_PROMPT), SamplingParams(**{**GREEDY, "max_tokens": 8}))
    tokens = Engine(model, config, settings(**kw)).generate([request])[0].token_ids
    new = (i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in config.eos_token_ids)
    at = next(new, None)
    assert at is not None, f"greedy tokens {tokens}: no new token mid-stream to stop on"
    return tokens[at], at + 1


def mixed_requests(stop_id: int) -> dict[int, list[Request]]:
    """Requests by the step they arrive at: greedy and seeded, stop ids, max_tokens, a shared prefix."""
    shared = prompt(17, 9)
    greedy = SamplingParams(**GREEDY, stop_token_ids=(stop_id,))
    return {
        0: [
            Request("greedy", list(GREEDY_PROMPT), greedy),
            Request("seeded", prompt(9, 2), SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=14)),
            Request("first", shared + [5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
        ],
        3: [
            Request("aborted", prompt(7, 4), SamplingParams(temperature=0.7, seed=1, max_tokens=30, ignore_eos=True)),
            Request(
                "stop-id",
                prompt(11, 5),
                SamplingParams(
                    temperature=1.0, seed=3, max_tokens=20, stop_token_ids=(40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50)
                ),
            ),  # fmt: skip
        ],
        6: [Request("hit", shared + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))],
        9: [Request("late", prompt(21, 6), SamplingParams(temperature=0.5, seed=8, max_tokens=7))],
    }


def drive(engine: Engine, arrivals: dict[int, list[Request]], aborts: dict[int, str]) -> tuple[dict[str, tuple], int]:
    """Steps until every request ended: per request (tokens, finish reason, cached prompt tokens), and the number
    of preemptions. Checks that the deltas add up to the tokens and that each request finishes exactly once and
    reports nothing after, and that an output's tokens stay those of its step once later steps have run."""
    streams: dict[str, list[int]] = {}
    finals: dict[str, tuple] = {}
    seen = []  # (output, its tokens when it came out)
    step = 0
    while engine.has_unfinished or step <= max(arrivals):
        for request in arrivals.get(step, []):
            engine.add_request(request)
            streams[request.request_id] = []
        if step in aborts:
            engine.abort(aborts[step])
        for out in engine.step():
            assert out.request_id not in finals, f"{out.request_id} reported after it finished"
            streams[out.request_id] += out.new_token_ids
            assert out.token_ids == streams[out.request_id]
            seen.append((out, list(streams[out.request_id])))
            if out.finished:
                finals[out.request_id] = (out.token_ids, out.finish_reason, out.num_cached_tokens)
        step += 1
    assert finals.keys() == streams.keys(), "a request was lost"
    assert all(out.token_ids == tokens for out, tokens in seen), "an output's tokens moved after its step"
    assert not engine.requests and not engine.runner.requests
    assert engine.cache.num_free_slots == engine.cache.spec.num_conv_slots
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    assert all(pool.num_free == pool.num_pages for pool in engine.cache.pools.values()), "pages left behind"
    return finals, sum(r.num_preemptions for rs in arrivals.values() for r in rs)


def both_ways(model, config, arrivals, aborts=None, **kw) -> tuple[dict, dict, Engine, int]:
    """Sync then async over fresh copies of the same arrivals: (sync finals, async finals, the async engine, its
    preemptions)."""
    results, engine = {}, None
    for mode in (False, True):
        engine = Engine(model, config, settings(async_scheduling=mode, **kw))
        results[mode] = drive(engine, arrivals(), aborts or {})
    return results[False][0], results[True][0], engine, results[True][1]


def test_async_equals_sync_over_interleaved_requests(cpu_interpreter, kernel_model, kernel_config):
    """Arrivals mid-run (their chunked prefills join decode batches), a prefix-cache hit, greedy and seeded
    sampling, stop ids and max_tokens hit mid-stream, an abort mid-run."""
    model = kernel_model.with_ops("fast")
    stop_id, stop_len = greedy_stop(model, kernel_config)
    sync, overlapped, engine, _ = both_ways(model, kernel_config, lambda: mixed_requests(stop_id), {8: "aborted"})
    assert overlapped == sync
    reasons = {rid: reason for rid, (_, reason, _) in sync.items()}
    assert reasons["aborted"] == "abort" and reasons["first"] == "length" and reasons["stop-id"] == "stop"
    assert sync["greedy"][1] == "stop" and len(sync["greedy"][0]) == stop_len  # its stop id, before max_tokens
    assert sync["hit"][2] > 0 and 0 < len(sync["aborted"][0]) < 30
    assert engine.num_steps["async"] > 0 and engine.num_steps["sync"] > 0


def test_async_equals_sync_under_preemption(cpu_interpreter, kernel_model, kernel_config):
    """A KV budget too small for the running requests: preempted requests (some with a token in flight) recompute
    and end with the synchronous engine's tokens."""

    def arrivals() -> dict[int, list[Request]]:
        return {
            0: [
                Request(f"r{i}", prompt(n, 20 + i), SamplingParams(temperature=t, seed=i, max_tokens=16))
                for i, (n, t) in enumerate(((14, 0.0), (9, 0.8), (17, 0.0), (6, 1.0)))
            ]
        }

    # 17 global pages of 4 tokens for requests that grow to 30 + 25 + 33 + 22 tokens
    sync, overlapped, engine, preemptions = both_ways(kernel_model.with_ops("fast"), kernel_config, arrivals,
                                                      kv_cache_bytes=60000)  # fmt: skip
    assert engine.cache.pools[False].num_pages == 17 and preemptions > 0
    assert overlapped == sync
    assert engine.num_steps["async"] > 0
    assert all(reason == "length" or reason == "stop" for _, reason, _ in sync.values())


@pytest.mark.gpu
def test_async_equals_sync_on_the_gpu_with_cuda_graphs(cuda_device, kernel_model, kernel_config):
    model = kernel_model.to("cuda").with_ops("auto")
    try:
        stop_id, _ = greedy_stop(model, kernel_config, device="cuda")
        requests = lambda: mixed_requests(stop_id)  # noqa: E731
        sync, overlapped, engine, _ = both_ways(model, kernel_config, requests, {8: "aborted"}, device="cuda")
    finally:
        kernel_model.to("cpu")
    assert engine.runner.decode_graphs.capture
    assert overlapped == sync
    assert engine.num_steps["async"] > 0 and engine.num_steps["sync"] > 0
