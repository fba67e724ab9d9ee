"""Dense GEMMs of a few rows (the decode step's linears) at the weight-streaming floor: ``y = x @ W^T``.

    skinny_linear(x, W)              y = round(x W^T)                         [M, N]
        scale=s                      y = round(round(x W^T) * s)              (DenseMLP's global_scale)
        divisor=d                    y = round(round(x / d) W^T)              (the lm_head's muP division)
        out_dtype=torch.float32      the rounded y stored as fp32             (the model's fp32 logits)
    skinny_argmax(x, W)              argmax(round(x W^T), -1) int64 [M]       (greedy tokens, no logits stored)
        divisor=d                    over round(round(x / d) W^T)             (the lm_head's)
    skinny_swiglu(x, W13, width)     W13 = G groups of [gate I rows; up I rows], I = width:
                                     a = round(round(silu(round(x Wg^T))) * round(x Wu^T))   [M, G*I]
        gammas=g [M, G] fp32         a = round(a * round(g))                  (the shared experts' gammas)

round = to x's dtype, as the torch ops of the reference store their results; products accumulate in fp32. W is
``[N, K]`` with unit last stride (row slices such as the lm_head's unpadded vocabulary rows are views), x ``[M, K]``
of W's dtype. Up to ``MAX_ROWS`` rows; more belong to cuBLAS (the callers in ``fast_path.py`` decide). One launch,
grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))`` from shapes only and no host reads: CUDA-graph safe (the argmax: a
second launch reducing the programs' packed (value, column) keys, equal values to the first column like torch).
``default_config`` holds the tiles measured best on an H200 (bench/bench_gemm.py) per weight shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inkling_kernels.pdl import pdl

MAX_ROWS = 16  # rows of x this kernel is for (bench/bench_gemm.py: cuBLAS at and above 64)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of one launch: the GEMV over ``next_pow2(M)`` rows (at most 4) per program."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


_GEMV_MAX_ROWS = 4  # the GEMV keeps one accumulator column per row of x: beyond this, more row blocks


def preferred(m: int, n: int) -> bool:
    """Whether this kernel beat cuBLAS for ``m`` rows against ``n`` weight rows on an H200 (bench/bench_gemm.py,
    Small-L6 decode linears): one row, at every shape (summed over a step 799 us against cuBLAS' 1018, floor
    ~795). At 2-16 rows cuBLAS' split-K kernels: the GEMV lost every shape, and tensor-core tiles, tried, beat
    cuBLAS alone but not inside a B=8 decode step (decisions, 2026-12-03)."""
    return m == 1


def default_config(m: int, rows: int, k: int) -> SkinnyConfig:
    """Best measured on an H200 (bench/bench_gemm.py over the Small-L6 proxy's decode linears, bf16) for ``m``
    rows of x against a weight of ``rows`` x ``k``. One row: long K blocks, so that each program has most of its
    weight rows in flight at once (a GEMV of a few MB per layer is bound by how many loads are in flight, not by
    the bandwidth): 4 rows of 2048 columns on up to 6656 x 4096 weights (wo 11.2 -> 10.1 us, qkvr 16.8 -> 15.8,
    floors 7.9 and 12.9), 2 rows of 4096 over 8 warps above (dense down 37.5 -> 34.4 us, floor 31.7; a 1 GB
    lm_head 247 -> 239). K blocks are halved (down to 512) until they divide K. More rows: (8, 512, 4 warps)."""
    if m != 1:
        return SkinnyConfig(block_n=8, block_k=512, num_warps=4)
    block_n, block_k, warps = (4, 2048, 4) if rows * k <= 6656 * 4096 else (2, 4096, 8)
    while block_k > 512 and k % block_k:
        block_k //= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, num_warps=warps)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[1] == 0:
        raise ValueError(f"x [M, K] and weight [N, K] (K > 0) expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _FLOATS or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of fp32/fp16/bf16, got {x.dtype} and {weight.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x and weight need a unit last stride, got {x.stride()} and {weight.stride()}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows: this kernel takes at most MAX_ROWS={MAX_ROWS} (use cuBLAS)")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    config: SkinnyConfig,
    *,
    width: int = 0,
    gammas: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    divisor: float | None = None,
    argmax: bool = False,
) -> torch.Tensor:
    from inkling_kernels import _triton_skinny_gemm as tk

    m, n = x.shape[0], weight.shape[0] if argmax else out.shape[1]
    k = x.shape[1]
    if m == 0 or n == 0:
        return out
    block_m = min(_next_pow2(m), _GEMV_MAX_ROWS)
    exact_reciprocal = divisor is not None and abs(math.frexp(divisor)[0]) == 0.5  # x / 2^e == x * 2^-e
    grid = (-(-n // config.block_n), -(-m // block_m))
    tk.skinny_gemm_kernel[grid](
        x,
        weight,
        out,
        scale if scale is not None else out,
        gammas if gammas is not None else out,
        m,
        n,
        k,
        width,
        1.0 / divisor if exact_reciprocal else float(divisor or 1.0),
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        gammas.stride(0) if gammas is not None else 0,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        SWIGLU=width > 0,
        HAS_GAMMA=gammas is not None,
        HAS_SCALE=scale is not None,
        DIVIDE_X=divisor is not None,
        RECIPROCAL=exact_reciprocal,
        ARGMAX=argmax,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl(x),
    )
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    divisor: float | None = None,
    out_dtype: torch.dtype | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x ``[M, K]``, weight ``[N, K]`` -> ``[M, N]`` in ``out_dtype`` (default x's); see the module docstring."""
    _check(x, weight)
    if scale is not None and (scale.numel() != 1 or scale.dtype != x.dtype or scale.device != x.device):
        raise ValueError(f"scale must be one element of x's dtype {x.dtype}, got {scale.dtype} {tuple(scale.shape)}")
    if divisor is not None and divisor == 0:
        raise ValueError("divisor must be non-zero")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    return _launch(x, weight, out, config or default_config(m, n, k), scale=scale, divisor=divisor)


def skinny_argmax(
    x: torch.Tensor, weight: torch.Tensor, *, divisor: float | None = None, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """x ``[M, K]``, weight ``[N, K]`` -> int64 ``[M]``: the column of each row's largest rounded product (the first
    of equal ones, NaN above everything, as ``torch.argmax``) without storing the products; see the module
    docstring."""
    from inkling_kernels.argmax import MAX_COLUMNS, reduce_keys

    _check(x, weight)
    if divisor is not None and divisor == 0:
        raise ValueError("divisor must be non-zero")
    (m, k), n = x.shape, weight.shape[0]
    if n == 0 or n > MAX_COLUMNS:
        raise ValueError(f"weight has {n} rows: the argmax takes 1..{MAX_COLUMNS}")
    config = config or default_config(m, n, k)
    keys = torch.empty((m, -(-n // config.block_n)), dtype=torch.int64, device=x.device)
    tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return tokens
    _launch(x, weight, keys, config, divisor=divisor, argmax=True)
    return reduce_keys(keys, tokens)


def skinny_swiglu(
    x: torch.Tensor,
    w13: torch.Tensor,
    width: int,
    *,
    gammas: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x ``[M, K]``, w13 ``[G * 2 * width, K]`` -> ``[M, G * width]``; see the module docstring."""
    _check(x, w13)
    if width <= 0 or w13.shape[0] % (2 * width):
        raise ValueError(f"w13 has {w13.shape[0]} rows: expected groups of 2 * width = {2 * width}")
    (m, k), groups = x.shape, w13.shape[0] // (2 * width)
    if gammas is not None and (gammas.shape != (m, groups) or gammas.dtype != torch.float32 or gammas.stride(-1) != 1):
        raise ValueError(f"gammas must be fp32 [M, G] = [{m}, {groups}], got {gammas.dtype} {tuple(gammas.shape)}")
    n = groups * width
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    return _launch(x, w13, out, config or default_config(m, w13.shape[0], k), width=width, gammas=gammas)


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    divisor: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch reference of ``skinny_linear`` (same arguments but ``config``)."""
    if divisor is not None:
        x = x / divisor
    y = F.linear(x, weight)
    if scale is not None:
        y = y * scale
    return y.to(out_dtype or x.dtype)


def skinny_argmax_reference(x: torch.Tensor, weight: torch.Tensor, *, divisor: float | None = None) -> torch.Tensor:
    """Torch reference of ``skinny_argmax`` (same arguments but ``config``)."""
    return skinny_linear_reference(x, weight, divisor=divisor).argmax(-1)


def skinny_swiglu_reference(
    x: torch.Tensor, w13: torch.Tensor, width: int, *, gammas: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of ``skinny_swiglu`` (same arguments but ``config``)."""
    m = x.shape[0]
    gate_up = F.linear(x, w13).view(m, -1, 2, width)  # [M, G, 2, I]
    act = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [M, G, I]
    if gammas is not None:
        act = act * gammas.to(x.dtype)[:, :, None]
    return act.reshape(m, -1)
