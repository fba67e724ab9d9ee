"""``x.float()`` of ``[M, N]`` rows with a unit last stride and any row stride, as a contiguous fp32 copy in one
launch (inkling_kernels/_triton_float_rows.py): the lm_head's product for more than one row is ``[M, V_padded]`` sliced
to its unpadded columns, a view torch's copy cannot flatten into one vectorised pass; this one reads each row slice
with vector loads. The cast is exact: the values are those of ``float_rows_reference``.
"""

from __future__ import annotations

import torch

from inkling_kernels.pdl import pdl

BLOCK = 4096  # columns per program
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def is_float_rows(x: torch.Tensor) -> bool:
    """What the row kernels here and in inkling_kernels/argmax.py take: ``[M, N]`` fp32/fp16/bf16, unit last stride."""
    return x.dim() == 2 and x.dtype in _FLOATS and x.stride(-1) == 1


def check_float_rows(x: torch.Tensor) -> None:
    """``is_float_rows`` or a ValueError naming what came."""
    if not is_float_rows(x):
        raise ValueError(f"[M, N] fp32/fp16/bf16 rows with a unit last stride expected, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip


def float_rows(x: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` fp32/fp16/bf16 rows (unit last stride) -> contiguous fp32 ``[M, N]``."""
    import triton

    from inkling_kernels import _triton_float_rows as tk

    check_float_rows(x)
    m, n = x.shape
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m and n:
        tk.float_rows_kernel[(m, triton.cdiv(n, BLOCK))](
            x,
            out,
            n,
            x.stride(0),
            BLOCK=BLOCK,
            num_warps=4,
            **pdl(x),
        )
    return out


def float_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``float_rows``."""
    return x.float().contiguous()
