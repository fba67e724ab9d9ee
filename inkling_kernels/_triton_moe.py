"""Triton code for the routed-expert MoE (weight-only NVFP4 or bf16 weights). Public entry: inkling_kernels/moe.py.

Three launches per MoE call:
  1. ``moe_w13_kernel``: per (row block of one expert, tile of I[, slice of H]): gate and up accumulators over H,
     then ``silu(g) * u`` into an intermediate ``[n_pairs, I]`` (one row per (token, slot) pair); with
     ``PRESPLIT_K`` each PRESPLIT_K-wide column block is stored as [even columns | odd columns]. ``SPLIT_K``
     slices: fp32 partials in ``Partial``, the tile's last slice (``Count``) adds them, runs the epilogue and puts
     the tile's counter back to 0.
  2. ``moe_w2_kernel``: per (row block, tile of H): the down projection over I, times the pair's routing
     weight, into ``[n_pairs, H]`` fp32 (``PRESPLIT``: reads the split intermediate as two halves).
  3. ``moe_sum_kernel``: the fp32 sum of each token's k slots, one rounding to the output dtype.

``SWAP``: the MMA computes ``W_tile @ x^T`` (weights as its M operand, the block's rows as its N, padded
to 8) instead of ``x @ W_tile^T`` (rows as M, padded to 16): the dequantised weights feed the MMA without
the zero rows of the token operand, and there are half as many MMAs per weight.

Row blocks come from one of two routings (constexpr ``IDENTITY``):
  * identity: block b is pair b alone (expert ``topk_ids.flat[b]``); no metadata, best when pairs are few;
  * sorted: ``sorted_pairs[b * BLOCK_M + i]`` lists the pairs of expert ``block_expert[b]`` (sentinel
    ``n_pairs`` pads; ``block_rank[b]``: its place among the expert's blocks), built by
    ``inkling_kernels.moe_align.moe_align`` (its kernels: ``_triton_moe_align``); a
    block with expert -1 exits at once.
A masked route (id -1) is in no sorted block, its identity block exits at once, and the slot sum skips it.

NVFP4 weights are unpacked in registers (``_triton_nvfp4.fp4_tile``), two dots per K block (the activations' even and
odd columns); the per-expert fp32 ``scale2`` is applied to the fp32 accumulator in the epilogue.
"""

import triton
import triton.language as tl

