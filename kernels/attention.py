"""Inkling attention with the relative bias (spec inkling-text 3.3-3.5): decode (one new query per sequence against
its cached keys) and prefill (a chunk of queries of one sequence).

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
``prefill_attention``: the same logits for n queries of one sequence at positions ``q_start..`` against its
visible keys ``[m, nKV, hd]`` from position ``k_first``, flash-attention style (no ``[nH, n, m]`` scores);
``paged_prefill_attention`` reads those keys in place from a paged pool through the sequence's pages.
Excluded from this slice: ring-buffer sliding caches, several sequences per prefill launch, speculative verify
(several queries per sequence in a decode batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Split kernel tiles, measured on the H200 (B=64, Small-L6 shapes, paged): 128-key blocks and ~8 programs per SM
# took a global layer at ctx 8192 from 687 us (73% of its KV bytes, 64-key blocks, 1 split) to 513-525 us (95%),
# a sliding layer from 67 to 55 us.
_BLOCK_N = 128
_TARGET_PROGRAMS = 1056
_NUM_WARPS, _NUM_STAGES = 4, 2


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


def _check(q, r, rel_proj, k_cache, v_cache, seq_lens):
    if q.dim() != 3 or r.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q [B,nH,hd], r [B,nH,d_rel], k_cache [B,S,nKV,hd] expected, got {tuple(q.shape)}, "
            f"{tuple(r.shape)}, {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != q.shape[0] or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k/v caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    _check_seq_lens(seq_lens, q.shape[0])
    return _check_common(q, r, rel_proj, k_cache, v_cache, k_cache.shape[2])


def _check_paged(q, r, rel_proj, k_pool, v_pool, block_table, seq_lens, page_size):
    if q.dim() != 3 or r.dim() != 3 or k_pool.dim() != 3:
        raise ValueError(
            f"q [B,nH,hd], r [B,nH,d_rel], k_pool [slots,nKV,hd] expected, got {tuple(q.shape)}, "
            f"{tuple(r.shape)}, {tuple(k_pool.shape)}"
        )
    if k_pool.shape != v_pool.shape or k_pool.shape[2] != q.shape[2]:
        raise ValueError(f"k/v pools {tuple(k_pool.shape)}, {tuple(v_pool.shape)} do not match q {tuple(q.shape)}")
    if page_size < 1 or k_pool.shape[0] % page_size:
        raise ValueError(f"page_size={page_size} must be >= 1 and divide the pool's {k_pool.shape[0]} slots")
    if (
        block_table.dim() != 2
        or block_table.shape[0] != q.shape[0]
        or block_table.dtype not in (torch.int32, torch.int64)
        or (block_table.shape[1] > 1 and block_table.stride(1) != 1)
    ):
        raise ValueError(
            f"block_table must be int32/int64 [B={q.shape[0]}, max_pages] with unit last stride, got "
            f"{block_table.dtype} {tuple(block_table.shape)} strides {block_table.stride()}"
        )
    _check_seq_lens(seq_lens, q.shape[0])
    return _check_common(q, r, rel_proj, k_pool, v_pool, k_pool.shape[1])


def _split_plan(b: int, n_kv: int, max_keys: int, window: int | None, num_splits: int | None) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU at the longest visible range; each
    sequence's own visible keys are divided over them in whole key blocks in-kernel (short ones leave some idle)."""
    if window is not None:
        max_keys = min(max_keys, window)
    max_blocks = max(1, -(-max_keys // _BLOCK_N))
    if num_splits is None:
        num_splits = max(1, -(-_TARGET_PROGRAMS // max(1, b * n_kv)))
    return min(max_blocks, num_splits)


def _launch(q, r, rel_proj, k, v, seq_lens, block_table, page_size, kv_strides, window, log_scaling, num_splits):
    """Split kernel + combine. ``kv_strides``: (batch, row, head) strides of k then v (batch 0 for a pool);
    ``block_table`` None for the contiguous layout."""
    from kernels import _triton_attention as tk

    b, n_heads, hd = q.shape
    n_kv = k.shape[-2]
    group = n_heads // n_kv
    d_rel, rel_extent = rel_proj.shape
    acc = torch.empty((b, n_heads, num_splits, hd), dtype=torch.float32, device=q.device)
    ml = torch.empty((b, n_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((b, n_heads, hd), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    paged = block_table is not None
    alpha, n_floor = log_scaling if log_scaling is not None else (0.0, 1.0)
    tk.attn_decode_split_kernel[(b, n_kv, num_splits)](
        q,
        r,
        rel_proj,
        k,
        v,
        seq_lens,
        block_table if paged else seq_lens,  # dummy pointer, never read without PAGED
        acc,
        ml,
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
        *kv_strides,
        block_table.stride(0) if paged else 0,
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        ml.stride(0),
        ml.stride(1),
        ml.stride(2),
        GROUP=group,
        BLOCK_H=max(16, 1 << (group - 1).bit_length()),
        HEAD_DIM=hd,
        D_REL=d_rel,
        BLOCK_N=_BLOCK_N,
        HAS_WINDOW=window is not None,
        USE_TAU=log_scaling is not None,
        PAGED=paged,
        PAGE_SIZE=page_size if paged else 1,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
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
) -> torch.Tensor:
    """Decode attention with the Inkling relative bias; returns ``[B, nH, hd]`` in q's dtype.

    ``window``: sliding window W (keys p-W+1..p) or None for a global layer. ``log_scaling``:
    ``(alpha, n_floor)`` for tau on global layers, or None. ``max_seq_len``: an upper bound on seq_lens
    (default S_max; never read from the device, so the call is CUDA-graph safe) used to size the splits.
    """
    b, _, _, n_kv = _check(q, r, rel_proj, k_cache, v_cache, seq_lens)
    max_keys = max_seq_len if max_seq_len is not None else k_cache.shape[1]
    kv_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    num_splits = _split_plan(b, n_kv, max_keys, window, num_splits)
    return _launch(q, r, rel_proj, k_cache, v_cache, seq_lens, None, 1, kv_strides, window, log_scaling, num_splits)


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
) -> torch.Tensor:
    """``decode_attention`` over a paged KV pool; returns ``[B, nH, hd]`` in q's dtype.

    ``k_pool``/``v_pool``: one layer's pool ``[num_pages * page_size, nKV, hd]`` (any strides, unit last).
    ``block_table`` int ``[B, max_pages]``: key position s of sequence b lives at pool row
    ``block_table[b, s // page_size] * page_size + s % page_size``; entries of pages holding no visible key
    (beyond seq_lens, or before a sliding window) are never read. ``max_seq_len`` defaults to
    ``max_pages * page_size``; like the other arguments it is a host int, so the call is CUDA-graph safe.
    """
    b, _, _, n_kv = _check_paged(q, r, rel_proj, k_pool, v_pool, block_table, seq_lens, page_size)
    max_keys = max_seq_len if max_seq_len is not None else block_table.shape[1] * page_size
    kv_strides = (0, *k_pool.stride()[:2], 0, *v_pool.stride()[:2])
    num_splits = _split_plan(b, n_kv, max_keys, window, num_splits)
    return _launch(
        q, r, rel_proj, k_pool, v_pool, seq_lens, block_table, page_size, kv_strides, window, log_scaling, num_splits
    )


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


# -- prefill: several queries of one sequence ---------------------------------------------------------------------


def _check_prefill(q, r, rel_proj, keys, values, q_start, k_first, paged=False):
    """Shapes, dtypes and the key range (keys ending with the queries' own; for a pool, any rows)."""
    if q.dim() != 3 or r.dim() != 3 or keys.dim() != 3:
        raise ValueError(
            f"q [n,nH,hd], r [n,nH,d_rel], keys [m,nKV,hd] expected, got {tuple(q.shape)}, {tuple(r.shape)}, "
            f"{tuple(keys.shape)}"
        )
    if keys.shape != values.shape or keys.shape[2] != q.shape[2]:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match q {tuple(q.shape)}")
    n, m = q.shape[0], keys.shape[0]
    if q_start < 0 or k_first < 0 or k_first > q_start or (not paged and k_first + m != q_start + n):
        raise ValueError(
            f"keys at positions {k_first}..{k_first + m - 1} must end with the queries' own "
            f"(positions {q_start}..{q_start + n - 1})"
        )
    return _check_common(q, r, rel_proj, keys, values, keys.shape[1], kv_dtype_of_q=not paged)


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles of ``prefill_attention`` and how the relative bias is formed per block: "table" (``r @ P`` precomputed
    for every query at every distance it can see, read per pair: the fastest measured), "gather" (one ``r @ P``
    product over the block's distances, each pair picking its column) or "rank1" (D_REL rank-1 updates with P
    gathered per pair, the first kernel)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    bias: str = "table"


_BIAS_MODES = ("gather", "rank1", "table")


def _prefill_config(n: int) -> PrefillConfig:
    """64 x 64 tiles, 4 warps, 2 stages, the precomputed bias table (H200, Small-L6 chunk of 2048 with the bias
    in a branch of the one key loop: 294 us for a sliding layer against 707 us for the best "gather" tile and 1601
    us for the first kernel); short chunks shrink BLOCK_M to cover n."""
    return PrefillConfig(block_m=min(64, max(16, 1 << (n - 1).bit_length())), block_n=64, num_warps=4)


def prefill_attention(
    q: torch.Tensor,
    r: torch.Tensor,
    rel_proj: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: int,
    k_first: int,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Attention of n queries of ONE sequence with the Inkling relative bias; returns ``[n, nH, hd]`` in q's dtype.

    q ``[n, nH, hd]`` (after q_norm, before tau) at absolute positions ``q_start .. q_start+n-1``, r ``[n, nH,
    d_rel]``, P ``[d_rel, R]``, keys/values ``[m, nKV, hd]``: every key visible to these queries, row j at position
    ``k_first + j``, ending with the queries' own keys (``k_first + m == q_start + n``). Any strides with a unit
    last one (q and r may be views of one stacked projection). ``window``/``log_scaling`` as in
    ``decode_attention``. Flash-attention style: no ``[nH, n, m]`` tensor; the bias is formed per key block.
    """
    _check_prefill(q, r, rel_proj, keys, values, q_start, k_first)
    return _prefill_launch(q, r, rel_proj, keys, values, None, 1, q_start, k_first, window, log_scaling, config)


def paged_prefill_attention(
    q: torch.Tensor,
    r: torch.Tensor,
    rel_proj: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    lengths: Sequence[int],
    q_starts: Sequence[int],
    k_firsts: Sequence[int],
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """``prefill_attention`` of a packed batch of sequences in one launch, their visible keys read in place from one
    layer's paged pool ``[slots, nKV, hd]``; returns ``[T, nH, hd]``.

    Sequence b owns ``lengths[b]`` consecutive rows of q ``[T, nH, hd]`` / r ``[T, nH, d_rel]`` (queries at positions
    ``q_starts[b]..``) and sees keys from position ``k_firsts[b]``: position s lives at pool row ``page_table[b,
    s // page_size - k_firsts[b] // page_size] * page_size + s % page_size`` (``page_table`` int ``[B, max_pages]``,
    row b from the page holding ``k_firsts[b]``). The pools may hold another float dtype than q: keys and values are
    cast to q's dtype as they are loaded. The lists are host ints (one small upload of the launch's block list).
    """
    b = len(lengths)
    if not len(q_starts) == len(k_firsts) == b or sum(lengths) != q.shape[0] or min(lengths, default=1) < 1:
        raise ValueError(f"lengths {list(lengths)}, q_starts {list(q_starts)}, k_firsts {list(k_firsts)}: one of "
                         f"each per sequence, lengths >= 1 summing to q's {q.shape[0]} rows")  # fmt: skip
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape or page_size < 1 or k_pool.shape[0] % page_size:
        raise ValueError(f"k/v pools [pages * {page_size}, nKV, hd] expected, got {tuple(k_pool.shape)}, "
                         f"{tuple(v_pool.shape)}")  # fmt: skip
    spans = zip(lengths, q_starts, k_firsts, strict=True)
    n_pages = max(((qs + n - 1) // page_size - kf // page_size + 1 for n, qs, kf in spans), default=0)
    if (
        page_table.dim() != 2
        or page_table.shape[0] != b
        or page_table.shape[1] < n_pages
        or (page_table.dtype not in (torch.int32, torch.int64) or page_table.stride(-1) != 1)
    ):
        raise ValueError(f"page_table must be int32/int64 [B={b}, >= {n_pages}] with a unit last stride, got "
                         f"{page_table.dtype} {tuple(page_table.shape)} strides {page_table.stride()}")  # fmt: skip
    _check_prefill(q, r, rel_proj, k_pool, v_pool, 0, 0, paged=True)
    if not all(0 <= kf <= qs for qs, kf in zip(q_starts, k_firsts, strict=True)):
        raise ValueError(f"q_starts {list(q_starts)} / k_firsts {list(k_firsts)}: need 0 <= k_first <= q_start")
    return _prefill_launch(
        q, r, rel_proj, k_pool, v_pool, page_table, page_size, (lengths, q_starts, k_firsts), 0, window,
        log_scaling, config,
    )  # fmt: skip


def _block_list(lengths, q_starts, k_firsts, block_m, window, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(Blocks int32 [num_blocks, 2] = (sequence, query block), heaviest key range first; Seqs int32 [B, 4] =
    (first row, queries, q_start, k_first)) on `device`, in one asynchronous upload."""
    blocks, row = [], 0
    seqs = []
    for b, (n, qs, kf) in enumerate(zip(lengths, q_starts, k_firsts, strict=True)):
        seqs.append((row, n, qs, kf))
        row += n
        for m in range(-(-n // block_m)):
            last = qs + min((m + 1) * block_m, n) - 1
            lo = max(kf, qs + m * block_m - window + 1) if window is not None else kf
            blocks.append((last - lo, b, m))
    blocks.sort(key=lambda blk: -blk[0])
    flat = [v for _, b, m in blocks for v in (b, m)] + [v for seq in seqs for v in seq]
    meta = torch.tensor(flat, dtype=torch.int32)
    if device.type == "cuda":  # from pinned memory the upload does not wait for the work queued before it
        meta = meta.pin_memory().to(device, non_blocking=True)
    return meta[: 2 * len(blocks)], meta[2 * len(blocks) :]


def _prefill_launch(q, r, rel_proj, keys, values, pages, page_size, q_start, k_first, window, log_scaling, config):
    """``attn_prefill_kernel`` over one sequence's contiguous visible keys (``pages`` None, q_start/k_first ints) or
    a packed batch over a paged pool (``pages`` the page table, q_start = (lengths, q_starts, k_firsts))."""
    from kernels import _triton_attention as tk

    n, n_heads, hd = q.shape
    n_kv = keys.shape[1]
    out = torch.empty((n, n_heads, hd), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    d_rel, rel_extent = rel_proj.shape
    alpha, n_floor = log_scaling if log_scaling is not None else (0.0, 1.0)
    paged = pages is not None
    config = config or _prefill_config(max(q_start[0]) if paged else n)
    block_m, block_n = config.block_m, config.block_n
    bias = q  # a dummy pointer, never read unless config.bias == "table"
    if config.bias == "table":  # distances >= W are never visible: the table stops there
        rel_extent = min(rel_extent, window) if window is not None else rel_extent
        bias = torch.matmul(r.float(), rel_proj[:, :rel_extent].float())  # [n, nH, R']
    if paged:
        blocks, seqs = _block_list(*q_start, block_m, window, q.device)
        grid, scalars = (n_heads, blocks.shape[0] // 2), (0, 0, 0, 0, 0)
    else:
        blocks = seqs = q  # dummy pointers
        grid, scalars = (n_heads, -(-n // block_m)), (n, q_start + n - k_first, q_start, k_first, 0)
    tk.attn_prefill_kernel[grid](
        q, r, rel_proj, bias, keys, values, pages if paged else q, out, blocks, seqs,
        *scalars, rel_extent, window or 0, float(alpha), 1.0 / float(n_floor), 1.0 / hd,
        q.stride(0), q.stride(1), r.stride(0), r.stride(1), rel_proj.stride(0), bias.stride(0), bias.stride(1),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), out.stride(0), out.stride(1),
        pages.stride(0) if paged else 0,
        GROUP=n_heads // n_kv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=hd,
        D_REL=d_rel,
        REL_WIDTH=1 << (block_m + block_n - 2).bit_length(),
        REL_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BIAS=_BIAS_MODES.index(config.bias),
        HAS_WINDOW=window is not None,
        USE_TAU=log_scaling is not None,
        PAGED=paged,
        PAGE_SIZE=page_size,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    r: torch.Tensor,
    rel_proj: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    lengths: Sequence[int],
    q_starts: Sequence[int],
    k_firsts: Sequence[int],
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,
) -> torch.Tensor:
    """fp32 reference of ``paged_prefill_attention``: each sequence's visible keys gathered, then
    ``prefill_attention_reference``."""
    outs, row = [], 0
    for b, (n, q_start, k_first) in enumerate(zip(lengths, q_starts, k_firsts, strict=True)):
        pos = torch.arange(k_first, q_start + n, device=q.device)
        rows = page_table[b].long()[pos // page_size - k_first // page_size] * page_size + pos % page_size
        one = slice(row, row + n)
        outs.append(prefill_attention_reference(
            q[one], r[one], rel_proj, k_pool[rows], v_pool[rows], q_start, k_first, window, log_scaling
        ))  # fmt: skip
        row += n
    return torch.cat(outs)


def prefill_attention_reference(
    q: torch.Tensor,
    r: torch.Tensor,
    rel_proj: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: int,
    k_first: int,
    window: int | None = None,
    log_scaling: tuple[float, float] | None = None,
) -> torch.Tensor:
    """fp32 reference of ``prefill_attention`` (same arguments), one KV head's query heads at a time."""
    n, n_heads, hd = q.shape
    m, n_kv = keys.shape[:2]
    group = n_heads // n_kv
    rel_extent = rel_proj.shape[1]
    q_pos = torch.arange(q_start, q_start + n, device=q.device)
    distance = q_pos[:, None] - torch.arange(k_first, k_first + m, device=q.device)[None, :]  # [n, m]
    hidden = distance < 0
    if window is not None:
        hidden |= distance >= window  # a query sees itself and W-1 previous tokens
    far = hidden | (distance >= rel_extent)  # pairs without a bias term
    index = distance.clamp(0, rel_extent - 1).expand(group, n, m)
    tau = torch.ones(n, device=q.device)
    if log_scaling is not None:
        alpha, n_floor = log_scaling
        tau = 1.0 + alpha * torch.log(((q_pos + 1).float() / n_floor).clamp(min=1.0))
    out = torch.empty_like(q)
    for h in range(n_kv):
        heads = slice(h * group, (h + 1) * group)
        scores = q[:, heads].float().transpose(0, 1) @ keys[:, h].float().T / hd  # [g, n, m]
        table = (r[:, heads].float() @ rel_proj.float()).transpose(0, 1)  # [g, n, R]
        bias = table.gather(-1, index).masked_fill(far, 0.0)
        logits = ((scores + bias) * tau[:, None]).masked_fill(hidden, -math.inf)
        out[:, heads] = (torch.softmax(logits, dim=-1) @ values[:, h].float()).transpose(0, 1).to(q.dtype)
    return out
