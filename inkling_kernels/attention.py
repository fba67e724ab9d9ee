"""Inkling decode attention with the relative bias (spec inkling-text 3.3-3.5): one new query per sequence against
its cached keys (prefill, a chunk of queries per sequence: inkling_kernels/prefill_attention.py).

For sequence b with ``seq_lens[b]`` keys (the new token's k/v already written at slot ``seq_lens[b] - 1``,
which is also the query's absolute position p), query head j and KV head ``j // (nH / nKV)``:

    logit(j, s) = tau(p) * ( q_j . k_s / hd + L_j(p, p - s) ),  L_j(p, d) = r_j . P[:, d] for d < R else 0
    tau(p) = 1 + alpha * ln(max((p + 1) / n_floor, 1))   (global layers with log-scaling; else 1)

over keys p - W + 1 <= s <= p (sliding, window W including self) or 0 <= s <= p (global), softmax in fp32.
Inputs: q ``[B, nH, hd]`` (after q_norm, before tau), r ``[B, nH, d_rel]``, P ``[d_rel, R]``, k/v caches
``[B, S_max, nKV, hd]`` (contiguous per sequence, position == slot), seq_lens int ``[B]``.
The kernel keeps logits in fp32 and does not round L or q*tau to bf16 in between (HF does): rounding-level
differences. ``paged_decode_attention`` is the same kernel over one layer's paged pool ``[slots, nKV, hd]``
addressed through a block table (positions stay absolute; pages before a sliding window may point anywhere).
``paged_decode_attention(..., rows_per_seq=W)``: W consecutive queries per sequence (an MTP verify), one program
for all W rows of a sequence and KV head, so each key is read once for them. It is faster than the rows as
sequences at every measured context (ctx 1024 and 8192) from B=8 on; at B=1 on a sliding window the rows as
sequences win by ~3 us at W=5 (13.5 against 16.5, 2026-12-03), too little to keep a second path, so the engine's
verify takes it at every shape. Where several rows run at one split the bias comes from the rows' precomputed
table (``DecodeConfig.bias_table``). Tiles: ``DecodeConfig``, chosen per shape by ``default_config``. Prefill
attention lives in
``inkling_kernels/prefill_attention.py``. Excluded from this slice: ring-buffer sliding caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from inkling_kernels.pdl import pdl
from inkling_kernels.rel_bias import rel_bias_table


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of one decode-attention launch: ``block_n`` keys per loop step, the split kernel's warps and pipeline
    stages, and the key splits per (sequence, KV head): ``num_splits``, or None for enough programs to reach
    ``target_programs`` at the batch. One split writes the output from the split kernel (no combine launch).
    ``bias_table``: the bias read from the rows' ``L = r @ P`` table (``rel_bias_table``, one launch before), not
    formed per key block in the kernel."""

    block_n: int = 64
    num_warps: int = 2
    num_stages: int = 3
    num_splits: int | None = None
    target_programs: int = 512
    bias_table: bool = False


def default_config(
    batch: int, n_kv: int, max_keys: int, window: int | None, group: int = 1, rows: int = 1
) -> DecodeConfig:
    """Measured choice (H200, Small shapes, bench_attention --sweep and bench_verify_attention; see
    docs/decisions.md): 64-key blocks of 2 warps, 3 stages (209 registers: 4 programs per SM) and ~512 programs, so
    one split from B*nKV = 512 on (B >= 64 at nKV = 8), 8 at B = 8, 64 at B = 1. ``group`` query heads per KV head,
    ``rows`` query rows per sequence (an MTP verify's W). Several rows at one split read the bias from their table
    (2026-12-03, B=64 W=5 ctx 1024: sliding 119 -> 81 us, global 194 -> 128, with these tiles up to 32 rows per
    program's tile); at many splits (B=1) the table's launch costs more than it saves and 64-key tiles of 4 warps
    were the best measured (B=1, W=3 and 5), and above 16 rows a tile of 128 keys and 4 warps was the best measured
    with the bias formed in the kernel (B=64, W=5: 711 us at ctx 8192; at B=8 within 10% of the others)."""
    one_split = batch * n_kv >= DecodeConfig.target_programs
    table = rows > 1 and one_split
    if rows > 1 and batch * n_kv < 64:  # a few sequences over many splits (B=1 W=5 sliding: 24.7 -> 16.5 us)
        return DecodeConfig(block_n=64, num_warps=4, num_stages=3)
    if group * rows > (32 if table else 16):
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2, bias_table=table)
    return DecodeConfig(bias_table=table)


