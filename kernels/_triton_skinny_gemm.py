"""Triton code for the skinny GEMM ``y = x @ W^T`` of a few rows. Public entry: kernels/skinny_gemm.py.

Program (column block of the output, row block of x, K split) reads its ``BLOCK_N`` weight rows over its share of K
once, so the weight is streamed exactly once. With ``SPLIT_K == 1`` (the measured default: the decode shapes have
N >= 4096, enough column blocks for one row) no partial sum leaves the program; with more splits each parks its
fp32 tile in a workspace and the last split of a tile to arrive (an atomic counter per tile, re-armed by it) adds
them up in split order and finishes the tile: no reduce launch, deterministic sums. Two ways to multiply, both
accumulating an fp32 ``[BLOCK_N, BLOCK_M]`` tile:

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
    k_start,
    k_end,
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
    """acc ``[BLOCK_N, BLOCK_M]`` += W[rows, k_start:k_end] @ X[m0 : m0 + BLOCK_M, k_start:k_end]^T in fp32 (and
    acc_up with W[up_rows, :] in the same loop when PAIRED: both weight tiles in flight at once)."""
    dtype = X.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = W + up_rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + offs_k) < k_end
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


@triton.jit
def _epilogue(
    acc,
    up,
    Out,
    Scale,
    Res,
    Gamma,
    offs_n,
    offs_m,
    group,
    out_mask,
    stride_om,
    stride_rm,
    stride_gm,
    DTYPE: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Round the fp32 tile(s) like the torch reference, apply the fused ops, store ``[BLOCK_M, BLOCK_N]``."""
    if SWIGLU:
        gate = _round(acc, DTYPE)
        silu = _round(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), DTYPE)  # F.silu in the activation dtype
        y = _round(silu * _round(up, DTYPE), DTYPE)
        if HAS_GAMMA:  # gammas fp32 [M, G], rounded to the activation dtype like `gammas.to(x.dtype)`
            gamma = tl.load(Gamma + offs_m[None, :] * stride_gm + group[:, None], mask=out_mask, other=0.0)
            y = _round(y * _round(gamma, DTYPE), DTYPE)
    else:
        y = _round(acc, DTYPE)
        if HAS_SCALE:
            y = _round(y * tl.load(Scale).to(tl.float32), DTYPE)
        if HAS_RESIDUAL:
            res = tl.load(Res + offs_m[None, :] * stride_rm + offs_n[:, None], mask=out_mask, other=0.0)
            y = _round(res.to(tl.float32) + y, DTYPE)
    tl.store(Out + offs_m[None, :] * stride_om + offs_n[:, None], y.to(Out.dtype.element_ty), mask=out_mask)


# one compile for every batch size and shape (the sizes and output strides only bound masks)
@triton.jit(do_not_specialize=["M", "N", "K", "width", "k_chunk", "stride_om", "stride_rm", "stride_gm"])
def skinny_gemm_kernel(
    X,
    W,
    Out,
    Scale,
    Res,
    Gamma,
    Partial,
    Counter,
    M,
    N,
    K,
    width,
    k_chunk,
    divisor,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    stride_gm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
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
    k_start = tl.program_id(2) * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    acc, up = _accumulate(acc, acc, W, X, rows, rows + width, n_mask, m0, M, k_start, k_end, stride_wn, stride_xm,
                          divisor, BLOCK_M, BLOCK_K, USE_DOT, DOT_IEEE, EVEN_K, DIVIDE_X, SWIGLU)  # fmt: skip
    if SPLIT_K == 1:
        _epilogue(acc, up, Out, Scale, Res, Gamma, offs_n, offs_m, group, out_mask, stride_om, stride_rm, stride_gm,
                  dtype, SWIGLU, HAS_GAMMA, HAS_SCALE, HAS_RESIDUAL)  # fmt: skip
    else:
        # Each split parks its fp32 tile(s); the last of the tile's splits to arrive (a counter per output tile)
        # sums all of them in split order (deterministic), runs the epilogue and re-arms the counter.
        tile = tl.program_id(1) * tl.num_programs(0) + pid_n
        parts: tl.constexpr = 2 if SWIGLU else 1
        size: tl.constexpr = BLOCK_N * BLOCK_M
        here = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        slot = Partial + (tile * SPLIT_K + tl.program_id(2)).to(tl.int64) * (parts * size) + here
        tl.store(slot, acc)
        if SWIGLU:
            tl.store(slot + size, up)
        tl.debug_barrier()  # every thread's stores above precede the release of the one thread's atomic
        ticket = tl.atomic_add(Counter + tile, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            first = Partial + (tile * SPLIT_K).to(tl.int64) * (parts * size) + here
            for split in tl.static_range(SPLIT_K):
                acc += tl.load(first + split * (parts * size), cache_modifier=".cg")
                if SWIGLU:
                    up += tl.load(first + split * (parts * size) + size, cache_modifier=".cg")
            tl.atomic_xchg(Counter + tile, 0)
            _epilogue(acc, up, Out, Scale, Res, Gamma, offs_n, offs_m, group, out_mask, stride_om, stride_rm,
                      stride_gm, dtype, SWIGLU, HAS_GAMMA, HAS_SCALE, HAS_RESIDUAL)  # fmt: skip
