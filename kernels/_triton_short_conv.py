"""Triton code for the decode step of the short convs. Public entries: kernels/short_conv.py.

``conv_block`` is one channel block of one sequence: it reads the sequence's ``K-1`` state rows as one
``[STATE_ROWS, BLOCK_C]`` tile, forms ``y = x + sum_j window[j] * w[:, j]`` in fp32 with the terms added in order
j = 0..K-1 (as ``ShortConv.step`` does; launches pass ``enable_fp_fusion=False`` so no product is fused into an
add), then shifts the state in place: old rows 1..K-2 move down one, x becomes the newest row. A barrier between
the read and the writes keeps a thread from overwriting a row that another thread of the program still reads.

``conv_decode_kernel``: program (b, channel block), or program b looping over the channel blocks twice when the
row is normalised too. ``kv_prologue_kernel``: program (b, kv head) convolves the head's k and v channels,
k-norms the head and writes both into the KV pool; with HAS_Q it also q-norms the head's group of query heads.
"""

import torch
import triton
import triton.language as tl

from kernels._triton_rms_norm import rms_apply

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def conv_block(
    X,
    S,
    W,
    cols,
    mask,
    stride_sk,
    stride_wc,
    stride_wk,
    KERNEL_SIZE: tl.constexpr,
    STATE_ROWS: tl.constexpr,
):
    """Channels ``cols`` of one sequence: X its input row, S its state ``[K-1, C]`` -> y in x's dtype."""
    x = tl.load(X + cols, mask=mask, other=0.0)
    rows = tl.arange(0, STATE_ROWS)
    s_mask = (rows < KERNEL_SIZE - 1)[:, None] & mask[None, :]
    s_ptrs = S + rows[:, None] * stride_sk + cols[None, :]
    window = tl.load(s_ptrs, mask=s_mask, other=0.0).to(x.dtype).to(tl.float32)  # [STATE_ROWS, BLOCK_C]
    w = tl.load(W + cols[None, :] * stride_wc + rows[:, None] * stride_wk, mask=s_mask, other=0.0).to(tl.float32)
    terms = window * w
    conv = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(KERNEL_SIZE - 1):
        conv += tl.sum(tl.where(rows[:, None] == j, terms, 0.0), axis=0)  # exactly term j
    xf = x.to(tl.float32)
    w_last = tl.load(W + cols * stride_wc + (KERNEL_SIZE - 1) * stride_wk, mask=mask, other=0.0).to(tl.float32)
    conv += xf * w_last
    y = (xf + conv).to(x.dtype)
    tl.debug_barrier()
    state_ty = S.dtype.element_ty
    tl.store(s_ptrs - stride_sk, window.to(state_ty), mask=s_mask & (rows >= 1)[:, None])
    tl.store(S + (KERNEL_SIZE - 2) * stride_sk + cols, x.to(state_ty), mask=mask)
    return y


