"""Routed-expert MoE: ``out[t] = sum_i w[t, i] * W2_e (silu(Wg_e x_t) * (Wu_e x_t))`` with e = topk_ids[t, i].

Weights are either the loader's NVFP4 stacks (weight-only: unpacked in registers, bf16 MMA, fp32
accumulation; dequantised weights are never materialised) or plain bf16 stacks (layer 2 of the checkpoint):

* NVFP4: w13 uint8 ``[E, 2I, H/2]`` (rows ``[gate; up]``, low nibble = even column), w13_scale
  float8_e4m3fn ``[E, 2I, H/16]``, w13_scale2 fp32 ``[E]``; w2 uint8 ``[E, H, I/2]``, w2_scale
  ``[E, H, I/16]``, w2_scale2 ``[E]``.
  ``W[e, r, c] = e2m1(code) * float(scale[e, r, c // 16]) * scale2[e]`` (`common.nvfp4.dequant_nvfp4`).
* bf16: w13 ``[E, 2I, H]``, w2 ``[E, H, I]``, in the activation dtype.

Routing: with few (token, slot) pairs each pair is its own row block (no metadata, duplicates of an expert
re-read its weights); with many, ``moe_align`` (inkling_kernels/moe_align.py) groups the pairs by expert into blocks
of ``block_m`` rows, on the device and without a host sync (CUDA-graph safe). Three launches (w13 + SwiGLU, w2 x
routing weight into fp32 ``[pairs, H]``, slot sum) plus, for the sorted routing, ``moe_align``'s two over a grid.

Decode-size blocks hold 1-8 valid rows, so the kernels are grouped GEMVs whose cost is the in-register
dequantisation (~2 instructions per weight) overlapping the weight stream. What the H200 measurements
(bench_moe) chose: K tiles of 256 (128 contiguous bytes of each weight row per load; 64-byte rows reach
only ~58% of the copy bandwidth even without any dequantisation), the weights as the MMA's M operand and
the block's <= 8 rows as its N (``swap_ab``: no padded token rows through shared memory, half the MMAs),
8-row sorted blocks, and the intermediate stored even/odd-split per w2 K block (``presplit``).
Prefill-sized calls (``PREFILL_MIN_PAIRS`` on) take 64-row blocks of one expert's pairs, the NVFP4 weights still as
the MMA's M operand (wgmma, fed from registers) and K in the ``kperm`` order: per 32 columns, column
16c + 8h + 2l + b of each nibble half reads packed byte 16c + 4l + 2h + b, so the 4 bytes an operand thread holds
per row and 16-column step are one word under one block scale; x (a permuted copy) and the intermediate follow.
Masked routes: a (token, slot) pair whose id is ``MASKED_ROUTE`` (-1; expert parallelism marks the routes to
other ranks' experts so) reaches no expert: ``moe_align`` leaves it out of every block, its identity block exits at
once, and the slot sum skips it (it adds exactly 0). Ids must otherwise lie in [0, E).
Split-K of the gate/up kernel (a handful of pairs, to put more warps on the SMs): its slices store fp32 partials
and the last slice of a tile to finish (an atomic count) adds them in slice order and runs the SwiGLU epilogue,
so the sum does not depend on the arrival order.
Paired blocks (``pair_blocks``, sorted NVFP4 routing): an expert with more pairs than a block has consecutive
blocks; a program whose block is an even one of its expert's run (counted from the run's first) also takes the
next block when it holds the same expert's pairs, and feeds both blocks' rows through each dequantised weight tile
(a loop of its own, chosen before it starts: no branch inside the pipelined loop); the odd blocks' programs exit.
Each block's MMAs are the same as alone, so the outputs are bit for bit the unpaired launch's.
The stages are public (``moe_routing``, ``moe_w13``, ``moe_w2``, ``moe_sum``) for bench_moe to time each alone.
``shuffled=True``: the NVFP4 stacks in ``shuffle_nvfp4``'s layout (re-laid once at load; the same values, ~25% fewer
unpack instructions per weight), on every tile whose K tiles are at least ``SHUFFLED_MIN_BLOCK_K`` wide.
Excluded from this slice: fp8 activations, fusing the slot sum / shared experts into the w2 epilogue.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from common.nvfp4 import dequant_nvfp4
from inkling_kernels.moe_align import moe_align
from inkling_kernels.pdl import pdl


@dataclass(frozen=True)
class MoeConfig:
    """Tiles and code-shape choices of one MoE launch pair (``13``: the gate/up kernel, ``2``: the down kernel).

    The defaults are the best measured on an H200 for Inkling-Small shapes from 768 (token, slot) pairs on
    (sorted routing); ``default_config`` picks the measured best for fewer pairs and for prefill.
    """

    block_m: int = 8  # rows (pairs of one expert) per block of the sorted routing
    block_n13: int = 64
    block_k13: int = 256
    block_n2: int = 64
    block_k2: int = 256
    num_warps13: int = 4
    num_warps2: int = 4
    num_stages: int = 3
    sorted_min_pairs: int = 64  # use the sorted routing from this many (token, slot) pairs on
    maxnreg: int | None = None  # register cap per thread (more CTAs per SM), None = compiler's choice
    identity_block_m: int = 1  # rows of an identity-routing block (one pair; more rows only pad the MMA)
    n_fast13: bool = True  # grid order: the N tiles of one row block adjacent (else the row blocks of one N tile)
    n_fast2: bool = True
    split_k13: int = 1  # gate/up: H in this many programs per tile, the last to finish adds their partials
    swap_ab: bool = True  # weights as the MMA's M operand, the block's rows as its N (decode: rows <= 8)
    presplit: bool = True  # NVFP4: w13 stores each block_k2 slice of the intermediate as [even | odd] columns
    split_acc: bool = False  # w13: separate accumulators for the even and the odd columns of a K block
    # NVFP4, with presplit: both kernels take K in ``_triton_nvfp4.fp4_tile``'s KPERM order (w13 reads a permuted
    # copy of x)
    kperm: bool = False
    # NVFP4, sorted routing: a program takes two consecutive row blocks of one expert, each weight tile dequantised
    # once for both (``_block_pair``); the gate/up kernel with one K slice and one accumulator per projection
    pair_blocks: bool = False
    # sm_90: wait for each K step's wgmma groups inside the step (``_triton_moe._wgmma_drain``); elsewhere no effect
    wgmma_drain: bool = False


MASKED_ROUTE = -1  # a route id that no expert computes and that contributes 0 to its token

PREFILL_MIN_PAIRS = 6144  # from here on (T = 1024 at k = 6, 24 pairs per expert at E = 256) prefill-sized tiles
BF16_WIDE_MIN_PAIRS = 24576  # bf16 weights from here on (T = 4096, 96 pairs per expert): 128-row blocks, 8 warps
# up to here (T = 1 at k = 6) the identity gate/up kernel splits H in two: 2 * 64 tiles per pair of 2-warp CTAs
# (144 registers: 7 per SM) stay within one wave of the 132 SMs
SPLIT_K13_MAX_PAIRS = 8
NARROW_WARPS_MAX_PAIRS = 767  # sorted decode below T = 128 at k = 6: 2-warp tiles (32 weight rows per warp)
# the shuffled layout's sorted tiles from T = 320 at k = 6 (7.5 pairs per expert) up to the prefill tiles: row
# blocks in pairs, 128-row weight tiles of 4 warps
PAIRED_MIN_PAIRS = 1920
# The shuffled layout's K tiles are at least this wide (32 columns per MMA): on its word-unpacked weights Triton 3.6
# gives the mma.sync operands kWidth 8, 8 consecutive K columns per thread, which a dot of 16 columns (K tiles of
# 32, the tiny checkpoint's I = 32) cannot hold: wrong sums (Triton 3.9 bounds kWidth by K; decisions 2026-12-02)
SHUFFLED_MIN_BLOCK_K = 64


def default_config(n_pairs: int, fp4: bool = True, shuffled: bool = False) -> MoeConfig:
    """Measured choice (H200, H=4096, I=2048, E=256, k=6; ``bench_moe --sweep``, each kernel alone, 2026-12-01):

    * below ``sorted_min_pairs`` (identity routing, one block per pair): 32-row tiles of 2 warps, so a batch-1 call
      still has ~6 CTAs per SM; up to ``SPLIT_K13_MAX_PAIRS`` the gate/up kernel's H in two slices (T=1: 23.6 us
      against 26.4; T=8, two waves: 133 against 129); splitting the down kernel was slower at T=1 and 8;
    * sorted 8-row blocks up to ``NARROW_WARPS_MAX_PAIRS``: 64-row tiles of 2 warps for both kernels (T=64: gate/up
      551 us against 566 with 4 warps, down 283 against 300); beyond, the class defaults' 4 warps (T=256: down
      423-445 us against 460 with 2 warps, gate/up even);
    * from ``PREFILL_MIN_PAIRS`` on 64-row blocks, so each expert's weights are dequantised once per 64 pairs
      (T=2048: 3.40 ms against 7.18 ms with the decode tiles). NVFP4 (``bench_moe --prefill``): the weights as the
      MMA's M operand fed from registers (``swap_ab``) in the ``kperm`` K order, the down kernel in 128-wide
      tiles of 8 warps (T=1024/2048/4096: gate/up 1575/1743/3517 us against 1972 (decode tiles)/2113/4070, down
      789/815/1561 against 976/1017/2006); bf16 weights: the 64-row tiles as before up to ``BF16_WIDE_MIN_PAIRS``,
      then 128-row blocks of 8 warps (T=4096: gate/up 2502 us against 3464, down 1831 against 1796).
    * ``shuffled`` (``shuffle_nvfp4``'s layout, the model's): the same, but 2-warp sorted tiles up to
      ``PAIRED_MIN_PAIRS`` (T=256: gate/up 771 us against 822 with 4 warps, down 398 against 468;
      2026-12-03, the MTP verify's T = B(D+1): T=320 gate/up 887 against 943, down 434 against 490; T=512 1245
      against 1324, 661 against 726); from ``PAIRED_MIN_PAIRS`` up to the prefill tiles two row blocks of one
      expert per program (``pair_blocks``) over 128-row weight tiles of 4 warps, so each program's x rows meet
      twice the weight rows (2026-12-03, against the 64-row 2-warp paired tiles up to T=512 and the 4-warp
      unpaired ones above, two timings each: gate/up T=320 736-738 us against 827-833, T=512 866-868 against
      1028-1045, T=640 1052-1064 against 1481-1489, T=768 1236-1238 against 1729-1790, T=960 1424-1483 against
      2077-2095; down even at T=320 (398-400 / 397-401), T=512 475-486 against 488-534, T=768 667-674 against
      933-942, T=960 802-809 against 1075-1087; bit for bit the same outputs). Below T=320 not taken: T=192 paired
      751 against 718 / 447 against 333 (64-row tiles), 128-row tiles 722-737 against 714 / 335-414 against 347
      (one timing of 15 replays).
      128-row tiles of 2 or 8 warps, 256-row tiles of 8 warps and 4 stages were slower at every T from 64 to 768.
      The prefill tiles wait for each K step's wgmma groups inside the step (``wgmma_drain``: ptxas otherwise
      serialises every wgmma of the kernel, C7515; 2026-12-04, T=2048 gate/up 1742 -> 1633 us, down 723 -> 680; T=4096
      3278 -> 3223, 1424 -> 1356; on the canonical layout slower, 1755 -> 1835 at T=2048: not taken there).

    Measured and not taken: 16-row blocks (T=256: gate/up 968-1568 us against 858: Triton stages their dequantised
    weights through shared memory for wgmma; in the ``kperm`` order they stay its register operand and still lose,
    T=320 gate/up 847-1028 us against 756, 2026-12-04; only the down kernel at T=512 gained, 465 against 563),
    4-row blocks, 128-row tiles of 8 warps, 128-wide K tiles (on the shuffled layout too, 2026-12-04: T=320 gate/up
    1024-1036 us against 779), 2 or 4 pipeline stages, a 128-register cap, the e4m3 scales through an fp32 convert."""
    base = MoeConfig()
    if n_pairs < base.sorted_min_pairs:
        few = MoeConfig(block_n13=32, block_n2=32, num_warps13=2, num_warps2=2, n_fast13=False, n_fast2=False,
                        split_acc=True)  # fmt: skip
        return replace(few, split_k13=2) if n_pairs <= SPLIT_K13_MAX_PAIRS else few
    if n_pairs >= PREFILL_MIN_PAIRS:
        if fp4:
            return MoeConfig(block_m=64, block_k13=128, block_k2=128, block_n2=128, num_warps2=8, kperm=True,
                             wgmma_drain=shuffled)  # fmt: skip
        wide = {"block_m": 128, "num_warps13": 8, "num_warps2": 8} if n_pairs >= BF16_WIDE_MIN_PAIRS else {}
        return MoeConfig(**{"block_m": 64, "swap_ab": False, "block_k13": 128, "block_k2": 128, **wide})
    if fp4 and shuffled and n_pairs >= PAIRED_MIN_PAIRS:
        return replace(base, pair_blocks=True, block_n13=128, block_n2=128)
    if (fp4 and shuffled) or n_pairs <= NARROW_WARPS_MAX_PAIRS:
        return replace(base, num_warps13=2, num_warps2=2)
    return base


# The shuffled layout's bit sources: code bits 0..3 of the 8 codes of a canonical 4-byte word (lo(b0), lo(b1),
# lo(b2), lo(b3), hi(b0), ..., hi(b3)) go to these bits of the stored word (``_triton_nvfp4._shuffled_codes`` reads
# them back; ``_E2M1_SHUFFLED_WORD_ASM`` rotates each pair of codes onto the bf16 bits 6..8 and 15 of its halves).
SHUFFLE_BITS = (
    (6, 7, 8, 15), (22, 23, 24, 31), (2, 3, 4, 11), (18, 19, 20, 27),
    (28, 29, 30, 5), (12, 13, 14, 21), (0, 1, 10, 9), (16, 17, 26, 25),
)  # fmt: skip
_SCALE_EXP_BIAS = 10  # shuffled scale byte = (exponent + 10) * 8 + mantissa, exponents -9 (2^-9) .. 8 (448)


def _shuffle_tables(device: torch.device) -> torch.Tensor:
    """int64 [4, 256]: the stored-word bits of byte value v at byte i of a canonical word."""
    tables = torch.zeros((4, 256), dtype=torch.int64)
    values = torch.arange(256)
    for e, bits in enumerate(SHUFFLE_BITS):
        byte, nibble = e % 4, e // 4
        for cb, dst in enumerate(bits):
            tables[byte] |= ((values >> (4 * nibble + cb)) & 1) << dst
    return tables.to(device)


def shuffle_nvfp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE kernels' NVFP4 layout (``shuffled=True``: every tile, decode and prefill), made once where the weights
    are loaded (``NVFP4Experts`` under the fast ops); the kernels read each 4-byte word whole.

    ``packed`` uint8 ``[..., R, C/2]`` and ``scale`` float8_e4m3fn ``[..., R, C/16]`` as in ``common.nvfp4``;
    returns (weights, scales) of the same shapes and dtypes (scales as uint8) and the same dequantised values:
    * each block's sign moves into its codes (a negative scale flips the code signs, whose value is the same) and
      a zero scale's codes become 0 (the block is 0 either way);
    * each 4-byte word's 8 codes are permuted bitwise (``SHUFFLE_BITS``), so two bf16 weights are one rotate and
      one mask of the word;
    * a scale becomes B = (exponent + 10) * 8 + its 3 mantissa bits, subnormal e4m3 scales normalised (0 for a
      zero scale), so the kernels' bf16 scale * 2^119 is B * 16 + 0x7600.
    """
    if packed.dtype != torch.uint8 or packed.shape[-1] % 8:
        raise ValueError(f"packed: uint8, last dim a multiple of 8 expected, got {packed.dtype} {tuple(packed.shape)}")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (*packed.shape[:-1], packed.shape[-1] // 8):
        raise ValueError(f"scale must be float8_e4m3fn {(*packed.shape[:-1], packed.shape[-1] // 8)}, got "
                         f"{scale.dtype} {tuple(scale.shape)}")  # fmt: skip
    if torch.isnan(scale.float()).any():
        raise ValueError("NaN block scales")
    rows_w, rows_s = packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1])
    out_w, out_s = torch.empty_like(rows_w), torch.empty(rows_s.shape, dtype=torch.uint8, device=scale.device)
    tables = _shuffle_tables(packed.device)
    for r in range(0, rows_w.shape[0], _SHUFFLE_ROWS):  # bounded int64 temporaries for whole expert stacks
        out_w[r : r + _SHUFFLE_ROWS], out_s[r : r + _SHUFFLE_ROWS] = _shuffle_rows(
            rows_w[r : r + _SHUFFLE_ROWS], rows_s[r : r + _SHUFFLE_ROWS].float(), tables
        )
    return out_w.view(packed.shape), out_s.view(scale.shape)


