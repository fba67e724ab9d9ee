"""The MTP drafter's lm_head over an FP8 copy of the unembedding: fp32 logits at half the bf16 head's bytes.

    quantize_rows_fp8(W)                W [N, K] -> (W8 [N, K] e4m3, s [N] fp32), s[n] = amax|W[n]| / 448 and
                                        W8[n] = e4m3(W[n] / s[n]) (round to nearest, within +-448)
    fp8_logits(x, W8, s, divisor=d)     x [M, K] -> fp32 [M, N]: z = round(x / d) (x's dtype, the muP division
                                        as the bf16 head does it), logits[m, n] = s[n] * sum_k z[m, k] W8[n, k]

The e4m3 values are exact in x's dtype (fp32, fp16 or bf16), so the products are the exact products of z and
the stored weights, summed in fp32; the logits are not rounded to x's dtype (nothing downstream of a draft needs
them to be). Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))`` from shapes only, no host reads: CUDA-graph safe.
On the tensor cores at every row count (a GEMV per program measured slower from one row: ``default_config``): x
divided first (one elementwise launch, ``x / d`` as the reference) and the weight tile converted to x's dtype in
registers as the MMA's left operand (swap-AB) with 8..64 rows of x per program, so at the drafter's batch buckets
(<= 64) the weight is streamed once. Tiles: ``default_config``; where
it beats the bf16 head: ``preferred``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inkling_kernels.pdl import pdl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_PREFERRED_MAX_ROWS = 64  # `preferred` up to here: set from bench_draft_head's sweep (H200)
_DOT_MIN_ROWS, _DOT_MAX_ROWS = 8, 64  # rows of x per tensor-core program (the MMA's N, padded)


@dataclass(frozen=True)
class Fp8HeadConfig:
    """Tiles of one launch (x padded to 8..64 rows; ``block_n``, ``block_k`` >= 16)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def preferred(m: int) -> bool:
    """Whether the FP8 head beats the drafter's bf16 head (cuBLAS) for ``m`` rows on an H200
    (bench/bench_draft_head.py), i.e. ``m <= _PREFERRED_MAX_ROWS``: the rebuilt tensor-core path at 1 / 8 / 64 rows
    194 / 201 / 318 us against cuBLAS's 451 / 412 / 481 (floors 198 / 199 / 210; decisions.md). Up to the drafter's
    largest batch bucket, every row count."""
    return m <= _PREFERRED_MAX_ROWS


def default_config(m: int) -> Fp8HeadConfig:
    """Tiles for ``m`` rows (the lm_head's shape: N ~ 200k, K = 4096), the best of bench/bench_draft_head.py's sweep
    on an H200: up to 8 rows mma.sync over 64 x 256 tiles of 4 warps (194 us at one row, 201 at eight: the byte
    floor; the GEMV took 263 at one row), above that wgmma over 128 x 128 tiles of 8 warps (318 us at 64 rows, 1.5x
    its floor: every program re-reads its x rows from L2; 256 x 128 tiles took 390)."""
    if m <= 8:
        return Fp8HeadConfig(block_n=64, block_k=256, num_warps=4, num_stages=3)
    return Fp8HeadConfig(block_n=128, block_k=128, num_warps=8, num_stages=3)


def dot_block_rows(m: int) -> int:
    """Rows of x per tensor-core program for ``m`` rows: the next power of two, 8..64."""
    return min(max(_next_pow2(m), _DOT_MIN_ROWS), _DOT_MAX_ROWS)


def uses_wgmma(config: Fp8HeadConfig, block_m: int) -> bool:
    """Whether Triton 3.6 lowers the tensor-core tile to wgmma on sm_90 (else mma.sync): the weight tile a multiple
    of 64 rows (its M) over whole warp groups and x at least 16 rows wide (its N); read off the compiled code."""
    return config.block_n % 64 == 0 and config.num_warps % 4 == 0 and block_m >= 16


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
    from inkling_kernels import _triton_fp8_head as tk

    _check(x, weight, scale)
    if divisor is not None and divisor == 0:
        raise ValueError("divisor must be non-zero")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    config = config or default_config(m)
    if min(config.block_n, config.block_k) < 16:
        raise ValueError(f"tensor-core tiles need block_n and block_k >= 16, got {config}")
    z = x if divisor is None else x / divisor  # [M, K] in x's dtype, as the reference divides
    block_m = dot_block_rows(m)
    # bf16 on the GPU: the conversion in inline PTX, as many weights per call as the MMA operand holds in a row
    asm_pack = 0 if x.dtype != torch.bfloat16 or not x.is_cuda else 2 if uses_wgmma(config, block_m) else 4
    tk.fp8_dot_kernel[(-(-n // config.block_n), -(-m // block_m))](
        z, weight, scale, out,
        m, n, k,
        z.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        DOT_IEEE=x.dtype == torch.float32, ASM_PACK=asm_pack, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl(z),
    )  # fmt: skip
    return out


def fp8_logits_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, divisor: float | None = None
) -> torch.Tensor:
    """Torch reference of ``fp8_logits`` (same arguments but ``config``)."""
    if divisor is not None:
        x = x / divisor  # rounded to x's dtype, as the bf16 head divides
    return F.linear(x.float(), weight.float()) * scale
