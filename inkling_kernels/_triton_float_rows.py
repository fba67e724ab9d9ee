"""Triton code of the fp32 copy of row-strided rows. Public entry: inkling_kernels/float_rows.py."""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def float_rows_kernel(X, Out, n_cols, stride_xm, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    # Program (row, BLOCK columns): contiguous loads of one row's slice, its fp32 values stored contiguously.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_xm + cols, mask=ok)
    tl.store(Out + row * n_cols + cols, x.to(tl.float32), mask=ok)