_SHUFFLE_ROWS = 4096


def _shuffle_rows(packed: torch.Tensor, s: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = packed.unflatten(-1, (-1, 8))  # [N, C/16, 8]: the bytes of one scale
    flip = torch.where(s < 0, 0x88, 0).to(torch.uint8)[..., None]
    keep = torch.where(s == 0, 0, 0xFF).to(torch.uint8)[..., None]
    words = ((blocks ^ flip) & keep).flatten(-2).unflatten(-1, (-1, 4)).long()  # [N, C/8, 4]
    stored = tables[0][words[..., 0]] | tables[1][words[..., 1]] | tables[2][words[..., 2]] | tables[3][words[..., 3]]
    shifts = torch.arange(0, 32, 8, device=packed.device)
    shuffled = ((stored[..., None] >> shifts) & 0xFF).to(torch.uint8).flatten(-2)
    mant, exp = torch.frexp(s.abs())  # |s| = mant * 2^exp, mant in [0.5, 1): 2^(exp - 1) * (1 + m / 8)
    m = torch.round((mant * 2 - 1) * 8).long()
    code = torch.where(s == 0, 0, (exp.long() - 1 + _SCALE_EXP_BIAS) * 8 + m).to(torch.uint8)
    return shuffled, code


def unshuffle_nvfp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``shuffle_nvfp4`` up to its value-preserving edits: canonical bytes and e4m3 scales (>= 0)."""
    words = packed.unflatten(-1, (-1, 4)).long()
    stored = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    canon = torch.zeros_like(stored)
    for e, bits in enumerate(SHUFFLE_BITS):
        byte, nibble = e % 4, e // 4
        for cb, src in enumerate(bits):
            canon |= ((stored >> src) & 1) << (8 * byte + 4 * nibble + cb)
    shifts = torch.arange(0, 32, 8, device=packed.device)
    canon_bytes = ((canon[..., None] >> shifts) & 0xFF).to(torch.uint8).flatten(-2)
    b = scale.long()
    value = torch.ldexp(1 + (b & 7).float() / 8, (b >> 3) - _SCALE_EXP_BIAS)
    return canon_bytes, torch.where(b == 0, 0.0, value).to(torch.float8_e4m3fn)


def _check(x, topk_ids, topk_weights, w13, w2, fp4, scales):
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"x [T,H], topk_ids/topk_weights [T,k] expected, got {tuple(x.shape)}, "
            f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows for {x.shape[0]} tokens")
    pack = 2 if fp4 else 1
    e, two_i, hp = w13.shape
    if two_i % 2 or hp * pack != x.shape[1]:
        raise ValueError(f"w13 {tuple(w13.shape)} does not match H={x.shape[1]} ({'NVFP4' if fp4 else 'bf16'})")
    i = two_i // 2
    if tuple(w2.shape) != (e, x.shape[1], i // pack):
        raise ValueError(f"w2 {tuple(w2.shape)} expected {(e, x.shape[1], i // pack)}")
    if fp4:
        if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
            raise ValueError(f"NVFP4 weights must be uint8, got {w13.dtype}, {w2.dtype}")
        s13, s13b, s2, s2b = scales
        if tuple(s13.shape) != (e, two_i, x.shape[1] // 16) or tuple(s2.shape) != (e, x.shape[1], i // 16):
            raise ValueError(f"block scales {tuple(s13.shape)}, {tuple(s2.shape)} do not match the weights")
        if s13b.shape != (e,) or s2b.shape != (e,):
            raise ValueError(f"scale2 must be [E]={e}, got {tuple(s13b.shape)}, {tuple(s2b.shape)}")
        for name, t in (("w13_scale", s13), ("w2_scale", s2)):
            if t.dtype not in (torch.float8_e4m3fn, torch.uint8) or t.stride(-1) != 1:
                raise ValueError(f"{name} must be float8_e4m3fn with unit last stride, got {t.dtype}")
    elif w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"bf16-weight MoE needs weights in the activation dtype {x.dtype}, got {w13.dtype}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {t.stride()}")
    return e, i


def _check_shuffled_tile(name: str, block_k: int) -> None:
    if block_k < SHUFFLED_MIN_BLOCK_K:
        raise ValueError(f"the shuffled NVFP4 layout needs {name} >= {SHUFFLED_MIN_BLOCK_K} (SHUFFLED_MIN_BLOCK_K), "
                         f"got {block_k}")  # fmt: skip


def _check_words(w13: torch.Tensor, w2: torch.Tensor, scales) -> None:
    """The shuffled layout's kernels read the packed weights as whole 4-byte words: word-aligned rows and uint8
    block scales (``shuffle_nvfp4``'s)."""
    for name, w in (("w13", w13), ("w2", w2)):
        if w.data_ptr() % 4 or w.stride(0) % 4 or w.stride(1) % 4:
            raise ValueError(f"shuffled {name} needs 4-byte aligned rows, got strides {w.stride()}")
    if scales[0].dtype != torch.uint8 or scales[2].dtype != torch.uint8:
        raise ValueError(f"shuffled block scales are uint8 (shuffle_nvfp4), got {scales[0].dtype}, {scales[2].dtype}")


@dataclass(frozen=True)
class MoeRouting:
    """Row blocks of one MoE call (``moe_routing``): ``identity`` blocks are one pair each (``ids``' order),
    sorted ones ``block_m`` pairs of one expert listed in ``sorted_pairs`` / ``block_expert`` / ``block_rank``
    (``moe_align``)."""

    ids: torch.Tensor  # int32/int64 [n_pairs], expert of pair t * k + i
    weights: torch.Tensor  # [n_pairs] routing weights
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_rank: torch.Tensor
    identity: bool
    block_m: int
    n_blocks: int
    topk: int


def moe_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, cfg: MoeConfig) -> MoeRouting:
    """Row blocks for ``topk_ids`` [T, k]: identity below ``cfg.sorted_min_pairs`` pairs, else ``moe_align``'s."""
    n_pairs = topk_ids.numel()
    ids = topk_ids.reshape(-1).contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    if n_pairs >= cfg.sorted_min_pairs:
        sorted_pairs, block_expert, block_rank = moe_align(ids, num_experts, cfg.block_m)
        n_blocks = block_expert.numel()
        return MoeRouting(
            ids, wts, sorted_pairs, block_expert, block_rank, False, cfg.block_m, n_blocks, topk_ids.shape[1]
        )
    return MoeRouting(ids, wts, ids, ids, ids, True, cfg.identity_block_m, n_pairs, topk_ids.shape[1])


def _fused_moe(
    x, topk_ids, topk_weights, w13, w2, scales, fp4: bool, config: MoeConfig | None, shuffled=False, plus=None
):  # fmt: skip
    cfg = config or default_config(topk_ids.numel(), fp4, shuffled)
    e, i = _check(x, topk_ids, topk_weights, w13, w2, fp4, scales)
    if not fp4 and x.element_size() > 2:  # fp32 weight tiles: keep the pipeline within shared memory
        cfg = replace(cfg, block_k13=min(cfg.block_k13, 128), block_k2=min(cfg.block_k2, 128))
    h = x.shape[1]
    for name, dim, blk in (
        ("I", i, cfg.block_n13),
        ("H", h, cfg.block_k13 * cfg.split_k13),
        ("H", h, cfg.block_n2),
        ("I", i, cfg.block_k2),
    ):
        if dim % blk:
            raise ValueError(f"{name}={dim} is not a multiple of the tile {blk}")
    if fp4 and shuffled:
        _check_words(w13, w2, scales)
    if fp4 and cfg.kperm and not (cfg.presplit and cfg.block_k13 % 32 == 0 and cfg.block_k2 % 32 == 0):
        raise ValueError(f"kperm needs presplit and K tiles that are multiples of 32, got {cfg}")
    _check_plus(x, plus)
    if topk_ids.numel() == 0:
        return torch.empty_like(x)
    routing = moe_routing(topk_ids, topk_weights, e, cfg)
    s13, s2 = ((scales[0], scales[1]), (scales[2], scales[3])) if fp4 else ((None, None), (None, None))
    inter = moe_w13(x, routing, w13, s13, cfg, shuffled)
    return moe_sum(moe_w2(inter, routing, w2, s2, cfg, shuffled), routing, x.dtype, plus)


def _check_plus(x: torch.Tensor, plus: torch.Tensor | None) -> None:
    if plus is None:
        return
    if plus.shape != x.shape or plus.dtype != x.dtype or not plus.is_contiguous() or plus.device != x.device:
        raise ValueError(f"plus must be contiguous {tuple(x.shape)} {x.dtype} on {x.device}, got "
                         f"{tuple(plus.shape)} {plus.dtype} on {plus.device}")  # fmt: skip


_SCALE_ASM = 2  # 2: block scales through the native e4m3 convert, 1: through fp32 bit arithmetic


def _fp4_args(w: torch.Tensor, scales, act_dtype: torch.dtype):
    """(block scales, scale2, FP4, ASM) kernel arguments; scales ``(None, None)``: plain weights (unused args).
    ASM: the inline-PTX unpack for bf16 activations on the GPU, else 0 (portable Triton: interpreter, fp16/fp32)."""
    if scales[0] is None:
        return w, w, False, 0
    s, s2 = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in scales)
    asm = _SCALE_ASM if act_dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1" else 0
    return s, s2, True, asm


