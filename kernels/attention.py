"""Inkling decode attention: one new query per sequence against its cached keys (spec inkling-text 3.3-3.5).

For sequence b with ``seq_lens[b]`` keys (the new token's k/v already written at slot ``seq_lens[b] - 1``,
which is also the query's absolute position p), query head j and KV head ``j // (nH / nKV)``:

    logit(j, s) = tau(p) * ( q_j . k_s / hd + L_j(p, p - s) ),  L_j(p, d) = r_j . P[:, d] for d < R else 0
    tau(p) = 1 + alpha * ln(max((p + 1) / n_floor, 1))   (global layers with log-scaling; else 1)

over keys p - W + 1 <= s <= p (sliding, window W including self) or 0 <= s <= p (global), softmax in fp32.
Inputs: q ``[B, nH, hd]`` (after q_norm, before tau), r ``[B, nH, d_rel]``, P ``[d_rel, R]``, k/v caches
``[B, S_max, nKV, hd]`` (contiguous per sequence, position == slot), seq_lens int ``[B]``.
The kernel keeps logits in fp32 and does not round L or q*tau to bf16 in between (HF does): rounding-level
differences. Excluded from this slice: paged KV (the kernel's ``_kv_offsets`` is where a page table goes),
ring-buffer sliding caches, several queries per sequence (prefill / speculative verify).
"""

from __future__ import annotations

import math

import torch

_BLOCK_N = 64
_TARGET_PROGRAMS = 264  # ~2 waves of the H200's 132 SMs


def _check(q, r, rel_proj, k_cache, v_cache, seq_lens):
    if q.dim() != 3 or r.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q [B,nH,hd], r [B,nH,d_rel], k_cache [B,S,nKV,hd] expected, got {tuple(q.shape)}, "
            f"{tuple(r.shape)}, {tuple(k_cache.shape)}"
        )
    b, n_heads, hd = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != hd:
        raise ValueError(f"k/v caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    n_kv = k_cache.shape[2]
    if n_heads % n_kv:
        raise ValueError(f"nH={n_heads} is not a multiple of nKV={n_kv}")
    if r.shape[:2] != (b, n_heads) or rel_proj.dim() != 2 or rel_proj.shape[0] != r.shape[2]:
        raise ValueError(f"r {tuple(r.shape)} / P {tuple(rel_proj.shape)} do not match q {tuple(q.shape)}")
    if seq_lens.shape != (b,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64 [B]={b}, got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("q", q), ("r", r), ("P", rel_proj), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")
    for name, n in (("head_dim", hd), ("d_rel", r.shape[2])):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two >= 16")
    return b, n_heads, hd, n_kv


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
    from kernels import _triton_attention as tk

    b, n_heads, hd, n_kv = _check(q, r, rel_proj, k_cache, v_cache, seq_lens)
    group = n_heads // n_kv
    d_rel, rel_extent = rel_proj.shape
    max_keys = max_seq_len if max_seq_len is not None else k_cache.shape[1]
    if window is not None:
        max_keys = min(max_keys, window)
    max_blocks = max(1, -(-max_keys // _BLOCK_N))
    if num_splits is None:
        num_splits = min(max_blocks, max(1, -(-_TARGET_PROGRAMS // (b * n_kv))))
    chunk = -(-max_blocks // num_splits) * _BLOCK_N
    num_splits = -(-max_keys // chunk)
    acc = torch.empty((b, n_heads, num_splits, hd), dtype=torch.float32, device=q.device)
    ml = torch.empty((b, n_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((b, n_heads, hd), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    alpha, n_floor = log_scaling if log_scaling is not None else (0.0, 1.0)
    tk.attn_decode_split_kernel[(b, n_kv, num_splits)](
        q,
        r,
        rel_proj,
        k_cache,
        v_cache,
        seq_lens,
        acc,
        ml,
        n_heads,
        rel_extent,
        window or 0,
        chunk,
        float(alpha),
        1.0 / float(n_floor),
        1.0 / hd,
        q.stride(0),
        q.stride(1),
        r.stride(0),
        r.stride(1),
        rel_proj.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
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
        num_warps=4,
        num_stages=2,
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
