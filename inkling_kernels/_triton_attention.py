"""Triton code for Inkling attention: decode (one new query per sequence) and prefill (a chunk of queries of one
sequence). Public entries: inkling_kernels/attention.py (decode), inkling_kernels/prefill_attention.py.

Split-KV ("flash-decoding"): program (b, kv head, split) walks its chunk of visible keys for the GROUP query
heads that share the KV head (padded to BLOCK_H rows so the products run on the tensor cores), keeps an
online softmax in fp32, and writes an unnormalised partial (acc, max, sum); ``attn_combine_kernel`` merges
the splits. With one split (SPLIT off) the program writes the normalised output itself and no combine runs.
With ROWS > 1 (an MTP verify) the program's tile holds the GROUP heads of each of the sequence's ROWS
query rows, each row masked to its own keys and window, with its own tau and bias columns.
The relative bias ``L_j(p, p - s) = r_j(p) . P[:, p - s]`` is formed per key block from the small P bank (bias 0
at distances >= R) as one tensor-core product per query row, ``r [BLOCK_H, D_REL] @ P[:, p_w - s]`` with the
tile's other rows' r zeroed, so no [T, nH, T] tensor exists; or, with BIAS_TABLE, read from the rows'
precomputed ``[rows, nH, R']`` table (inkling_kernels/rel_bias.py) at each key's distance, one gather per block.

All KV addressing goes through ``_kv_rows``: with ``PAGED`` off, K/V are contiguous per sequence
(``[B, S_max, nKV, hd]``, row == position); with it on, K/V are one layer's pool ``[slots, nKV, hd]`` and key
position s of sequence b lives at row ``table[b, s // PAGE_SIZE] * PAGE_SIZE + s % PAGE_SIZE``. Only table
entries of visible keys are loaded, so pages outside the window (released to a scratch page) are never read.

Prefill (``attn_prefill_kernel``): program (query head, block of BLOCK_M queries) walks the key blocks of the
causal/window band of its queries (blocks wholly outside it are never visited), online softmax in fp32; keys are
rows of a contiguous tensor or, with PAGED, of a paged pool through the sequence's pages. The bias of a (query,
key) pair is column ``p - s`` of its query's row of the table ``r @ P`` (precomputed per query, ``[n, nH, R']``),
read per pair. Only blocks that hold some pair closer than R read the table.
"""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def _kv_rows(Table, b, slots, s_mask, stride_tb, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    # Row (int64) of key positions ``slots`` of sequence b in its K/V tensor (whose batch offset, for the
    # contiguous layout, is added by the caller). Masked-out positions get row 0 and their table entry is not read.
    if PAGED:
        page = tl.load(Table + b.to(tl.int64) * stride_tb + slots // PAGE_SIZE, mask=s_mask, other=0)
        rows = page.to(tl.int64) * PAGE_SIZE + slots % PAGE_SIZE
    else:
        rows = slots.to(tl.int64)
    return rows


@triton.jit(do_not_specialize=["stride_tb", "stride_ab", "stride_ah", "stride_mb", "stride_mh"])
def attn_decode_split_kernel(
    Q,
    R,
    P,
    Bias,
    K,
    V,
    SeqLens,
    Table,
    Acc,
    ML,
    Out,
    n_heads,
    rel_extent,
    window,
    tau_alpha,
    tau_inv_n_floor,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_rb,
    stride_rh,
    stride_pd,
    stride_bm,
    stride_bh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ab,
    stride_ah,
    stride_as,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_REL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_TAU: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
    REL_PRECISION: tl.constexpr,
    BIAS_TABLE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)  # the sequence (its ROWS query rows are b*ROWS .. b*ROWS+ROWS-1)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Tile row m: query row b*ROWS + m // GROUP, head kv_head*GROUP + m % GROUP (ROWS = 1: the GROUP heads).
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, D_REL)
    h_mask = offs_h < GROUP * ROWS
    q_row = (b * ROWS + offs_h // GROUP).to(tl.int64)
    heads = kv_head * GROUP + offs_h % GROUP
    if ROWS == 1:
        seq_len = tl.load(SeqLens + b)
        p = seq_len - 1  # absolute position of the query (its own key is already in the cache)
        p_first = p
        p_row = p
    else:
        row_len = tl.load(SeqLens + q_row, mask=h_mask, other=1)  # [BLOCK_H] each row's visible keys
        p_row = row_len - 1
        seq_len = tl.max(row_len, axis=0)  # the keys of the longest row
        p_first = tl.min(tl.where(h_mask, p_row, seq_len), axis=0)  # the earliest row: its window starts first
        p = seq_len - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p_first - window + 1, 0)
    # This sequence's visible keys split evenly over the grid's splits, in whole key blocks (idle splits exit).
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    q = tl.load(
        Q + q_row[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )
    if BIAS_TABLE:  # the tile rows' L(p, .) rows of the precomputed table (r unused)
        r = Bias + q_row * stride_bm + heads * stride_bh  # [BLOCK_H] pointers
    else:
        r = tl.load(
            R + q_row[:, None] * stride_rb + heads[:, None] * stride_rh + offs_r[None, :],
            mask=h_mask[:, None],
            other=0.0,
        )  # [BLOCK_H, D_REL]
    # Logits in log2 units: (q.k * sm_scale + bias) * tau * log2(e).
    if ROWS == 1:
        logit_scale = 1.4426950408889634
        if USE_TAU:
            ratio = tl.maximum((p + 1).to(tl.float32) * tau_inv_n_floor, 1.0)
            logit_scale = logit_scale * (1.0 + tau_alpha * tl.log(ratio))
    else:
        logit_scale = tl.full((BLOCK_H,), 1.4426950408889634, dtype=tl.float32)
        if USE_TAU:
            ratio = tl.maximum((p_row + 1).to(tl.float32) * tau_inv_n_floor, 1.0)
            logit_scale = logit_scale * (1.0 + tau_alpha * tl.log(ratio))
        logit_scale = logit_scale[:, None]

    # Per-sequence K/V bases (the batch strides are 0 for a pool) and the head offset within a row.
    K_b = K + b.to(tl.int64) * stride_kb + kv_head * stride_kh
    V_b = V + b.to(tl.int64) * stride_vb + kv_head * stride_vh
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), dtype=tl.float32)
    # Two loops over the chunk: the key blocks wholly beyond every row's bias extent first (no bias), then those
    # holding some key closer than R (the bias every block). No branch in either, so their loads are pipelined.
    near_first = p_first - rel_extent - BLOCK_N + 2  # blocks starting here or later hold a key within R
    near = tl.minimum(start + tl.cdiv(tl.maximum(near_first - start, 0), BLOCK_N) * BLOCK_N, end)
    for bias in tl.static_range(2):
        m_i, l_i, acc = _decode_blocks(
            q, r, P, K_b, V_b, Table, SeqLens, m_i, l_i, acc, near if bias else start, end if bias else near, end,
            b, p, p_row, logit_scale, offs_h, offs_r, offs_d, rel_extent, window, sm_scale, stride_pd, stride_ks,
            stride_vs, stride_tb, GROUP, BLOCK_N, HAS_WINDOW, PAGED, PAGE_SIZE, ROWS, REL_PRECISION, BIAS_TABLE,
            bias == 1,
        )  # fmt: skip
    if SPLIT:  # an unnormalised partial for attn_combine_kernel
        a_ptrs = Acc + q_row[:, None] * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_d[None, :]
        tl.store(a_ptrs, acc, mask=h_mask[:, None])
        ml_ptrs = ML + q_row * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(ml_ptrs, m_i, mask=h_mask)
        tl.store(ml_ptrs + 1, l_i, mask=h_mask)
    else:  # one split: the program holds every visible key of its rows, so it writes the output itself
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = Out + q_row[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=h_mask[:, None])


