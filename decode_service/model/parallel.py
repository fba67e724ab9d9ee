"""One rank of a tensor / expert parallel decoder (issue 14): the model of `inkling.py` with local sizes.

The rank's `RankPlan` (common/tensor_parallel.py) says which slices it holds; `local_text_config` turns that into
the `TextConfig` the rank's modules are built with (its query / KV heads per layer kind, its share of the dense and
expert intermediate sizes, its vocabulary rows), so the KV pools and conv slots sized from `model.config` hold the
local heads. Everything that must know the other ranks goes through the `TPGroup` (collectives.py): the two
all-reduces per layer, the vocab-parallel embedding and lm_head, the routed experts held under expert
parallelism. The router sees the global expert count (it is replicated).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from common.config import TextConfig
from common.errors import ConfigError
from common.tensor_parallel import RankPlan
from decode_service.model.collectives import TPGroup
from decode_service.model.inkling import InklingDecoder
from decode_service.model.ops import Ops


def local_text_config(text: TextConfig, plan: RankPlan) -> TextConfig:
    """The sizes rank `plan.rank` builds its modules with; `n_routed_experts` stays global (the router's)."""
    return dataclasses.replace(
        text,
        num_heads=plan.full.num_q,
        num_kv_heads=plan.full.num_kv,
        swa_num_heads=plan.sliding.num_q,
        swa_num_kv_heads=plan.sliding.num_kv,
        dense_intermediate_size=text.dense_intermediate_size // plan.size,
        moe_intermediate_size=text.moe_intermediate_size // plan.size,
        vocab_size=plan.vocab_per_rank,
    )


def tp_group(text: TextConfig, plan: RankPlan, group: dist.ProcessGroup | None) -> TPGroup:
    """The collectives of rank `plan.rank` over `group` (of `plan.size` ranks; None = the default group)."""
    first, stop = plan.experts
    if stop == first:
        raise ConfigError(
            f"expert parallelism over {plan.size} ranks: {text.n_routed_experts} routed experts leave rank "
            f"{plan.rank} with none (use a smaller tensor_parallel_size or no expert parallelism)"
        )
    if plan.size > 1 and dist.get_world_size(group) != plan.size:
        raise ConfigError(f"tensor_parallel_size={plan.size}: the process group has {dist.get_world_size(group)} ranks")
    if not plan.expert_parallel:
        return TPGroup(plan.size, plan.rank, group, plan.rank * plan.vocab_per_rank)
    return TPGroup(
        plan.size, plan.rank, group, plan.rank * plan.vocab_per_rank, plan.experts, text.moe_intermediate_size
    )


def build_rank_decoder(
    text: TextConfig,
    weights: dict[str, torch.Tensor],
    plan: RankPlan,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    ops: Ops | str = "auto",
) -> InklingDecoder:
    """Rank `plan.rank`'s decoder from its local weights (`common.checkpoint_shard.load_decoder_shard`)."""
    tp = tp_group(text, plan, group)
    return InklingDecoder.from_weights(local_text_config(text, plan), weights, dtype, device, ops, tp=tp)
