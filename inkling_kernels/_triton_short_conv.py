"""Triton code for the decode step of the short convs. Public entries: inkling_kernels/short_conv.py.

``conv_tile`` is a ``[rows, channels]`` tile of one new token per sequence: it reads each of the ``K-1`` state rows
of its sequences as its own tile (state rows are contiguous channel vectors, in the layout of x's tile, so no
value moves between threads), forms ``y = x + sum_j window[j] * w[:, j]`` in fp32 with the terms added in order
j = 0..K-1 (as ``ShortConv.step`` does; launches pass ``enable_fp_fusion=False`` so no product is fused into an
add), then shifts the states in place: old rows 1..K-2 move down one, x becomes the newest row. Each tap's
weights are read once per program for all its rows (``load_rows``). A barrier between the reads and the writes
keeps a thread from overwriting a row that another thread of the program still reads.

``conv_decode_kernel``: program (row group, channel block), or program (row group) looping over the channel blocks
twice when the rows are normalised too. ``kv_prologue_kernel``: program (row group, kv head) convolves the head's k
and v channels, k-norms the head and writes both into the KV pool; with HAS_Q it also q-norms the head's group of
query heads of each of its rows.
"""

import torch
import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait
from inkling_kernels._triton_rms_norm import rms_apply

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def load_rows(ptrs, mask, ONCE: tl.constexpr):
    """The values at ``ptrs`` ``[rows, channels]`` (the same pointers down the rows) in the tile's layout. ONCE: for
    tiles whose rows lie in each thread's registers, a load of the first row only: the other rows read -0.0 and
    the sum over the rows is exactly the first row (``v + -0.0`` is v, bit for bit), which the compiler folds into
    that row's registers. Else a load per row (where rows lie in different threads, which read the same lines)."""
    if ONCE:
        first = (tl.arange(0, ptrs.shape[0]) == 0)[:, None]
        values = tl.broadcast_to(tl.sum(tl.load(ptrs, mask=first & mask, other=-0.0), axis=0)[None, :], ptrs.shape)
    else:
        values = tl.load(ptrs, mask=mask, other=0.0)
    return values


@triton.jit
def conv_tile(
    X,
    S,
    W,
    x_rows,
    s_rows,
    cols,
    row_mask,
    col_mask,
    stride_sk,
    stride_wc,
    stride_wk,
    KERNEL_SIZE: tl.constexpr,
    WEIGHTS_ONCE: tl.constexpr,
):
    """Channels ``cols`` of the rows at offsets ``x_rows`` of X, their states ``[K-1, C]`` at offsets ``s_rows`` of
    S -> y ``[rows, channels]`` in x's dtype; each tap's weights read as ``load_rows(..., WEIGHTS_ONCE)``."""
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    s_ptrs = S + s_rows[:, None] + cols[None, :]
    w_ptrs = tl.broadcast_to(W + (cols * stride_wc)[None, :], x.shape)  # [rows, channels], equal down the rows
    window = ()  # the K-1 state rows in x's dtype, oldest first
    conv = tl.zeros(x.shape, dtype=tl.float32)
    for j in tl.static_range(KERNEL_SIZE - 1):
        s = tl.load(s_ptrs + j * stride_sk, mask=mask, other=0.0).to(x.dtype)
        conv += s.to(tl.float32) * load_rows(w_ptrs + j * stride_wk, col_mask[None, :], WEIGHTS_ONCE).to(tl.float32)
        window = window + (s,)
    xf = x.to(tl.float32)
    conv += xf * load_rows(w_ptrs + (KERNEL_SIZE - 1) * stride_wk, col_mask[None, :], WEIGHTS_ONCE).to(tl.float32)
    y = (xf + conv).to(x.dtype)
    tl.debug_barrier()
    state_ty = S.dtype.element_ty
    for j in tl.static_range(1, KERNEL_SIZE - 1):
        tl.store(s_ptrs + (j - 1) * stride_sk, window[j].to(state_ty), mask=mask)
    tl.store(s_ptrs + (KERNEL_SIZE - 2) * stride_sk, x.to(state_ty), mask=mask)
    return y


