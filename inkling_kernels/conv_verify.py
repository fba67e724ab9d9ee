"""Verify step of the depthwise causal short convs (spec inkling-text 4.2, 7.5): W new rows per sequence, the
conv state committed once acceptance is known.

Sequence b brings rows ``x[b*W .. b*W+W-1]`` (in order) onto its state ``S = states[slots[b]]`` ``[K-1, C]``.
Exactly as ``ShortConv.step`` of decode_service/model/layers.py over those W rows:

    window = cat(S.to(x.dtype), x_b).float()                               [K-1+W, C]
    y_j = (x_j.float() + sum_i window[j + i] * w[:, i]).to(x.dtype)       (fp32, terms added in order i = 0..K-1)

The state is NOT updated: the launch writes ``windows[b] = cat(S, x_b)`` in the state dtype ``[K-1+W, C]``, and
``ConvCommit`` later installs ``states[slots[b]] = windows[b, n_b : n_b + K-1]`` for the ``n_b`` rows (0..W) the
verify accepted: the state after those rows, as n_b one-row ``conv_decode`` steps leave it (when the state dtype
holds x's values: the engine's pools share the activations' dtype).

* ``conv_verify`` returns ``y`` (or ``residual + y``, rounded like torch's add), for the residual-stream convs.
* ``kv_prologue_verify`` is ``inkling_kernels.short_conv.kv_prologue`` over the W rows: the k and v convs, the per-head
  k RMSNorm, the KV write of every row at ``kv_rows`` (all W rows are written before attention reads them, so
  causality inside the W rows holds through the rows' seq_lens) and the q RMSNorm, in one launch.

Slots are distinct except for the padding rows of a CUDA-graph bucket, which share the scratch slot. Grids come
from shapes alone and nothing is read back to the host: the kernels and references can be captured in a graph.
"""

from __future__ import annotations

import torch

from inkling_kernels.pdl import pdl
from inkling_kernels.rms_norm import rms_norm_reference

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_C = 512  # channels per program (as conv_decode's)


def _check(name: str, x: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
           windows: torch.Tensor) -> tuple[int, int]:  # fmt: skip
    """Validate one conv's operands; returns (K, W)."""
    if x.dim() != 2 or states.dim() != 3 or weight.dim() != 2 or windows.dim() != 3:
        raise ValueError(
            f"{name}: x [B*W, C], states [slots, K-1, C], weight [C, K], windows [B, K-1+W, C] expected, got "
            f"{tuple(x.shape)}, {tuple(states.shape)}, {tuple(weight.shape)}, {tuple(windows.shape)}"
        )
    c, k, b = x.shape[1], weight.shape[1], slots.shape[0]
    if not 2 <= k <= 8 or weight.shape[0] != c or states.shape[1:] != (k - 1, c):
        raise ValueError(f"{name}: weight {tuple(weight.shape)} and states {tuple(states.shape)} do not fit x "
                         f"{tuple(x.shape)} with a kernel size 2..8")  # fmt: skip
    width = windows.shape[1] - (k - 1)
    if slots.dim() != 1 or slots.dtype != torch.int64 or width < 1 or windows.shape != (b, k - 1 + width, c):
        raise ValueError(f"{name}: slots int64 [B] and windows [B, K-1+W, C] expected, got slots {slots.dtype} "
                         f"{tuple(slots.shape)}, windows {tuple(windows.shape)}")  # fmt: skip
    if x.shape[0] != b * width:
        raise ValueError(f"{name}: x has {x.shape[0]} rows, expected B*W = {b}*{width}")
    if windows.dtype != states.dtype:
        raise ValueError(f"{name}: windows must be in the states' dtype {states.dtype}, got {windows.dtype}")
    for t_name, t in (("x", x), ("states", states), ("weight", weight)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name}: {t_name} must be fp32/fp16/bf16, got {t.dtype}")
    if x.stride(-1) != 1 or states.stride(-1) != 1 or windows.stride(-1) != 1:
        raise ValueError(f"{name}: x, states and windows need a unit last stride")
    if len({t.device for t in (x, states, slots, weight, windows)}) != 1:
        raise ValueError(f"{name}: operands on several devices")
    return k, width


