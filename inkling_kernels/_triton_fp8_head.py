"""Triton code for the FP8 draft lm_head ``logits = s * (z @ W8^T)``. Public entry: inkling_kernels/fp8_head.py.

Each program (column block of the logits, row block of x) streams its ``BLOCK_N`` e4m3 weight rows over the whole
of K once and accumulates an fp32 ``[BLOCK_N, BLOCK_M]`` tile; the epilogue multiplies each column by its row scale
and stores fp32.

``fp8_dot_kernel``: the tensor cores, the weight tile as the MMA's left operand (swap-AB: the rows of x,
zero-padded to ``BLOCK_M`` >= 8, are its N) and x already divided (the caller's one elementwise launch: every column
block re-reads x, so dividing it here would repeat the division per program and keep x out of the pipelined
copies). The weights and x come through shared memory by Triton's pipelined copies; the weight tile is converted
to x's dtype in registers, in the layout of the MMA operand. ``ASM_PACK`` (bf16 x on the GPU): the e4m3 -> bf16
conversion as integer ops and one packed multiply (``_E4M3_BF16_ASM``) instead of Triton's convert, which goes
through fp16 and costs a quarter-rate F2F per weight (Triton 3.6, sm_90: 1 F2F + 1/2 F2FP per weight against
2 full-rate ops). Its value is the weights per asm call: 4 where the operand holds 8 consecutive K per thread
(mma.sync), 2 where it holds pairs (wgmma), so the asm's inputs are whole registers and need no byte shuffles.
"""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait

# e4m3 bytes -> bf16 of the same values. A byte is spread to a 16-bit half with its sign replicated above it (prmt
# mode 8), moved up 4 bits and masked to sign | 0000 | eeee mmm | 0000: the bf16 of value * 2^-120 for normal codes
# (exponent e - 7 + 127 - 120) and subnormal ones (e = 0: bf16 subnormal m/8 * 2^-126) alike; one packed multiply by
# 2^120 (0x7B80) restores the value exactly. NaN codes (quantize_rows_fp8 writes none) read as 480.
_E4M3_BF16_STEP = """
prmt.b32 a, {src}, 0, {sel};
shl.b32 a, a, 4;
and.b32 a, a, 0x87F087F0;
mul.rn.bf16x2 {dst}, a, c;"""
_E4M3_BF16_X4_ASM: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 a, c;\nmov.b32 c, 0x7B807B80;"
    + _E4M3_BF16_STEP.format(src="$2", sel="0x9180", dst="$0")
    + _E4M3_BF16_STEP.format(src="$2", sel="0xB3A2", dst="$1")
    + "\n}"
)  # 4 bytes in one register -> bf16x2 (bytes 0, 1), bf16x2 (bytes 2, 3)
_E4M3_BF16_X2_ASM: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 a, c, p;\nmov.b32 c, 0x7B807B80;\ncvt.u32.u16 p, $1;"
    + _E4M3_BF16_STEP.format(src="p", sel="0x9180", dst="$0")
    + "\n}"
)  # 2 bytes in a 16-bit register -> bf16x2


@triton.jit
def _to_operand(w, DT: tl.constexpr, ASM_PACK: tl.constexpr):
    """e4m3 tile -> the same values in x's dtype (exact: every e4m3 value is an fp16, bf16 and fp32 value)."""
    if ASM_PACK == 4:
        return tl.inline_asm_elementwise(_E4M3_BF16_X4_ASM, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)  # fmt: skip
    elif ASM_PACK == 2:
        return tl.inline_asm_elementwise(_E4M3_BF16_X2_ASM, "=r,h", [w.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)  # fmt: skip
    else:
        return w.to(DT)


# one compile for every batch size (the sizes and the output stride only bound masks)
@triton.jit(do_not_specialize=["M", "N", "K", "stride_om"])
def fp8_dot_kernel(
    X,
    W,
    Scale,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    ASM_PACK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    dtype: tl.constexpr = X.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # logit columns = weight rows
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # row masks only: constant along K, so the copies stay 16 bytes wide
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_IEEE:  # fp32 operands: exact fp32 products, no TF32
            acc = tl.dot(w.to(tl.float32), tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(_to_operand(w, dtype, ASM_PACK), tl.trans(x), acc)
    scale = tl.load(Scale + offs_n, mask=n_mask, other=0.0)  # each logit column times its weight row's scale
    out_ptrs = Out + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc * scale[:, None], mask=n_mask[:, None] & m_mask[None, :])
