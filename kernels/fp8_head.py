"""The MTP drafter's lm_head over an FP8 copy of the unembedding: fp32 logits at half the bf16 head's bytes.

    quantize_rows_fp8(W)                W [N, K] -> (W8 [N, K] e4m3, s [N] fp32), s[n] = amax|W[n]| / 448 and
                                        W8[n] = e4m3(W[n] / s[n]) (round to nearest, within +-448)
    fp8_logits(x, W8, s, divisor=d)     x [M, K] -> fp32 [M, N]: z = round(x / d) (x's dtype, the muP division
                                        as the bf16 head does it), logits[m, n] = s[n] * sum_k z[m, k] W8[n, k]

The e4m3 values are exact in x's dtype (fp32, fp16 or bf16), so the products are the exact products of z and
the stored weights, summed in fp32; the logits are not rounded to x's dtype (nothing downstream of a draft needs
them to be). One launch, grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))`` from shapes only, no host reads: CUDA-graph
safe. Up to 4 rows a GEMV per program (like ``skinny_gemm``'s one-row kernel); more rows on the tensor cores, the
weight tile converted to x's dtype and multiplied as the left operand (swap-AB) with up to 64 rows of x per
program, so at the drafter's batch buckets (<= 64) the weight is streamed once. Tiles: ``default_config``; where
it beats the bf16 head: ``preferred`` (measured: the tensor-core path does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_GEMV_MAX_ROWS = 4
_PREFERRED_ROWS = 2  # see `preferred`
_DOT_MIN_ROWS, _DOT_MAX_ROWS = 16, 64  # rows of x per tensor-core program


@dataclass(frozen=True)
class Fp8HeadConfig:
    """Tiles of one launch: ``dot`` on the tensor cores (x padded to 16..64 rows, ``block_n``, ``block_k`` >= 16),
    otherwise the GEMV over ``next_pow2(M)`` rows (at most 4) per program."""

    dot: bool
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def preferred(m: int) -> bool:
    """Whether the FP8 head beat the drafter's bf16 head (cuBLAS) for ``m`` rows on an H200
    (bench/bench_draft_head.py): one row 258 us against 466 (floor 197), two 405 against 434; four rows 807
    against 452, and the tensor-core path 2-3x slower than cuBLAS at 8 and 64 rows (848 / 1462 against 451 / 474)."""
    return m <= _PREFERRED_ROWS


def default_config(m: int) -> Fp8HeadConfig:
    """Tiles for ``m`` rows (the lm_head's shape: N ~ 200k, K = 4096), best of bench/bench_draft_head.py's sweep."""
    if m <= _GEMV_MAX_ROWS:
        return Fp8HeadConfig(dot=False, block_n=8, block_k=512, num_warps=4)
    return Fp8HeadConfig(dot=True, block_n=64, block_k=128, num_warps=4, num_stages=4)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def quantize_rows_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (e4m3 ``[N, K]``, fp32 per-row scales ``[N]``); an all-zero row gets scale 1."""
    if weight.dim() != 2 or weight.dtype not in _FLOATS:
        raise ValueError(f"weight must be a [N, K] float tensor, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [N]
    w8 = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8.contiguous(), scale.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _FLOATS or weight.dtype != FP8:
        raise ValueError(f"x must be fp32/fp16/bf16 and weight e4m3fn, got {x.dtype} and {weight.dtype}")
    if scale.shape != (weight.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 [N] = [{weight.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or scale.stride(0) != 1:
        raise ValueError(f"x, weight and scale need a unit last stride, got {x.stride()}, {weight.stride()}")
    if not x.device == weight.device == scale.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}, scale on {scale.device}")


def fp8_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    divisor: float | None = None,
    config: Fp8HeadConfig | None = None,
) -> torch.Tensor:
    """x ``[M, K]``, weight e4m3 ``[N, K]``, scale fp32 ``[N]`` -> fp32 logits ``[M, N]``; see the module docstring."""
    from kernels import _triton_fp8_head as tk

    _check(x, weight, scale)
    if divisor is not None and divisor == 0:
        raise ValueError("divisor must be non-zero")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    config = config or default_config(m)
    if config.dot:
        if min(config.block_n, config.block_k) < 16:
            raise ValueError(f"tensor-core tiles need block_n and block_k >= 16, got {config}")
        block_m = min(max(_next_pow2(m), _DOT_MIN_ROWS), _DOT_MAX_ROWS)
    else:
        block_m = min(_next_pow2(m), _GEMV_MAX_ROWS)
    grid = (-(-n // config.block_n), -(-m // block_m))
    tk.fp8_logits_kernel[grid](
        x, weight, scale, out,
        m, n, k, float(divisor or 1.0),
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.dot, DOT_IEEE=x.dtype == torch.float32, EVEN_K=k % config.block_k == 0,
        DIVIDE_X=divisor is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def fp8_logits_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, divisor: float | None = None
) -> torch.Tensor:
    """Torch reference of ``fp8_logits`` (same arguments but ``config``)."""
    if divisor is not None:
        x = x / divisor  # rounded to x's dtype, as the bf16 head divides
    return F.linear(x.float(), weight.float()) * scale
