"""Dense GEMMs of a few rows (the decode step's linears) at the weight-streaming floor: ``y = x @ W^T``.

    skinny_linear(x, W)              y = round(x W^T)                         [M, N]
        scale=s                      y = round(round(x W^T) * s)              (DenseMLP's global_scale)
        residual=r [M, N]            y = round(r + y)                         (the routed experts' output)
        divisor=d                    y = round(round(x / d) W^T)              (the lm_head's muP division)
        out_dtype=torch.float32      the rounded y stored as fp32             (the model's fp32 logits)
    skinny_swiglu(x, W13, width)     W13 = G groups of [gate I rows; up I rows], I = width:
                                     a = round(round(silu(round(x Wg^T))) * round(x Wu^T))   [M, G*I]
        gammas=g [M, G] fp32         a = round(a * round(g))                  (the shared experts' gammas)

round = to x's dtype, as the torch ops of the reference store their results; products accumulate in fp32. W is
``[N, K]`` with unit last stride (row slices such as the lm_head's unpadded vocabulary rows are views), x ``[M, K]``
of W's dtype. Up to ``MAX_ROWS`` rows; ``preferred`` says where it beat cuBLAS (the callers in ``fast_path.py``
ask it). One launch,
grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))`` from shapes only and no host reads: CUDA-graph safe.
``default_config`` holds the tiles measured best on an H200 (bench/bench_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # rows of x this kernel is for (bench/bench_gemm.py: cuBLAS at and above 64)
_DOT_ROWS = 16  # the tensor-core path pads x's rows to this
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of one launch: ``dot`` runs on the tensor cores (x padded to 16 rows, ``block_n``, ``block_k`` >= 16),
    otherwise the GEMV over ``next_pow2(M)`` rows (at most 4) per program; ``split_k`` > 1 spreads K over that many
    programs per tile."""

    dot: bool
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # K splits per output tile, summed by the last split to finish (no reduce launch)


_GEMV_MAX_ROWS = 4  # the GEMV keeps one accumulator column per row of x: beyond this, the tensor cores
_WIDE_N = 65536  # output columns from which the tensor-core tiles beat cuBLAS at 2-16 rows (the lm_head)


def preferred(m: int, n: int) -> bool:
    """Whether this kernel beat cuBLAS for ``m`` rows against ``n`` weight rows on an H200 (bench/bench_gemm.py,
    Small-L6 decode linears): one row at every shape (the GEMV, 0.93-1.39x the byte floor where cuBLAS is at
    1.01-1.70x), 2-16 rows only on the lm_head's ~200k rows (0.94-0.97x against 1.32x). At 2-16 rows and
    N <= 32768 cuBLAS' split-K kernels win (1.0-1.7x the floor; these tiles 1.04-2.6x: too few programs)."""
    return m == 1 or (m <= MAX_ROWS and n >= _WIDE_N)


