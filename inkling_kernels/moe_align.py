"""``moe_align``: an MoE call's (token, slot) pairs grouped by expert into row blocks of ``block_m`` rows, on the
device and without a host sync (CUDA-graph safe), for ``inkling_kernels.moe``'s sorted routing. Two launches over a
grid (``_triton_moe_align``); the results equal ``moe_align_reference``'s stable torch sort. Pairs of a masked route
(a negative id, ``inkling_kernels.moe.MASKED_ROUTE``) are in no block."""

from __future__ import annotations

import torch

from inkling_kernels.pdl import pdl

# Pairs per program and per one-hot step of ``moe_align``'s grid by size (H200, CUDA graphs, ``bench_moe --align``,
# us per call at E=256, k=6, 2026-12-04): 32/32 up to 2048 pairs (384 pairs 6.9 us, 1920 8.4 against 9.8 at 64/64),
# 64/64 up to 6144 (3072 10.3, 6144 14.5), 128/64 up to 24576 (12288 21.6, 24576 32.0), 256/32 beyond (49152 50.6
# against 77.5). A program's time grows with its one-hot steps, and every program reads the whole count table, which
# grows with the grid. The one-program kernel these replaced: 5.9 us at 66 pairs, 15.0 at 384, 28-37 at 768-1020.
_GRID_TILES = ((2048, 32, 32), (6144, 64, 64), (24576, 128, 64))  # (up to n_pairs, chunk, sub)
_GRID_LARGE = (256, 32)
_GRID_ROWS, _GRID_FILL = 16, 16  # count-table rows per load, blocks per pad-fill step


def align_tiles(n_pairs: int) -> tuple[int, int]:
    """(pairs per program, pairs per one-hot step) of ``moe_align``'s grid for ``n_pairs`` pairs."""
    return next(((chunk, sub) for most, chunk, sub in _GRID_TILES if n_pairs <= most), _GRID_LARGE)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert into row blocks, without reading anything back to the host.

    Returns ``sorted_pairs`` int32 ``[n_blocks * block_m]`` (pair ids ``t * k + i``, pad = n_pairs),
    ``block_expert`` int32 ``[n_blocks]`` (-1 for blocks past the used ones) and ``block_rank`` int32 ``[n_blocks]``
    (a block's place among its expert's blocks, 0 for the first and for unused blocks: the paired MoE kernels take
    it instead of walking back over the blocks before them). Pairs of id ``MASKED_ROUTE`` are in no block.
    ``n_blocks`` is the static upper bound ``ceil(n_pairs / block_m) + min(n_pairs, E)``. Two launches over a grid
    (``moe_align_grid``, tiles from ``align_tiles``); the results equal ``moe_align_reference``'s stable sort.
    """
    flat = _check_align(topk_ids, num_experts, block_m)
    return moe_align_grid(flat, num_experts, block_m, *align_tiles(flat.numel()))


def moe_align_grid(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int, sub: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align`` in two launches over ``ceil(n_pairs / chunk)`` programs: each counts its ``chunk`` pairs per
    expert (``moe_align_count_kernel``), then each reads the count table, lays out the experts' padded spans and
    places its pairs after those of the programs before it, and fills a share of the pads and block ids
    (``moe_align_place_kernel``). ``sub``: pairs per one-hot step; both powers of two, ``sub <= chunk``."""
    import triton

    from inkling_kernels import _triton_moe_align as tk

    if chunk & (chunk - 1) or sub & (sub - 1) or not 0 < sub <= chunk:
        raise ValueError(f"powers of two with 0 < sub <= chunk expected, got chunk={chunk}, sub={sub}")
    flat = _check_align(topk_ids, num_experts, block_m)
    n_pairs = flat.numel()
    if n_pairs == 0:
        return moe_align_reference(flat, num_experts, block_m)
    n_blocks = -(-n_pairs // block_m) + min(n_pairs, num_experts)
    dev = flat.device
    programs = triton.cdiv(n_pairs, chunk)
    expert_rows = triton.next_power_of_2(num_experts)
    counts = torch.empty((programs, expert_rows), dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty((n_blocks * block_m,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((n_blocks,), dtype=torch.int32, device=dev)
    block_rank = torch.empty((n_blocks,), dtype=torch.int32, device=dev)
    tk.moe_align_count_kernel[(programs,)](flat, counts, n_pairs, EXPERT_ROWS=expert_rows, CHUNK=chunk, SUB=sub,
                                           num_warps=4, **pdl(flat))  # fmt: skip
    tk.moe_align_place_kernel[(programs,)](
        flat, counts, sorted_pairs, block_expert, block_rank, n_pairs, n_blocks,
        EXPERT_ROWS=expert_rows, BLOCK_M=block_m, CHUNK=chunk, SUB=sub, ROWS=_GRID_ROWS, FILL_BLOCKS=_GRID_FILL,
        num_warps=4, **pdl(flat),
    )  # fmt: skip
    return sorted_pairs, block_expert, block_rank


def _check_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """``topk_ids`` flat and contiguous, after checking the arguments of ``moe_align``."""
    flat = topk_ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64, got {flat.dtype}")
    if not 0 < num_experts or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"num_experts >= 1 and a power-of-two block_m expected, got {num_experts}, {block_m}")
    return flat.contiguous()


def moe_align_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of ``moe_align`` (same arguments and results): a stable sort of the pairs by expert."""
    flat = topk_ids.reshape(-1)
    n_pairs = flat.numel()
    dev = flat.device
    n_blocks = -(-n_pairs // block_m) + min(n_pairs, num_experts)
    n_slots = n_blocks * block_m
    ids = flat.long()
    ids = torch.where(ids < 0, num_experts, ids)  # masked routes: an extra bucket past the experts, dropped below
    sorted_ids, order = torch.sort(ids, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, sorted_ids, torch.ones_like(sorted_ids))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = torch.cat([padded_end - padded, padded.new_full((1,), n_slots)])  # masked pairs land past the end
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n_pairs, device=dev) - start[sorted_ids]
    slots = torch.full((n_slots + n_pairs,), n_pairs, dtype=torch.int32, device=dev)
    slots.scatter_(0, padded_start[sorted_ids] + rank, order.to(torch.int32))
    sorted_pairs = slots[:n_slots]
    block_start = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    used = block_start < padded_end[-1]
    block_rank = (block_start - padded_start[block_expert.clamp(max=num_experts - 1)]) // block_m
    block_rank = torch.where(used, block_rank, 0).to(torch.int32)
    block_expert = torch.where(used, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert, block_rank
