"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): a draft token sampled from the drafter's
distribution `q` is kept with probability `min(1, p(d) / q(d))` under the target's distribution `p`, else a token is
drawn from the residual `max(0, p - q)` renormalised. Whatever `q` is, the emitted token is distributed as `p`."""

from __future__ import annotations

import torch


def verify_draft(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator) -> tuple[bool, int]:
    """`p`, `q` `[V]` probabilities (each sums to 1; `q(draft) > 0`) -> (accepted, the emitted token)."""
    u = float(torch.rand((), generator=generator, device=p.device))
    if u * float(q[draft]) < float(p[draft]):  # u < p/q without dividing by a tiny q
        return True, draft
    residual = (p - q).clamp(min=0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q up to rounding: acceptance was certain but for rounding; p is the residual's limit
        residual, total = p, float(p.sum())
    return False, int(torch.multinomial(residual / total, 1, generator=generator))
