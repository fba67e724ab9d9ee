"""RMSNorm exactly as ``Ops.rms_norm`` of decode_service/model/ops.py, optionally after a residual add:

    s = residual + x                                   (rounded to x's dtype like torch's add; s = x without)
    out = weight * round(s * rsqrt(mean(s^2) + eps))   (statistics in fp32, round = to x's dtype)

The product is rounded once to torch's promoted dtype of weight and x (bf16 * bf16 -> bf16). x is ``[N, C]``
(strided rows, unit last stride), or for per-head norms ``[T, nH, hd]`` with any token and head strides (the heads
of a stacked projection's view are read in place; the output is contiguous). With a
residual the call returns ``(s, out)``, fusing "h = h + delta; next = norm(h)" into one launch.
Grid: ``cdiv(N, BLOCK_M)`` programs of ``BLOCK_M`` rows each, several rows per program only for narrow rows;
no host reads, so the call is CUDA-graph safe.
"""

from __future__ import annotations

import torch

from inkling_kernels.pdl import pdl

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK_C = 8192  # widest row a program holds in registers; wider rows loop over column blocks twice
_ROW_ELEMS = 2048  # rows narrower than this share a program, up to this many elements per program


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    heads_ok = x.dim() == 2 or (x.dim() == 3 and residual is None)
    if not heads_ok or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"x [N, C] (or [T, nH, C] without a residual) and weight [C] expected, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")  # fmt: skip
    if x.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        raise ValueError(f"x and weight must be fp32/fp16/bf16, got {x.dtype} and {weight.dtype}")
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError(f"x and weight need a unit stride in their last dim, got {x.stride()} and {weight.stride()}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(
                f"residual must match x {tuple(x.shape)} {x.dtype} with a unit last stride, "
                f"got {tuple(residual.shape)} {residual.dtype} strides {residual.stride()}"
            )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm`` of x ``[N, C]`` or ``[T, nH, C]`` (or of ``residual + x``, 2-D: then returns ``(residual + x,
    its norm)``); the norm is contiguous, of x's shape."""
    import triton

    from inkling_kernels import _triton_rms_norm as tk

    _check(x, weight, residual)
    heads, stride_xh = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    n, c = x.shape[0] * heads, x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty((n, c), dtype=x.dtype, device=x.device) if residual is not None else None
    if n and c:
        block_c = min(triton.next_power_of_2(c), _MAX_BLOCK_C)
        block_m = min(max(1, _ROW_ELEMS // block_c), triton.next_power_of_2(n))
        tk.rms_norm_kernel[(-(-n // block_m),)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            summed if summed is not None else out,
            n,
            c,
            float(eps),
            x.stride(0),
            stride_xh,
            residual.stride(0) if residual is not None else 0,
            c,
            summed.stride(0) if summed is not None else 0,
            HEADS=heads,
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            NUM_BLOCKS=-(-c // block_c),
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block_m * block_c // 512)),
            enable_fp_fusion=False,  # products rounded on their own, as torch computes them
            **pdl(x),
        )
    return out if summed is None else (summed, out)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``rms_norm`` (same arguments and results); ``RMSNorm.forward``'s math."""
    s = x if residual is None else residual + x
    sf = s.float()
    normed = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(s.dtype)
    return out if residual is None else (s, out)
