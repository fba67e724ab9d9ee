"""Argmax over the last dimension as torch.argmax takes it (the first of equal values; NaN above everything, the
first NaN), without an fp32 copy: ``argmax_rows(values)`` -> int64 ``[M]`` for ``[M, N]`` fp32/fp16/bf16 rows with
a unit last stride (row slices such as the lm_head's unpadded columns are views).

Two launches, grid from shapes only (CUDA-graph safe): programs of ``CHUNK`` columns each store their largest
packed (value, column) key (inkling_kernels/_triton_argmax.py), then one program per row reduces them. ``reduce_keys``
is the second launch on its own, for keys the skinny GEMM's epilogue stores (inkling_kernels/skinny_gemm.py).
"""

from __future__ import annotations

import torch

from inkling_kernels.float_rows import check_float_rows
from inkling_kernels.pdl import pdl

MAX_COLUMNS = 0x7FFFFFFF  # columns pack into 31 bits under the value
CHUNK = 2048  # columns per program of the first launch
_REDUCE_BLOCK = 1024  # keys per step of the reduce (the lm_head's GEMV stores ~25k per row)


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` -> int64 ``[M]``, ``values.argmax(-1)``."""
    from inkling_kernels import _triton_argmax as tk

    check_float_rows(values)
    m, n = values.shape
    if not 0 < n <= MAX_COLUMNS:
        raise ValueError(f"{n} columns: argmax_rows takes 1..{MAX_COLUMNS}")
    chunks = -(-n // CHUNK)
    keys = torch.empty((m, chunks), dtype=torch.int64, device=values.device)
    tokens = torch.empty(m, dtype=torch.int64, device=values.device)
    if m == 0:
        return tokens
    tk.argmax_chunks_kernel[(chunks, m)](
        values,
        keys,
        n,
        values.stride(0),
        keys.stride(0),
        BLOCK=CHUNK,
        num_warps=4,
        **pdl(values),
    )
    return reduce_keys(keys, tokens)


def reduce_keys(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Packed keys int64 ``[M, P]`` (unit last stride) -> each row's column into ``tokens`` int64 ``[M]``."""
    from inkling_kernels import _triton_argmax as tk

    m, p = keys.shape
    if m:
        tk.argmax_reduce_kernel[(m,)](
            keys,
            tokens,
            p,
            keys.stride(0),
            BLOCK=_REDUCE_BLOCK,
            num_warps=4,
            **pdl(keys),
        )
    return tokens


def argmax_rows_reference(values: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``argmax_rows``."""
    return values.argmax(-1)
