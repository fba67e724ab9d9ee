"""Decode step of the depthwise causal short convs (spec inkling-text 4.2), one new token per sequence.

For sequence b with state ``S = states[slots[b]]`` ``[K-1, C]`` (oldest first) and new input ``x = x[b]`` ``[C]``,
exactly as ``ShortConv.step`` of decode_service/model/layers.py:

    window = cat(S.to(x.dtype), x).float()                  [K, C]
    y = (x.float() + sum_j window[j] * w[:, j]).to(x.dtype)  (fp32, terms added in order j = 0..K-1)
    states[slots[b]] = window[1:]  (in place, in the state dtype)

* ``conv_decode`` returns ``out = y`` (or ``residual + y``, rounded like torch's add) and, given ``norm_weight``,
  ``rms_norm(out)`` as in inkling_kernels/rms_norm.py: "h = h + sconv(delta); next = norm(h)" in one launch.
* ``kv_prologue`` is the attention prologue of a decode step: the k and v convs, the per-head k RMSNorm (of the
  conv output rounded to k0's dtype) and the write of k, v into the layer's KV pool at ``kv_rows``, in one launch;
  given the step's queries ``q`` ``[B, nH, hd]`` and ``q_norm_weight``, the same launch returns their per-head
  RMSNorm (``Attention.q_norm``) as a new contiguous ``[B, nH, hd]``.

Slots are distinct, except that the padding rows of a CUDA-graph bucket may share one scratch slot (any of their
writes wins). Grids come from shapes alone and nothing is read back to the host, so the kernels and the torch
references (the non-Triton fallback) can be captured in a CUDA graph. Several tokens per sequence (prefill
chunks): inkling_kernels/short_conv_prefill.py.
"""

from __future__ import annotations

import torch

from inkling_kernels.pdl import pdl
from inkling_kernels.rms_norm import rms_norm_reference

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# (rows, channels, warps) per program of conv_decode without the norm, by batch size: the first entry whose bound
# is None or at least B (H200, C=4096, bf16 states, fp32 tap-major weights; bench/bench_conv.py). A program loads
# its channels' weights once for all its rows.
CONV_TILES = ((16, (1, 512, 2)), (64, (2, 512, 2)), (None, (4, 512, 2)))
NORM_TILES = (1, 4096, 16)  # a normalising program: whole rows, in steps of this many channels
KV_TILES = ((16, (1, 1)), (None, (4, 2)))  # (rows, warps) per program of kv_prologue, one kv head of each row


def tiles_for(table: tuple, b: int) -> tuple[int, ...]:
    """The tiles of ``table`` (``CONV_TILES``, ``KV_TILES``) for B rows."""
    return next(tiles for bound, tiles in table if bound is None or b <= bound)