def _grid(n_fast: bool, n_blocks: int, n_tiles: int, *rest: int) -> tuple[tuple[int, ...], bool]:
    """Launch grid and N_FAST (the row blocks go to grid dim 1 only while they fit its 65535 limit)."""
    n_fast = n_fast and n_blocks < 65536
    return ((n_tiles, n_blocks, *rest) if n_fast else (n_blocks, n_tiles, *rest)), n_fast


def _pair_blocks(cfg: MoeConfig, fp4: bool, routing: MoeRouting) -> bool:
    """Whether a launch takes its row blocks in pairs: ``cfg.pair_blocks`` on NVFP4 weights and the sorted routing
    (identity blocks are one pair each, bf16 weights have no dequantisation to share)."""
    return cfg.pair_blocks and fp4 and not routing.identity


def _drain(cfg: MoeConfig, t: torch.Tensor) -> bool:
    """The kernels' DRAIN: ``cfg.wgmma_drain`` on an sm_90 GPU (the only one with wgmma; the interpreter has none)."""
    if not (cfg.wgmma_drain and t.is_cuda):
        return False
    index = t.device.index
    return _is_sm90(index if index is not None else torch.cuda.current_device())


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _launch_opts(cfg: MoeConfig, num_warps: int) -> dict:
    opts = {"num_warps": num_warps, "num_stages": cfg.num_stages}
    return opts if cfg.maxnreg is None else {**opts, "maxnreg": cfg.maxnreg}


