"""Triton code for the verify step of the short convs (W new rows per sequence). Public entries:
inkling_kernels/conv_verify.py.

``conv_row`` is one channel block of row j of one sequence: tap i of its window is state row ``j + i`` while that
is below ``K-1``, else new row ``j + i - (K-1)``, so ``y_j = x_j + sum_i window[j + i] * w[:, i]`` in fp32 with the
terms added in order i = 0..K-1 (as ``ShortConv.step``; launches pass ``enable_fp_fusion=False``). The state is
only read; the program of row j writes window row ``K-1+j`` (its input), the program of row 0 also rows 0..K-2
(the state), so the window ``state ++ W inputs`` is complete when the launch ends. ``conv_commit_kernel`` copies
rows ``n .. n+K-2`` of a sequence's window into its slot, for every conv of a ``ConvCommit`` in one launch.
"""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait
from inkling_kernels._triton_rms_norm import rms_apply


@triton.jit
def conv_row(
    X,
    S,
    Win,
    W,
    j,
    cols,
    mask,
    stride_xm,
    stride_sk,
    stride_nk,
    stride_wc,
    stride_wk,
    KERNEL_SIZE: tl.constexpr,
):
    """Channels ``cols`` of row j: X the sequence's first new row, S its state ``[K-1, C]``, Win its window
    ``[K-1+W, C]`` (rows written as described above) -> y in x's dtype."""
    x = tl.load(X + j * stride_xm + cols, mask=mask, other=0.0)
    conv = tl.zeros(cols.shape, dtype=tl.float32)
    for i in tl.static_range(KERNEL_SIZE - 1):
        r = j + i  # window row of tap i
        in_state = tl.full(cols.shape, r, tl.int64) < KERNEL_SIZE - 1  # as a block (a scalar mask is refused)
        s = tl.load(S + r * stride_sk + cols, mask=mask & in_state, other=0.0).to(x.dtype)
        new = tl.load(X + (r - (KERNEL_SIZE - 1)) * stride_xm + cols, mask=mask & ~in_state, other=0.0)
        tap = tl.where(in_state, s, new).to(tl.float32)
        conv += tap * tl.load(W + cols * stride_wc + i * stride_wk, mask=mask, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    conv += xf * tl.load(W + cols * stride_wc + (KERNEL_SIZE - 1) * stride_wk, mask=mask, other=0.0).to(tl.float32)
    state_ty = Win.dtype.element_ty
    tl.store(Win + (KERNEL_SIZE - 1 + j) * stride_nk + cols, x.to(state_ty), mask=mask)
    if j == 0:
        for i in tl.static_range(KERNEL_SIZE - 1):
            tl.store(Win + i * stride_nk + cols, tl.load(S + i * stride_sk + cols, mask=mask, other=0.0), mask=mask)
    return (xf + conv).to(x.dtype)


@triton.jit
def conv_verify_kernel(
    X,
    States,
    Slots,
    Windows,
    W,
    Res,
    Out,
    n_cols,
    stride_xm,
    stride_ss,
    stride_sk,
    stride_nb,
    stride_nk,
    stride_wc,
    stride_wk,
    stride_rm,
    stride_om,
    WIDTH: tl.constexpr,
    KERNEL_SIZE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # b * WIDTH + j
    b = row // WIDTH
    j = row % WIDTH
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < n_cols
    states = States + tl.load(Slots + b).to(tl.int64) * stride_ss
    y = conv_row(
        X + b * WIDTH * stride_xm, states, Windows + b * stride_nb, W, j, cols, mask, stride_xm, stride_sk,
        stride_nk, stride_wc, stride_wk, KERNEL_SIZE,
    )  # fmt: skip
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_rm + cols, mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(y.dtype)
    tl.store(Out + row * stride_om + cols, y, mask=mask)


@triton.jit
def kv_prologue_verify_kernel(
    K0,
    V0,
    KStates,
    VStates,
    Slots,
    KWin,
    VWin,
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
    stride_knb,
    stride_knk,
    stride_vnb,
    stride_vnk,
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
    WIDTH: tl.constexpr,
    KERNEL_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # b * WIDTH + j
    head = tl.program_id(1)
    b = row // WIDTH
    j = row % WIDTH
    slot = tl.load(Slots + b).to(tl.int64)
    kv_row = tl.load(KvRows + row).to(tl.int64)
    offs = tl.arange(0, HEAD_DIM)
    cols = head * HEAD_DIM + offs
    mask = offs < HEAD_DIM

    k = conv_row(
        K0 + b * WIDTH * stride_km, KStates + slot * stride_kss, KWin + b * stride_knb, KW, j, cols, mask,
        stride_km, stride_ksk, stride_knk, stride_kwc, stride_kwk, KERNEL_SIZE,
    ).to(tl.float32)  # fmt: skip
    rstd = tl.rsqrt(tl.sum(k * k, axis=0) / HEAD_DIM + eps)
    k = rms_apply(k, rstd, tl.load(KNormW + offs), K0.dtype.element_ty).to(NORM_DTYPE)
    tl.store(KPool + kv_row * stride_kpr + head * stride_kph + offs, k.to(KPool.dtype.element_ty))

    v = conv_row(
        V0 + b * WIDTH * stride_vm, VStates + slot * stride_vss, VWin + b * stride_vnb, VW, j, cols, mask,
        stride_vm, stride_vsk, stride_vnk, stride_vwc, stride_vwk, KERNEL_SIZE,
    )  # fmt: skip
    tl.store(VPool + kv_row * stride_vpr + head * stride_vph + offs, v.to(VPool.dtype.element_ty))

    g = tl.arange(0, GROUP_ROWS)  # query heads head * GROUP .. (head + 1) * GROUP of this row
    q_heads = head * GROUP + g
    q_mask = (g < GROUP)[:, None] & mask[None, :]
    qf = tl.load(Q + row * stride_qm + q_heads[:, None] * stride_qh + offs[None, :], mask=q_mask, other=0.0)
    qf = qf.to(tl.float32)
    q_rstd = tl.rsqrt(tl.sum(qf * qf, axis=1) / HEAD_DIM + q_eps)
    qn = rms_apply(qf, q_rstd[:, None], tl.load(QNormW + offs)[None, :], Q.dtype.element_ty)
    q_ptrs = QOut + row * stride_qom + q_heads[:, None] * stride_qoh + offs[None, :]
    tl.store(q_ptrs, qn.to(QOut.dtype.element_ty), mask=q_mask)


@triton.jit
def conv_commit_kernel(
    Base,
    Table,
    Slots,
    Accepted,
    KERNEL_SIZE: tl.constexpr,
    STATE_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    META_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence b, conv g, channel block): conv g's state at ``Slots[b]`` from its window rows
    ``Accepted[b] ..`` (``ConvCommit``: row g of Table holds its channels, and its window's and its state's element
    offset from Base and their strides)."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    meta = Table + tl.program_id(1) * META_COLS
    n_cols = tl.load(meta)
    c0 = tl.program_id(2) * BLOCK_C
    if c0 >= n_cols:  # a narrower conv than the widest
        return
    cols = c0 + tl.arange(0, BLOCK_C)
    rows = tl.arange(0, STATE_ROWS)
    mask = (rows < KERNEL_SIZE - 1)[:, None] & (cols < n_cols)[None, :]
    first = tl.load(Accepted + b).to(tl.int64)  # rows committed: the state is window rows first .. first+K-2
    window = Base + tl.load(meta + 1) + b * tl.load(meta + 2)
    state = Base + tl.load(meta + 4) + tl.load(Slots + b).to(tl.int64) * tl.load(meta + 5)
    src = window + (first + rows)[:, None] * tl.load(meta + 3) + cols[None, :]
    dst = state + rows[:, None] * tl.load(meta + 6) + cols[None, :]
    tl.store(dst, tl.load(src, mask=mask, other=0.0), mask=mask)
