"""Per-rank loading for tensor / expert parallelism: each rank reads only its slices of the checkpoint (issue 14).

The checks, name mapping and tensor accounting are the single-process loader's (`plan_decoder_weights`,
`plan_mtp_weights`: every checkpoint tensor is consumed, ignored with a reason, or an error). What changes is
the read: for each in-memory key the rank's `Shard` (common/tensor_parallel.py) is turned into ranges of the
tensor AS STORED, read with safetensors' lazy `get_slice` (only those bytes leave the file), and the slice goes
through the same transform as a whole tensor would (cast, gate/up de-interleave). That works because a rank's
de-interleaved `[gate rows a..b; up rows a..b]` is exactly the de-interleave of the stored rows `2a..2b`, and
an HF-saved checkpoint stores gate and up apart (or already as `[gate; up]`), where the two ranges are read
as they are.
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from common.checkpoint import LoadReport, plan_decoder_weights, plan_mtp_weights
from common.checkpoint_files import CheckpointFiles
from common.checkpoint_layout import RawView, interleave_dim
from common.config import ModelConfig
from common.errors import CheckpointError
from common.tensor_parallel import RankPlan, Shard, plan_rank


def stored_ranges(view: RawView, raw: str, shard: Shard) -> tuple[int | None, tuple[tuple[int, int], ...]]:
    """(dim, ranges) to read from the stored tensor `raw` for `shard`; dim None reads it whole."""
    shape = view.shape(raw)
    if shard.dim is None:
        return 0, ((0, shape[0]),)
    dim = interleave_dim(raw) if view.interleaved(raw) else None
    if dim != shard.dim:
        return shard.dim, shard.ranges
    half = shape[dim] // 2
    (a, b), (c, d) = shard.ranges
    assert (c, d) == (a + half, b + half), f"{raw}: gate/up shard {shard.ranges} is not the same rows of both halves"
    return dim, ((2 * a, 2 * b),)  # interleaved rows g_a, u_a, ..., g_{b-1}, u_{b-1}


def _read(view: RawView, raw: str, dim: int, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    pieces = [view.read_slice(raw, dim, a, b) for a, b in ranges if b > a]
    if not pieces:  # a vocab shard lying wholly in the padding
        shape = list(view.shape(raw))
        shape[dim] = 0
        return torch.empty(shape, dtype=view.dtype(raw))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _nbytes(view: RawView, raw: str, dim: int, ranges: tuple[tuple[int, int], ...]) -> int:
    shape = list(view.shape(raw))
    shape[dim] = sum(b - a for a, b in ranges)
    return math.prod(shape) * view.dtype(raw).itemsize


def read_shards(
    view: RawView,
    plan: dict,
    shards: dict[str, Shard],
    device: torch.device | str,
    progress: bool | None,
    what: str,
    position: int = 0,
) -> dict[str, torch.Tensor]:
    """Every planned tensor's local slice, on `device`; `progress=None` shows the bar only above 1 GiB."""
    unruled = sorted(set(plan) - set(shards))
    if unruled:
        raise CheckpointError(f"{what}: no sharding rule for {unruled[:10]}")
    device = torch.device(device)
    reads = {key: stored_ranges(view, raw, shards[key]) for key, (raw, _) in plan.items()}
    total = sum(_nbytes(view, plan[key][0], *r) for key, r in reads.items())
    show = total > (1 << 30) if progress is None else progress
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {what}", position=position, disable=not show)
    with bar:
        for key, (raw, transform) in plan.items():
            shard = shards[key]
            x = transform(_read(view, raw, *reads[key]).to(device))
            if shard.pad:
                shape = list(x.shape)
                shape[shard.dim] = shard.pad
                x = torch.cat([x, x.new_zeros(shape)], dim=shard.dim)
            assert tuple(x.shape) == shard.local_shape(view.shape(raw)), f"{key}: local shape {tuple(x.shape)}"
            out[key] = x
            bar.update(_nbytes(view, raw, *reads[key]))
    return out


def load_decoder_shard(
    files: CheckpointFiles,
    config: ModelConfig,
    size: int,
    rank: int,
    expert_parallel: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport, RankPlan]:
    """Rank `rank` of `size`: its decoder weights (ARCHITECTURE.md keys, local slices), the accounting of every
    checkpoint tensor (as `load_decoder_weights`) and the rank's plan (built for the checkpoint's NVFP4 layers)."""
    view, plan, report = plan_decoder_weights(files, config, dtype)
    rank_plan = plan_rank(config, size, rank, expert_parallel, report.nvfp4_layers)
    what = f"decoder weights (rank {rank}/{size})"
    return read_shards(view, plan, rank_plan.shards, device, progress, what, rank), report, rank_plan


def load_mtp_shard(
    files: CheckpointFiles,
    config: ModelConfig,
    rank_plan: RankPlan,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """The MTP drafter's local slices for the rank of `rank_plan` (prefix `model.mtp.` stripped)."""
    view, plan, report = plan_mtp_weights(files, config, dtype)
    what = f"MTP weights (rank {rank_plan.rank}/{rank_plan.size})"
    return read_shards(view, plan, rank_plan.mtp_shards, device, progress, what, rank_plan.rank), report
