"""Triton code that unpacks NVFP4 weight tiles in registers for the MoE kernels (``_triton_moe``).

The low nibble of byte m is column 2m and the high nibble column 2m+1, so a tile comes out as its even and its odd
columns (a K block is two dots). e2m1 codes become fp16 by bit placement (value * 2^-14, exact); the e4m3 block
scale is decoded from its bits with the 2^14 folded in, so ``code * scale`` is exact in bf16; the kernels apply the
per-expert fp32 ``scale2`` to their fp32 accumulators (times ``ASM_UNSCALE`` on the asm path). ``SHUFFLED``
(``inkling_kernels.moe.shuffle_nvfp4``'s layout, the model's under the fast ops): the packed weights are loaded as
int32 words and each word's 8 weights come out of one elementwise asm, so the unpack does not depend on how the MMA
operand's registers group bytes (mma.sync or wgmma, kperm or not).
"""

import triton
import triton.language as tl


@triton.jit
def _e2m1_times_2pow_m14(c):
    # c: integer nibble 0..15 (bit 3 sign, bits 0..2 exponent/mantissa) -> fp32 value * 2^-14, exact.
    c = c.to(tl.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_times_2pow14(b):
    # b: uint8 bits of a float8_e4m3fn -> fp32 value * 2^14 (NaN codes are not expected in scales).
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 134) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7+14) * (1 + m/8)
    sub = m.to(tl.float32) * 32.0  # 2^-6 * m/8 * 2^14
    v = tl.where(e == 0, sub, normal)
    return tl.where((b & 128) != 0, -v, v)


# 4 packed bytes -> the 4 low-nibble and the 4 high-nibble weights as bf16, times (block scale * 2^119).
# Bytes b0, b1 (b2, b3) are spread to the low bytes of the two register halves (prmt 0x4140 / 0x4342).
# For a nibble n at bits 0..3 of a half, n * (2^6 + 2^12) puts its magnitude bits at 8..6 and a copy of
# its sign at bit 15 with no carries between the copies; masking with 0x81C0 leaves the bf16 of
# e2m1 * 2^-126 (the 0.5 code lands on a bf16 subnormal). The high nibble (bits 4..7) uses 2^2 + 2^8.
# One packed multiply by the bf16 (scale * 2^119) gives e2m1 * scale * 2^-7 exactly (<= 6 significant
# bits); the epilogue multiplies by 2^7 * scale2.
_E2M1_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 t0, t1, a;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
and.b32 a, t0, 0x000F000F; mul.lo.u32 a, a, 4160; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $0, a, $5;
and.b32 a, t1, 0x000F000F; mul.lo.u32 a, a, 4160; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $1, a, $6;
and.b32 a, t0, 0x00F000F0; mul.lo.u32 a, a, 260; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $2, a, $5;
and.b32 a, t1, 0x00F000F0; mul.lo.u32 a, a, 260; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $3, a, $6;
}
""")
ASM_UNSCALE: tl.constexpr = tl.constexpr(128.0)  # 2^7 taken out of the weights by the asm path

# The same outputs from one word of the shuffled layout (``inkling_kernels.moe.shuffle_nvfp4``), loaded whole as an
# int32: its 8 codes sit so that each bf16 pair is the word rotated left by 0, 4 or 10 bits and masked (pairs lo(b0,
# b1), lo(b2, b3), hi(b0, b1)); the last pair, hi(b2, b3), takes its bits from the rotations by 6 and 30. 9 integer
# instructions and 4 packed multiplies per 8 weights (18 above, whose nibbles need spreading and a multiply to
# place). Outputs: 8 bf16 (lo(b0), lo(b1), lo(b2), lo(b3), hi(b0), ..., hi(b3)); $9: the word's block scale * 2^119
# in both bf16 halves. Elementwise over whole words, it is right whatever register layout the MMA operand takes
# (the 4-byte groups of a wgmma register operand span two rows: a byte-packed unpack of this layout is wrong there).
_E2M1_SHUFFLED_WORD_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 r, a, b, o;
and.b32 a, $8, 0x81C081C0; mul.rn.bf16x2 o, a, $9; mov.b32 {$0, $1}, o;
shf.l.wrap.b32 r, $8, $8, 4; and.b32 a, r, 0x81C081C0; mul.rn.bf16x2 o, a, $9; mov.b32 {$2, $3}, o;
shf.l.wrap.b32 r, $8, $8, 10; and.b32 a, r, 0x81C081C0; mul.rn.bf16x2 o, a, $9; mov.b32 {$4, $5}, o;
shf.l.wrap.b32 r, $8, $8, 6; and.b32 a, r, 0x80C080C0;
shf.l.wrap.b32 r, $8, $8, 30; and.b32 b, r, 0x01000100; or.b32 a, a, b; mul.rn.bf16x2 o, a, $9; mov.b32 {$6, $7}, o;
}
""")

