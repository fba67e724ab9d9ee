"""Speculative rejection sampling: on fixed logits the emitted token is distributed as the target (chi-square), and
the acceptance rate is sum(min(p, q))."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from decode_service.engine.worker.rejection import verify_draft

TRIALS = 20000


def run(p: torch.Tensor, q: torch.Tensor, seed: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    counts, accepted = torch.zeros(p.shape[0]), 0
    for _ in range(TRIALS):
        draft = int(torch.multinomial(q, 1, generator=g))
        ok, token = verify_draft(p, q, draft, g)
        counts[token] += 1
        accepted += ok
    return counts, accepted


CASES = {
    "different": (torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]), torch.tensor([-1.0, 0.0, 2.0, 1.5, 0.0, 1.0])),
    "draft-misses-a-token": (torch.tensor([0.0, 1.0, 1.0, 0.5]), torch.tensor([3.0, 1.0, 0.0, -30.0])),
    "equal": (torch.tensor([1.0, 0.2, -0.5, 0.3, 0.0]), torch.tensor([1.0, 0.2, -0.5, 0.3, 0.0])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_emitted_tokens_follow_the_target_and_acceptance_is_the_overlap(case):
    target, draft = CASES[case]
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    counts, accepted = run(p, q, seed=len(case))
    assert chisquare(counts.numpy(), (TRIALS * p).numpy()).pvalue > 1e-3
    overlap = float(torch.minimum(p, q).sum())
    sigma = math.sqrt(TRIALS * overlap * (1 - overlap)) + 1e-9
    assert abs(accepted - TRIALS * overlap) <= 5 * sigma + 1


def test_the_draft_distribution_alone_would_fail_the_test():
    """Control: emitting the draft itself (no rejection) is detected at the same sample size."""
    target, draft = CASES["different"]
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    g = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.multinomial(q, TRIALS, replacement=True, generator=g), minlength=p.shape[0])
    assert chisquare(counts.float().numpy(), (TRIALS * p).numpy()).pvalue < 1e-6
