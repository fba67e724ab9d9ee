"""Inkling prefill attention with the relative bias (spec inkling-text 3.3-3.5; the logits of
inkling_kernels/attention.py): a chunk of queries per sequence against every key visible to them.

``prefill_attention``: n queries of one sequence at positions ``q_start..`` against its visible keys ``[m, nKV,
hd]`` from position ``k_first``, flash-attention style (no ``[nH, n, m]`` scores). ``paged_prefill_attention``:
the queries of a packed batch of sequences in one launch, their keys read in place from one layer's paged pool
through each sequence's pages. The logits are kept in fp32, the bias too: ``r @ P`` precomputed for every query at
the distances it can see (``rel_bias_table``: ``[n, nH, min(R, W)]`` fp32, on the tensor cores from the bf16 r and
P, exact products), read per (query, key) pair.
Excluded from this slice: several sequences per launch over contiguous caches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inkling_kernels.attention import _check_common
from inkling_kernels.pdl import pdl
from inkling_kernels.rel_bias import rel_bias_table


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
    """Tiles of ``prefill_attention``."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _prefill_config(n: int) -> PrefillConfig:
    """64 x 64 tiles, 4 warps, 2 stages (H200, Small-L6 chunk of 2048 with the bias in a branch of the one key
    loop: 294 us for a sliding layer with the bias table, against 707 us and 1601 us for the bias formed per block,
    docs/decisions.md issue 17); short chunks shrink BLOCK_M to cover n."""
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
    from inkling_kernels import _triton_attention as tk

    n, n_heads, hd = q.shape
    n_kv = keys.shape[1]
    out = torch.empty((n, n_heads, hd), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    rel_extent = rel_proj.shape[1]
    alpha, n_floor = log_scaling if log_scaling is not None else (0.0, 1.0)
    paged = pages is not None
    config = config or _prefill_config(max(q_start[0]) if paged else n)
    block_m, block_n = config.block_m, config.block_n
    rel_extent = min(rel_extent, window) if window is not None else rel_extent  # distances >= W are never visible
    bias = rel_bias_table(r, rel_proj, rel_extent)  # [n, nH, R'] fp32
    if paged:
        blocks, seqs = _block_list(*q_start, block_m, window, q.device)
        grid, scalars = (n_heads, blocks.shape[0] // 2), (0, 0, 0, 0, 0)
    else:
        blocks = seqs = q  # dummy pointers
        grid, scalars = (n_heads, -(-n // block_m)), (n, q_start + n - k_first, q_start, k_first, 0)
    tk.attn_prefill_kernel[grid](
        q, bias, keys, values, pages if paged else q, out, blocks, seqs,
        *scalars, rel_extent, window or 0, float(alpha), 1.0 / float(n_floor), 1.0 / hd,
        q.stride(0), q.stride(1), bias.stride(0), bias.stride(1),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), out.stride(0), out.stride(1),
        pages.stride(0) if paged else 0,
        GROUP=n_heads // n_kv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=hd,
        HAS_WINDOW=window is not None,
        USE_TAU=log_scaling is not None,
        PAGED=paged,
        PAGE_SIZE=page_size,
        num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl(q),
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
