"""Routes for the MoE kernel tests: random, skewed and masked (token, slot) -> expert ids."""

import torch

from inkling_kernels.moe import MASKED_ROUTE


def routing(t, e, k, gen, device="cpu"):
    ids = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :k].to(torch.int32)
    wts = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return ids.to(device), wts.to(device)


def skewed_ids(t, e, k, gen, device="cpu"):
    """Routing with a few hot experts and many unused ones (several align chunks share an expert)."""
    hot = torch.rand(e, generator=gen) ** 4
    return torch.multinomial(hot.expand(t, e), k, generator=gen).to(torch.int32).to(device)


def masked(ids: torch.Tensor, gen: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """ids with about a fraction p of the routes masked, as expert parallelism masks other ranks' experts."""
    return ids.masked_fill(torch.rand(ids.shape, generator=gen) < p, MASKED_ROUTE)
