"""SwiGLU of a GEMM's gate/up output for prefill-sized rows, in one pass (torch takes two or three):

    out[t, g * I + j] = round(round(silu(gate)) * up) [* round(gammas[t, g])]   (gate, up = gate_up[t, g, 0 / 1, j])

``gate_up`` ``[T, G * 2I]`` holds G groups of [gate; up] columns (the dense MLP: G = 1; the shared experts: one
group per expert, scaled by its router gamma). Each step rounds to the activation dtype as torch's
``F.silu(gate) * up * gammas.to(dtype)`` does (``inkling_kernels.skinny_gemm.skinny_swiglu_reference`` after its GEMM),
in fp32 between the roundings. Reads ``gate_up`` once and writes the ``[T, G * I]`` result: 3 bytes moved per
2 of torch's 5 (7 with gammas). Grid ``(T, cdiv(G * I, BLOCK))``; no host reads (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inkling_kernels.pdl import pdl

_BLOCK = 1024  # columns per program


def swiglu(gate_up: torch.Tensor, width: int, gammas: torch.Tensor | None = None) -> torch.Tensor:
    """``gate_up`` ``[T, G * 2 * width]`` (unit last stride) -> ``[T, G * width]`` in its dtype; ``gammas`` fp32
    ``[T, G]`` or None."""
    from inkling_kernels import _triton_swiglu as tk

    t, cols = gate_up.shape
    if cols % (2 * width) or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up [T, G*2*{width}] with a unit last stride expected, got {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")  # fmt: skip
    groups = cols // (2 * width)
    if gammas is not None and (tuple(gammas.shape) != (t, groups) or gammas.dtype != torch.float32):
        raise ValueError(f"gammas must be fp32 [{t}, {groups}], got {gammas.dtype} {tuple(gammas.shape)}")
    out = torch.empty((t, groups * width), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    grid = (t, -(-groups * width // _BLOCK))
    tk.swiglu_kernel[grid](
        gate_up, gammas if gammas is not None else gate_up, out, groups * width, width,
        gate_up.stride(0), gammas.stride(0) if gammas is not None else 0, out.stride(0),
        HAS_GAMMAS=gammas is not None, BLOCK=_BLOCK, num_warps=4, **pdl(gate_up),
    )  # fmt: skip
    return out


def swiglu_reference(gate_up: torch.Tensor, width: int, gammas: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of ``swiglu`` (same arguments and result)."""
    t = gate_up.shape[0]
    halves = gate_up.view(t, -1, 2, width)  # [T, G, 2, I]
    act = F.silu(halves[:, :, 0]) * halves[:, :, 1]  # [T, G, I]
    if gammas is not None:
        act = act * gammas.to(gate_up.dtype)[:, :, None]
    return act.reshape(t, -1)
