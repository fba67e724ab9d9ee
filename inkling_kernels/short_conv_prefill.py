"""The depthwise causal short convs (spec inkling-text 4.2) over a packed batch of prefill chunks, one launch.

Rows ``cu_seqlens[b] .. cu_seqlens[b+1]`` of x ``[T, C]`` are the new inputs of sequence b (``seq_ids[t]`` names the
sequence of row t), continuing from its state ``states[b]`` ``[K-1, C]`` (oldest first). Per sequence, exactly as
``ShortConv.step`` of decode_service/model/layers.py:

    window = cat(states[b].to(x.dtype), x_b).float()                                  [K-1+n, C]
    y[t] = (x_b[t].float() + sum_j window[t + j] * w[:, j]).to(x.dtype)  (fp32, terms added in order j)
    new_states[b] = window[-(K-1):].to(x.dtype)

``conv_prefill`` returns ``y`` (or ``residual + y``, rounded like torch's add), or, given ``norm_weight`` of width
``head_dim``, the per-head RMSNorm of y (``Attention.k_norm`` of the convolved keys), and the new states as their
own ``[B, K-1, C]`` tensor in x's dtype (the old ones are left as they were: the caller stores the new ones).
"""

from __future__ import annotations

import torch

from inkling_kernels.pdl import pdl
from inkling_kernels.rms_norm import rms_norm_reference

_BLOCK_T = 16
_BLOCK_C = 256


def _check(x, states, seq_ids, cu_seqlens, weight, residual, norm_weight, head_dim):
    if x.dim() != 2 or states.dim() != 3 or weight.dim() != 2:
        raise ValueError(f"x [T, C], states [B, K-1, C], weight [C, K] expected, got {tuple(x.shape)}, "
                         f"{tuple(states.shape)}, {tuple(weight.shape)}")  # fmt: skip
    t, c = x.shape
    b, k = states.shape[0], weight.shape[1]
    if not 2 <= k <= 8 or weight.shape[0] != c or states.shape[1:] != (k - 1, c):
        raise ValueError(f"weight {tuple(weight.shape)} and states {tuple(states.shape)} do not fit x {tuple(x.shape)} "
                         "with a kernel size 2..8")  # fmt: skip
    if (
        seq_ids.shape != (t,)
        or cu_seqlens.shape != (b + 1,)
        or torch.int32 != seq_ids.dtype
        or torch.int32 != cu_seqlens.dtype
    ):
        raise ValueError(
            f"seq_ids int32 [T]={t} and cu_seqlens int32 [B+1]={b + 1} expected, got "
            f"{seq_ids.dtype} {tuple(seq_ids.shape)}, {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if x.stride(-1) != 1 or states.stride(-1) != 1:
        raise ValueError(f"x and states need a unit last stride, got {x.stride()} and {states.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype} with a unit last stride, got "
                         f"{tuple(residual.shape)} {residual.dtype} strides {residual.stride()}")  # fmt: skip
    if norm_weight is not None:
        if residual is not None:
            raise ValueError("norm_weight and residual: the per-head norm follows a conv without a residual")
        if head_dim is None or norm_weight.shape != (head_dim,) or c % head_dim or head_dim & (head_dim - 1):
            raise ValueError(f"norm_weight [head_dim] with a power-of-two head_dim dividing C={c} expected, got "
                             f"{tuple(norm_weight.shape)} and head_dim={head_dim}")  # fmt: skip
        if norm_weight.stride(0) != 1:
            raise ValueError(f"norm_weight must be contiguous, got strides {norm_weight.stride()}")
    return k


def conv_prefill(
    x: torch.Tensor,
    states: torch.Tensor,
    seq_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    head_dim: int | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[T, C]`` (packed chunks), states ``[B, K-1, C]``, seq_ids int32 ``[T]``, cu_seqlens int32 ``[B+1]``,
    weight ``[C, K]`` -> (``y``, ``residual + y`` or ``norm(y)`` per head ``[T, C]``, new states ``[B, K-1, C]``)."""
    import triton

    from inkling_kernels import _triton_short_conv as tk

    k = _check(x, states, seq_ids, cu_seqlens, weight, residual, norm_weight, head_dim)
    t, c = x.shape
    out_dtype = x.dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, x.dtype)
    out = torch.empty((t, c), dtype=out_dtype, device=x.device)
    new_states = torch.empty(states.shape, dtype=x.dtype, device=x.device)
    if t == 0:
        return out, new_states.copy_(states)
    block_c = head_dim if norm_weight is not None else min(_BLOCK_C, triton.next_power_of_2(c))
    tk.conv_prefill_kernel[(triton.cdiv(t, _BLOCK_T), triton.cdiv(c, block_c))](
        x, states, new_states, seq_ids, cu_seqlens, weight,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight,
        out, t, c, float(eps),
        x.stride(0), states.stride(0), states.stride(1), new_states.stride(0), new_states.stride(1),
        weight.stride(0), weight.stride(1), residual.stride(0) if residual is not None else 0, out.stride(0),
        KERNEL_SIZE=k,
        BLOCK_T=_BLOCK_T,
        BLOCK_C=block_c,
        HAS_RESIDUAL=residual is not None,
        HAS_NORM=norm_weight is not None,
        num_warps=4,
        enable_fp_fusion=False, **pdl(x),
    )  # fmt: skip
    return out, new_states


def conv_prefill_reference(
    x: torch.Tensor,
    states: torch.Tensor,
    seq_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    head_dim: int | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``conv_prefill`` (same arguments and results), one sequence at a time."""
    k = weight.shape[1]
    w = weight.float()  # [C, K]
    outs, new_states = [], []
    bounds = cu_seqlens.tolist()
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        xb, n = x[lo:hi], hi - lo
        window = torch.cat([states[b].to(x.dtype), xb]).float()  # [K-1+n, C]
        conv = sum(window[j : j + n] * w[:, j] for j in range(k))  # [n, C]
        outs.append((xb.float() + conv).to(x.dtype))
        new_states.append(window[-(k - 1) :].to(x.dtype))
    y = torch.cat(outs)  # [T, C]
    if residual is not None:
        y = residual + y
    if norm_weight is not None:
        y = rms_norm_reference(y.view(-1, head_dim), norm_weight, eps).view(y.shape)
    return y, torch.stack(new_states)