@triton.jit
def _conv_out(
    X,
    States,
    W,
    Res,
    Out,
    x_rows,
    s_rows,
    rows,
    cols,
    row_mask,
    col_mask,
    stride_sk,
    stride_wc,
    stride_wk,
    stride_rm,
    stride_om,
    KERNEL_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """``conv_tile`` plus the residual add (rounded to x's dtype); stores and returns the output in fp32."""
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_RESIDUAL:  # loaded first: conv_tile's barrier would hold the load back until the states are read
        r = tl.load(Res + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
    out = conv_tile(
        X, States, W, x_rows, s_rows, cols, row_mask, col_mask, stride_sk, stride_wc, stride_wk, KERNEL_SIZE, True
    )
    if HAS_RESIDUAL:
        out = (r.to(tl.float32) + out.to(tl.float32)).to(out.dtype)
    tl.store(Out + rows[:, None] * stride_om + cols[None, :], out, mask=mask)
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
    n_rows,
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
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)
    x_rows = rows * stride_xm
    s_rows = tl.load(Slots + rows, mask=row_mask, other=0) * stride_ss
    offs = tl.arange(0, BLOCK_C)
    if not HAS_NORM:
        cols = tl.program_id(1) * BLOCK_C + offs
        _conv_out(
            X, States, W, Res, Out, x_rows, s_rows, rows, cols, row_mask, cols < n_cols, stride_sk, stride_wc,
            stride_wk, stride_rm, stride_om, KERNEL_SIZE, HAS_RESIDUAL,
        )  # fmt: skip
    elif NUM_BLOCKS == 1:
        col_mask = offs < n_cols
        out = _conv_out(
            X, States, W, Res, Out, x_rows, s_rows, rows, offs, row_mask, col_mask, stride_sk, stride_wc, stride_wk,
            stride_rm, stride_om, KERNEL_SIZE, HAS_RESIDUAL,
        )  # fmt: skip
        rstd = tl.rsqrt(tl.sum(out * out, axis=1) / n_cols + eps)
        nw = tl.load(NormW + offs, mask=col_mask, other=0.0)
        normed = rms_apply(out, rstd[:, None], nw[None, :], X.dtype.element_ty)
        mask = row_mask[:, None] & col_mask[None, :]
        tl.store(Normed + rows[:, None] * stride_nm + offs[None, :], normed.to(Normed.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros((BLOCK_B,), dtype=tl.float32)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_C + offs
            out = _conv_out(
                X, States, W, Res, Out, x_rows, s_rows, rows, cols, row_mask, cols < n_cols, stride_sk, stride_wc,
                stride_wk, stride_rm, stride_om, KERNEL_SIZE, HAS_RESIDUAL,
            )  # fmt: skip
            sum_sq += tl.sum(out * out, axis=1)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        tl.debug_barrier()  # the rows of Out written above are read back by other threads below
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK_C + offs
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            out = tl.load(Out + rows[:, None] * stride_om + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            nw = tl.load(NormW + cols, mask=col_mask, other=0.0)
            normed = rms_apply(out, rstd[:, None], nw[None, :], X.dtype.element_ty)
            tl.store(Normed + rows[:, None] * stride_nm + cols[None, :], normed.to(Normed.dtype.element_ty), mask=mask)


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
    n_rows,
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
    HEAD_DIM: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_Q: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)
    head = tl.program_id(1)
    slots = tl.load(Slots + rows, mask=row_mask, other=0)
    pool_rows = tl.load(KvRows + rows, mask=row_mask, other=0)
    offs = tl.arange(0, HEAD_DIM)
    cols = head * HEAD_DIM + offs
    col_mask = offs < HEAD_DIM
    mask = row_mask[:, None] & col_mask[None, :]

    k = conv_tile(
        K0, KStates, KW, rows * stride_km, slots * stride_kss, cols, row_mask, col_mask, stride_ksk, stride_kwc,
        stride_kwk, KERNEL_SIZE, False,
    ).to(tl.float32)  # fmt: skip
    rstd = tl.rsqrt(tl.sum(k * k, axis=1) / HEAD_DIM + eps)
    k = rms_apply(k, rstd[:, None], tl.load(KNormW + offs)[None, :], K0.dtype.element_ty).to(NORM_DTYPE)
    k_ptrs = KPool + pool_rows[:, None] * stride_kpr + head * stride_kph + offs[None, :]
    tl.store(k_ptrs, k.to(KPool.dtype.element_ty), mask=mask)

    v = conv_tile(
        V0, VStates, VW, rows * stride_vm, slots * stride_vss, cols, row_mask, col_mask, stride_vsk, stride_vwc,
        stride_vwk, KERNEL_SIZE, False,
    )  # fmt: skip
    v_ptrs = VPool + pool_rows[:, None] * stride_vpr + head * stride_vph + offs[None, :]
    tl.store(v_ptrs, v.to(VPool.dtype.element_ty), mask=mask)

    if HAS_Q:  # query heads head * GROUP .. (head + 1) * GROUP of each row: tile row i is (row i // GROUP_ROWS, g)
        i = tl.arange(0, BLOCK_B * GROUP_ROWS)
        q_rows = tl.program_id(0) * BLOCK_B + i // GROUP_ROWS
        g = i % GROUP_ROWS
        q_rows, q_heads = q_rows.to(tl.int64), head * GROUP + g
        q_mask = ((q_rows < n_rows) & (g < GROUP))[:, None] & col_mask[None, :]
        qx = tl.load(Q + (q_rows * stride_qm + q_heads * stride_qh)[:, None] + offs[None, :], mask=q_mask, other=0.0)
        qf = qx.to(tl.float32)
        q_rstd = tl.rsqrt(tl.sum(qf * qf, axis=1) / HEAD_DIM + q_eps)
        qn = rms_apply(qf, q_rstd[:, None], tl.load(QNormW + offs)[None, :], Q.dtype.element_ty)
        q_ptrs = QOut + (q_rows * stride_qom + q_heads * stride_qoh)[:, None] + offs[None, :]
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
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
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