def _check_conv(name: str, x: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> int:
    """Validate one conv's operands; returns the kernel size K."""
    if x.dim() != 2 or states.dim() != 3 or weight.dim() != 2:
        raise ValueError(
            f"{name}: x [B, C], states [slots, K-1, C], weight [C, K] expected, got {tuple(x.shape)}, "
            f"{tuple(states.shape)}, {tuple(weight.shape)}"
        )
    b, c = x.shape
    k = weight.shape[1]
    if not 2 <= k <= 8 or weight.shape[0] != c or states.shape[1:] != (k - 1, c):
        raise ValueError(
            f"{name}: weight {tuple(weight.shape)} and states {tuple(states.shape)} do not fit x {tuple(x.shape)} "
            f"with a kernel size 2..8"
        )
    if slots.shape != (b,) or slots.dtype != torch.int64:
        raise ValueError(f"{name}: slots must be int64 [B]={b}, got {slots.dtype} {tuple(slots.shape)}")
    for t_name, t in (("x", x), ("states", states), ("weight", weight)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name}: {t_name} must be fp32/fp16/bf16, got {t.dtype}")
    if x.stride(-1) != 1 or states.stride(-1) != 1:
        raise ValueError(f"{name}: x and states need a unit last stride, got {x.stride()} and {states.stride()}")
    if len({t.device for t in (x, states, slots, weight)}) != 1:
        raise ValueError(f"{name}: operands on several devices")
    return k


def conv_decode(
    x: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    tiles: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x ``[B, C]``, states ``[num_slots, K-1, C]`` (updated in place at ``slots``), slots int64 ``[B]``, weight
    ``[C, K]`` -> (``y`` or ``residual + y`` in x's dtype ``[B, C]``, its RMSNorm by ``norm_weight`` or None).
    ``tiles``: (rows, channels, warps) per program (channels per loop step when normalising); by default
    ``CONV_TILES``' for B, or ``NORM_TILES``. At most one warp per 256 elements of a program's tile."""
    import triton

    from inkling_kernels import _triton_short_conv as tk

    k = _check_conv("conv_decode", x, states, slots, weight)
    b, c = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(
            f"residual must match x {tuple(x.shape)} {x.dtype} with a unit last stride, got "
            f"{tuple(residual.shape)} {residual.dtype} strides {residual.stride()}"
        )
    if norm_weight is not None and (
        norm_weight.shape != (c,) or norm_weight.dtype not in _FLOATS or norm_weight.stride(0) != 1
    ):
        raise ValueError(
            f"norm_weight must be a contiguous float [C]={c}, got {norm_weight.dtype} {tuple(norm_weight.shape)}"
        )
    out = torch.empty((b, c), dtype=x.dtype, device=x.device)
    normed = None
    if norm_weight is not None:
        normed = torch.empty((b, c), dtype=torch.promote_types(norm_weight.dtype, x.dtype), device=x.device)
    if b == 0:
        return out, normed
    block_b, block_c, num_warps = tiles or (NORM_TILES if normed is not None else tiles_for(CONV_TILES, b))
    block_c = min(triton.next_power_of_2(c), block_c)
    num_warps = min(num_warps, max(1, block_b * block_c // 256))
    num_blocks = triton.cdiv(c, block_c)
    # Grid: (row group, channel block), or row groups alone when normalising (each loops over the blocks).
    # enable_fp_fusion=False: no product is fused into an add, so the sums round like ShortConv.step's.
    tk.conv_decode_kernel[(triton.cdiv(b, block_b), 1 if normed is not None else num_blocks)](
        x,
        states,
        slots,
        weight,
        residual if residual is not None else x,
        out,
        norm_weight if norm_weight is not None else weight,
        normed if normed is not None else out,
        b,
        c,
        float(eps),
        x.stride(0),
        states.stride(0),
        states.stride(1),
        weight.stride(0),
        weight.stride(1),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        normed.stride(0) if normed is not None else 0,
        KERNEL_SIZE=k,
        BLOCK_B=block_b,
        BLOCK_C=block_c,
        NUM_BLOCKS=num_blocks,
        HAS_RESIDUAL=residual is not None,
        HAS_NORM=normed is not None,
        num_warps=num_warps,
        enable_fp_fusion=False,
        **pdl(x),
    )
    return out, normed


def conv_decode_reference(
    x: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of ``conv_decode`` (same arguments and results, states updated in place)."""
    k = weight.shape[1]
    window = torch.cat([states.index_select(0, slots).to(x.dtype), x[:, None]], dim=1).float()  # [B, K, C]
    w = weight.float()  # [C, K]
    conv = sum(window[:, j] * w[:, j] for j in range(k))  # [B, C]
    y = (x.float() + conv).to(x.dtype)
    states.index_copy_(0, slots, window[:, 1:].to(states.dtype))
    out = y if residual is None else residual + y
    return out, None if norm_weight is None else rms_norm_reference(out, norm_weight, eps)


def _check_prologue(k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, k_pool, v_pool, kv_rows):
    """Validate the prologue's operands; returns (K, nKV, hd)."""
    k = _check_conv("kv_prologue k", k0, k_states, slots, k_weight)
    if _check_conv("kv_prologue v", v0, v_states, slots, v_weight) != k or v0.shape != k0.shape:
        raise ValueError(f"k and v convs differ: k0 {tuple(k0.shape)}, v0 {tuple(v0.shape)}, kernel sizes")
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool/v_pool [rows, nKV, hd] expected, got {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    b, width = k0.shape
    n_kv, hd = k_pool.shape[1:]
    if n_kv * hd != width or hd < 16 or hd & (hd - 1):
        raise ValueError(f"pools {tuple(k_pool.shape)} need a power-of-two hd >= 16 with nKV * hd = {width}")
    if k_norm_weight.shape != (hd,) or k_norm_weight.dtype not in _FLOATS or k_norm_weight.stride(0) != 1:
        raise ValueError(f"k_norm_weight must be a contiguous float [hd]={hd}, got {k_norm_weight.dtype} "
                         f"{tuple(k_norm_weight.shape)}")  # fmt: skip
    if k_pool.dtype not in _FLOATS or v_pool.dtype not in _FLOATS or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError(f"pools must be float with a unit last stride, got {k_pool.dtype} {k_pool.stride()}, "
                         f"{v_pool.dtype} {v_pool.stride()}")  # fmt: skip
    if kv_rows.shape != (b,) or kv_rows.dtype != torch.int64 or kv_rows.device != k0.device:
        raise ValueError(
            f"kv_rows must be int64 [B]={b}, got {kv_rows.dtype} {tuple(kv_rows.shape)} on {kv_rows.device}"
        )
    return k, n_kv, hd


def _check_queries(q: torch.Tensor | None, q_norm_weight: torch.Tensor | None, b: int, n_kv: int, hd: int) -> int:
    """Validate the optional queries of the prologue; returns the query heads per kv head (0 without q)."""
    if (q is None) != (q_norm_weight is None):
        raise ValueError("q and q_norm_weight: give both (queries normed in the prologue) or neither")
    if q is None:
        return 0
    if q.dim() != 3 or q.shape[0] != b or q.shape[2] != hd or q.shape[1] % n_kv or q.stride(-1) != 1:
        raise ValueError(
            f"q must be [B={b}, nH, hd={hd}] with nH a multiple of nKV={n_kv} and a unit last stride, got "
            f"{tuple(q.shape)} strides {q.stride()}"
        )
    if q.dtype not in _FLOATS or q.device != q_norm_weight.device:
        raise ValueError(f"q must be fp32/fp16/bf16 on q_norm_weight's device, got {q.dtype} on {q.device}")
    if q_norm_weight.shape != (hd,) or q_norm_weight.dtype not in _FLOATS or q_norm_weight.stride(0) != 1:
        raise ValueError(f"q_norm_weight must be a contiguous float [hd]={hd}, got {q_norm_weight.dtype} "
                         f"{tuple(q_norm_weight.shape)}")  # fmt: skip
    return q.shape[1] // n_kv


def kv_prologue(
    k0: torch.Tensor,
    v0: torch.Tensor,
    k_states: torch.Tensor,
    v_states: torch.Tensor,
    slots: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_rows: torch.Tensor,
    q: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    q_eps: float = 1e-6,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor | None:
    """k0, v0 ``[B, nKV*hd]`` -> ``k_pool[kv_rows] = k_norm(conv_k(k0))``, ``v_pool[kv_rows] = conv_v(v0)``
    (pools ``[rows, nKV, hd]``), conv states ``[num_slots, K-1, nKV*hd]`` updated in place at ``slots``; returns
    ``q_norm(q)`` ``[B, nH, hd]`` (contiguous, dtype of q and q_norm_weight promoted) when q is given, else None.
    ``tiles``: (rows, warps) per program, by default ``KV_TILES``' for B."""
    import triton

    from inkling_kernels import _triton_short_conv as tk

    k, n_kv, hd = _check_prologue(
        k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, k_pool, v_pool, kv_rows
    )
    b = k0.shape[0]
    group = _check_queries(q, q_norm_weight, b, n_kv, hd)
    q_out = None
    if q is not None:
        q_out = torch.empty(q.shape, dtype=torch.promote_types(q_norm_weight.dtype, q.dtype), device=q.device)
    if b == 0:
        return q_out
    # Grid: (row group, kv head); a program holds one head of k and of v (hd channels, the span of the k-norm) and
    # the kv head's group of query heads, of each of its rows.
    block_b, num_warps = tiles or tiles_for(KV_TILES, b)
    tk.kv_prologue_kernel[(triton.cdiv(b, block_b), n_kv)](
        k0,
        v0,
        k_states,
        v_states,
        slots,
        k_weight,
        v_weight,
        k_norm_weight,
        k_pool,
        v_pool,
        kv_rows,
        q if q is not None else k0,
        q_norm_weight if q is not None else k_norm_weight,
        q_out if q is not None else k0,
        b,
        float(eps),
        float(q_eps),
        k0.stride(0),
        v0.stride(0),
        k_states.stride(0),
        k_states.stride(1),
        v_states.stride(0),
        v_states.stride(1),
        k_weight.stride(0),
        k_weight.stride(1),
        v_weight.stride(0),
        v_weight.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        q.stride(0) if q is not None else 0,
        q.stride(1) if q is not None else 0,
        q_out.stride(0) if q is not None else 0,
        q_out.stride(1) if q is not None else 0,
        KERNEL_SIZE=k,
        HEAD_DIM=hd,
        NORM_DTYPE=tk.TL_DTYPES[torch.promote_types(k_norm_weight.dtype, k0.dtype)],
        BLOCK_B=block_b,
        HAS_Q=q is not None,
        GROUP=max(group, 1),
        GROUP_ROWS=triton.next_power_of_2(max(group, 1)),
        num_warps=num_warps,
        enable_fp_fusion=False,
        **pdl(k0),
    )
    return q_out


def kv_prologue_reference(
    k0: torch.Tensor,
    v0: torch.Tensor,
    k_states: torch.Tensor,
    v_states: torch.Tensor,
    slots: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_rows: torch.Tensor,
    q: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    q_eps: float = 1e-6,
) -> torch.Tensor | None:
    """Torch reference of ``kv_prologue`` (same arguments and result; writes the pools and states in place)."""
    b = k0.shape[0]
    n_kv, hd = k_pool.shape[1:]
    k, _ = conv_decode_reference(k0, k_states, slots, k_weight)
    v, _ = conv_decode_reference(v0, v_states, slots, v_weight)
    k = rms_norm_reference(k.view(b * n_kv, hd), k_norm_weight, eps)  # [B*nKV, hd]
    k_pool.index_copy_(0, kv_rows, k.view(b, n_kv, hd).to(k_pool.dtype))
    v_pool.index_copy_(0, kv_rows, v.view(b, n_kv, hd).to(v_pool.dtype))
    if q is None:
        return None
    return rms_norm_reference(q.reshape(-1, hd), q_norm_weight, q_eps).view(q.shape)
