"""Triton code for RMSNorm, optionally after a residual add. Public entry: inkling_kernels/rms_norm.py.

Program p normalises rows ``p * BLOCK_M ..`` of ``[N, C]``; with ``HEADS`` > 1 row r of x is head ``r % HEADS``
of token ``r // HEADS`` (a ``[T, HEADS, C]`` view with any token and head strides; the output is contiguous). A row
that fits one ``BLOCK_C`` tile stays in registers (``NUM_BLOCKS == 1``); a wider row takes two passes over its
column blocks (sum of squares, then normalise), the second re-reading x (and recomputing residual + x) rather than
holding the row.
``rms_apply`` is shared with the short-conv kernels, which normalise what they just computed.
"""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def rms_apply(xf, rstd, w, ROUND: tl.constexpr):
    """``w * round(xf * rstd)`` in fp32, round = to the activation dtype ``ROUND`` (``RMSNorm.forward``)."""
    return w.to(tl.float32) * (xf * rstd).to(ROUND).to(tl.float32)


@triton.jit
def _input_block(
    X,
    Res,
    SumOut,
    rows,
    x_rows,
    cols,
    mask,
    stride_rm,
    stride_sm,
    HAS_RESIDUAL: tl.constexpr,
    STORE_SUM: tl.constexpr,
):
    """The rows' columns ``cols`` of the normalised input in fp32 (x's rows at offsets ``x_rows``): x, or
    ``residual + x`` rounded to x's dtype (written to SumOut when STORE_SUM)."""
    x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(X.dtype.element_ty)
        if STORE_SUM:
            tl.store(SumOut + rows[:, None] * stride_sm + cols[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def rms_norm_kernel(
    X,
    Res,
    W,
    Out,
    SumOut,
    n_rows,
    n_cols,
    eps,
    stride_xm,
    stride_xh,
    stride_rm,
    stride_om,
    stride_sm,
    HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n_rows
    x_rows = (rows // HEADS) * stride_xm + (rows % HEADS) * stride_xh
    offs = tl.arange(0, BLOCK_C)
    round_to = X.dtype.element_ty
    if NUM_BLOCKS == 1:
        col_mask = offs < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        xf = _input_block(X, Res, SumOut, rows, x_rows, offs, mask, stride_rm, stride_sm, HAS_RESIDUAL, True)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
        w = tl.load(W + offs, mask=col_mask, other=0.0)
        out = rms_apply(xf, rstd[:, None], w[None, :], round_to)
        tl.store(Out + rows[:, None] * stride_om + offs[None, :], out.to(Out.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_C + offs
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            xf = _input_block(X, Res, SumOut, rows, x_rows, cols, mask, stride_rm, stride_sm, HAS_RESIDUAL, True)
            sum_sq += tl.sum(xf * xf, axis=1)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_C + offs
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            xf = _input_block(X, Res, SumOut, rows, x_rows, cols, mask, stride_rm, stride_sm, HAS_RESIDUAL, False)
            w = tl.load(W + cols, mask=col_mask, other=0.0)
            out = rms_apply(xf, rstd[:, None], w[None, :], round_to)
            tl.store(Out + rows[:, None] * stride_om + cols[None, :], out.to(Out.dtype.element_ty), mask=mask)