# 2 e4m3 scale bytes -> bf16x2 of scale * 2^119, exact for every non-NaN code (0 included): the native e4m3 -> f16
# convert (one F2FP on sm_89+); e4m3 values are f16-normal with zero low mantissa bits, so the f16 magnitude moved
# down 3 bits reads as the bf16 of scale * 2^-112 (normal, or 0); the sign goes back to bit 15, then two exact
# power-of-two multiplies (2^127 * 2^104). 3 instructions per scale instead of ~6 for the fp32 route below.
_E4M3_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 f, t, c;
cvt.rn.f16x2.e4m3x2 f, $1;
and.b32 t, f, 0x7FFF7FFF;
shr.b32 t, t, 3;
and.b32 f, f, 0x80008000;
or.b32 t, t, f;
mov.b32 c, 0x7F007F00;
mul.rn.bf16x2 t, t, c;
mov.b32 c, 0x73807380;
mul.rn.bf16x2 $0, t, c;
}
""")


@triton.jit
def _e4m3_times_2pow119(b):
    # e4m3 bits moved into an fp32 (sign to 31, exponent+mantissa to 26..20) read as scale * 2^-120 for
    # normal and subnormal codes alike; two exact multiplies bring it to scale * 2^119 (<= 1.75 * 2^127).
    b = b.to(tl.int32)
    v = (((b & 0x7F) << 20) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return (v * 1.329227995784916e36) * 6.646139978924579e35  # * 2^120 * 2^119


@triton.jit
def _code(word, b0: tl.constexpr, b1: tl.constexpr, b2: tl.constexpr, b3: tl.constexpr):
    # the e2m1 code whose bits 0..3 sit at bits b0..b3 of the 32-bit word
    return ((word >> b0) & 1) | (((word >> b1) & 1) << 1) | (((word >> b2) & 1) << 2) | (((word >> b3) & 1) << 3)


@triton.jit
def _interleave4(c0, c1, c2, c3):
    # [.., W] x 4 -> [.., 4W]: element 4w + i from c_i
    t = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(t, [c0.shape[0], c0.shape[1] * 4])


@triton.jit
def _shuffled_codes(packed):
    """Bytes [BN, BK/2] of the shuffled layout -> the (low, high) nibble codes of the canonical bytes, as int32."""
    BN: tl.constexpr = packed.shape[0]
    WORDS: tl.constexpr = packed.shape[1] // 4
    even, odd = tl.split(tl.reshape(packed.to(tl.int32), [BN, WORDS, 2, 2]))  # bytes (0, 2), (1, 3) of each word
    byte0, byte2 = tl.split(even)
    byte1, byte3 = tl.split(odd)
    word = byte0 | (byte1 << 8) | (byte2 << 16) | (byte3 << 24)
    lo = _interleave4(_code(word, 6, 7, 8, 15), _code(word, 22, 23, 24, 31), _code(word, 2, 3, 4, 11),
                      _code(word, 18, 19, 20, 27))  # fmt: skip
    hi = _interleave4(_code(word, 28, 29, 30, 5), _code(word, 12, 13, 14, 21), _code(word, 0, 1, 10, 9),
                      _code(word, 16, 17, 26, 25))  # fmt: skip
    return lo, hi


@triton.jit
def _shuffled_scale_times_2pow14(b):
    # a scale byte of the shuffled layout, (exponent + 10) * 8 + mantissa -> fp32 scale * 2^14
    return ((b.to(tl.int32) << 20) + (131 << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _shuffled_word_tile(W, w_row_off, k0, stride_wn, offs_n, raw_scale, BLOCK_K: tl.constexpr, KPERM: tl.constexpr):
    """``fp4_tile`` for ASM + SHUFFLED: (lo, hi) bf16, the weights times scale * 2^-7 as the canonical asm's; KPERM:
    [BN, C, 2, 4, 2] (c, h, l, b: column 16c + 8h + 2l + b of each half from byte 2h + b of word 4c + l), else
    [BN, WORDS, 2, 2] (column 4w + 2h + b)."""
    BN: tl.constexpr = offs_n.shape[0]
    WORDS: tl.constexpr = BLOCK_K // 8
    C: tl.constexpr = BLOCK_K // 32
    words = W.to(tl.pointer_type(tl.int32)) + w_row_off // 4 + offs_n[:, None] * (stride_wn // 4)
    word = tl.load(words + (k0 // 8 + tl.arange(0, WORDS)[None, :]))  # [BN, WORDS]: byte offsets are multiples of 4
    # scale * 2^119 as bf16 in both halves: (B * 16 + 0x7600) * 0x10001, one per 2 words
    scale = raw_scale.to(tl.int32) * 0x100010 + 0x76007600
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, WORDS // 2, 2)), [BN, WORDS])
    e = tl.inline_asm_elementwise(_E2M1_SHUFFLED_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [word, scale],
                                  dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)  # fmt: skip
    lo = tl.join(tl.join(e[0], e[1]), tl.join(e[2], e[3]))  # [BN, WORDS, b, h]
    hi = tl.join(tl.join(e[4], e[5]), tl.join(e[6], e[7]))
    if KPERM:
        lo = tl.permute(tl.reshape(lo, [BN, C, 4, 2, 2]), [0, 1, 4, 2, 3])
        hi = tl.permute(tl.reshape(hi, [BN, C, 4, 2, 2]), [0, 1, 4, 2, 3])
    else:  # column 4w + 2h + b from byte 2h + b of word w
        lo = tl.permute(lo, [0, 1, 3, 2])
        hi = tl.permute(hi, [0, 1, 3, 2])
    return lo, hi


@triton.jit
def fp4_tile(
    W,
    S,
    w_row_off,
    s_row_off,
    k0,
    stride_wn,
    stride_sn,
    offs_n,
    BLOCK_K: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
    KPERM: tl.constexpr = False,
    SHUFFLED: tl.constexpr = False,
):
    """Dequantise rows ``offs_n`` x columns [k0, k0 + BLOCK_K) -> (even cols, odd cols), each [BN, BK/2].

    ``ASM`` (GPU, bf16 only): packed-bf16 inline PTX (1: fp32 scale decode, 2: e4m3 convert for the scales);
    otherwise portable Triton arithmetic (interpreter).
    ``KPERM``: column j = 16c + 8h + 2l + b of each half holds packed byte 16c + 4l + 2h + b (``kperm_bytes``), so
    the 4 bytes an MMA operand thread holds per row and 16-column step are contiguous and share one block scale.
    ``SHUFFLED``: weights and scales in ``inkling_kernels.moe.shuffle_nvfp4``'s layout (the same even/odd columns out).
    """
    BN: tl.constexpr = offs_n.shape[0]
    G: tl.constexpr = BLOCK_K // 16
    offs_g = tl.arange(0, G)
    offs_b = tl.arange(0, BLOCK_K // 2)
    # 2-D load (rows of BLOCK_K/2 contiguous bytes -> 16-byte copies), then [BN, G, 8]: one scale per 8 bytes.
    s_ptrs = S + s_row_off + offs_n[:, None] * stride_sn + (k0 // 16 + offs_g[None, :])
    raw_scale = tl.load(s_ptrs)
    if ASM and SHUFFLED:
        lo, hi = _shuffled_word_tile(W, w_row_off, k0, stride_wn, offs_n, raw_scale, BLOCK_K, KPERM)
    elif ASM:
        packed = tl.load(W + w_row_off + offs_n[:, None] * stride_wn + (k0 // 2 + offs_b[None, :]))
        if ASM == 2:
            scale = tl.inline_asm_elementwise(_E4M3_ASM, "=r,h", [raw_scale], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            scale = _e4m3_times_2pow119(raw_scale).to(tl.bfloat16)
        if KPERM:  # [BN, c, lh, ll, h, b] (byte 16c + 8lh + 4ll + 2h + b) -> [BN, c, h, lh, ll, b] (column j)
            C: tl.constexpr = BLOCK_K // 32
            packed = tl.permute(tl.reshape(packed, [BN, C, 2, 2, 2, 2]), [0, 1, 4, 2, 3, 5])
            scale = tl.broadcast_to(tl.reshape(scale, [BN, C, 1, 2, 1, 1]), (BN, C, 2, 2, 2, 2))  # group 2c + lh
        else:
            packed = tl.reshape(packed, [BN, G, 8])
            scale = tl.broadcast_to(scale[:, :, None], (BN, G, 8))
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_ASM, "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    else:
        packed = tl.load(W + w_row_off + offs_n[:, None] * stride_wn + (k0 // 2 + offs_b[None, :]))
        if SHUFFLED:
            lo, hi = _shuffled_codes(packed)
            scale = _shuffled_scale_times_2pow14(raw_scale)
        else:
            lo, hi = packed & 15, packed >> 4
            scale = _e4m3_times_2pow14(raw_scale)
        if KPERM:
            C: tl.constexpr = BLOCK_K // 32
            lo = tl.permute(tl.reshape(lo, [BN, C, 2, 2, 2, 2]), [0, 1, 4, 2, 3, 5])
            hi = tl.permute(tl.reshape(hi, [BN, C, 2, 2, 2, 2]), [0, 1, 4, 2, 3, 5])
            scale = tl.reshape(scale, [BN, C, 1, 2, 1, 1])
        else:
            lo = tl.reshape(lo, [BN, G, 8])
            hi = tl.reshape(hi, [BN, G, 8])
            scale = scale[:, :, None]
        lo = (_e2m1_times_2pow_m14(lo) * scale).to(DT)
        hi = (_e2m1_times_2pow_m14(hi) * scale).to(DT)
    return tl.reshape(lo, [BN, BLOCK_K // 2]), tl.reshape(hi, [BN, BLOCK_K // 2])
