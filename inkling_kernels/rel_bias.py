"""The relative-bias table of a set of query rows (spec inkling-text 3.4): ``L[t, h, d] = r[t, h] . P[:, d]`` for the
distances ``d < extent`` the rows can see, as one tensor-core launch. Prefill attention reads it per (query, key)
pair; the decode kernel reads it for an MTP verify's rows (``DecodeConfig.bias_table``)."""

from __future__ import annotations

import torch

from inkling_kernels.pdl import pdl

REL_TABLE_TILES = (128, 64, 4)  # (query-head rows, distances, warps) per program of ``rel_bias_table``


def rel_bias_table(
    r: torch.Tensor, rel_proj: torch.Tensor, extent: int, tiles: tuple[int, int, int] = REL_TABLE_TILES
) -> torch.Tensor:
    """``r [n, nH, d_rel] @ P[:, :extent]`` as a contiguous fp32 ``[n, nH, extent]`` table, one tensor-core launch.

    r and P share a dtype. For bf16/fp16 operands each product is exact in fp32 (8+8 / 11+11 significand bits
    within fp32's 24) and the d_rel products are summed in the fp32 accumulator, so the table is the fp32 product
    of the rounded inputs up to the order of that sum (``rel_bias_table_reference``); fp32 operands take IEEE fp32
    FMAs, not tf32. r may be a strided view (unit last stride)."""
    import triton

    from inkling_kernels import _triton_attention as tk

    n, n_heads, d_rel = r.shape
    unit = r.stride(-1) == 1 and rel_proj.stride(-1) == 1
    if not unit or rel_proj.dtype != r.dtype or not 0 < extent <= rel_proj.shape[1]:
        raise ValueError(f"r {tuple(r.shape)} strides {r.stride()} / P {tuple(rel_proj.shape)} {rel_proj.dtype}: "
                         f"unit last strides, one dtype and 0 < extent {extent} <= R expected")  # fmt: skip
    out = torch.empty((n, n_heads, extent), dtype=torch.float32, device=r.device)
    rows = n * n_heads
    if rows == 0:
        return out
    block_m, block_n, num_warps = tiles
    grid = (triton.cdiv(rows, block_m), triton.cdiv(extent, block_n))
    tk.rel_bias_table_kernel[grid](
        r, rel_proj, out, rows, n_heads, d_rel, extent, r.stride(0), r.stride(1), rel_proj.stride(0),
        D_PAD=max(16, triton.next_power_of_2(d_rel)), BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if r.dtype == torch.float32 else "tf32", num_warps=num_warps, **pdl(r),
    )  # fmt: skip
    return out


def rel_bias_table_reference(r: torch.Tensor, rel_proj: torch.Tensor, extent: int) -> torch.Tensor:
    """fp32 reference of ``rel_bias_table``."""
    return torch.matmul(r.float(), rel_proj[:, :extent].float())
