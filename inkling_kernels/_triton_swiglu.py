"""Triton code for the prefill SwiGLU. Public entry: inkling_kernels/swiglu.py."""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def swiglu_kernel(
    GateUp, Gammas, Out, n_cols, width, stride_gm, stride_cm, stride_om, HAS_GAMMAS: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (t, c): output columns ``c * BLOCK ..`` of row t; column ``g * width + j`` reads gate column
    ``g * 2 * width + j`` and up column ``+ width``, rounding after silu, after the product and the gamma to
    Out's dtype."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    group = cols // width
    src = GateUp + t * stride_gm + group * width + cols  # = g * 2 * width + j
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = (act * up).to(dtype)
    if HAS_GAMMAS:
        gamma = tl.load(Gammas + t * stride_cm + group, mask=mask, other=0.0).to(dtype).to(tl.float32)
        act = (act.to(tl.float32) * gamma).to(dtype)
    tl.store(Out + t * stride_om + cols, act, mask=mask)