def _check_common(q, r, rel_proj, k, v, n_kv, kv_dtype_of_q=True):
    b, n_heads, hd = q.shape
    if n_heads % n_kv:
        raise ValueError(f"nH={n_heads} is not a multiple of nKV={n_kv}")
    if r.shape[:2] != (b, n_heads) or rel_proj.dim() != 2 or rel_proj.shape[0] != r.shape[2]:
        raise ValueError(f"r {tuple(r.shape)} / P {tuple(rel_proj.shape)} do not match q {tuple(q.shape)}")
    if (kv_dtype_of_q and q.dtype != k.dtype) or v.dtype != k.dtype or not k.is_floating_point():
        raise ValueError(f"q and the caches must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("r", r), ("P", rel_proj), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")
    for name, n in (("head_dim", hd), ("d_rel", r.shape[2])):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two >= 16")
    return b, n_heads, hd, n_kv


def _check_seq_lens(seq_lens, b):
    if seq_lens.shape != (b,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64 [B]={b}, got {seq_lens.dtype} {tuple(seq_lens.shape)}")


def _check_decode_dtypes(r, rel_proj, seq_lens, b):
    if r.dtype != rel_proj.dtype or not r.is_floating_point():
        raise ValueError(
            f"r and P must share a float dtype (one product forms the bias), got {r.dtype}, {rel_proj.dtype}"
        )
    _check_seq_lens(seq_lens, b)


def _check(q, r, rel_proj, k_cache, v_cache, seq_lens):
    if q.dim() != 3 or r.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q [B,nH,hd], r [B,nH,d_rel], k_cache [B,S,nKV,hd] expected, got {tuple(q.shape)}, "
            f"{tuple(r.shape)}, {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != q.shape[0] or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k/v caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    _check_decode_dtypes(r, rel_proj, seq_lens, q.shape[0])
    return _check_common(q, r, rel_proj, k_cache, v_cache, k_cache.shape[2])


def _check_paged(q, r, rel_proj, k_pool, v_pool, block_table, seq_lens, page_size, rows_per_seq=1):
    if q.dim() != 3 or r.dim() != 3 or k_pool.dim() != 3:
        raise ValueError(
            f"q [B,nH,hd], r [B,nH,d_rel], k_pool [slots,nKV,hd] expected, got {tuple(q.shape)}, "
            f"{tuple(r.shape)}, {tuple(k_pool.shape)}"
        )
    if k_pool.shape != v_pool.shape or k_pool.shape[2] != q.shape[2]:
        raise ValueError(f"k/v pools {tuple(k_pool.shape)}, {tuple(v_pool.shape)} do not match q {tuple(q.shape)}")
    if page_size < 1 or k_pool.shape[0] % page_size:
        raise ValueError(f"page_size={page_size} must be >= 1 and divide the pool's {k_pool.shape[0]} slots")
    if rows_per_seq < 1 or q.shape[0] % rows_per_seq:
        raise ValueError(f"rows_per_seq={rows_per_seq} must be >= 1 and divide the {q.shape[0]} query rows")
    if (
        block_table.dim() != 2
        or block_table.shape[0] != q.shape[0] // rows_per_seq
        or block_table.dtype not in (torch.int32, torch.int64)
        or (block_table.shape[1] > 1 and block_table.stride(1) != 1)
    ):
        raise ValueError(
            f"block_table must be int32/int64 [B={q.shape[0] // rows_per_seq}, max_pages] with unit last stride, "
            f"got {block_table.dtype} {tuple(block_table.shape)} strides {block_table.stride()}"
        )
    _check_decode_dtypes(r, rel_proj, seq_lens, q.shape[0])
    return _check_common(q, r, rel_proj, k_pool, v_pool, k_pool.shape[1])


def _split_plan(b: int, max_keys: int, window: int | None, n_kv: int, config: DecodeConfig) -> int:
    """Splits per (sequence, KV head): ``config.num_splits`` or enough programs to fill the GPU at the longest
    visible range; each sequence's own visible keys are divided over them in whole key blocks in-kernel (short
    ones leave some idle)."""
    if window is not None:
        max_keys = min(max_keys, window)
    max_blocks = max(1, -(-max_keys // config.block_n))
    num_splits = config.num_splits
    if num_splits is None:
        num_splits = max(1, -(-config.target_programs // max(1, b * n_kv)))
    return min(max_blocks, num_splits)


def _launch(
    q, r, rel_proj, k, v, seq_lens, block_table, page_size, kv_strides, window, log_scaling, num_splits, config,
    rows=1,
):  # fmt: skip
    """Split kernel + combine (none at one split). ``kv_strides``: (batch, row, head) strides of k then v (batch 0
    for a pool); ``block_table`` None for the contiguous layout; ``rows`` query rows per sequence (paged only)."""
    from inkling_kernels import _triton_attention as tk

    b, n_heads, hd = q.shape
    n_kv = k.shape[-2]
    group = n_heads // n_kv
    d_rel, rel_extent = rel_proj.shape
    if window is not None:
        rel_extent = min(rel_extent, window)  # distances >= W are never visible
    split = num_splits > 1
    out = torch.empty((b, n_heads, hd), dtype=q.dtype, device=q.device)
    if split:
        acc = torch.empty((b, n_heads, num_splits, hd), dtype=torch.float32, device=q.device)
        ml = torch.empty((b, n_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:  # never written: the split kernel stores the output
        acc = ml = out
    if b == 0:
        return out
    bias = rel_bias_table(r, rel_proj, rel_extent) if config.bias_table else None  # [B, nH, R'] fp32
    paged = block_table is not None
    alpha, n_floor = log_scaling if log_scaling is not None else (0.0, 1.0)
    tk.attn_decode_split_kernel[(b // rows, n_kv, num_splits)](
        q,
        r,
        rel_proj,
        r if bias is None else bias,  # dummy pointer, never read without BIAS_TABLE
        k,
        v,
        seq_lens,
        block_table if paged else seq_lens,  # dummy pointer, never read without PAGED
        acc,
        ml,
        out,
        n_heads,
        rel_extent,
        window or 0,
        float(alpha),
        1.0 / float(n_floor),
        1.0 / hd,
        q.stride(0),
        q.stride(1),
        r.stride(0),
        r.stride(1),
        rel_proj.stride(0),
        0 if bias is None else bias.stride(0),
        0 if bias is None else bias.stride(1),
        *kv_strides,
        block_table.stride(0) if paged else 0,
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        ml.stride(0),
        ml.stride(1),
        ml.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_H=max(16, 1 << (group * rows - 1).bit_length()),
        HEAD_DIM=hd,
        D_REL=d_rel,
        BLOCK_N=config.block_n,
        HAS_WINDOW=window is not None,
        USE_TAU=log_scaling is not None,
        PAGED=paged,
        PAGE_SIZE=page_size if paged else 1,
        ROWS=rows,
        SPLIT=split,
        REL_PRECISION="ieee" if r.dtype == torch.float32 else "tf32",  # fp32 r @ P exact, not tf32
        BIAS_TABLE=config.bias_table,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl(q),
    )
    if not split:
        return out
    tk.attn_combine_kernel[(b, n_heads)](
        acc,
        ml,
        out,
        num_splits,
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        ml.stride(0),
        ml.stride(1),
        ml.stride(2),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=hd,
        BLOCK_S=max(2, 1 << (num_splits - 1).bit_length()),
        num_warps=4,
        **pdl(acc),
    )
    return out


def decode_attention(
    q: torch.Tensor,
    r: torch.Tensor,
    rel_proj: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Decode attention with the Inkling relative bias; returns ``[B, nH, hd]`` in q's dtype.

    ``window``: sliding window W (keys p-W+1..p) or None for a global layer. ``log_scaling``:
    ``(alpha, n_floor)`` for tau on global layers, or None. ``max_seq_len``: an upper bound on seq_lens
    (default S_max; never read from the device, so the call is CUDA-graph safe) used to size the splits.
    ``config``: the tiles (default ``default_config`` of the shape); ``num_splits`` overrides its splits.
    """
    b, _, _, n_kv = _check(q, r, rel_proj, k_cache, v_cache, seq_lens)
    max_keys = max_seq_len if max_seq_len is not None else k_cache.shape[1]
    config = config or default_config(b, n_kv, max_keys, window, q.shape[1] // n_kv)
    kv_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if num_splits is not None:
        config = replace(config, num_splits=num_splits)
    splits = _split_plan(b, max_keys, window, n_kv, config)
    return _launch(
        q, r, rel_proj, k_cache, v_cache, seq_lens, None, 1, kv_strides, window, log_scaling, splits, config
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    r: torch.Tensor,
    rel_proj: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    rows_per_seq: int = 1,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """``decode_attention`` over a paged KV pool; returns ``[B, nH, hd]`` in q's dtype.

    ``k_pool``/``v_pool``: one layer's pool ``[num_pages * page_size, nKV, hd]`` (any strides, unit last).
    ``block_table`` int ``[B, max_pages]``: key position s of sequence b lives at pool row
    ``block_table[b, s // page_size] * page_size + s % page_size``; entries of pages holding no visible key
    (beyond seq_lens, or before a sliding window) are never read. ``max_seq_len`` defaults to
    ``max_pages * page_size``; like the other arguments it is a host int, so the call is CUDA-graph safe.

    ``rows_per_seq`` W > 1 (an MTP verify): q, r and seq_lens have W rows per sequence (rows b*W .. b*W+W-1 of
    sequence b, each row a query at position ``seq_lens[row] - 1`` over sequence b's keys), ``block_table`` one
    row per sequence. One program serves the W rows of a sequence (its query tile holds W x the group of heads),
    so each visible key is read once for all of them; its key range spans its rows' windows.
    """
    _, _, _, n_kv = _check_paged(q, r, rel_proj, k_pool, v_pool, block_table, seq_lens, page_size, rows_per_seq)
    b = block_table.shape[0]
    max_keys = max_seq_len if max_seq_len is not None else block_table.shape[1] * page_size
    config = config or default_config(b, n_kv, max_keys, window, q.shape[1] // n_kv, rows_per_seq)
    kv_strides = (0, *k_pool.stride()[:2], 0, *v_pool.stride()[:2])
    if num_splits is not None:
        config = replace(config, num_splits=num_splits)
    splits = _split_plan(b, max_keys, window, n_kv, config)
    return _launch(
        q, r, rel_proj, k_pool, v_pool, seq_lens, block_table, page_size, kv_strides, window, log_scaling, splits,
        config, rows_per_seq,
    )  # fmt: skip


def attention_reference(
    q: torch.Tensor,
    r: torch.Tensor,
    rel_proj: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,
) -> torch.Tensor:
    """fp32 reference of ``decode_attention`` (same arguments), one sequence at a time."""
    b, n_heads, hd = q.shape
    group = n_heads // k_cache.shape[2]
    rel_extent = rel_proj.shape[1]
    out = torch.empty_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        p = n - 1
        lo = max(0, p - window + 1) if window is not None else 0
        k = k_cache[i, lo:n].float().repeat_interleave(group, dim=1)  # [S, nH, hd]
        v = v_cache[i, lo:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[i].float(), k) / hd
        delta = p - torch.arange(lo, n, device=q.device)
        rel = r[i].float() @ rel_proj.float()  # [nH, R]
        near = delta < rel_extent
        bias = torch.zeros_like(scores)
        bias[:, near] = rel[:, delta[near]]
        scores = scores + bias
        if log_scaling is not None:
            alpha, n_floor = log_scaling
            scores = scores * (1.0 + alpha * math.log(max((p + 1) / n_floor, 1.0)))
        out[i] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def paged_attention_reference(
    q: torch.Tensor,
    r: torch.Tensor,
    rel_proj: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,
) -> torch.Tensor:
    """fp32 reference of ``paged_decode_attention``: gathers each sequence's keys, then ``attention_reference``."""
    out = torch.empty_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)
        rows = block_table[i].long()[pos // page_size] * page_size + pos % page_size  # [S]
        one = slice(i, i + 1)
        out[one] = attention_reference(
            q[one], r[one], rel_proj, k_pool[rows][None], v_pool[rows][None], seq_lens[one], window, log_scaling
        )
    return out