from inkling_kernels._triton_nvfp4 import ASM_UNSCALE, fp4_tile
from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def _mma(acc, x, w, SWAP: tl.constexpr):
    """acc += x @ w^T (acc [BM, BN]); SWAP: acc += w @ x^T (acc [BN, BM], the weights as the MMA's A operand)."""
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _wgmma_drain(ON: tl.constexpr):
    """With ON (sm_90 only): wait for this K step's wgmma groups before the next step's dequantisation writes the
    registers they read, so no group runs across the loop's back-edge (ptxas serialises every wgmma of a kernel where
    one does: C7515, one group of 4 k16 instructions then issues as 4 waited ones)."""
    if ON:
        tl.inline_asm_elementwise("wgmma.wait_group.sync.aligned 0; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)  # fmt: skip


@triton.jit
def _block_rows(TopkIds, SortedPairs, BlockExpert, pid_m, n_pairs, BLOCK_M: tl.constexpr, IDENTITY: tl.constexpr):
    """(expert, pair ids [BLOCK_M], valid [BLOCK_M]) of row block ``pid_m``; expert < 0: nothing to do."""
    offs_m = tl.arange(0, BLOCK_M)
    if IDENTITY:
        expert = tl.load(TopkIds + pid_m).to(tl.int32)
        pairs = pid_m + offs_m * 0
        valid = offs_m == 0
    else:
        expert = tl.load(BlockExpert + pid_m).to(tl.int32)
        pairs = tl.load(SortedPairs + pid_m * BLOCK_M + offs_m).to(tl.int32)
        valid = pairs < n_pairs
    return expert, pairs, valid


@triton.jit
def _block_pair(BlockRank, SortedPairs, pid_m, n_blocks, n_pairs, BLOCK_M: tl.constexpr):
    """Sorted routing, two row blocks per program: (lead, second, pair ids and valid rows of block pid_m + 1).
    An expert's blocks are consecutive, ranked from its first (``BlockRank``): the even ones lead and take the odd one
    after them (``second``: the next block's rank is one more, so it holds the same expert's pairs), the odd ones have
    nothing left to do (``lead`` False). No walk back over the blocks before this one."""
    nxt = tl.minimum(pid_m + 1, n_blocks - 1)
    rank = tl.load(BlockRank + pid_m)
    rank_next = tl.load(BlockRank + nxt)
    second = (pid_m + 1 < n_blocks) & (rank_next == rank + 1)
    pairs_b = tl.load(SortedPairs + nxt * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int32)
    # ranks are never negative: the second term only makes the exit test read the next rank too, so its load goes
    # out with this block's, before the exit, instead of after it
    lead = (rank % 2 == 0) | (rank_next < 0)
    return lead, second, pairs_b, pairs_b < tl.where(second, n_pairs, 0)  # no rows without a second


@triton.jit
def _program_blocks(TopkIds, SortedPairs, BlockExpert, BlockRank, pid_m, n_blocks, n_pairs, BLOCK_M: tl.constexpr,
                    IDENTITY: tl.constexpr, PAIR: tl.constexpr):  # fmt: skip
    """A program's row blocks: (run, expert, pair ids, valid rows, second, the second block's pair ids and valid
    rows); ``run`` False: nothing to do (an unused block, or the odd block of a pair). Every metadata load here is
    independent of the others and the caller's exit test reads them all, so they go out together: one load latency
    before the weights' (which need the expert), not a chain of them."""
    expert, pairs, valid = _block_rows(TopkIds, SortedPairs, BlockExpert, pid_m, n_pairs, BLOCK_M, IDENTITY)
    second = False
    pairs_b, valid_b = pairs, pairs < 0  # no second block
    lead = True
    if PAIR:
        lead, second, pairs_b, valid_b = _block_pair(BlockRank, SortedPairs, pid_m, n_blocks, n_pairs, BLOCK_M)
    return (expert >= 0) & lead, expert, pairs, valid, second, pairs_b, valid_b


@triton.jit
def _expert_scale2(S2, expert, FP4: tl.constexpr, ASM: tl.constexpr):
    """NVFP4's per-expert fp32 scale for the epilogue (times ``ASM_UNSCALE`` on the asm path); 1 for bf16 weights."""
    s2 = 1.0
    if FP4:
        s2 = tl.load(S2 + expert)
        if ASM:
            s2 = s2 * ASM_UNSCALE
    return s2


@triton.jit
def _x_ptrs(X, rows, stride_xm, BLOCK_K: tl.constexpr):
    """Pointers to a K block of these rows of X at column 0: all ``BLOCK_K`` columns, and its first half."""
    base = X + rows.to(tl.int64)[:, None] * stride_xm
    return base + tl.arange(0, BLOCK_K)[None, :], base + tl.arange(0, BLOCK_K // 2)[None, :]


@triton.jit
def _x_halves(x_ptrs, xh_ptrs, k0, valid, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """The even and the odd columns of the rows' K block at k0 (``_x_ptrs``' pointers; rows not ``valid`` read 0).
    SPLIT: the block is stored as [even columns | odd columns], two contiguous loads; else one load, split."""
    if SPLIT:
        x_even = tl.load(xh_ptrs + k0, mask=valid[:, None], other=0.0)
        x_odd = tl.load(xh_ptrs + (k0 + BLOCK_K // 2), mask=valid[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs + k0, mask=valid[:, None], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
    return x_even, x_odd


@triton.jit
def _w13_loop(W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, up_off, N_HALF, k_lo, K,
              stride_wn, stride_se, stride_sn, offs_n, offs_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr, X_SPLIT: tl.constexpr,
              SPLIT_ACC: tl.constexpr, SWAP: tl.constexpr, KPERM: tl.constexpr, SHUFFLED: tl.constexpr,
              TWO: tl.constexpr, DRAIN: tl.constexpr):  # fmt: skip
    """The gate/up kernel's reduction over K slice [k_lo, k_lo + K): (gate, up) accumulators of the row block, then
    of the second block (TWO: its rows through the same dequantised tiles; else zeros). DRAIN: ``_wgmma_drain``
    after each K step."""
    DT: tl.constexpr = x_ptrs.dtype.element_ty
    ACC: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    acc_g = tl.zeros(ACC, dtype=tl.float32)
    acc_u = tl.zeros(ACC, dtype=tl.float32)
    acc_gb = tl.zeros(ACC, dtype=tl.float32)
    acc_ub = tl.zeros(ACC, dtype=tl.float32)
    acc_g2 = tl.zeros(ACC, dtype=tl.float32)
    acc_u2 = tl.zeros(ACC, dtype=tl.float32)
    for k0 in range(k_lo, k_lo + K, BLOCK_K):
        if FP4:
            s_off = expert.to(tl.int64) * stride_se
            s_up = N_HALF.to(tl.int64) * stride_sn
            x_even, x_odd = _x_halves(x_ptrs, xh_ptrs, k0, valid, BLOCK_M, BLOCK_K, X_SPLIT)
            g_even, g_odd = fp4_tile(
                W, S, w_off, s_off, k0, stride_wn, stride_sn, offs_n, BLOCK_K, DT, ASM, KPERM, SHUFFLED
            )
            u_even, u_odd = fp4_tile(
                W, S, w_off + up_off, s_off + s_up, k0, stride_wn, stride_sn, offs_n, BLOCK_K, DT, ASM, KPERM, SHUFFLED
            )
            acc_g = _mma(acc_g, x_even, g_even, SWAP)
            acc_u = _mma(acc_u, x_even, u_even, SWAP)
            if SPLIT_ACC:
                acc_g2 = _mma(acc_g2, x_odd, g_odd, SWAP)
                acc_u2 = _mma(acc_u2, x_odd, u_odd, SWAP)
            else:
                acc_g = _mma(acc_g, x_odd, g_odd, SWAP)
                acc_u = _mma(acc_u, x_odd, u_odd, SWAP)
            if TWO:  # the same dequantised tiles, the second block's rows
                xb_even, xb_odd = _x_halves(xb_ptrs, xbh_ptrs, k0, valid_b, BLOCK_M, BLOCK_K, X_SPLIT)
                acc_gb = _mma(acc_gb, xb_even, g_even, SWAP)
                acc_ub = _mma(acc_ub, xb_even, u_even, SWAP)
                acc_gb = _mma(acc_gb, xb_odd, g_odd, SWAP)
                acc_ub = _mma(acc_ub, xb_odd, u_odd, SWAP)
            _wgmma_drain(DRAIN)
        else:
            x = tl.load(x_ptrs + k0, mask=valid[:, None], other=0.0)
            w_ptrs = W + w_off + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
            acc_g = _mma(acc_g, x, tl.load(w_ptrs), SWAP)
            acc_u = _mma(acc_u, x, tl.load(w_ptrs + up_off), SWAP)
    if SPLIT_ACC:
        acc_g += acc_g2
        acc_u += acc_u2
    return acc_g, acc_u, acc_gb, acc_ub


@triton.jit
def _w13_store(acc_g, acc_u, s2, Out, pairs, valid, offs_n, stride_om, SWAP: tl.constexpr, PRESPLIT_K: tl.constexpr,
               KPERM: tl.constexpr):  # fmt: skip
    """The gate/up kernel's epilogue: ``silu(g) * u`` of one row block's accumulators (times NVFP4's ``s2``) into its
    pairs' rows of Out, each PRESPLIT_K block of columns as [even | odd] (in the KPERM order when set)."""
    acc_g = acc_g * s2
    acc_u = acc_u * s2
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    if SWAP:
        h = tl.trans(h)
    cols = offs_n
    if PRESPLIT_K:
        # column c of a PRESPLIT_K-wide block goes to (c % 2) * PRESPLIT_K / 2 + c // 2 within the block: the w2
        # kernel then reads the even and the odd columns of its K block as two contiguous halves.
        r = offs_n % PRESPLIT_K
        if KPERM:  # and byte m = 16c + 4l + 2h + b of each half to 16c + 8h + 2l + b (``fp4_tile``'s KPERM)
            m = r // 2
            m = m - (m % 16) + ((m // 2) % 2) * 8 + ((m // 4) % 4) * 2 + m % 2
            cols = offs_n - r + (r % 2) * (PRESPLIT_K // 2) + m
        else:
            cols = offs_n - r + (r % 2) * (PRESPLIT_K // 2) + r // 2
    o_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, h.to(Out.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["n_pairs"])
def moe_w13_kernel(
    X,
    TopkIds,
    SortedPairs,
    BlockExpert,
    BlockRank,
    W,
    S,
    S2,
    Out,
    Partial,
    Count,
    n_pairs,
    N_HALF,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IDENTITY: tl.constexpr,
    FP4: tl.constexpr,
    ASM: tl.constexpr,
    N_FAST: tl.constexpr = False,
    SPLIT_ACC: tl.constexpr = False,
    PRESPLIT_K: tl.constexpr = 0,
    SWAP: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    X_SPLIT: tl.constexpr = False,
    KPERM: tl.constexpr = False,
    SHUFFLED: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    DRAIN: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    if N_FAST:
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # slice [pid_s * K, (pid_s + 1) * K) of the reduction
    # PAIR: the sorted routing, NVFP4, one K slice, one accumulator per projection (``moe_w13`` checks)
    run, expert, pairs, valid, second, pairs_b, valid_b = _program_blocks(
        TopkIds, SortedPairs, BlockExpert, BlockRank, pid_m, tl.num_programs(1 if N_FAST else 0), n_pairs, BLOCK_M,
        IDENTITY, PAIR,
    )  # fmt: skip
    if not run:
        return
    s2 = _expert_scale2(S2, expert, FP4, ASM)  # before the K loop: its load's latency overlaps the loop
    rows = pairs // TOPK
    rows_b = pairs_b // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_off = expert.to(tl.int64) * stride_we
    up_off = N_HALF.to(tl.int64) * stride_wn
    x_ptrs, xh_ptrs = _x_ptrs(X, rows, stride_xm, BLOCK_K)
    xb_ptrs, xbh_ptrs = _x_ptrs(X, rows_b, stride_xm, BLOCK_K)
    ACC: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    k_lo = tl.multiple_of(pid_s * K, BLOCK_K)  # K is a multiple of BLOCK_K
    # A program with a second block runs the loop that also feeds it: no branch inside the pipelined loop.
    if second:
        acc_g, acc_u, acc_gb, acc_ub = _w13_loop(
            W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, up_off, N_HALF, k_lo, K,
            stride_wn, stride_se, stride_sn, offs_n, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, FP4, ASM, X_SPLIT, SPLIT_ACC,
            SWAP, KPERM, SHUFFLED, True, DRAIN,
        )  # fmt: skip
    else:
        acc_g, acc_u, acc_gb, acc_ub = _w13_loop(
            W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, up_off, N_HALF, k_lo, K,
            stride_wn, stride_se, stride_sn, offs_n, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, FP4, ASM, X_SPLIT, SPLIT_ACC,
            SWAP, KPERM, SHUFFLED, False, DRAIN,
        )  # fmt: skip
    if SPLIT_K > 1:
        # Each slice stores its fp32 partials; the last of the tile's SPLIT_K programs to arrive adds them all in
        # slice order (the same sum whatever the arrival order) and goes on to the epilogue; the others stop.
        tile = pid_m * (N_HALF // BLOCK_N) + pid_n
        offs_acc = tl.arange(0, ACC[0])[:, None] * ACC[1] + tl.arange(0, ACC[1])[None, :]
        SIZE: tl.constexpr = ACC[0] * ACC[1]
        tile_part = Partial + tile.to(tl.int64) * (SPLIT_K * 2 * SIZE)
        tl.store(tile_part + pid_s * (2 * SIZE) + offs_acc, acc_g)
        tl.store(tile_part + pid_s * (2 * SIZE) + SIZE + offs_acc, acc_u)
        tl.debug_barrier()  # every thread's partials are stored before the arrival is counted (release below)
        if tl.atomic_add(Count + tile, 1, sem="acq_rel") < SPLIT_K - 1:
            return
        tl.store(Count + tile, 0)  # every slice has arrived: the counter is zero again for the next launch
        acc_g = tl.zeros(ACC, dtype=tl.float32)
        acc_u = tl.zeros(ACC, dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc_g += tl.load(tile_part + s * (2 * SIZE) + offs_acc, cache_modifier=".cg")
            acc_u += tl.load(tile_part + s * (2 * SIZE) + SIZE + offs_acc, cache_modifier=".cg")
    _w13_store(acc_g, acc_u, s2, Out, pairs, valid, offs_n, stride_om, SWAP, PRESPLIT_K, KPERM)
    if PAIR:
        if second:
            _w13_store(acc_gb, acc_ub, s2, Out, pairs_b, valid_b, offs_n, stride_om, SWAP, PRESPLIT_K, KPERM)


@triton.jit
def _w2_loop(W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, K, stride_wn, stride_se,
             stride_sn, offs_n, offs_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             FP4: tl.constexpr, ASM: tl.constexpr, PRESPLIT: tl.constexpr, SWAP: tl.constexpr, KPERM: tl.constexpr,
             SHUFFLED: tl.constexpr, TWO: tl.constexpr, DRAIN: tl.constexpr):  # fmt: skip
    """The down kernel's reduction over K: the row block's accumulator, then the second block's (TWO: its rows
    through the same dequantised tiles; else zeros). DRAIN: ``_wgmma_drain`` after each K step."""
    DT: tl.constexpr = x_ptrs.dtype.element_ty
    ACC: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    acc = tl.zeros(ACC, dtype=tl.float32)
    acc_b = tl.zeros(ACC, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if FP4:
            s_off = expert.to(tl.int64) * stride_se
            # PRESPLIT: the w13 kernel stored this K block as [even columns | odd columns]
            x_even, x_odd = _x_halves(x_ptrs, xh_ptrs, k0, valid, BLOCK_M, BLOCK_K, PRESPLIT)
            w_even, w_odd = fp4_tile(
                W, S, w_off, s_off, k0, stride_wn, stride_sn, offs_n, BLOCK_K, DT, ASM, KPERM, SHUFFLED
            )
            acc = _mma(acc, x_even, w_even, SWAP)
            acc = _mma(acc, x_odd, w_odd, SWAP)
            if TWO:  # the same dequantised tile, the second block's rows
                xb_even, xb_odd = _x_halves(xb_ptrs, xbh_ptrs, k0, valid_b, BLOCK_M, BLOCK_K, PRESPLIT)
                acc_b = _mma(acc_b, xb_even, w_even, SWAP)
                acc_b = _mma(acc_b, xb_odd, w_odd, SWAP)
            _wgmma_drain(DRAIN)
        else:
            x = tl.load(x_ptrs + k0, mask=valid[:, None], other=0.0)
            w_ptrs = W + w_off + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
            acc = _mma(acc, x, tl.load(w_ptrs), SWAP)
    return acc, acc_b


@triton.jit
def _w2_store(acc, TopkWeights, s2, Out, pairs, valid, offs_n, stride_om, SWAP: tl.constexpr, FP4: tl.constexpr):
    """The down kernel's epilogue: one row block's accumulator times each pair's routing weight (and NVFP4's
    ``s2``) into its pairs' fp32 rows of Out."""
    if SWAP:
        acc = tl.trans(acc)
    scale = tl.load(TopkWeights + pairs, mask=valid, other=0.0).to(tl.float32)
    if FP4:
        scale = scale * s2
    acc = acc * scale[:, None]
    o_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=valid[:, None])


@triton.jit(do_not_specialize=["n_pairs"])
def moe_w2_kernel(
    X,
    TopkIds,
    TopkWeights,
    SortedPairs,
    BlockExpert,
    BlockRank,
    W,
    S,
    S2,
    Out,
    n_pairs,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IDENTITY: tl.constexpr,
    FP4: tl.constexpr,
    ASM: tl.constexpr,
    N_FAST: tl.constexpr = False,
    PRESPLIT: tl.constexpr = False,
    SWAP: tl.constexpr = False,
    KPERM: tl.constexpr = False,
    SHUFFLED: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    DRAIN: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    if N_FAST:
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    # PAIR: the sorted routing, NVFP4 (``moe_w2`` checks)
    run, expert, pairs, valid, second, pairs_b, valid_b = _program_blocks(
        TopkIds, SortedPairs, BlockExpert, BlockRank, pid_m, tl.num_programs(1 if N_FAST else 0), n_pairs, BLOCK_M,
        IDENTITY, PAIR,
    )  # fmt: skip
    if not run:
        return
    s2 = _expert_scale2(S2, expert, FP4, ASM)  # before the K loop: its load's latency overlaps the loop
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_off = expert.to(tl.int64) * stride_we
    x_ptrs, xh_ptrs = _x_ptrs(X, pairs, stride_xm, BLOCK_K)
    xb_ptrs, xbh_ptrs = _x_ptrs(X, pairs_b, stride_xm, BLOCK_K)
    # A program with a second block runs the loop that also feeds it: no branch inside the pipelined loop.
    if second:
        acc, acc_b = _w2_loop(
            W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, K, stride_wn, stride_se,
            stride_sn, offs_n, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, FP4, ASM, PRESPLIT, SWAP, KPERM, SHUFFLED, True,
            DRAIN,
        )  # fmt: skip
    else:
        acc, acc_b = _w2_loop(
            W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, K, stride_wn, stride_se,
            stride_sn, offs_n, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, FP4, ASM, PRESPLIT, SWAP, KPERM, SHUFFLED, False,
            DRAIN,
        )  # fmt: skip
    _w2_store(acc, TopkWeights, s2, Out, pairs, valid, offs_n, stride_om, SWAP, FP4)
    if PAIR:
        if second:
            _w2_store(acc_b, TopkWeights, s2, Out, pairs_b, valid_b, offs_n, stride_om, SWAP, FP4)


@triton.jit
def moe_sum_kernel(
    Part,
    TopkIds,
    Out,
    Plus,
    N,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_PLUS: tl.constexpr,
    PDL: tl.constexpr,
):
    """``Out[t, :] = sum_i Part[t * TOPK + i, :]`` over the slots whose id is not masked (< 0: no expert wrote
    their rows), an fp32 sum with one rounding to Out's dtype; with HAS_PLUS, ``+ Plus[t, :]`` after that rounding
    (torch's add of two tensors of Out's dtype: an fp32 sum, rounded)."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(TOPK):
        routed = (offs * 0 + tl.load(TopkIds + t * TOPK + i)) >= 0
        acc += tl.load(Part + (t * TOPK + i).to(tl.int64) * N + offs, mask=mask & routed, other=0.0)
    out = acc.to(Out.dtype.element_ty)
    if HAS_PLUS:
        plus = tl.load(Plus + t.to(tl.int64) * N + offs, mask=mask, other=0.0)
        out = (out.to(tl.float32) + plus.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + t.to(tl.int64) * N + offs, out, mask=mask)


@triton.jit
def kperm_x_kernel(
    X,
    Out,
    n_rows,
    stride_xm,
    stride_om,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """``Out[t, k0 + nib * BLOCK_K / 2 + 16c + 8h + 2l + b] = X[t, k0 + 32c + 8l + 4h + 2b + nib]`` for each BLOCK_K
    block of columns from k0 (``moe_w13``'s kperm order of x: the even and the odd columns as two halves, each in
    ``fp4_tile``'s KPERM order); program (BLOCK_T rows, one K block)."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < n_rows)[:, None]
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=ok)
    C: tl.constexpr = BLOCK_K // 32
    # [T, c, l, h, b, nib] -> [T, nib, c, h, l, b]
    x = tl.permute(tl.reshape(x, [BLOCK_T, C, 4, 2, 2, 2]), [0, 5, 1, 3, 2, 4])
    tl.store(Out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], tl.reshape(x, [BLOCK_T, BLOCK_K]), mask=ok)
