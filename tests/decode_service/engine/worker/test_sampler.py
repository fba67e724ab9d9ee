from __future__ import annotations

import pytest
import torch

from common.errors import InvalidInputError
from decode_service.engine.request import SamplingParams
from decode_service.engine.worker.runner import WorkerRequest
from decode_service.engine.worker.sampler import Sampler, apply_penalties, argmax_only, filtered_probs

V = 12


def req(rid: str = "r", prompt=(1, 2), **params) -> WorkerRequest:
    return WorkerRequest(rid, list(prompt), SamplingParams(**params))


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 2


def draw_counts(sampler: Sampler, logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    r = req(seed=123, **params)
    counts = torch.zeros(V)
    for _ in range(n):
        counts[sampler.sample(logits, [r])[0].token_id] += 1
    return counts


def test_greedy_is_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    out = Sampler().sample(logits, [req(str(i), temperature=0.0) for i in range(4)])
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params,expected",
    [
        ({}, True),
        ({"top_k": 3, "top_p": 0.5, "min_p": 0.1, "seed": 4}, True),  # filters do not move a greedy argmax
        ({"temperature": 0.5}, False),
        ({"repetition_penalty": 1.1}, False),
        ({"presence_penalty": 0.5}, False),
        ({"frequency_penalty": -0.5}, False),
        ({"logprobs": 0}, False),
    ],
)
def test_argmax_only_is_what_sample_returns(params, expected):
    """`argmax_only`: exactly the requests whose sampled token is the raw argmax with nothing else to compute."""
    request = req(**({"temperature": 0.0} | params))
    assert argmax_only(request) is expected
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    if expected:
        out = Sampler().sample(logits, [request] * 6)
        assert [o.token_id for o in out] == logits.argmax(-1).tolist() and all(o.logprobs is None for o in out)


def test_argmax_only_refuses_a_constrained_request():
    request = req(temperature=0.0)
    request.constraint = object()  # any matcher: its mask moves the argmax
    assert not argmax_only(request)


def test_temperature_sampling_follows_softmax():
    logits = logits_row()
    counts = draw_counts(Sampler(), logits, 4000, temperature=0.7)
    expected = torch.softmax(logits[0] / 0.7, -1) * 4000
    # Chi-square over the 12 categories (dof 11): 99.9% quantile is ~31.3.
    chi2 = float(((counts - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    assert chi2 < 31.3, (counts, expected)


def test_seeded_request_is_reproducible_and_independent_of_its_batch():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    alone, batched = req("a", seed=7), req("a", seed=7)
    others = [req("b", seed=1), req("c", temperature=0.0)]
    tokens_alone = [Sampler(seed=0).sample(logits[:1], [alone])[0].token_id for _ in range(20)]
    sampler = Sampler(seed=99)
    tokens_batched = [sampler.sample(logits, [batched, *others])[0].token_id for _ in range(20)]
    assert tokens_alone == tokens_batched
    assert len(set(tokens_alone)) > 1  # really sampling
    unseeded = [Sampler(seed=5).sample(logits[:1], [req("x")])[0].token_id for _ in range(5)]
    assert len(set(unseeded)) == 1  # engine seed + arrival give the same first draw


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]])
    sampler = Sampler()
    assert set(draw_counts(sampler, logits, 300, top_k=2).nonzero().flatten().tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)
    # top_p just above p0: keeps the first two tokens only.
    support = draw_counts(sampler, logits, 300, top_p=float(probs[0]) + 1e-3).nonzero().flatten().tolist()
    assert set(support) == {0, 1}
    # min_p: tokens below 0.1 * max are dropped (e^-3 < 0.1 < e^-2 -> tokens 0, 1, 2).
    assert set(draw_counts(sampler, logits, 400, min_p=0.1).nonzero().flatten().tolist()) == {0, 1, 2}


def test_filtered_probs_keeps_at_least_the_best_token():
    logits = torch.tensor([[0.0, 10.0, 0.0]])
    probs = filtered_probs(logits, [SamplingParams(top_p=1e-6, top_k=1, min_p=1.0)])
    assert probs[0].nonzero().flatten().tolist() == [1]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    r = req(prompt=(0, 1), repetition_penalty=2.0)
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, -4.0, 1.0, 1.0]]
    r = req(prompt=(0,), presence_penalty=0.5, frequency_penalty=0.25)
    r.output_token_ids = [2, 2, 3]
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25]]
    # Repetition penalty flips the greedy choice away from a repeated token.
    r = req(prompt=(0,), temperature=0.0, repetition_penalty=3.0)
    assert Sampler().sample(logits, [r])[0].token_id == 2


def test_logprobs_are_raw_model_logprobs():
    logits = logits_row(3)
    res = Sampler().sample(logits, [req(temperature=0.5, logprobs=3, seed=1)])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert res.logprobs.logprob == pytest.approx(float(raw[res.token_id]))
    assert [t for t, _ in res.logprobs.top] == raw.topk(3).indices.tolist()
    assert Sampler().sample(logits, [req()])[0].logprobs is None


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -1),
        ("max_tokens", 0),
        ("min_p", 2.0),
        ("logprobs", V + 1),
        ("temperature", float("inf")),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", float("nan")),
        ("min_tokens", -1),
    ],
)
def test_invalid_params_are_rejected(field, value):
    with pytest.raises(InvalidInputError, match=field):
        SamplingParams(**{field: value}).validate(V)


def mixed_rows() -> list[WorkerRequest]:
    """Greedy, seeded with every filter, and penalised rows."""
    rows = [
        req("greedy", temperature=0.0),
        req("filtered", seed=1, top_k=3, top_p=0.9, min_p=0.05),
        req("penalised", prompt=(0, 1), seed=2, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25),
        req("greedy-penalised", temperature=0.0, repetition_penalty=3.0),
    ]
    rows[2].output_token_ids = [1, 1, 3]
    return rows


def test_penalties_count_output_tokens_like_bincount():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4))
    r = req(prompt=(0,), presence_penalty=0.5, frequency_penalty=0.25)
    r.output_token_ids = [5, 5, 5, 0, V - 1]
    counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=V).float()
    assert torch.equal(apply_penalties(logits, [r])[0], logits[0] - 0.25 * counts - 0.5 * (counts > 0).float())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["greedy", "mixed"])
def test_choosing_tokens_never_waits_for_the_device_gpu(cuda_device, kind):
    """Everything before the read of the tokens is queued on the stream (the runner enqueues it behind the forward):
    no host sync inside `choose`, for greedy rows (what bench_structured steps) and for seeded, filtered and
    penalised ones (`mixed_rows`); the tokens are those of a run without the check (the same seeds)."""
    logits = (torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 2).to(cuda_device)

    def rows():
        return [req(str(i), temperature=0.0) for i in range(4)] if kind == "greedy" else mixed_rows()

    expected = Sampler(device=cuda_device).choose(logits.clone(), rows()).tolist()
    sampler = Sampler(device=cuda_device)
    sampler.choose(logits.clone(), rows())  # warm-up (the generators of these rows are fresh again below)
    checked = rows()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sampler.choose(logits.clone(), checked)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.tolist() == expected
    assert expected[0] == int(logits[0].argmax())