_COUNTERS_MIN = 4096  # split-K tiles of the default configs: <= SPLIT_K13_MAX_PAIRS blocks x I / 32 tiles, I <= 16384
_counters: dict[torch.device, list[torch.Tensor]] = {}


def _arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """``n`` zero int32 split-K arrival counters from one buffer per device: the last slice of each tile puts its
    counter back to 0, so the buffer is zero between launches and a call needs no memset launch (one launch
    fewer). Launches that share it must run in stream order (the engine's one stream; CUDA graphs captured from it
    replay in that order too). Buffers are never freed: a captured graph may hold one."""
    buffers = _counters.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros((max(n, _COUNTERS_MIN),), dtype=torch.int32, device=device))
    return buffers[-1][:n]


KPERM_X_ROWS = 32  # rows per program of the x permutation


def kperm_x(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x ``[T, H]`` (unit last stride) with each ``block_k`` block of columns in ``moe_w13``'s kperm order, a
    contiguous copy in one launch: column 32c + 8l + 4h + 2b + nibble of a block moves to nibble * block_k/2 + 16c +
    8h + 2l + b (the even and the odd columns as two halves, each in the KPERM order, as the MMA reads them)."""
    import triton

    from inkling_kernels import _triton_moe as tk

    t, h = x.shape
    if x.stride(1) != 1 or block_k % 32 or h % block_k:
        raise ValueError(f"x {tuple(x.shape)} strides {x.stride()}: unit last stride, H a multiple of {block_k} "
                         "(itself a multiple of 32) expected")  # fmt: skip
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t:
        tk.kperm_x_kernel[(triton.cdiv(t, KPERM_X_ROWS), h // block_k)](
            x,
            out,
            t,
            x.stride(0),
            out.stride(0),
            BLOCK_T=KPERM_X_ROWS,
            BLOCK_K=block_k,
            num_warps=4,
            **pdl(x),
        )
    return out


def kperm_x_reference(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """torch reference of ``kperm_x``."""
    return x.unflatten(1, (-1, block_k // 32, 4, 2, 2, 2)).permute(0, 1, 6, 2, 4, 3, 5).reshape(x.shape)


def moe_w13(
    x: torch.Tensor, routing: MoeRouting, w13: torch.Tensor, scales, cfg: MoeConfig, shuffled: bool = False
) -> torch.Tensor:
    """Gate/up projection + SwiGLU of every routed pair: ``[n_pairs, I]`` in x's dtype (``presplit`` NVFP4: each
    ``block_k2`` slice stored as [even | odd] columns, the order ``moe_w2`` reads). ``scales``: (w13_scale,
    w13_scale2), or (None, None) for weights in x's dtype; ``shuffled``: NVFP4 in ``shuffle_nvfp4``'s layout."""
    from inkling_kernels import _triton_moe as tk

    s13, s13b, fp4, asm = _fp4_args(w13, scales, x.dtype)
    r = routing
    i = w13.shape[1] // 2
    kperm = fp4 and cfg.kperm
    if fp4 and shuffled:
        _check_shuffled_tile("block_k13", cfg.block_k13)
    pair = _pair_blocks(cfg, fp4, r)
    if pair and (cfg.split_k13 > 1 or cfg.split_acc):
        raise ValueError(f"pair_blocks with split_k13={cfg.split_k13}, split_acc={cfg.split_acc}: one K slice and "
                         "one accumulator per projection expected")  # fmt: skip
    if kperm:
        x = kperm_x(x, cfg.block_k13)
    inter = torch.empty((r.ids.numel(), i), dtype=x.dtype, device=x.device)
    n_tiles, splits = i // cfg.block_n13, cfg.split_k13
    grid, n_fast = _grid(cfg.n_fast13, r.n_blocks, n_tiles, splits)
    if splits > 1:  # per tile: each slice's fp32 gate and up partials, and the count of slices done
        partial = torch.empty((r.n_blocks * n_tiles, splits, 2, cfg.block_n13 * r.block_m), device=x.device)
        count = _arrival_counters(r.n_blocks * n_tiles, x.device)
    else:
        partial, count = inter, r.ids  # unused
    tk.moe_w13_kernel[grid](
        x, r.ids, r.sorted_pairs, r.block_expert, r.block_rank, w13, s13, s13b, inter, partial, count,
        r.ids.numel(), i, x.shape[1] // splits, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), inter.stride(0),
        TOPK=r.topk, BLOCK_M=r.block_m, BLOCK_N=cfg.block_n13, BLOCK_K=cfg.block_k13, IDENTITY=r.identity, FP4=fp4,
        ASM=asm, N_FAST=n_fast, SPLIT_ACC=cfg.split_acc, PRESPLIT_K=cfg.block_k2 if fp4 and cfg.presplit else 0,
        SWAP=cfg.swap_ab, SPLIT_K=splits, X_SPLIT=kperm, KPERM=kperm, SHUFFLED=fp4 and shuffled, PAIR=pair,
        DRAIN=_drain(cfg, x), **_launch_opts(cfg, cfg.num_warps13), **pdl(x),
    )  # fmt: skip
    return inter


def moe_w2(
    inter: torch.Tensor, routing: MoeRouting, w2: torch.Tensor, scales, cfg: MoeConfig, shuffled: bool = False
) -> torch.Tensor:
    """Down projection of every routed pair times its routing weight: fp32 ``[n_pairs, H]``. ``scales``:
    (w2_scale, w2_scale2), or (None, None) for weights in the activations' dtype; ``shuffled`` as for ``moe_w13``."""
    from inkling_kernels import _triton_moe as tk

    s2, s2b, fp4, asm = _fp4_args(w2, scales, inter.dtype)
    if fp4 and shuffled:
        _check_shuffled_tile("block_k2", cfg.block_k2)
    r = routing
    h = w2.shape[1]
    part = torch.empty((r.ids.numel(), h), dtype=torch.float32, device=inter.device)
    grid, n_fast = _grid(cfg.n_fast2, r.n_blocks, h // cfg.block_n2)
    tk.moe_w2_kernel[grid](
        inter, r.ids, r.weights, r.sorted_pairs, r.block_expert, r.block_rank, w2, s2, s2b, part,
        r.ids.numel(), inter.shape[1], inter.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        part.stride(0),
        BLOCK_M=r.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, IDENTITY=r.identity, FP4=fp4, ASM=asm,
        N_FAST=n_fast, PRESPLIT=fp4 and cfg.presplit, SWAP=cfg.swap_ab, KPERM=fp4 and cfg.kperm,
        SHUFFLED=fp4 and shuffled, PAIR=_pair_blocks(cfg, fp4, r), DRAIN=_drain(cfg, inter),
        **_launch_opts(cfg, cfg.num_warps2), **pdl(inter),
    )  # fmt: skip
    return part


def moe_sum(
    part: torch.Tensor,
    routing: MoeRouting,
    dtype: torch.dtype,
    plus: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum over its k slots of part`` ``[n_pairs, H]`` -> ``[T, H]`` in ``dtype`` (one rounding);
    masked slots add exactly 0. ``plus`` ``[T, H]`` in ``dtype``: ``out + plus`` instead, rounded like torch's add
    of the two (the shared experts' output)."""
    import triton

    from inkling_kernels import _triton_moe as tk

    n_pairs, h = part.shape
    t = n_pairs // routing.topk
    out = torch.empty((t, h), dtype=dtype, device=part.device)
    block = min(1024, triton.next_power_of_2(h))
    tk.moe_sum_kernel[(t, triton.cdiv(h, block))](
        part, routing.ids, out, plus if plus is not None else out, h, TOPK=routing.topk, BLOCK=block,
        HAS_PLUS=plus is not None, num_warps=4, **pdl(part),
    )  # fmt: skip
    return out


def nvfp4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale2: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale2: torch.Tensor,
    config: MoeConfig | None = None,
    shuffled: bool = False,
    plus: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts with NVFP4 weights (layout in the module docstring; ``shuffled``: w13/w2 and their block
    scales through ``shuffle_nvfp4``). Returns ``[T, H]`` in x's dtype (``+ plus``: see ``moe_sum``)."""
    scales = (w13_scale, w13_scale2, w2_scale, w2_scale2)
    return _fused_moe(x, topk_ids, topk_weights, w13, w2, scales, True, config, shuffled, plus)


def bf16_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoeConfig | None = None,
    plus: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts with plain weights in x's dtype: w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` (``+ plus``: see
    ``moe_sum``)."""
    return _fused_moe(x, topk_ids, topk_weights, w13, w2, None, False, config, plus=plus)


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w13_scale2: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    w2_scale2: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 reference: dequantise each touched expert (NVFP4 when the scales are given), matmul in fp32."""
    t, k = topk_ids.shape
    out = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        if e == MASKED_ROUTE:
            continue
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if w13_scale is not None:
            g13 = dequant_nvfp4(w13[e], w13_scale[e], w13_scale2[e])
            g2 = dequant_nvfp4(w2[e], w2_scale[e], w2_scale2[e])
        else:
            g13, g2 = w13[e].float(), w2[e].float()
        gate, up = (xf[tok] @ g13.T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ g2.T
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)