def conv_verify(
    x: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x ``[B*W, C]``, states ``[num_slots, K-1, C]`` (read only), slots int64 ``[B]``, weight ``[C, K]``, windows
    ``[B, K-1+W, C]`` (written) -> ``y`` or ``residual + y`` in x's dtype ``[B*W, C]``."""
    import triton

    from inkling_kernels import _triton_conv_verify as tk

    k, width = _check("conv_verify", x, states, slots, weight, windows)
    rows, c = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype} with a unit last stride, got "
                         f"{tuple(residual.shape)} {residual.dtype} strides {residual.stride()}")  # fmt: skip
    out = torch.empty((rows, c), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_c = min(triton.next_power_of_2(c), _BLOCK_C)
    # Grid: (row, channel block); enable_fp_fusion=False: the sums round like ShortConv.step's.
    tk.conv_verify_kernel[(rows, triton.cdiv(c, block_c))](
        x, states, slots, windows, weight, residual if residual is not None else x, out, c,
        x.stride(0), states.stride(0), states.stride(1), windows.stride(0), windows.stride(1),
        weight.stride(0), weight.stride(1), residual.stride(0) if residual is not None else 0, out.stride(0),
        WIDTH=width, KERNEL_SIZE=k, BLOCK_C=block_c, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block_c // 256)), enable_fp_fusion=False, **pdl(x),
    )  # fmt: skip
    return out


def conv_verify_reference(
    x: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of ``conv_verify`` (same arguments and result, windows written in place)."""
    k, b = weight.shape[1], slots.shape[0]
    width = windows.shape[1] - (k - 1)
    state = states.index_select(0, slots)  # [B, K-1, C]
    window = torch.cat([state.to(x.dtype), x.view(b, width, -1)], dim=1).float()  # [B, K-1+W, C]
    w = weight.float()  # [C, K]
    conv = sum(window[:, i : i + width] * w[:, i] for i in range(k))  # [B, W, C]
    y = (x.float() + conv.reshape(b * width, -1)).to(x.dtype)
    windows.copy_(torch.cat([state, x.view(b, width, -1).to(states.dtype)], dim=1))
    return y if residual is None else residual + y


def kv_prologue_verify(
    k0: torch.Tensor,
    v0: torch.Tensor,
    k_states: torch.Tensor,
    v_states: torch.Tensor,
    slots: torch.Tensor,
    k_windows: torch.Tensor,
    v_windows: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_rows: torch.Tensor,
    q: torch.Tensor,
    q_norm_weight: torch.Tensor,
    q_eps: float = 1e-6,
) -> torch.Tensor:
    """k0, v0 ``[B*W, nKV*hd]`` -> ``k_pool[kv_rows] = k_norm(conv_k(k0))``, ``v_pool[kv_rows] = conv_v(v0)``
    (pools ``[rows, nKV, hd]``, kv_rows int64 ``[B*W]``), the windows ``[B, K-1+W, nKV*hd]`` written, the states
    read only; returns ``q_norm(q)`` ``[B*W, nH, hd]`` (contiguous, dtype of q and q_norm_weight promoted)."""
    import triton

    from inkling_kernels import _triton_conv_verify as tk
    from inkling_kernels import _triton_short_conv as tsc

    k, width = _check("kv_prologue_verify k", k0, k_states, slots, k_weight, k_windows)
    if _check("kv_prologue_verify v", v0, v_states, slots, v_weight, v_windows) != (k, width) or v0.shape != k0.shape:
        raise ValueError(f"k and v convs differ: k0 {tuple(k0.shape)}, v0 {tuple(v0.shape)}, kernel sizes or widths")
    rows, kv_width = k0.shape
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError(f"k_pool/v_pool [rows, nKV, hd] with a unit last stride expected, got "
                         f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}")  # fmt: skip
    n_kv, hd = k_pool.shape[1:]
    if n_kv * hd != kv_width or hd < 16 or hd & (hd - 1):
        raise ValueError(f"pools {tuple(k_pool.shape)} need a power-of-two hd >= 16 with nKV * hd = {kv_width}")
    if kv_rows.shape != (rows,) or kv_rows.dtype != torch.int64 or kv_rows.device != k0.device:
        raise ValueError(f"kv_rows must be int64 [B*W]={rows}, got {kv_rows.dtype} {tuple(kv_rows.shape)}")
    if q.dim() != 3 or q.shape[0] != rows or q.shape[2] != hd or q.shape[1] % n_kv or q.stride(-1) != 1:
        raise ValueError(f"q must be [B*W={rows}, nH, hd={hd}] with nH a multiple of nKV={n_kv}, got {tuple(q.shape)}")
    for name, w, n in (("k_norm_weight", k_norm_weight, hd), ("q_norm_weight", q_norm_weight, hd)):
        if w.shape != (n,) or w.dtype not in _FLOATS or w.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous float [hd]={hd}, got {w.dtype} {tuple(w.shape)}")
    group = q.shape[1] // n_kv
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q_norm_weight.dtype, q.dtype), device=q.device)
    if rows == 0:
        return q_out
    # Grid: (row, kv head): one head of k and v of one row (the k-norm's span) and its group of query heads.
    tk.kv_prologue_verify_kernel[(rows, n_kv)](
        k0, v0, k_states, v_states, slots, k_windows, v_windows, k_weight, v_weight, k_norm_weight, k_pool, v_pool,
        kv_rows, q, q_norm_weight, q_out, float(eps), float(q_eps),
        k0.stride(0), v0.stride(0), k_states.stride(0), k_states.stride(1), v_states.stride(0), v_states.stride(1),
        k_windows.stride(0), k_windows.stride(1), v_windows.stride(0), v_windows.stride(1),
        k_weight.stride(0), k_weight.stride(1), v_weight.stride(0), v_weight.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        WIDTH=width, KERNEL_SIZE=k, HEAD_DIM=hd,
        NORM_DTYPE=tsc.TL_DTYPES[torch.promote_types(k_norm_weight.dtype, k0.dtype)],
        GROUP=group, GROUP_ROWS=triton.next_power_of_2(group),
        num_warps=max(1, hd // 128), enable_fp_fusion=False, **pdl(k0),
    )  # fmt: skip
    return q_out


def kv_prologue_verify_reference(
    k0: torch.Tensor,
    v0: torch.Tensor,
    k_states: torch.Tensor,
    v_states: torch.Tensor,
    slots: torch.Tensor,
    k_windows: torch.Tensor,
    v_windows: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_rows: torch.Tensor,
    q: torch.Tensor,
    q_norm_weight: torch.Tensor,
    q_eps: float = 1e-6,
) -> torch.Tensor:
    """Torch reference of ``kv_prologue_verify`` (same arguments and result; writes pools and windows in place)."""
    rows = k0.shape[0]
    n_kv, hd = k_pool.shape[1:]
    k = conv_verify_reference(k0, k_states, slots, k_weight, k_windows)
    v = conv_verify_reference(v0, v_states, slots, v_weight, v_windows)
    k = rms_norm_reference(k.view(rows * n_kv, hd), k_norm_weight, eps)  # [B*W*nKV, hd]
    k_pool.index_copy_(0, kv_rows, k.view(rows, n_kv, hd).to(k_pool.dtype))
    v_pool.index_copy_(0, kv_rows, v.view(rows, n_kv, hd).to(v_pool.dtype))
    return rms_norm_reference(q.reshape(-1, hd), q_norm_weight, q_eps).view(q.shape)


class ConvCommit:
    """A verify's conv commits, every conv in one launch: for every (windows, states) pair given at build,
    ``states[slots[b]] = windows[b, accepted[b] : accepted[b] + K-1]`` for every b, the conv state after the
    ``accepted[b]`` rows (0..W, device int64 ``[B]``, never read on the host; 0 keeps the state) a verify committed.

    Built once over the full window buffers (``[N, K-1+W, C]``, one per conv, C may differ; the graphs slice rows
    ``:B`` and ``:K-1+W`` of the same storage) and their state pools (``[slots, K-1, C]``), all of one dtype on one
    device: their places are element offsets from the first window in a small device table, so a call launches
    one program per (sequence, conv, block of channels) and uploads nothing (CUDA-graph safe).
    """

    _COLS = 7  # per conv: channels, window offset and strides (sequence, row), state offset and strides

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        if not pairs:
            raise ValueError("ConvCommit needs at least one (windows, states) pair")
        base, k1 = pairs[0][0], pairs[0][1].shape[1]
        rows = []
        for i, (windows, states) in enumerate(pairs):
            if windows.dim() != 3 or states.dim() != 3 or windows.shape[2] != states.shape[2]:
                raise ValueError(f"pair {i}: windows [N, K-1+W, C] and states [slots, K-1, C] expected, got "
                                 f"{tuple(windows.shape)}, {tuple(states.shape)}")  # fmt: skip
            if states.shape[1] != k1 or windows.shape[1] <= k1:
                raise ValueError(f"pair {i}: states of K-1={k1} rows and windows of more expected, got "
                                 f"{tuple(windows.shape)}, {tuple(states.shape)}")  # fmt: skip
            for t in (windows, states):
                if t.dtype != base.dtype or t.device != base.device or t.stride(-1) != 1:
                    raise ValueError(f"pair {i}: every window and state in {base.dtype} on {base.device} with a unit "
                                     f"last stride, got {t.dtype} on {t.device}, strides {t.stride()}")  # fmt: skip
            size = base.element_size()  # every allocation is aligned to its element size: whole elements apart
            offsets = [(t.data_ptr() - base.data_ptr()) // size for t in (windows, states)]
            rows.append([states.shape[2], offsets[0], *windows.stride()[:2], offsets[1], *states.stride()[:2]])
        self.pairs = list(pairs)  # the buffers the table points into stay alive with it
        self.k1 = k1
        self.max_batch = min(w.shape[0] for w, _ in pairs)
        self.max_channels = max(s.shape[2] for _, s in pairs)
        self.table = torch.tensor(rows, dtype=torch.int64).to(base.device)

    def __call__(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        import triton

        from inkling_kernels import _triton_conv_verify as tk

        b, base = slots.shape[0], self.pairs[0][0]
        for name, t in (("slots", slots), ("accepted", accepted)):
            if t.shape != (b,) or t.dtype != torch.int64 or t.device != base.device:
                raise ValueError(f"{name} must be int64 [B]={b} on the states' device, got {t.dtype} {tuple(t.shape)}")
        if b > self.max_batch:
            raise ValueError(f"{b} sequences, but the windows hold {self.max_batch}")
        if b == 0:
            return
        block_c = min(triton.next_power_of_2(self.max_channels), _BLOCK_C)
        tk.conv_commit_kernel[(b, len(self.pairs), triton.cdiv(self.max_channels, block_c))](
            base, self.table, slots, accepted, KERNEL_SIZE=self.k1 + 1, STATE_ROWS=triton.next_power_of_2(self.k1),
            BLOCK_C=block_c, META_COLS=self._COLS, num_warps=min(16, max(1, block_c // 256)), **pdl(base),
        )  # fmt: skip


def conv_commit_reference(
    windows: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor
) -> None:
    """``states[slots[b]] = windows[b, accepted[b] : accepted[b] + K-1]`` for every b: what ``ConvCommit`` does for each
    of its pairs, in torch."""
    k1 = states.shape[1]
    index = accepted[:, None] + torch.arange(k1, device=accepted.device)  # [B, K-1]
    rows = windows.gather(1, index[:, :, None].expand(-1, -1, windows.shape[2]))  # [B, K-1, C]
    states.index_copy_(0, slots, rows)