@triton.jit
def _decode_blocks(
    q, r, P, K_b, V_b, Table, SeqLens, m_i, l_i, acc, begin, stop, end, b, p, p_row, logit_scale, offs_h, offs_r,
    offs_d, rel_extent, window, sm_scale, stride_pd, stride_ks, stride_vs, stride_tb,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, REL_PRECISION: tl.constexpr, BIAS_TABLE: tl.constexpr,
    NEAR: tl.constexpr,
):  # fmt: skip
    """Key blocks ``begin, begin + BLOCK_N, .. < stop`` (keys < ``end``) of one program into its online softmax
    (m, l, acc); NEAR: the blocks hold keys within some row's bias extent, form the bias (BIAS_TABLE: ``r`` holds
    the tile rows' pointers into the precomputed table, read at each key's distance)."""
    for s0 in range(begin, stop, BLOCK_N):
        slots = s0 + tl.arange(0, BLOCK_N)
        s_mask = slots < end
        rows = _kv_rows(Table, b, slots, s_mask, stride_tb, PAGED, PAGE_SIZE)
        k = tl.load(K_b + (rows * stride_ks)[:, None] + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_H, BLOCK_N] fp32
        if NEAR and BIAS_TABLE:
            if ROWS == 1:
                delta = tl.broadcast_to((p - slots)[None, :], (offs_h.shape[0], BLOCK_N))
            else:
                delta = p_row[:, None] - slots[None, :]  # [BLOCK_H, BLOCK_N]
            near = (delta >= 0) & (delta < rel_extent) & s_mask[None, :] & (offs_h < GROUP * ROWS)[:, None]
            s += tl.load(r[:, None] + delta, mask=near, other=0.0)
        elif NEAR:
            for w in tl.static_range(ROWS):  # row w's heads take columns P[:, p_w - s] (one product per row)
                if ROWS == 1:
                    p_w = p
                    r_w = r
                else:
                    p_w = tl.load(SeqLens + b * ROWS + w) - 1
                    r_w = tl.where((offs_h // GROUP == w)[:, None], r, tl.zeros_like(r))
                delta = p_w - slots
                pv = tl.load(
                    P + offs_r[:, None] * stride_pd + delta[None, :],
                    mask=((delta >= 0) & (delta < rel_extent) & s_mask)[None, :],
                    other=0.0,
                )  # [D_REL, BLOCK_N]
                s += tl.dot(r_w, pv, input_precision=REL_PRECISION)
        if ROWS == 1:
            s = tl.where(s_mask[None, :], s * logit_scale, float("-inf"))
        else:
            visible = s_mask[None, :] & (slots[None, :] <= p_row[:, None])
            if HAS_WINDOW:
                visible = visible & (slots[None, :] > p_row[:, None] - window)
            s = tl.where(visible, s * logit_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if ROWS == 1:
            m_shift = m_new
        else:  # a row none of whose keys is in this block so far keeps m = -inf: shift by 0 instead
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        prob = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        v = tl.load(V_b + (rows * stride_vs)[:, None] + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["n_splits"])
def attn_combine_kernel(
    Acc,
    ML,
    Out,
    n_splits,
    stride_ab,
    stride_ah,
    stride_as,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < n_splits
    ml_ptrs = ML + b.to(tl.int64) * stride_mb + h * stride_mh + offs_s * stride_ms
    m = tl.load(ml_ptrs, mask=s_mask, other=float("-inf"))
    l_s = tl.load(ml_ptrs + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    denom = tl.sum(l_s * w, axis=0)
    a = tl.load(
        Acc + b.to(tl.int64) * stride_ab + h * stride_ah + offs_s[:, None] * stride_as + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    o = tl.sum(a * w[:, None], axis=0) / denom
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(Out.dtype.element_ty))


@triton.jit
def attn_prefill_kernel(
    Q,
    Bias,
    K,
    V,
    Pages,
    Out,
    Blocks,
    Seqs,
    n_queries,
    n_keys,
    q_start,
    k_first,
    page0,
    rel_extent,
    window,
    tau_alpha,
    tau_inv_n_floor,
    sm_scale,
    stride_qm,
    stride_qh,
    stride_bm,
    stride_bh,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_om,
    stride_oh,
    stride_pages,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_TAU: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # Program (query head, query block): BLOCK_M queries of one sequence (absolute positions q_start + row) against
    # key rows j (position k_first + j) of the head's KV head, online softmax in fp32. Heads vary fastest over the
    # grid, so the GROUP heads of a KV head read the same K/V blocks at about the same time (L2 hits); query
    # blocks run last-first, the longest key ranges first. PAGED: the block is (sequence, query block) of a packed
    # batch (Blocks, heaviest first), the sequence's (first row, queries, q_start, k_first) in Seqs and its pages
    # in row `sequence` of Pages; the scalar arguments are then unused.
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    if PAGED:
        block = tl.program_id(1)
        seq = tl.load(Blocks + 2 * block)
        m_block = tl.load(Blocks + 2 * block + 1)
        row0 = tl.load(Seqs + 4 * seq).to(tl.int64)
        n_queries = tl.load(Seqs + 4 * seq + 1)
        q_start = tl.load(Seqs + 4 * seq + 2)
        k_first = tl.load(Seqs + 4 * seq + 3)
        n_keys = q_start + n_queries - k_first
        page0 = k_first // PAGE_SIZE
        Q += row0 * stride_qm
        Out += row0 * stride_om
        Bias += row0 * stride_bm
        Pages += seq.to(tl.int64) * stride_pages
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < n_queries
    pos_q = q_start + offs_m
    q = tl.load(
        Q + offs_m.to(tl.int64)[:, None] * stride_qm + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    )
    # Logits in log2 units: (q.k * sm_scale + bias) * tau(p) * log2(e), tau per query row.
    row_scale = tl.full((BLOCK_M,), 1.4426950408889634, dtype=tl.float32)
    if USE_TAU:
        ratio = tl.maximum((pos_q + 1).to(tl.float32) * tau_inv_n_floor, 1.0)
        row_scale = row_scale * (1.0 + tau_alpha * tl.log(ratio))

    # Key rows visible to some query of this block: the causal/window band, nothing outside it.
    p_first = q_start + m_block * BLOCK_M
    p_last = q_start + tl.minimum((m_block + 1) * BLOCK_M, n_queries) - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p_first - window + 1 - k_first, 0)
    hi = tl.minimum(p_last - k_first + 1, n_keys)

    K_h = K + kv_head * stride_kh
    V_h = V + kv_head * stride_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    # Two passes over the band: the blocks wholly beyond the bias extent first (no bias), then those holding some
    # pair closer than R, which form the bias every block (no branch in the loop, so its loads are pipelined).
    d_first = p_first - k_first - BLOCK_N + 2 - rel_extent  # key blocks from here on hold a pair within R
    near_lo = tl.minimum(lo + (tl.maximum(d_first - lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, hi)
    for near in tl.static_range(2):
        m_i, l_i, acc = _prefill_blocks(
            q, Bias, K_h, V_h, Pages, m_i, l_i, acc, near_lo if near else lo, hi if near else near_lo,
            hi, pos_q, offs_m, m_mask, row_scale, k_first, page0, rel_extent, window, sm_scale,
            stride_bm, stride_bh, stride_km, stride_vm, head, BLOCK_N, HEAD_DIM, near == 1, HAS_WINDOW, PAGED,
            PAGE_SIZE,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        Out + offs_m.to(tl.int64)[:, None] * stride_om + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None],
    )


@triton.jit
def _prefill_blocks(
    q, Bias, K_h, V_h, Pages, m_i, l_i, acc, start, end, hi, pos_q, offs_m, m_mask, row_scale,
    k_first, page0, rel_extent, window, sm_scale, stride_bm, stride_bh, stride_km, stride_vm, head,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, NEAR: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    """Key blocks ``start, start + BLOCK_N, .. < end`` of one query block into its online softmax (m, l, acc);
    NEAR: the blocks hold pairs closer than R, read the bias table."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for s0 in range(start, end, BLOCK_N):
        offs_s = s0 + offs_n
        s_mask = offs_s < hi
        if PAGED:  # key j at position k_first + j lives in page Pages[pos // PAGE_SIZE - page0]
            pos_k = k_first + offs_s
            page = tl.load(Pages + pos_k // PAGE_SIZE - page0, mask=s_mask, other=0)
            kv_rows = page.to(tl.int64) * PAGE_SIZE + pos_k % PAGE_SIZE
        else:
            kv_rows = offs_s.to(tl.int64)
        k = tl.load(K_h + kv_rows[:, None] * stride_km + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        k = k.to(q.dtype)  # a pool may hold another float dtype than the activations
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_M, BLOCK_N] fp32
        delta = pos_q[:, None] - (k_first + offs_s)[None, :]  # backward distance query - key
        if NEAR:  # the queries' rows of the precomputed table L[p, head, delta] (delta < rel_extent)
            near = (delta >= 0) & (delta < rel_extent) & m_mask[:, None]
            b_rows = Bias + offs_m.to(tl.int64) * stride_bm + head * stride_bh
            s += tl.load(b_rows[:, None] + delta, mask=near, other=0.0)
        visible = (delta >= 0) & s_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (delta < window)
        s = tl.where(visible, s * row_scale[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key yet (window start beyond this block) keeps m = -inf: shift by 0 instead.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        prob = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        v = tl.load(V_h + kv_rows[:, None] * stride_vm + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(prob.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def rel_bias_table_kernel(
    R,
    P,
    Out,
    n_rows,
    n_heads,
    d_rel,
    extent,
    stride_rm,
    stride_rh,
    stride_pk,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # Program (block of BLOCK_M (query, head) rows, block of BLOCK_N distances): Out[t, h, s] = R[t, h, :] @ P[:, s]
    # as one MMA with an fp32 accumulator, row t * n_heads + h of a contiguous [n, nH, extent] table; d_rel padded
    # to D_PAD with zeros.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, D_PAD)
    row_ok = rows < n_rows
    col_ok = cols < extent
    k_ok = offs_k < d_rel
    t, h = rows // n_heads, rows % n_heads
    r = tl.load(
        R + t.to(tl.int64)[:, None] * stride_rm + h[:, None] * stride_rh + offs_k[None, :],
        mask=row_ok[:, None] & k_ok[None, :],
        other=0.0,
    )
    p = tl.load(P + offs_k[:, None] * stride_pk + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    table = tl.dot(r, p, input_precision=PRECISION)
    tl.store(Out + rows.to(tl.int64)[:, None] * extent + cols[None, :], table, mask=row_ok[:, None] & col_ok[None, :])
