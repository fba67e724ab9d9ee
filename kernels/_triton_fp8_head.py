"""Triton code for the FP8 draft lm_head ``logits = s * (z @ W8^T)``. Public entry: kernels/fp8_head.py.

Program (column block of the logits, row block of x) streams its ``BLOCK_N`` e4m3 weight rows over the whole of K
once and accumulates an fp32 ``[BLOCK_N, BLOCK_M]`` tile: ``USE_DOT`` on the tensor cores (the weight tile
converted to x's dtype, exact, as the left operand; x's rows zero-padded to ``BLOCK_M``), otherwise a GEMV (the
weight tile in registers, each of the ``BLOCK_M`` rows of x multiplied into it and summed along K). ``DIVIDE_X``
divides x by the muP multiplier, rounded to x's dtype, before the product; the epilogue multiplies each column by
its row scale and stores fp32.
"""

import triton
import triton.language as tl


# one compile for every batch size (the sizes and the output stride only bound masks)
@triton.jit(do_not_specialize=["M", "N", "K", "stride_om"])
def fp8_logits_kernel(
    X,
    W,
    Scale,
    Out,
    M,
    N,
    K,
    divisor,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    DIVIDE_X: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    dtype = X.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # logit columns = weight rows
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        # EVEN_K: every K block is full, so only whole rows are masked (keeps the loads vectorised)
        w_mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
        if USE_DOT:
            x = tl.load(
                X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            if DIVIDE_X:
                x = tl.math.div_rn(x.to(tl.float32), divisor).to(dtype)
            if DOT_IEEE:  # fp32 operands: exact fp32 products, no TF32
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(dtype), tl.trans(x), acc)
        else:
            wf = w.to(tl.float32)
            for i in tl.static_range(BLOCK_M):
                row_mask = (m0 + i + offs_k * 0) < M  # a vector: the interpreter rejects a scalar mask
                x = tl.load(X + (m0 + i) * stride_xm + k0 + offs_k, mask=row_mask & k_mask, other=0.0)
                if DIVIDE_X:
                    x = tl.math.div_rn(x.to(tl.float32), divisor).to(dtype)
                column = (tl.arange(0, BLOCK_M) == i)[None, :]
                acc = tl.where(column, acc + tl.sum(wf * x.to(tl.float32)[None, :], axis=1)[:, None], acc)
    scale = tl.load(Scale + offs_n, mask=n_mask, other=0.0)
    out_ptrs = Out + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc * scale[:, None], mask=n_mask[:, None] & m_mask[None, :])