def default_config(m: int, n: int, k: int) -> SkinnyConfig:
    """Best measured on an H200 for ``m`` rows against ``n`` weight rows (bench/bench_gemm.py over the Small-L6
    proxy's decode linears, bf16): one row, the GEMV tile best on the wide weights (the lm_head, the dense
    gate+up) or else the one with the least time over a step's other linears; more rows, the tensor-core tile best
    on wide weights or else the one with the least time over a step's linears."""
    wide = n >= 32768
    if m == 1 and wide:
        return SkinnyConfig(dot=False, block_n=16, block_k=256, num_warps=4)
    if m == 1:
        return SkinnyConfig(dot=False, block_n=8, block_k=1024, num_warps=8)
    if wide:
        return SkinnyConfig(dot=True, block_n=128, block_k=128, num_warps=8, num_stages=3)
    return SkinnyConfig(dot=True, block_n=64, block_k=256, num_warps=4, num_stages=3)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _FLOATS or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of fp32/fp16/bf16, got {x.dtype} and {weight.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x and weight need a unit last stride, got {x.stride()} and {weight.stride()}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows: this kernel takes at most MAX_ROWS={MAX_ROWS} (use cuBLAS)")


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K arrival counters of ``device`` (int32, zero between launches: the last split re-arms its tile's),
    at least ``tiles`` of them. Shared by the launches of one stream, which run one after another."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return counters


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    config: SkinnyConfig,
    *,
    width: int = 0,
    gammas: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    divisor: float | None = None,
) -> torch.Tensor:
    from kernels import _triton_skinny_gemm as tk

    m, n = out.shape
    k = x.shape[1]
    if m == 0 or n == 0:
        return out
    if config.dot and min(config.block_n, config.block_k) < 16:
        raise ValueError(f"tensor-core tiles need block_n and block_k >= 16, got {config}")
    block_m = _DOT_ROWS if config.dot else min(_next_pow2(m), _GEMV_MAX_ROWS)
    k_blocks = -(-k // config.block_k)
    chunk = max(1, -(-k_blocks // max(1, min(config.split_k, k_blocks)))) * config.block_k  # whole blocks
    split = max(1, -(-k // chunk))  # K per split `chunk`, no split empty
    grid = (-(-n // config.block_n), -(-m // block_m), split)
    tiles = grid[0] * grid[1]
    partial = counter = out
    if split > 1:
        partial = torch.empty(tiles * split * (2 if width else 1) * config.block_n * block_m, device=x.device)
        counter = _counters(x.device, tiles)
    tk.skinny_gemm_kernel[grid](
        x,
        weight,
        out,
        scale if scale is not None else out,
        residual if residual is not None else out,
        gammas if gammas is not None else out,
        partial,
        counter,
        m,
        n,
        k,
        width,
        chunk,
        float(divisor or 1.0),
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        gammas.stride(0) if gammas is not None else 0,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split,
        USE_DOT=config.dot,
        DOT_IEEE=x.dtype == torch.float32,
        EVEN_K=k % config.block_k == 0,  # then every split's K range is whole blocks too
        SWIGLU=width > 0,
        HAS_GAMMA=gammas is not None,
        HAS_SCALE=scale is not None,
        HAS_RESIDUAL=residual is not None,
        DIVIDE_X=divisor is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    divisor: float | None = None,
    out_dtype: torch.dtype | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x ``[M, K]``, weight ``[N, K]`` -> ``[M, N]`` in ``out_dtype`` (default x's); see the module docstring."""
    _check(x, weight)
    if scale is not None and (scale.numel() != 1 or scale.dtype != x.dtype or scale.device != x.device):
        raise ValueError(f"scale must be one element of x's dtype {x.dtype}, got {scale.dtype} {tuple(scale.shape)}")
    shape = (x.shape[0], weight.shape[0])
    if residual is not None and (
        residual.shape != shape or residual.dtype != x.dtype or residual.stride(-1) != 1 or residual.device != x.device
    ):
        raise ValueError(f"residual must be {list(shape)} of x's dtype with a unit last stride, got "
                         f"{residual.dtype} {tuple(residual.shape)} strides {residual.stride()}")  # fmt: skip
    if divisor is not None and divisor == 0:
        raise ValueError("divisor must be non-zero")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    return _launch(x, weight, out, config or default_config(m, n, k), scale=scale, residual=residual, divisor=divisor)


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
    out = torch.empty((m, groups * width), dtype=x.dtype, device=x.device)
    return _launch(x, w13, out, config or default_config(m, w13.shape[0], k), width=width, gammas=gammas)


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    divisor: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch reference of ``skinny_linear`` (same arguments but ``config``)."""
    if divisor is not None:
        x = x / divisor
    y = F.linear(x, weight)
    if scale is not None:
        y = y * scale
    if residual is not None:
        y = residual + y
    return y.to(out_dtype or x.dtype)


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
