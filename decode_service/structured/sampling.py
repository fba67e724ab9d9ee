"""The sampler's hooks: grammar masks on the logits before sampling, matchers advanced after it.

Masks are filled on the host (xgrammar, rows in parallel on its threads) into one packed `[N, cdiv(V, 32)]`
bitmask per step (unconstrained rows all ones), copied to the logits' device and applied by `kernels.token_mask`
(Triton on CUDA, torch elsewhere). The masked logits are a copy: logprobs stay those of the raw model
distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from decode_service.structured.matcher import ConstraintMatcher, fill_bitmasks
from kernels.token_mask import apply_token_mask, token_mask_reference


class Constrained(Protocol):
    """What the hooks read of a request (the data plane's `WorkerRequest`)."""

    constraint: ConstraintMatcher | None


def mask_logits(logits: torch.Tensor, requests: Sequence[Constrained]) -> torch.Tensor:
    """logits `[N, V]` -> the same, or a copy with the disallowed tokens of constrained rows at -inf."""
    rows = [i for i, r in enumerate(requests) if r.constraint is not None]
    if not rows:
        return logits
    bitmask = torch.full((logits.shape[0], -(-logits.shape[1] // 32)), -1, dtype=torch.int32)
    fill_bitmasks([requests[i].constraint for i in rows], bitmask, rows)
    masked = logits.clone()
    if masked.is_cuda:
        apply_token_mask(masked, bitmask.pin_memory().to(masked.device, non_blocking=True))
    else:
        token_mask_reference(masked, bitmask)
    return masked


def advance_matchers(requests: Sequence[Constrained], token_ids: Sequence[int]) -> None:
    for request, token in zip(requests, token_ids, strict=True):
        if request.constraint is not None:
            request.constraint.accept(token)