@triton.jit
def _conv_out(
    X,
    S,
    W,
    Res,
    Out,
    cols,
    mask,
    stride_sk,
    stride_wc,
    stride_wk,
    KERNEL_SIZE: tl.constexpr,
    STATE_ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """``conv_block`` plus the residual add (rounded to x's dtype); stores and returns the output in fp32."""
    out = conv_block(X, S, W, cols, mask, stride_sk, stride_wc, stride_wk, KERNEL_SIZE, STATE_ROWS)
    if HAS_RESIDUAL:
        r = tl.load(Res + cols, mask=mask, other=0.0)
        out = (r.to(tl.float32) + out.to(tl.float32)).to(out.dtype)
    tl.store(Out + cols, out, mask=mask)
    return out.to(tl.float32)


@triton.jit
def conv_decode_kernel(
    X,
    States,
    Slots,
    W,
    Res,
    Out,
    NormW,
    Normed,
    n_cols,
    eps,
    stride_xm,
    stride_ss,
    stride_sk,
    stride_wc,
    stride_wk,
    stride_rm,
    stride_om,
    stride_nm,
    KERNEL_SIZE: tl.constexpr,
    STATE_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    X += b * stride_xm
    States += tl.load(Slots + b).to(tl.int64) * stride_ss
    Res += b * stride_rm
    Out += b * stride_om
    offs = tl.arange(0, BLOCK_C)
    if not HAS_NORM:
        cols = tl.program_id(1) * BLOCK_C + offs
        _conv_out(
            X, States, W, Res, Out, cols, cols < n_cols, stride_sk, stride_wc, stride_wk,
            KERNEL_SIZE, STATE_ROWS, HAS_RESIDUAL,
        )  # fmt: skip
    elif NUM_BLOCKS == 1:
        mask = offs < n_cols
        out = _conv_out(
            X, States, W, Res, Out, offs, mask, stride_sk, stride_wc, stride_wk, KERNEL_SIZE, STATE_ROWS, HAS_RESIDUAL
        )
        rstd = tl.rsqrt(tl.sum(out * out, axis=0) / n_cols + eps)
        normed = rms_apply(out, rstd, tl.load(NormW + offs, mask=mask, other=0.0), X.dtype.element_ty)
        tl.store(Normed + b * stride_nm + offs, normed.to(Normed.dtype.element_ty), mask=mask)
    else:
        sum_sq = 0.0
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_C + offs
            out = _conv_out(
                X, States, W, Res, Out, cols, cols < n_cols, stride_sk, stride_wc, stride_wk,
                KERNEL_SIZE, STATE_ROWS, HAS_RESIDUAL,
            )  # fmt: skip
            sum_sq += tl.sum(out * out, axis=0)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        tl.debug_barrier()  # the row of Out written above is read back by other threads below
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_C + offs
            mask = cols < n_cols
            out = tl.load(Out + cols, mask=mask, other=0.0).to(tl.float32)
            normed = rms_apply(out, rstd, tl.load(NormW + cols, mask=mask, other=0.0), X.dtype.element_ty)
            tl.store(Normed + b * stride_nm + cols, normed.to(Normed.dtype.element_ty), mask=mask)


@triton.jit
def kv_prologue_kernel(
    K0,
    V0,
    KStates,
    VStates,
    Slots,
    KW,
    VW,
    KNormW,
    KPool,
    VPool,
    KvRows,
    Q,
    QNormW,
    QOut,
    eps,
    q_eps,
    stride_km,
    stride_vm,
    stride_kss,
    stride_ksk,
    stride_vss,
    stride_vsk,
    stride_kwc,
    stride_kwk,
    stride_vwc,
    stride_vwk,
    stride_kpr,
    stride_kph,
    stride_vpr,
    stride_vph,
    stride_qm,
    stride_qh,
    stride_qom,
    stride_qoh,
    KERNEL_SIZE: tl.constexpr,
    STATE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    HAS_Q: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(Slots + b).to(tl.int64)
    row = tl.load(KvRows + b).to(tl.int64)
    offs = tl.arange(0, HEAD_DIM)
    cols = head * HEAD_DIM + offs
    mask = offs < HEAD_DIM

    k = conv_block(
        K0 + b * stride_km, KStates + slot * stride_kss, KW, cols, mask, stride_ksk, stride_kwc, stride_kwk,
        KERNEL_SIZE, STATE_ROWS,
    ).to(tl.float32)  # fmt: skip
    rstd = tl.rsqrt(tl.sum(k * k, axis=0) / HEAD_DIM + eps)
    k = rms_apply(k, rstd, tl.load(KNormW + offs), K0.dtype.element_ty).to(NORM_DTYPE)
    tl.store(KPool + row * stride_kpr + head * stride_kph + offs, k.to(KPool.dtype.element_ty))

    v = conv_block(
        V0 + b * stride_vm, VStates + slot * stride_vss, VW, cols, mask, stride_vsk, stride_vwc, stride_vwk,
        KERNEL_SIZE, STATE_ROWS,
    )  # fmt: skip
    tl.store(VPool + row * stride_vpr + head * stride_vph + offs, v.to(VPool.dtype.element_ty))

    if HAS_Q:  # query heads head * GROUP .. (head + 1) * GROUP, one row each
        g = tl.arange(0, GROUP_ROWS)
        q_heads = head * GROUP + g
        q_mask = (g < GROUP)[:, None] & mask[None, :]
        qx = tl.load(Q + b * stride_qm + q_heads[:, None] * stride_qh + offs[None, :], mask=q_mask, other=0.0)
        qf = qx.to(tl.float32)
        q_rstd = tl.rsqrt(tl.sum(qf * qf, axis=1) / HEAD_DIM + q_eps)
        qn = rms_apply(qf, q_rstd[:, None], tl.load(QNormW + offs)[None, :], Q.dtype.element_ty)
        q_ptrs = QOut + b * stride_qom + q_heads[:, None] * stride_qoh + offs[None, :]
        tl.store(q_ptrs, qn.to(QOut.dtype.element_ty), mask=q_mask)


@triton.jit
def conv_prefill_kernel(
    X,
    States,
    NewStates,
    SeqIds,
    CuSeqlens,
    W,
    Res,
    NormW,
    Out,
    n_rows,
    n_cols,
    eps,
    stride_xm,
    stride_sb,
    stride_sk,
    stride_nb,
    stride_nk,
    stride_wc,
    stride_wk,
    stride_rm,
    stride_om,
    KERNEL_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    # Program (row block, channel block) of the packed rows: row t of sequence b = SeqIds[t] sits at offset
    # pos = t - cu[b] of its n_b new rows; tap j reads input pos - (K-1) + j, a row of X or, before the chunk,
    # row K-1 + (pos - (K-1) + j) of the sequence's old state. New states go to their own tensor (other programs
    # still read the old ones): the last K-1 rows of a sequence's window, from X where it has them, else from the
    # old state (copied by the program holding the sequence's first row).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = t < n_rows
    c_mask = cols < n_cols
    mask = t_mask[:, None] & c_mask[None, :]
    seq = tl.load(SeqIds + t, mask=t_mask, other=0).to(tl.int64)
    begin = tl.load(CuSeqlens + seq, mask=t_mask, other=0)
    n = tl.load(CuSeqlens + seq + 1, mask=t_mask, other=0) - begin
    pos = t - begin
    t64 = t.to(tl.int64)
    x = tl.load(X + t64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    S_b = States + seq[:, None] * stride_sb + cols[None, :]
    conv = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KERNEL_SIZE):
        w_j = tl.load(W + cols * stride_wc + j * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
        if j == KERNEL_SIZE - 1:
            tap = xf
        else:
            o = pos - (KERNEL_SIZE - 1) + j  # this tap's input offset in the sequence
            in_x = (o >= 0)[:, None]
            from_x = tl.load(X + (t64 - (KERNEL_SIZE - 1) + j)[:, None] * stride_xm + cols[None, :],
                             mask=mask & in_x, other=0.0)  # fmt: skip
            from_s = tl.load(S_b + (KERNEL_SIZE - 1 + o)[:, None] * stride_sk, mask=mask & ~in_x, other=0.0)
            tap = tl.where(in_x, from_x, from_s.to(x.dtype)).to(tl.float32)
        conv += tap * w_j  # terms added in order j = 0..K-1 (no fused multiply-add), as ShortConv.step
    y = (xf + conv).to(x.dtype)
    if HAS_RESIDUAL:
        r = tl.load(Res + t64[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
    if HAS_NORM:  # per row over this block's channels (one head)
        yf = y.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(yf * yf, axis=1) / BLOCK_C + eps)
        nw = tl.load(NormW + tl.arange(0, BLOCK_C))
        out = rms_apply(yf, rstd[:, None], nw[None, :], x.dtype)
    else:
        out = y
    tl.store(Out + t64[:, None] * stride_om + cols[None, :], out.to(Out.dtype.element_ty), mask=mask)

    # New state row i = window row n + i: input n + i - (K-1), from X at offsets >= 0.
    state_ty = NewStates.dtype.element_ty
    N_b = NewStates + seq[:, None] * stride_nb + cols[None, :]
    i_x = pos - (n - (KERNEL_SIZE - 1))
    tl.store(N_b + i_x[:, None] * stride_nk, x.to(state_ty), mask=mask & (i_x >= 0)[:, None])
    first = mask & (pos == 0)[:, None]
    for i in tl.static_range(KERNEL_SIZE - 1):
        keep = first & (n + i < KERNEL_SIZE - 1)[:, None]  # a chunk shorter than K-1 keeps old rows
        old = tl.load(S_b + (n + i)[:, None] * stride_sk, mask=keep, other=0.0)
        tl.store(N_b + i * stride_nk, old.to(x.dtype).to(state_ty), mask=keep)
