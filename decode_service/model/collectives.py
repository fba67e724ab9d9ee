"""The collectives of one tensor-parallel decoder rank (issue 14), given to the model at build.

A `TPGroup` wraps a `torch.distributed` process group (gloo on CPU, NCCL on GPU) and what a rank needs to know
to combine its partial results: the first vocabulary row of its embedding / lm_head shard and, under expert
parallelism, the routed experts it holds. The model calls the same methods whatever the size; `SINGLE` (size 1)
makes every one of them the single-process computation, so the model never branches on tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from inkling_kernels.moe import MASKED_ROUTE


@dataclass(frozen=True, eq=False)
class TPGroup:
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    vocab_start: int = 0  # first row of the padded vocabulary this rank's embed / unembed shard holds
    experts: tuple[int, int] | None = None  # routed experts held under expert parallelism; None = all of them
    expert_width: int | None = None  # intermediate size of the routed experts held; None = the config's

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial `x` (row-parallel outputs); in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows of ids outside this rank's shard are zero, then summed over ranks."""
        if self.size == 1:
            return table(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= table.num_embeddings)
        rows = table(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0.0)  # [T, H]
        return self.all_reduce(rows)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """`[N, V/n]` logits of this rank's vocab shard -> `[N, n * V/n]` in vocabulary order."""
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def from_leader(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (each rank passes a tensor of the same shape): what only the leader
        decides, such as the tokens it sampled, reaches the followers through the model's own group."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x

    def expert_shape(self, num_experts: int, width: int) -> tuple[int, int]:
        """(routed experts, their intermediate size) this rank holds, from the global count and its local width."""
        held = num_experts if self.experts is None else self.experts[1] - self.experts[0]
        return held, width if self.expert_width is None else self.expert_width

    def local_routes(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids `[T, k]` -> ids into this rank's experts; a route to another rank's expert gets the id
        `MASKED_ROUTE` and weight 0: no expert here computes it, its own rank adds it in the same all-reduce."""
        if self.experts is None:
            return ids, weights
        first, stop = self.experts
        mine = (ids >= first) & (ids < stop)
        return (ids - first).masked_fill(~mine, MASKED_ROUTE), weights.masked_fill(~mine, 0.0)


SINGLE = TPGroup()
