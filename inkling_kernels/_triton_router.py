"""Triton code for the MoE gate (spec inkling-text 5.2). Public entry: inkling_kernels/router.py.

Two launches per gate call:
  1. ``router_logits_kernel``: program (row block of the gate weight, token block, K split) accumulates
     ``x @ W^T`` over its slice of H in fp32 and writes an fp32 partial ``[SPLIT, T, E+S]``. The weight is
     read in its stored dtype; a token block of >= 16 rows runs on the tensor cores (``tl.dot``, padding
     rows masked), a smaller one is a GEMV: the weight tile stays in registers and each token's row of x
     is multiplied into it and summed. Splitting K spreads the 2 MB weight read of a decode step over a
     few hundred programs without atomics; launch 2 adds the splits up.
  2. ``router_topk_kernel``: one token per program (one warp for E <= 256, so every reduction stays in
     the warp) sums the K splits, then sigmoid + bias, an iterative top-k (largest first; among equal
     scores the lowest expert id), logsigmoid of the k chosen raw logits and the S shared ("sink") logits,
     softmax over those k + S, times route_scale * global_scale.
"""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def _load(ptrs, row_mask, k_mask, EVEN_K: tl.constexpr):
    # EVEN_K: every K block is full, so only whole rows are masked (keeps the loads vectorised).
    if EVEN_K:
        return tl.load(ptrs, mask=row_mask, other=0.0)
    else:
        return tl.load(ptrs, mask=row_mask & k_mask, other=0.0)


@triton.jit
def router_logits_kernel(
    X,
    W,
    Partial,
    T,
    N,
    H,
    chunk,
    stride_xt,
    stride_wn,
    stride_ps,
    stride_pt,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)  # fastest: consecutive programs share a token block (x stays in L2)
    pid_t = tl.program_id(1)
    split = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    n_mask = offs_n < N
    k_start = split * chunk
    k_end = tl.minimum(k_start + chunk, H)
    x_ptrs = X + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]

    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + offs_k) < k_end
        w = _load(w_ptrs + k0, n_mask[:, None], k_mask[None, :], EVEN_K)
        if USE_DOT:
            x = _load(x_ptrs + k0, t_mask[:, None], k_mask[None, :], EVEN_K)
            if DOT_FP32:  # fp32 (or mixed-dtype) operands: exact fp32 products, no TF32
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        else:
            # GEMV: the weight tile stays in registers while each token's row of x is multiplied into it.
            w = w.to(tl.float32)
            for i in tl.static_range(BLOCK_T):
                row = pid_t * BLOCK_T + i
                row_mask = (row + offs_k * 0) < T  # a vector: the interpreter rejects a scalar mask
                x = _load(X + row.to(tl.int64) * stride_xt + k0 + offs_k, row_mask, k_mask, EVEN_K)
                dot = tl.sum(w * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
                acc = tl.where((tl.arange(0, BLOCK_T) == i)[:, None], acc + dot[None, :], acc)

    p_ptrs = Partial + split * stride_ps + offs_t[:, None].to(tl.int64) * stride_pt + offs_n[None, :]
    tl.store(p_ptrs, acc, mask=t_mask[:, None] & n_mask[None, :])


@triton.jit
def router_topk_kernel(
    Partial,
    Bias,
    GlobalScale,
    Ids,
    Weights,
    Gammas,
    E,
    S,
    n_split,
    route_scale,
    stride_ps,
    stride_pt,
    stride_it,
    stride_wt,
    stride_gt,
    TOPK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)  # routed experts
    offs_a = tl.arange(0, BLOCK_A)  # active slots: k routed, then S shared, then padding
    offs_s = tl.arange(0, BLOCK_S)  # K splits of launch 1, summed here
    e_mask = offs_e < E
    is_routed = offs_a < TOPK
    is_shared = (offs_a >= TOPK) & (offs_a < TOPK + S)

    # All splits in one load each (no dependent loads in a loop), summed over axis 0.
    base = Partial + token * stride_pt + offs_s[:, None] * stride_ps
    s_mask = (offs_s < n_split)[:, None]
    routed = tl.sum(tl.load(base + offs_e[None, :], mask=s_mask & e_mask[None, :], other=0.0), axis=0)
    active = tl.sum(tl.load(base + (E + offs_a - TOPK)[None, :], mask=s_mask & is_shared[None, :], other=0.0), 0)

    # Selection key: the score's bits made order-preserving as a signed int, in the high half; BLOCK_E-1-e in
    # the low half, so one max gives the best score and, among equal scores, the lowest expert id.
    bias = tl.load(Bias + offs_e, mask=e_mask, other=0.0)
    choice = tl.where(e_mask, tl.sigmoid(routed) + bias, float("-inf"))
    bits = choice.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (key.to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e).to(tl.int64)
    taken = tl.full((BLOCK_E,), -(2**63), dtype=tl.int64)
    ids = tl.zeros((BLOCK_A,), dtype=tl.int32)
    for i in tl.static_range(TOPK):
        best = tl.max(packed, axis=0)
        hit = packed == best
        packed = tl.where(hit, taken, packed)
        logit = tl.sum(tl.where(hit, routed, 0.0), axis=0)  # off the critical path of the next max
        ids = tl.where(offs_a == i, BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32), ids)
        active = tl.where(offs_a == i, logit, active)

    # logsigmoid(a) = min(a, 0) - log(1 + exp(-|a|)); weights = exp(ls - logsumexp(ls)) over the k + S slots.
    ls = tl.minimum(active, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(active)))
    ls = tl.where(is_routed | is_shared, ls, float("-inf"))
    p = tl.exp(ls - tl.max(ls, axis=0))
    w = p / tl.sum(p, axis=0) * (route_scale * tl.load(GlobalScale))

    tl.store(Ids + token * stride_it + offs_a, ids.to(tl.int64), mask=is_routed)
    tl.store(Weights + token * stride_wt + offs_a, w, mask=is_routed)
    tl.store(Gammas + token * stride_gt + offs_a - TOPK, w, mask=is_shared)
