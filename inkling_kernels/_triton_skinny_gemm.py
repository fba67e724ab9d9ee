"""Triton code for the skinny GEMM ``y = x @ W^T`` of a few rows. Public entry: inkling_kernels/skinny_gemm.py.

Program (column block of the output, row block of x) reads its ``BLOCK_N`` weight rows over the whole of K once,
so the weight is streamed exactly once and no partial sums leave the program (no split-K, no reduce launch: the
decode shapes have N >= 4096, enough column blocks to fill the GPU). A GEMV accumulating an fp32
``[BLOCK_N, BLOCK_M]`` tile: the weight tile stays in registers and each of the ``BLOCK_M`` rows of x is multiplied
into it and summed along K.

The epilogue rounds to the activation dtype exactly where the torch reference rounds: ``SWIGLU`` computes the gate
and up rows of each output column (groups of [gate ``I`` rows; up ``I`` rows] in W) and returns
``silu(gate) * up`` (times the group's gamma with ``HAS_GAMMA``); ``HAS_SCALE`` multiplies the rounded product by a
one-element tensor; ``DIVIDE_X`` divides x by a scalar
(rounded) before the product, as a multiplication by its exact reciprocal with ``RECIPROCAL`` (a power-of-two
divisor such as the lm_head's muP 16: the same correctly rounded quotient without a division per element and
program). ``ARGMAX`` stores, instead of y, one packed int64 key per row of x and program (the largest rounded value
of its columns, the first of equal ones: ``argmax_key``) that ``argmax_reduce_kernel`` reduces to the row's argmax
(inkling_kernels/_triton_argmax.py).
"""

import triton
import triton.language as tl

from inkling_kernels._triton_argmax import argmax_key
from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """fp32 ``v`` rounded to DTYPE and back (what a torch op in DTYPE stores)."""
    return v.to(DTYPE).to(tl.float32)


@triton.jit
def _weight_tiles(w_ptrs, up_ptrs, n_mask, offs_k, k0, K, EVEN_K: tl.constexpr, PAIRED: tl.constexpr):
    """The weight tile(s) of the K block at ``k0``."""
    # EVEN_K: every K block is full, so only whole rows are masked (keeps the loads vectorised)
    w_mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & ((k0 + offs_k) < K)[None, :]
    w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
    w_up = tl.load(up_ptrs + k0, mask=w_mask, other=0.0) if PAIRED else w
    return w, w_up


@triton.jit
def _products(
    acc,
    acc_up,
    w,
    w_up,
    X,
    offs_k,
    k0,
    m0,
    M,
    K,
    stride_xm,
    divisor,
    BLOCK_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DIVIDE_X: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    PAIRED: tl.constexpr,
):
    """acc (and acc_up when PAIRED) += the weight tile(s) of the K block at ``k0`` times each row of x there,
    summed along K into ``[BLOCK_N, BLOCK_M]``."""
    dtype = X.dtype.element_ty
    for i in tl.static_range(BLOCK_M):
        x_mask = (m0 + i + offs_k * 0) < M  # a vector: the interpreter rejects a scalar mask
        if not EVEN_K:
            x_mask &= (k0 + offs_k) < K
        x = tl.load(X + (m0 + i) * stride_xm + k0 + offs_k, mask=x_mask, other=0.0)[None, :]
        if DIVIDE_X:  # divisor: its exact reciprocal with RECIPROCAL (a power of two: the same rounded quotient)
            x = (x.to(tl.float32) * divisor if RECIPROCAL else tl.math.div_rn(x.to(tl.float32), divisor)).to(dtype)
        x = x.to(tl.float32)
        column = (tl.arange(0, BLOCK_M) == i)[None, :]
        acc = tl.where(column, acc + tl.sum(w.to(tl.float32) * x, axis=1)[:, None], acc)
        if PAIRED:
            acc_up = tl.where(column, acc_up + tl.sum(w_up.to(tl.float32) * x, axis=1)[:, None], acc_up)
    return acc, acc_up


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
    EVEN_K: tl.constexpr,
    DIVIDE_X: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    PAIRED: tl.constexpr,
    PDL: tl.constexpr,
):
    """acc ``[BLOCK_N, BLOCK_M]`` += W[rows, :] @ X[m0 : m0 + BLOCK_M, :]^T over all of K in fp32 (and acc_up
    with W[up_rows, :] in the same loop when PAIRED: both weight tiles in flight at once). With PDL the first K
    block's weight loads go out before ``pdl_wait``, while the kernel before this one still runs."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = W + up_rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w, w_up = _weight_tiles(w_ptrs, up_ptrs, n_mask, offs_k, 0, K, EVEN_K, PAIRED)  # the first K block peeled
    pdl_wait(PDL)
    acc, acc_up = _products(acc, acc_up, w, w_up, X, offs_k, 0, m0, M, K, stride_xm, divisor,
                            BLOCK_M, EVEN_K, DIVIDE_X, RECIPROCAL, PAIRED)  # fmt: skip
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w, w_up = _weight_tiles(w_ptrs, up_ptrs, n_mask, offs_k, k0, K, EVEN_K, PAIRED)
        acc, acc_up = _products(acc, acc_up, w, w_up, X, offs_k, k0, m0, M, K, stride_xm, divisor,
                                BLOCK_M, EVEN_K, DIVIDE_X, RECIPROCAL, PAIRED)  # fmt: skip
    return acc, acc_up


# one compile for every batch size and shape (the sizes and output strides only bound masks)
@triton.jit(do_not_specialize=["M", "N", "K", "width", "stride_om", "stride_gm"])
def skinny_gemm_kernel(
    X,
    W,
    Out,
    Scale,
    Gamma,
    M,
    N,
    K,
    width,
    divisor,
    stride_xm,
    stride_wn,
    stride_om,
    stride_gm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DIVIDE_X: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    ARGMAX: tl.constexpr,
    PDL: tl.constexpr,
):  # PDL: waits inside ``_accumulate``, after its first weight loads (no kernel writes W; nothing before reads)
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
                          BLOCK_M, BLOCK_K, EVEN_K, DIVIDE_X, RECIPROCAL, SWIGLU, PDL)  # fmt: skip
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
    if ARGMAX:  # Out: int64 [M, programs along N]; columns past N hold -inf, after every real one
        keys = argmax_key(tl.where(n_mask[:, None], y, float("-inf")), offs_n[:, None] + offs_m[None, :] * 0)
        tl.store(Out + offs_m * stride_om + pid_n, tl.max(keys, axis=0), mask=offs_m < M)
    else:
        out_ptrs = Out + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, y.to(Out.dtype.element_ty), mask=out_mask)
