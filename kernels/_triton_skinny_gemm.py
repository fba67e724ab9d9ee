"""Triton code for the skinny GEMM ``y = x @ W^T`` of a few rows. Public entry: kernels/skinny_gemm.py.

Program (column block of the output, row block of x) reads its ``BLOCK_N`` weight rows over the whole of K once,
so the weight is streamed exactly once and no partial sums leave the program (no split-K, no reduce launch: the
decode shapes have N >= 4096, enough column blocks to fill the GPU). Two ways to multiply, both accumulating an
fp32 ``[BLOCK_N, BLOCK_M]`` tile:

* ``USE_DOT``: on the tensor cores, the weight tile as the left operand ("swap-AB": ``W [BLOCK_N, BLOCK_K] @
  x^T [BLOCK_K, BLOCK_M]``), x's rows zero-padded to ``BLOCK_M = 16``;
* otherwise a GEMV: the weight tile stays in registers and each of the ``BLOCK_M`` rows of x is multiplied into
  it and summed along K.

The epilogue rounds to the activation dtype exactly where the torch reference rounds: ``SWIGLU`` computes the gate
and up rows of each output column (groups of [gate ``I`` rows; up ``I`` rows] in W) and returns
``silu(gate) * up`` (times the group's gamma with ``HAS_GAMMA``); ``HAS_SCALE`` multiplies the rounded product by a
one-element tensor, ``HAS_RESIDUAL`` then adds a tensor of the output's shape; ``DIVIDE_X`` divides x by a scalar
(rounded) before the product.
"""

import triton
import triton.language as tl


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """fp32 ``v`` rounded to DTYPE and back (what a torch op in DTYPE stores)."""
    return v.to(DTYPE).to(tl.float32)


@triton.jit
def _accumulate(
    acc,
    acc_up,
    W,
    X,
    rows,
    up_rows,
    n_mask,
    m0,
    M,
    K,
    stride_wn,
    stride_xm,
    divisor,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    DIVIDE_X: tl.constexpr,
    PAIRED: tl.constexpr,
):
    """acc ``[BLOCK_N, BLOCK_M]`` += W[rows, :] @ X[m0 : m0 + BLOCK_M, :]^T over all of K in fp32 (and acc_up
    with W[up_rows, :] in the same loop when PAIRED: both weight tiles in flight at once)."""
    dtype = X.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = W + up_rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        # EVEN_K: every K block is full, so only whole rows are masked (keeps the loads vectorised)
        w_mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
        if PAIRED:
            w_up = tl.load(up_ptrs + k0, mask=w_mask, other=0.0)
        if USE_DOT:
            x = tl.load(
                X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            if DIVIDE_X:
                x = tl.math.div_rn(x.to(tl.float32), divisor).to(dtype)
            if DOT_IEEE:  # fp32 operands: exact fp32 products, no TF32
                xt = tl.trans(x.to(tl.float32))
                acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
                if PAIRED:
                    acc_up = tl.dot(w_up.to(tl.float32), xt, acc_up, input_precision="ieee")
            else:
                xt = tl.trans(x)
                acc = tl.dot(w, xt, acc)
                if PAIRED:
                    acc_up = tl.dot(w_up, xt, acc_up)
        else:
            for i in tl.static_range(BLOCK_M):
                row_mask = (m0 + i + offs_k * 0) < M  # a vector: the interpreter rejects a scalar mask
                x = tl.load(X + (m0 + i) * stride_xm + k0 + offs_k, mask=row_mask & k_mask, other=0.0)
                if DIVIDE_X:
                    x = tl.math.div_rn(x.to(tl.float32), divisor).to(dtype)
                x = x.to(tl.float32)[None, :]
                column = (tl.arange(0, BLOCK_M) == i)[None, :]
                acc = tl.where(column, acc + tl.sum(w.to(tl.float32) * x, axis=1)[:, None], acc)
                if PAIRED:
                    acc_up = tl.where(column, acc_up + tl.sum(w_up.to(tl.float32) * x, axis=1)[:, None], acc_up)
    return acc, acc_up


# one compile for every batch size and shape (the sizes and output strides only bound masks)
@triton.jit(do_not_specialize=["M", "N", "K", "width", "stride_om", "stride_rm", "stride_gm"])
def skinny_gemm_kernel(
    X,
    W,
    Out,
    Scale,
    Res,
    Gamma,
    M,
    N,
    K,
    width,
    divisor,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    stride_gm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DIVIDE_X: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    dtype = X.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    offs_m = m0 + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    out_mask = n_mask[:, None] & (offs_m < M)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    group = offs_n // width if SWIGLU else offs_n  # column g * I + j: gate row g * 2I + j, up row g * 2I + I + j
    rows = offs_n + group * width if SWIGLU else offs_n
    acc, up = _accumulate(acc, acc, W, X, rows, rows + width, n_mask, m0, M, K, stride_wn, stride_xm, divisor,
                          BLOCK_M, BLOCK_K, USE_DOT, DOT_IEEE, EVEN_K, DIVIDE_X, SWIGLU)  # fmt: skip
    if SWIGLU:
        gate = _round(acc, dtype)
        silu = _round(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)  # F.silu in the activation dtype
        y = _round(silu * _round(up, dtype), dtype)
        if HAS_GAMMA:  # gammas fp32 [M, G], rounded to the activation dtype like `gammas.to(x.dtype)`
            gamma = tl.load(Gamma + offs_m[None, :] * stride_gm + group[:, None], mask=out_mask, other=0.0)
            y = _round(y * _round(gamma, dtype), dtype)
    else:
        y = _round(acc, dtype)
        if HAS_SCALE:
            y = _round(y * tl.load(Scale).to(tl.float32), dtype)
        if HAS_RESIDUAL:
            res = tl.load(Res + offs_m[None, :] * stride_rm + offs_n[:, None], mask=out_mask, other=0.0)
            y = _round(res.to(tl.float32) + y, dtype)
    out_ptrs = Out + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, y.to(Out.dtype.element_ty), mask=out_mask)
