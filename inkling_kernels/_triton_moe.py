"""Triton code for the routed-expert MoE (weight-only NVFP4 or bf16 weights). Public entry: inkling_kernels/moe.py.

Three launches per MoE call:
  1. ``moe_w13_kernel``: per (row block of one expert, tile of I[, slice of H]): gate and up accumulators over H,
     then ``silu(g) * u`` into an intermediate ``[n_pairs, I]`` (one row per (token, slot) pair); with
     ``PRESPLIT_K`` each PRESPLIT_K-wide column block is stored as [even columns | odd columns]. ``SPLIT_K``
     slices: fp32 partials in ``Partial``, the tile's last slice (``Count``) adds them, runs the epilogue and puts
     the tile's counter back to 0.
  2. ``moe_w2_kernel``: per (row block, tile of H): the down projection over I, times the pair's routing
     weight, into ``[n_pairs, H]`` fp32 (``PRESPLIT``: reads the split intermediate as two halves).
  3. ``moe_sum_kernel``: the fp32 sum of each token's k slots, one rounding to the output dtype.

``SWAP``: the MMA computes ``W_tile @ x^T`` (weights as its M operand, the block's rows as its N, padded
to 8) instead of ``x @ W_tile^T`` (rows as M, padded to 16): the dequantised weights feed the MMA without
the zero rows of the token operand, and there are half as many MMAs per weight.

Row blocks come from one of two routings (constexpr ``IDENTITY``):
  * identity: block b is pair b alone (expert ``topk_ids.flat[b]``); no metadata, best when pairs are few;
  * sorted: ``sorted_pairs[b * BLOCK_M + i]`` lists the pairs of expert ``block_expert[b]`` (sentinel
    ``n_pairs`` pads), built by ``inkling_kernels.moe_align.moe_align`` (its kernels: ``_triton_moe_align``); a
    block with expert -1 exits at once.
A masked route (id -1) is in no sorted block, its identity block exits at once, and the slot sum skips it.

NVFP4 weights are unpacked in registers: the low nibble of byte m is column 2m and the high nibble column
2m+1, so each K block issues two dots, the activations split into their even and odd columns. e2m1 codes
become fp16 by bit placement (value * 2^-14, exact); the e4m3 block scale is decoded from its bits with the
2^14 folded in, so ``code * scale`` is exact in bf16; the per-expert fp32 ``scale2`` is applied to the fp32
accumulator in the epilogue. ``SHUFFLED`` (``inkling_kernels.moe.shuffle_nvfp4``'s layout, the model's under the fast
ops): the packed weights are loaded as int32 words and each word's 8 weights come out of one elementwise asm, so the
unpack does not depend on how the MMA operand's registers group bytes (mma.sync or wgmma, kperm or not).
"""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


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
_ASM_UNSCALE: tl.constexpr = tl.constexpr(128.0)  # 2^7 taken out of the weights by the asm path

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
    """``_fp4_tile`` for ASM + SHUFFLED: (lo, hi) bf16, the weights times scale * 2^-7 as the canonical asm's; KPERM:
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
def _fp4_tile(
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


@triton.jit
def _mma(acc, x, w, SWAP: tl.constexpr):
    """acc += x @ w^T (acc [BM, BN]); SWAP: acc += w @ x^T (acc [BN, BM], the weights as the MMA's A operand)."""
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _wgmma_drain(ON: tl.constexpr):
    """With ON (sm_90 only): wait for this K step's wgmma groups before the next step's dequantisation writes the
    registers they read, so no group runs across the loop's back-edge (ptxas serialises every wgmma of a kernel where
    one does: C7515, one group of 4 k16 instructions then issues as 4 waited ones)."""
    if ON:
        tl.inline_asm_elementwise("wgmma.wait_group.sync.aligned 0; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)  # fmt: skip


@triton.jit
def _block_rows(TopkIds, SortedPairs, BlockExpert, pid_m, n_pairs, BLOCK_M: tl.constexpr, IDENTITY: tl.constexpr):
    """(expert, pair ids [BLOCK_M], valid [BLOCK_M]) of row block ``pid_m``; expert < 0: nothing to do."""
    offs_m = tl.arange(0, BLOCK_M)
    if IDENTITY:
        expert = tl.load(TopkIds + pid_m).to(tl.int32)
        pairs = pid_m + offs_m * 0
        valid = offs_m == 0
    else:
        expert = tl.load(BlockExpert + pid_m).to(tl.int32)
        pairs = tl.load(SortedPairs + pid_m * BLOCK_M + offs_m).to(tl.int32)
        valid = pairs < n_pairs
    return expert, pairs, valid


@triton.jit
def _block_pair(BlockExpert, SortedPairs, pid_m, n_blocks, expert, n_pairs, BLOCK_M: tl.constexpr):
    """Sorted routing, two row blocks per program: (lead, second, pair ids and valid rows of block pid_m + 1).
    An expert's blocks are consecutive; counted from its first, the even ones lead and take the odd one after them
    (``second``) when it holds the same expert's pairs, the odd ones have nothing left to do (``lead`` False)."""
    before = 0  # the expert's blocks before this one
    prev = pid_m - 1
    more = prev >= 0
    while more:
        same = tl.load(BlockExpert + tl.maximum(prev, 0)) == expert
        before += same.to(tl.int32)
        prev -= 1
        more = same & (prev >= 0)
    nxt = tl.minimum(pid_m + 1, n_blocks - 1)
    second = (pid_m + 1 < n_blocks) & (tl.load(BlockExpert + nxt) == expert)
    pairs_b = tl.load(SortedPairs + nxt * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int32)
    return before % 2 == 0, second, pairs_b, pairs_b < tl.where(second, n_pairs, 0)  # no rows without a second


@triton.jit
def _x_ptrs(X, rows, stride_xm, BLOCK_K: tl.constexpr):
    """Pointers to a K block of these rows of X at column 0: all ``BLOCK_K`` columns, and its first half."""
    base = X + rows.to(tl.int64)[:, None] * stride_xm
    return base + tl.arange(0, BLOCK_K)[None, :], base + tl.arange(0, BLOCK_K // 2)[None, :]


@triton.jit
def _x_halves(x_ptrs, xh_ptrs, k0, valid, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """The even and the odd columns of the rows' K block at k0 (``_x_ptrs``' pointers; rows not ``valid`` read 0).
    SPLIT: the block is stored as [even columns | odd columns], two contiguous loads; else one load, split."""
    if SPLIT:
        x_even = tl.load(xh_ptrs + k0, mask=valid[:, None], other=0.0)
        x_odd = tl.load(xh_ptrs + (k0 + BLOCK_K // 2), mask=valid[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs + k0, mask=valid[:, None], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
    return x_even, x_odd


@triton.jit
def _w13_loop(W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, up_off, N_HALF, k_lo, K,
              stride_wn, stride_se, stride_sn, offs_n, offs_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr, X_SPLIT: tl.constexpr,
              SPLIT_ACC: tl.constexpr, SWAP: tl.constexpr, KPERM: tl.constexpr, SHUFFLED: tl.constexpr,
              TWO: tl.constexpr, DRAIN: tl.constexpr):  # fmt: skip
    """The gate/up kernel's reduction over K slice [k_lo, k_lo + K): (gate, up) accumulators of the row block, then
    of the second block (TWO: its rows through the same dequantised tiles; else zeros). DRAIN: ``_wgmma_drain``
    after each K step."""
    DT: tl.constexpr = x_ptrs.dtype.element_ty
    ACC: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    acc_g = tl.zeros(ACC, dtype=tl.float32)
    acc_u = tl.zeros(ACC, dtype=tl.float32)
    acc_gb = tl.zeros(ACC, dtype=tl.float32)
    acc_ub = tl.zeros(ACC, dtype=tl.float32)
    acc_g2 = tl.zeros(ACC, dtype=tl.float32)
    acc_u2 = tl.zeros(ACC, dtype=tl.float32)
    for k0 in range(k_lo, k_lo + K, BLOCK_K):
        if FP4:
            s_off = expert.to(tl.int64) * stride_se
            s_up = N_HALF.to(tl.int64) * stride_sn
            x_even, x_odd = _x_halves(x_ptrs, xh_ptrs, k0, valid, BLOCK_M, BLOCK_K, X_SPLIT)
            g_even, g_odd = _fp4_tile(
                W, S, w_off, s_off, k0, stride_wn, stride_sn, offs_n, BLOCK_K, DT, ASM, KPERM, SHUFFLED
            )
            u_even, u_odd = _fp4_tile(
                W, S, w_off + up_off, s_off + s_up, k0, stride_wn, stride_sn, offs_n, BLOCK_K, DT, ASM, KPERM, SHUFFLED
            )
            acc_g = _mma(acc_g, x_even, g_even, SWAP)
            acc_u = _mma(acc_u, x_even, u_even, SWAP)
            if SPLIT_ACC:
                acc_g2 = _mma(acc_g2, x_odd, g_odd, SWAP)
                acc_u2 = _mma(acc_u2, x_odd, u_odd, SWAP)
            else:
                acc_g = _mma(acc_g, x_odd, g_odd, SWAP)
                acc_u = _mma(acc_u, x_odd, u_odd, SWAP)
            if TWO:  # the same dequantised tiles, the second block's rows
                xb_even, xb_odd = _x_halves(xb_ptrs, xbh_ptrs, k0, valid_b, BLOCK_M, BLOCK_K, X_SPLIT)
                acc_gb = _mma(acc_gb, xb_even, g_even, SWAP)
                acc_ub = _mma(acc_ub, xb_even, u_even, SWAP)
                acc_gb = _mma(acc_gb, xb_odd, g_odd, SWAP)
                acc_ub = _mma(acc_ub, xb_odd, u_odd, SWAP)
            _wgmma_drain(DRAIN)
        else:
            x = tl.load(x_ptrs + k0, mask=valid[:, None], other=0.0)
            w_ptrs = W + w_off + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
            acc_g = _mma(acc_g, x, tl.load(w_ptrs), SWAP)
            acc_u = _mma(acc_u, x, tl.load(w_ptrs + up_off), SWAP)
    if SPLIT_ACC:
        acc_g += acc_g2
        acc_u += acc_u2
    return acc_g, acc_u, acc_gb, acc_ub


@triton.jit
def _w13_store(acc_g, acc_u, s2, Out, pairs, valid, offs_n, stride_om, SWAP: tl.constexpr, PRESPLIT_K: tl.constexpr,
               KPERM: tl.constexpr):  # fmt: skip
    """The gate/up kernel's epilogue: ``silu(g) * u`` of one row block's accumulators (times NVFP4's ``s2``) into its
    pairs' rows of Out, each PRESPLIT_K block of columns as [even | odd] (in the KPERM order when set)."""
    acc_g = acc_g * s2
    acc_u = acc_u * s2
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    if SWAP:
        h = tl.trans(h)
    cols = offs_n
    if PRESPLIT_K:
        # column c of a PRESPLIT_K-wide block goes to (c % 2) * PRESPLIT_K / 2 + c // 2 within the block: the w2
        # kernel then reads the even and the odd columns of its K block as two contiguous halves.
        r = offs_n % PRESPLIT_K
        if KPERM:  # and byte m = 16c + 4l + 2h + b of each half to 16c + 8h + 2l + b (``_fp4_tile``'s KPERM)
            m = r // 2
            m = m - (m % 16) + ((m // 2) % 2) * 8 + ((m // 4) % 4) * 2 + m % 2
            cols = offs_n - r + (r % 2) * (PRESPLIT_K // 2) + m
        else:
            cols = offs_n - r + (r % 2) * (PRESPLIT_K // 2) + r // 2
    o_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, h.to(Out.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["n_pairs"])
def moe_w13_kernel(
    X,
    TopkIds,
    SortedPairs,
    BlockExpert,
    W,
    S,
    S2,
    Out,
    Partial,
    Count,
    n_pairs,
    N_HALF,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IDENTITY: tl.constexpr,
    FP4: tl.constexpr,
    ASM: tl.constexpr,
    N_FAST: tl.constexpr = False,
    SPLIT_ACC: tl.constexpr = False,
    PRESPLIT_K: tl.constexpr = 0,
    SWAP: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    X_SPLIT: tl.constexpr = False,
    KPERM: tl.constexpr = False,
    SHUFFLED: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    DRAIN: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    if N_FAST:
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # slice [pid_s * K, (pid_s + 1) * K) of the reduction
    expert, pairs, valid = _block_rows(TopkIds, SortedPairs, BlockExpert, pid_m, n_pairs, BLOCK_M, IDENTITY)
    if expert < 0:
        return
    second = False
    pairs_b, valid_b = pairs, pairs < 0  # no second block
    if PAIR:  # the sorted routing, NVFP4, one K slice, one accumulator per projection (``moe_w13`` checks)
        lead, second, pairs_b, valid_b = _block_pair(
            BlockExpert, SortedPairs, pid_m, tl.num_programs(1 if N_FAST else 0), expert, n_pairs, BLOCK_M
        )
        if not lead:
            return
    rows = pairs // TOPK
    rows_b = pairs_b // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_off = expert.to(tl.int64) * stride_we
    up_off = N_HALF.to(tl.int64) * stride_wn
    x_ptrs, xh_ptrs = _x_ptrs(X, rows, stride_xm, BLOCK_K)
    xb_ptrs, xbh_ptrs = _x_ptrs(X, rows_b, stride_xm, BLOCK_K)
    ACC: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    k_lo = tl.multiple_of(pid_s * K, BLOCK_K)  # K is a multiple of BLOCK_K
    # A program with a second block runs the loop that also feeds it: no branch inside the pipelined loop.
    if second:
        acc_g, acc_u, acc_gb, acc_ub = _w13_loop(
            W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, up_off, N_HALF, k_lo, K,
            stride_wn, stride_se, stride_sn, offs_n, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, FP4, ASM, X_SPLIT, SPLIT_ACC,
            SWAP, KPERM, SHUFFLED, True, DRAIN,
        )  # fmt: skip
    else:
        acc_g, acc_u, acc_gb, acc_ub = _w13_loop(
            W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, up_off, N_HALF, k_lo, K,
            stride_wn, stride_se, stride_sn, offs_n, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, FP4, ASM, X_SPLIT, SPLIT_ACC,
            SWAP, KPERM, SHUFFLED, False, DRAIN,
        )  # fmt: skip
    if SPLIT_K > 1:
        # Each slice stores its fp32 partials; the last of the tile's SPLIT_K programs to arrive adds them all in
        # slice order (the same sum whatever the arrival order) and goes on to the epilogue; the others stop.
        tile = pid_m * (N_HALF // BLOCK_N) + pid_n
        offs_acc = tl.arange(0, ACC[0])[:, None] * ACC[1] + tl.arange(0, ACC[1])[None, :]
        SIZE: tl.constexpr = ACC[0] * ACC[1]
        tile_part = Partial + tile.to(tl.int64) * (SPLIT_K * 2 * SIZE)
        tl.store(tile_part + pid_s * (2 * SIZE) + offs_acc, acc_g)
        tl.store(tile_part + pid_s * (2 * SIZE) + SIZE + offs_acc, acc_u)
        tl.debug_barrier()  # every thread's partials are stored before the arrival is counted (release below)
        if tl.atomic_add(Count + tile, 1, sem="acq_rel") < SPLIT_K - 1:
            return
        tl.store(Count + tile, 0)  # every slice has arrived: the counter is zero again for the next launch
        acc_g = tl.zeros(ACC, dtype=tl.float32)
        acc_u = tl.zeros(ACC, dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc_g += tl.load(tile_part + s * (2 * SIZE) + offs_acc, cache_modifier=".cg")
            acc_u += tl.load(tile_part + s * (2 * SIZE) + SIZE + offs_acc, cache_modifier=".cg")
    s2 = 1.0
    if FP4:
        s2 = tl.load(S2 + expert)
        if ASM:
            s2 = s2 * _ASM_UNSCALE
    _w13_store(acc_g, acc_u, s2, Out, pairs, valid, offs_n, stride_om, SWAP, PRESPLIT_K, KPERM)
    if PAIR:
        if second:
            _w13_store(acc_gb, acc_ub, s2, Out, pairs_b, valid_b, offs_n, stride_om, SWAP, PRESPLIT_K, KPERM)


@triton.jit
def _w2_loop(W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, K, stride_wn, stride_se,
             stride_sn, offs_n, offs_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             FP4: tl.constexpr, ASM: tl.constexpr, PRESPLIT: tl.constexpr, SWAP: tl.constexpr, KPERM: tl.constexpr,
             SHUFFLED: tl.constexpr, TWO: tl.constexpr, DRAIN: tl.constexpr):  # fmt: skip
    """The down kernel's reduction over K: the row block's accumulator, then the second block's (TWO: its rows
    through the same dequantised tiles; else zeros). DRAIN: ``_wgmma_drain`` after each K step."""
    DT: tl.constexpr = x_ptrs.dtype.element_ty
    ACC: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    acc = tl.zeros(ACC, dtype=tl.float32)
    acc_b = tl.zeros(ACC, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if FP4:
            s_off = expert.to(tl.int64) * stride_se
            # PRESPLIT: the w13 kernel stored this K block as [even columns | odd columns]
            x_even, x_odd = _x_halves(x_ptrs, xh_ptrs, k0, valid, BLOCK_M, BLOCK_K, PRESPLIT)
            w_even, w_odd = _fp4_tile(
                W, S, w_off, s_off, k0, stride_wn, stride_sn, offs_n, BLOCK_K, DT, ASM, KPERM, SHUFFLED
            )
            acc = _mma(acc, x_even, w_even, SWAP)
            acc = _mma(acc, x_odd, w_odd, SWAP)
            if TWO:  # the same dequantised tile, the second block's rows
                xb_even, xb_odd = _x_halves(xb_ptrs, xbh_ptrs, k0, valid_b, BLOCK_M, BLOCK_K, PRESPLIT)
                acc_b = _mma(acc_b, xb_even, w_even, SWAP)
                acc_b = _mma(acc_b, xb_odd, w_odd, SWAP)
            _wgmma_drain(DRAIN)
        else:
            x = tl.load(x_ptrs + k0, mask=valid[:, None], other=0.0)
            w_ptrs = W + w_off + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
            acc = _mma(acc, x, tl.load(w_ptrs), SWAP)
    return acc, acc_b


@triton.jit
def _w2_store(acc, TopkWeights, s2, Out, pairs, valid, offs_n, stride_om, SWAP: tl.constexpr, FP4: tl.constexpr):
    """The down kernel's epilogue: one row block's accumulator times each pair's routing weight (and NVFP4's
    ``s2``) into its pairs' fp32 rows of Out."""
    if SWAP:
        acc = tl.trans(acc)
    scale = tl.load(TopkWeights + pairs, mask=valid, other=0.0).to(tl.float32)
    if FP4:
        scale = scale * s2
    acc = acc * scale[:, None]
    o_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=valid[:, None])


@triton.jit(do_not_specialize=["n_pairs"])
def moe_w2_kernel(
    X,
    TopkIds,
    TopkWeights,
    SortedPairs,
    BlockExpert,
    W,
    S,
    S2,
    Out,
    n_pairs,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IDENTITY: tl.constexpr,
    FP4: tl.constexpr,
    ASM: tl.constexpr,
    N_FAST: tl.constexpr = False,
    PRESPLIT: tl.constexpr = False,
    SWAP: tl.constexpr = False,
    KPERM: tl.constexpr = False,
    SHUFFLED: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    DRAIN: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    if N_FAST:
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    expert, pairs, valid = _block_rows(TopkIds, SortedPairs, BlockExpert, pid_m, n_pairs, BLOCK_M, IDENTITY)
    if expert < 0:
        return
    second = False
    pairs_b, valid_b = pairs, pairs < 0  # no second block
    if PAIR:  # the sorted routing, NVFP4 (``moe_w2`` checks)
        lead, second, pairs_b, valid_b = _block_pair(
            BlockExpert, SortedPairs, pid_m, tl.num_programs(1 if N_FAST else 0), expert, n_pairs, BLOCK_M
        )
        if not lead:
            return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_off = expert.to(tl.int64) * stride_we
    x_ptrs, xh_ptrs = _x_ptrs(X, pairs, stride_xm, BLOCK_K)
    xb_ptrs, xbh_ptrs = _x_ptrs(X, pairs_b, stride_xm, BLOCK_K)
    # A program with a second block runs the loop that also feeds it: no branch inside the pipelined loop.
    if second:
        acc, acc_b = _w2_loop(
            W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, K, stride_wn, stride_se,
            stride_sn, offs_n, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, FP4, ASM, PRESPLIT, SWAP, KPERM, SHUFFLED, True,
            DRAIN,
        )  # fmt: skip
    else:
        acc, acc_b = _w2_loop(
            W, S, x_ptrs, xh_ptrs, xb_ptrs, xbh_ptrs, valid, valid_b, expert, w_off, K, stride_wn, stride_se,
            stride_sn, offs_n, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, FP4, ASM, PRESPLIT, SWAP, KPERM, SHUFFLED, False,
            DRAIN,
        )  # fmt: skip
    s2 = 1.0
    if FP4:
        s2 = tl.load(S2 + expert)
        if ASM:
            s2 = s2 * _ASM_UNSCALE
    _w2_store(acc, TopkWeights, s2, Out, pairs, valid, offs_n, stride_om, SWAP, FP4)
    if PAIR:
        if second:
            _w2_store(acc_b, TopkWeights, s2, Out, pairs_b, valid_b, offs_n, stride_om, SWAP, FP4)


@triton.jit
def moe_sum_kernel(
    Part,
    TopkIds,
    Out,
    Plus,
    N,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_PLUS: tl.constexpr,
    PDL: tl.constexpr,
):
    """``Out[t, :] = sum_i Part[t * TOPK + i, :]`` over the slots whose id is not masked (< 0: no expert wrote
    their rows), an fp32 sum with one rounding to Out's dtype; with HAS_PLUS, ``+ Plus[t, :]`` after that rounding
    (torch's add of two tensors of Out's dtype: an fp32 sum, rounded)."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(TOPK):
        routed = (offs * 0 + tl.load(TopkIds + t * TOPK + i)) >= 0
        acc += tl.load(Part + (t * TOPK + i).to(tl.int64) * N + offs, mask=mask & routed, other=0.0)
    out = acc.to(Out.dtype.element_ty)
    if HAS_PLUS:
        plus = tl.load(Plus + t.to(tl.int64) * N + offs, mask=mask, other=0.0)
        out = (out.to(tl.float32) + plus.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + t.to(tl.int64) * N + offs, out, mask=mask)


@triton.jit
def kperm_x_kernel(
    X,
    Out,
    n_rows,
    stride_xm,
    stride_om,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """``Out[t, k0 + nib * BLOCK_K / 2 + 16c + 8h + 2l + b] = X[t, k0 + 32c + 8l + 4h + 2b + nib]`` for each BLOCK_K
    block of columns from k0 (``moe_w13``'s kperm order of x: the even and the odd columns as two halves, each in
    ``_fp4_tile``'s KPERM order); program (BLOCK_T rows, one K block)."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < n_rows)[:, None]
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=ok)
    C: tl.constexpr = BLOCK_K // 32
    # [T, c, l, h, b, nib] -> [T, nib, c, h, l, b]
    x = tl.permute(tl.reshape(x, [BLOCK_T, C, 4, 2, 2, 2]), [0, 5, 1, 3, 2, 4])
    tl.store(Out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], tl.reshape(x, [BLOCK_T, BLOCK_K]), mask=ok)
