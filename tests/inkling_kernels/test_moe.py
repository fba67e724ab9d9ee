import itertools
from dataclasses import replace
from functools import partial

import pytest
import torch
import triton
import triton.language as tl

import inkling_kernels.moe as moe_module
from inkling_kernels import _triton_moe
from inkling_kernels.moe import (
    MASKED_ROUTE,
    MoeConfig,
    bf16_moe,
    default_config,
    kperm_x,
    kperm_x_reference,
    moe_reference,
    moe_routing,
    moe_w2,
    moe_w13,
    nvfp4_moe,
    shuffle_nvfp4,
    unshuffle_nvfp4,
)
from inkling_kernels.moe_align import moe_align, moe_align_reference
from tests.inkling_kernels.moe_routes import masked, routing, skewed_ids

SMALL = MoeConfig(block_m=16, block_n13=16, block_k13=32, block_n2=16, block_k2=32)
SHUFFLED_SMALL = replace(SMALL, block_k13=64, block_k2=64)  # the shuffled layout's narrowest K tiles


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def nvfp4_stack(e, rows, cols, gen, device="cpu"):
    packed = torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(e, rows, cols // 16, generator=gen) * 1.5 + 0.1).to(torch.float8_e4m3fn)
    scale2 = torch.rand(e, generator=gen) + 0.5
    return packed.to(device), scale.to(device), scale2.to(device)


def odd_scales(stack, gen):
    """The stack with some block scales negative, zero or e4m3-subnormal (what the shuffled layout folds away)."""
    packed, scale, scale2 = stack
    s = scale.float()
    pick = torch.randint(0, 8, s.shape, generator=gen).to(s.device)
    s = torch.where(pick == 0, -s, s)
    s = torch.where(pick == 1, 0.0, s)
    s = torch.where(pick == 2, 3 * 2.0**-9, s)  # subnormal e4m3
    return packed, s.to(torch.float8_e4m3fn), scale2


def shuffled(stack):
    return (*shuffle_nvfp4(stack[0], stack[1]), stack[2])


def exact_stack(e, rows, cols, gen, device):
    """NVFP4 stacks whose products with ``exact_rows`` sum exactly in fp32 in any order: block scales m * 2^p with
    m in {1, 1.5}, p in -8..-5 (1.5 * 2^-8 and 2^-8, 2^-7 e4m3-subnormal), random signs, some zero. Every product
    is a multiple of 2^-2 (rows) * 2^-1 (e2m1) * 2^-9 (scales) = 2^-12 and at most 2 * 6 * 1.5 * 2^-5 = 0.5625, so
    any partial sum of up to 4096 of them is a multiple of 2^-12 below 2^12: exact in fp32's 24 bits (also after the
    kernels' exact power-of-two rescaling of the weights)."""
    shape = (e, rows, cols // 16)
    mant = 1 + 0.5 * torch.randint(0, 2, shape, generator=gen)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.25, -1.0, 1.0)
    scale = sign * mant * torch.exp2(torch.randint(-8, -4, shape, generator=gen).float())
    scale = torch.where(torch.rand(shape, generator=gen) < 0.05, 0.0, scale).to(torch.float8_e4m3fn)
    packed = torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, generator=gen)
    return packed.to(device), scale.to(device), (torch.rand(e, generator=gen) + 0.5).to(device)


def exact_rows(n, cols, gen, device):
    """bf16 rows of multiples of 2^-2 in [-2, 2] (``exact_stack``)."""
    return (torch.randint(-8, 9, (n, cols), generator=gen) / 4).to(torch.bfloat16).to(device)


@pytest.mark.parametrize(
    "t,k,sorted_min_pairs,dtype",
    [
        (1, 2, 64, torch.float32),
        (5, 2, 64, torch.float32),
        (5, 3, 1, torch.float32),
        (7, 2, 1, torch.float16),
    ],
)
def test_nvfp4_moe_matches_reference(cpu_interpreter, t, k, sorted_min_pairs, dtype):
    gen = torch.Generator().manual_seed(t * 10 + k)
    e, h, i = 8, 64, 32
    w13 = nvfp4_stack(e, 2 * i, h, gen)
    w2 = nvfp4_stack(e, h, i, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids, wts = routing(t, e, k, gen)
    ref = moe_reference(x, ids, wts, *w13, *w2)
    cfg = MoeConfig(**{**SMALL.__dict__, "sorted_min_pairs": sorted_min_pairs})
    out = nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg)
    assert out.dtype == dtype and out.shape == (t, h)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize(
    "variant",
    [
        {"swap_ab": False, "presplit": False},
        {"swap_ab": True, "presplit": False, "split_acc": True},
        {"swap_ab": False, "presplit": True, "n_fast13": True, "n_fast2": False},
        {"swap_ab": True, "presplit": True, "n_fast13": False, "n_fast2": True},
        {"swap_ab": True, "split_k13": 2, "split_acc": True, "block_m": 4},
        {"swap_ab": False, "split_k13": 2, "n_fast13": True},
        {"swap_ab": True, "presplit": True, "block_m": 4, "identity_block_m": 16},
        {"swap_ab": True, "presplit": True, "block_n13": 32, "block_k13": 64, "block_k2": 32, "num_warps13": 2},
        {"swap_ab": False, "block_m": 64},  # the prefill tiles: several experts' rows padded in 64-row blocks
        {"swap_ab": True, "kperm": True, "block_m": 64},  # K permuted per 32 columns in both kernels (prefill)
        {"swap_ab": False, "kperm": True, "block_k13": 64},
        {"swap_ab": True, "kperm": True, "split_k13": 2},
    ],
)
@pytest.mark.parametrize("sorted_min_pairs", [1, 64])
def test_nvfp4_moe_code_shapes_match_reference(cpu_interpreter, variant, sorted_min_pairs):
    """Every MoeConfig code-shape switch (operand swap, split intermediate, grid order, row counts) gives the
    reference result, with the identity and the sorted routing."""
    gen = torch.Generator().manual_seed(11)
    e, h, i, t, k = 8, 64, 32, 6, 3
    w13 = nvfp4_stack(e, 2 * i, h, gen)
    w2 = nvfp4_stack(e, h, i, gen)
    x = torch.randn(t, h, generator=gen)
    ids, wts = routing(t, e, k, gen)
    ids[1] = ids[0]  # one expert with several pairs (several rows in a sorted block)
    cfg = MoeConfig(**{**SMALL.__dict__, "sorted_min_pairs": sorted_min_pairs, **variant})
    out = nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg)
    assert rel_err(out, moe_reference(x, ids, wts, *w13, *w2)) < 1e-5


@pytest.mark.parametrize("t,h,block_k,dtype", [(1, 64, 32, torch.float32), (45, 256, 128, torch.float16)])
def test_kperm_x_is_the_reference_permutation(cpu_interpreter, t, h, block_k, dtype):
    x = torch.randn(t, h + 8, generator=torch.Generator().manual_seed(t)).to(dtype)[:, :h]  # a row-strided view
    out = kperm_x(x, block_k)
    assert out.is_contiguous() and torch.equal(out, kperm_x_reference(x, block_k))
    assert torch.equal(out.sort(-1).values, x.sort(-1).values)  # a permutation of each row


def test_shuffle_nvfp4_keeps_the_dequantised_values():
    """Negative, zero and subnormal scales included; the bits of every word are a permutation."""
    from common.nvfp4 import dequant_nvfp4

    gen = torch.Generator().manual_seed(5)
    packed, scale, scale2 = odd_scales(nvfp4_stack(3, 8, 64, gen), gen)
    w, s = shuffle_nvfp4(packed, scale)
    assert w.dtype == torch.uint8 and w.shape == packed.shape and s.dtype == torch.uint8 and s.shape == scale.shape
    back_w, back_s = unshuffle_nvfp4(w, s)
    assert torch.equal(dequant_nvfp4(back_w, back_s, scale2), dequant_nvfp4(packed, scale, scale2))
    ones = torch.full_like(scale, 1.0)
    assert torch.equal(unshuffle_nvfp4(*shuffle_nvfp4(packed, ones))[0], packed)  # positive scales: bytes back
    assert sorted(b for bits in moe_module.SHUFFLE_BITS for b in bits) == list(range(32))


@pytest.mark.parametrize(
    "variant",
    [
        {"swap_ab": True, "presplit": True},
        {"swap_ab": False, "presplit": False},
        {"swap_ab": True, "kperm": True, "block_m": 64},
        {"swap_ab": True, "kperm": True, "split_k13": 2},
    ],
)
@pytest.mark.parametrize("sorted_min_pairs", [1, 64])
def test_shuffled_nvfp4_moe_matches_reference(cpu_interpreter, variant, sorted_min_pairs):
    """The kernels on ``shuffle_nvfp4``'s layout (portable path) give the reference result of the canonical weights,
    and the same result as on the canonical layout."""
    gen = torch.Generator().manual_seed(12)
    e, h, i, t, k = 8, 128, 64, 6, 3
    w13 = odd_scales(nvfp4_stack(e, 2 * i, h, gen), gen)
    w2 = odd_scales(nvfp4_stack(e, h, i, gen), gen)
    x = torch.randn(t, h, generator=gen)
    ids, wts = routing(t, e, k, gen)
    ids[1] = ids[0]
    cfg = MoeConfig(**{**SHUFFLED_SMALL.__dict__, "sorted_min_pairs": sorted_min_pairs, **variant})
    out = nvfp4_moe(x, ids, wts, *shuffled(w13), *shuffled(w2), config=cfg, shuffled=True)
    assert rel_err(out, moe_reference(x, ids, wts, *w13, *w2)) < 1e-5
    assert torch.equal(out, nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg))


def experts_of_block_runs(t, k, gen):
    """Routes of T tokens over 8 experts whose 4-row blocks come in runs of 1 to 4 per expert (8-wide x: 2 pairs
    per token): expert 0 no pair, 1 one block, 2 two, 3 three, 4 four, 5 four and a partial fifth, 6 a partial
    one, 7 one and a partial second."""
    want = [0, 4, 8, 12, 16, 18, 3, 5]  # pairs per expert
    ids = torch.cat([torch.full((n,), ex, dtype=torch.int32) for ex, n in enumerate(want)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    assert ids.numel() == t * k
    return ids.view(t, k)


@pytest.mark.parametrize(
    "shuffle,variant",
    [(True, {}), (True, {"kperm": True}), (False, {}), (False, {"presplit": False}), (False, {"swap_ab": False})],
)
def test_paired_blocks_equal_one_block_per_program(cpu_interpreter, shuffle, variant):
    """``pair_blocks``: a program takes two row blocks of one expert (runs of 1..5 blocks per expert, odd runs leave
    a block alone) and each kernel's output is bit for bit the one-block-per-program launch's, and the reference."""
    gen = torch.Generator().manual_seed(21)
    e, h, i, t, k = 8, 128, 64, 33, 2
    w13 = nvfp4_stack(e, 2 * i, h, gen)
    w2 = nvfp4_stack(e, h, i, gen)
    w13, w2 = (shuffled(w13), shuffled(w2)) if shuffle else (w13, w2)
    x = torch.randn(t, h, generator=gen)
    ids = experts_of_block_runs(t, k, gen)
    wts = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    base = MoeConfig(
        **{**SHUFFLED_SMALL.__dict__, "block_m": 4, "block_n13": 32, "block_n2": 32, "sorted_min_pairs": 1, **variant}
    )
    paired = replace(base, pair_blocks=True)
    r = moe_routing(ids, wts, e, base)
    runs = torch.unique_consecutive(r.block_expert[r.block_expert >= 0], return_counts=True)[1]
    assert set(runs.tolist()) >= {1, 2, 3, 4, 5}, runs
    one = moe_w13(x, r, w13[0], w13[1:], base, shuffle)
    two = moe_w13(x, r, w13[0], w13[1:], paired, shuffle)
    assert torch.equal(one, two)
    assert torch.equal(moe_w2(one, r, w2[0], w2[1:], base, shuffle), moe_w2(one, r, w2[0], w2[1:], paired, shuffle))
    out = nvfp4_moe(x, ids, wts, *w13, *w2, config=paired, shuffled=shuffle)
    ref13, ref2 = (unshuffle_stack(w13), unshuffle_stack(w2)) if shuffle else (w13, w2)
    assert rel_err(out, moe_reference(x, ids, wts, *ref13, *ref2)) < 1e-5


@triton.jit
def _pairing_kernel(BlockRank, SortedPairs, Lead, Second, n_blocks, n_pairs, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    lead, second, _, _ = _triton_moe._block_pair(BlockRank, SortedPairs, pid, n_blocks, n_pairs, BLOCK_M)
    tl.store(Lead + pid, lead.to(tl.int32))
    tl.store(Second + pid, second.to(tl.int32))


def test_block_pairing_leads_every_other_block_of_a_run(cpu_interpreter):
    """Each block's pairing decision against its run of blocks: the even blocks of an expert's run lead and take the
    next one when it is the same expert's (the kernels' outputs cannot show a wrong ``second`` when the interpreter
    runs the program that owns that block after it)."""
    gen = torch.Generator().manual_seed(23)
    ids = experts_of_block_runs(33, 2, gen)
    sorted_pairs, block_expert, block_rank = moe_align(ids, 8, 4)
    n = block_expert.numel()
    lead, second = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    _pairing_kernel[(n,)](block_rank, sorted_pairs, lead, second, n, ids.numel(), BLOCK_M=4)
    experts = block_expert.tolist()
    for b, ex in enumerate(experts):
        if ex < 0:
            continue
        place = sum(1 for _ in itertools.takewhile(lambda e, ex=ex: e == ex, reversed(experts[:b])))
        assert lead[b] == (place % 2 == 0), b
        if lead[b]:
            assert second[b] == (b + 1 < n and experts[b + 1] == ex), b


def unshuffle_stack(stack):
    return (*unshuffle_nvfp4(stack[0], stack[1]), stack[2])


def test_paired_blocks_need_one_slice_and_one_accumulator(cpu_interpreter):
    gen = torch.Generator().manual_seed(22)
    e, h, i, t, k = 8, 128, 64, 33, 2
    w13 = nvfp4_stack(e, 2 * i, h, gen)
    x = torch.randn(t, h, generator=gen)
    ids = experts_of_block_runs(t, k, gen)
    wts = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    for over in ({"split_k13": 2}, {"split_acc": True}):
        cfg = replace(SHUFFLED_SMALL, block_m=4, sorted_min_pairs=1, pair_blocks=True, **over)
        with pytest.raises(ValueError, match="pair_blocks"):
            moe_w13(x, moe_routing(ids, wts, e, cfg), w13[0], w13[1:], cfg)


def test_shuffled_nvfp4_moe_checks_its_layout(cpu_interpreter):
    """Canonical (e4m3) block scales, packed rows off 4-byte words or K tiles below ``SHUFFLED_MIN_BLOCK_K`` (which
    the compiled kernels sum wrongly) are refused, not misread."""
    gen = torch.Generator().manual_seed(13)
    e, h, i, t, k = 4, 64, 32, 2, 2
    w13, w2 = nvfp4_stack(e, 2 * i, h, gen), nvfp4_stack(e, h, i, gen)
    x = torch.randn(t, h, generator=gen)
    ids, wts = routing(t, e, k, gen)
    with pytest.raises(ValueError, match="uint8"):
        nvfp4_moe(x, ids, wts, *w13, *w2, config=SMALL, shuffled=True)
    packed, scale, scale2 = shuffled(w13)
    offset = torch.empty(packed.numel() + 2, dtype=torch.uint8)[2:].view(packed.shape)
    offset.copy_(packed)
    with pytest.raises(ValueError, match="aligned"):
        nvfp4_moe(x, ids, wts, offset, scale, scale2, *shuffled(w2), config=SMALL, shuffled=True)
    for tiles in ({"block_k13": 32}, {"block_k2": 32}):
        w2_64 = nvfp4_stack(e, h, 64, gen)
        w13_64 = nvfp4_stack(e, 128, h, gen)
        with pytest.raises(ValueError, match="SHUFFLED_MIN_BLOCK_K"):
            nvfp4_moe(x, ids, wts, *shuffled(w13_64), *shuffled(w2_64), config=replace(SHUFFLED_SMALL, **tiles),
                      shuffled=True)  # fmt: skip


@pytest.mark.parametrize("sorted_min_pairs", [1, 64])
@pytest.mark.parametrize("fp4", [True, False])
def test_masked_routes_reach_no_expert(cpu_interpreter, sorted_min_pairs, fp4):
    """A masked route adds nothing to its token, whatever its weight, and no expert computes it: a token whose every
    route is masked has a NaN input row and still gets exactly 0 (NaN * 0 is NaN, so one computed route would show),
    with the identity (64) and the sorted (1) routing."""
    gen = torch.Generator().manual_seed(5)
    e, h, i, t, k = 8, 64, 32, 6, 3
    if fp4:
        w13, w2 = nvfp4_stack(e, 2 * i, h, gen), nvfp4_stack(e, h, i, gen)
    else:
        w13, w2 = (torch.randn(e, 2 * i, h, generator=gen) * 0.2,), (torch.randn(e, h, i, generator=gen) * 0.2,)
    x = torch.randn(t, h, generator=gen)
    x[2] = float("nan")
    ids, wts = routing(t, e, k, gen)
    ids = masked(ids, gen, 0.4)
    ids[2] = MASKED_ROUTE
    ids[3, 0] = 1  # token 3 keeps at least one route
    cfg = MoeConfig(**{**SMALL.__dict__, "sorted_min_pairs": sorted_min_pairs})
    if fp4:
        out = nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg)
        ref = moe_reference(x, ids, wts, *w13, *w2)
    else:
        out = bf16_moe(x, ids, wts, *w13, *w2, config=cfg)
        ref = moe_reference(x, ids, wts, w13[0], None, None, w2[0], None, None)
    assert torch.equal(out[2], torch.zeros(h)) and torch.equal(ref[2], torch.zeros(h))
    keep = [r for r in range(t) if r != 2]
    kept_wts = wts.masked_fill(ids < 0, 0.0)  # the same routes with the masked ones at weight 0 on any expert
    zero_ids = ids.clamp(min=0)
    unmasked = moe_reference(x[keep], zero_ids[keep], kept_wts[keep], *(w13 if fp4 else (w13[0], None, None)),
                             *(w2 if fp4 else (w2[0], None, None)))  # fmt: skip
    assert rel_err(out[keep], unmasked) < 1e-5 and rel_err(ref[keep], unmasked) < 1e-5


def test_split_k_counters_are_zero_again_after_each_call(cpu_interpreter):
    """The split-K arrival counters live in one buffer per device (no memset launch per call): the last slice of
    every tile resets its counter, so back-to-back calls of other shapes each finish every tile exactly once."""
    gen = torch.Generator().manual_seed(12)
    e, h, i, k = 8, 64, 32, 3
    w13, w2 = nvfp4_stack(e, 2 * i, h, gen), nvfp4_stack(e, h, i, gen)
    cfg = MoeConfig(**{**SMALL.__dict__, "sorted_min_pairs": 64, "split_k13": 2})
    for t in (2, 1, 2):
        x = torch.randn(t, h, generator=gen)
        ids, wts = routing(t, e, k, gen)
        out = nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg)
        assert rel_err(out, moe_reference(x, ids, wts, *w13, *w2)) < 1e-5
        assert not moe_module._arrival_counters(t * k * (i // SMALL.block_n13), x.device).any()


def test_default_config_tiles_fit_inkling_small():
    h, i, k = 4096, 2048, 6
    for t, fp4, shuffled_layout in itertools.product(
        (1, 8, 10, 11, 64, 256, 319, 320, 512, 513, 1024, 2048, 4096), (True, False), (0, 1)
    ):
        cfg = default_config(t * k, fp4, bool(shuffled_layout))
        assert (t * k >= cfg.sorted_min_pairs) == (t >= 11)
        assert i % cfg.block_n13 == 0 and h % cfg.block_n2 == 0 and i % cfg.block_k2 == 0
        assert h % (cfg.block_k13 * cfg.split_k13) == 0
        if cfg.swap_ab and t * k < moe_module.PREFILL_MIN_PAIRS:  # decode: the block's rows as the MMA's N <= 8
            assert (cfg.block_m if t * k >= cfg.sorted_min_pairs else cfg.identity_block_m) <= 8
        assert not cfg.kperm or (fp4 and cfg.block_k13 % 32 == 0 and cfg.block_k2 % 32 == 0)
        # paired blocks: the shuffled NVFP4 sorted tiles from T = 320 (the MTP verify's sizes) to the prefill tiles
        paired = fp4 and shuffled_layout and 320 <= t < 1024
        assert cfg.pair_blocks == paired and not (paired and (cfg.split_k13 > 1 or cfg.split_acc))
        assert not paired or (cfg.block_n13, cfg.block_n2, cfg.num_warps13, cfg.num_warps2) == (128, 128, 4, 4)


def test_bf16_weight_moe_matches_reference(cpu_interpreter):
    gen = torch.Generator().manual_seed(1)
    e, h, i, t, k = 4, 64, 32, 3, 2
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.2
    w2 = torch.randn(e, h, i, generator=gen) * 0.2
    x = torch.randn(t, h, generator=gen)
    ids, wts = routing(t, e, k, gen)
    ref = moe_reference(x, ids, wts, w13, None, None, w2, None, None)
    for variant in ({"swap_ab": False}, {"swap_ab": True}, {"swap_ab": False, "block_m": 64, "sorted_min_pairs": 1}):
        out = bf16_moe(x, ids, wts, w13, w2, config=MoeConfig(**{**SMALL.__dict__, **variant}))
        assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("fp4", [True, False])
def test_plus_is_added_after_the_routed_sum_rounds(cpu_interpreter, fp4):
    """`plus` (the shared experts' output) comes out as torch's add of it to the routed output: bitwise in fp16."""
    gen = torch.Generator().manual_seed(3)
    e, h, i, t, k = 8, 64, 32, 5, 3
    if fp4:
        w13, w2 = nvfp4_stack(e, 2 * i, h, gen), nvfp4_stack(e, h, i, gen)
        run = partial(nvfp4_moe, w13=w13[0], w13_scale=w13[1], w13_scale2=w13[2], w2=w2[0], w2_scale=w2[1],
                      w2_scale2=w2[2], config=SMALL)  # fmt: skip
    else:
        w13, w2 = (
            (torch.randn(e, 2 * i, h, generator=gen) * 0.2).half(),
            (torch.randn(e, h, i, generator=gen) * 0.2).half(),
        )
        run = partial(bf16_moe, w13=w13, w2=w2, config=SMALL)
    x = torch.randn(t, h, generator=gen).half()
    ids, wts = routing(t, e, k, gen)
    plus = torch.randn(t, h, generator=gen).half()
    routed = run(x, ids, wts)
    assert torch.equal(run(x, ids, wts, plus=plus), routed + plus)
    with pytest.raises(ValueError, match="plus"):
        run(x, ids, wts, plus=plus.float())


def test_nvfp4_moe_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(2)
    w13 = nvfp4_stack(4, 64, 64, gen)
    w2 = nvfp4_stack(4, 64, 32, gen)
    ids, wts = routing(2, 4, 2, gen)
    with pytest.raises(ValueError, match="w13"):
        nvfp4_moe(torch.randn(2, 32), ids, wts, *w13, *w2)
    with pytest.raises(ValueError, match="tile"):
        nvfp4_moe(torch.randn(2, 64), ids, wts, *w13, *w2, config=MoeConfig(block_n13=64))


@pytest.mark.gpu
@pytest.mark.parametrize("t,sorted_min_pairs", [(1, 64), (8, 64), (8, 1), (64, 1), (1, None), (8, None), (64, None)])
def test_nvfp4_moe_gpu_full_width(cuda_device, t, sorted_min_pairs):
    """Full Inkling-Small widths on the GPU (inline-PTX dequant); ``sorted_min_pairs=None``: ``default_config``."""
    gen = torch.Generator().manual_seed(t)
    e, h, i, k = 16, 4096, 2048, 6
    w13 = nvfp4_stack(e, 2 * i, h, gen, cuda_device)
    w2 = nvfp4_stack(e, h, i, gen, cuda_device)
    w13 = (w13[0], w13[1], w13[2] * 1e-3)
    w2 = (w2[0], w2[1], w2[2] * 1e-3)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(cuda_device)
    ids, wts = routing(t, e, k, gen, cuda_device)
    cfg = None if sorted_min_pairs is None else MoeConfig(sorted_min_pairs=sorted_min_pairs)
    out = nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg)
    ref = moe_reference(x, ids, wts, *w13, *w2)
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    print(
        f"nvfp4_moe T={t} sorted_min_pairs={sorted_min_pairs}: rel {err:.2e}, "
        f"max_abs {(out.float() - ref.float()).abs().max().item():.3e}"
    )
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t,variant", [(1, {"split_k13": 2}), (8, {"split_k13": 4})])
def test_nvfp4_moe_gpu_code_paths(cuda_device, t, variant):
    """Full widths, identity routing: the gate/up kernel split along K (the slices' fp32 partials added by the last
    slice to finish) gives the reference result."""
    gen = torch.Generator().manual_seed(t + 7)
    e, h, i, k = 16, 4096, 2048, 6
    w13 = nvfp4_stack(e, 2 * i, h, gen, cuda_device)
    w2 = nvfp4_stack(e, h, i, gen, cuda_device)
    w13, w2 = (w13[0], w13[1], w13[2] * 1e-3), (w2[0], w2[1], w2[2] * 1e-3)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(cuda_device)
    ids, wts = routing(t, e, k, gen, cuda_device)
    few = MoeConfig(block_n13=32, block_n2=32, num_warps13=2, num_warps2=2, n_fast13=False, n_fast2=False)
    cfg = MoeConfig(**{**few.__dict__, "split_acc": True, **variant})
    out = nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg)
    err = rel_err(out, moe_reference(x, ids, wts, *w13, *w2))
    print(f"nvfp4_moe T={t} {variant}: rel {err:.2e}")
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 256, 320, 768])
def test_shuffled_nvfp4_moe_gpu(cuda_device, t):
    """Full widths, ``default_config``'s tiles for the shuffled layout: the reference result, and each kernel bit for
    bit the canonical layout's on inputs whose fp32 sums are exact in any order (``exact_stack``). Exactness is what
    makes them comparable: on mma.sync the operands take K in another order from int32 words than from bytes
    (``kWidth`` 8 against 4), so each MMA adds other products and general inputs round differently."""
    gen = torch.Generator().manual_seed(t + 3)
    e, h, i, k = 16, 4096, 2048, 6
    w13, w2 = exact_stack(e, 2 * i, h, gen, cuda_device), exact_stack(e, h, i, gen, cuda_device)
    x = exact_rows(t, h, gen, cuda_device)
    ids, wts = routing(t, e, k, gen, cuda_device)
    cfg = default_config(t * k, shuffled=True)
    sh13, sh2 = shuffled(w13), shuffled(w2)
    err = rel_err(nvfp4_moe(x, ids, wts, *sh13, *sh2, config=cfg, shuffled=True), moe_reference(x, ids, wts, *w13, *w2))
    r = moe_routing(ids, wts, e, cfg)
    same13 = torch.equal(moe_w13(x, r, sh13[0], sh13[1:], cfg, True), moe_w13(x, r, w13[0], w13[1:], cfg))
    inter = exact_rows(t * k, i, gen, cuda_device)
    same2 = torch.equal(moe_w2(inter, r, sh2[0], sh2[1:], cfg, True), moe_w2(inter, r, w2[0], w2[1:], cfg))
    print(f"shuffled nvfp4_moe T={t}: rel {err:.2e}; gate/up equal to canonical {same13}, down {same2}")
    assert err < 1e-2 and same13 and same2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [192, 320, 512, 768])
def test_paired_blocks_gpu(cuda_device, t):
    """Full widths, the shuffled layout's default tiles at the MTP verify's sizes, uniform and skewed routes: with
    ``pair_blocks`` each kernel's output is bit for bit the one-block-per-program launch's (the same MMAs per
    block, in the same order)."""
    gen = torch.Generator().manual_seed(t + 5)
    e, h, i, k = 256, 4096, 2048, 6
    w13 = shuffled(nvfp4_stack(e, 2 * i, h, gen, cuda_device))
    w2 = shuffled(nvfp4_stack(e, h, i, gen, cuda_device))
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(cuda_device)
    base = replace(default_config(t * k, shuffled=True), pair_blocks=False)
    paired = replace(base, pair_blocks=True)
    for ids in (routing(t, e, k, gen, cuda_device)[0], skewed_ids(t, e, k, gen, cuda_device)):
        wts = torch.softmax(torch.randn(t, k, generator=gen), dim=-1).to(cuda_device)
        r = moe_routing(ids, wts, e, base)
        one = moe_w13(x, r, w13[0], w13[1:], base, True)
        assert torch.equal(one, moe_w13(x, r, w13[0], w13[1:], paired, True))
        assert torch.equal(moe_w2(one, r, w2[0], w2[1:], base, True), moe_w2(one, r, w2[0], w2[1:], paired, True))


@pytest.mark.gpu
def test_kperm_x_gpu(cuda_device):
    x = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(cuda_device)
    assert torch.equal(kperm_x(x, 128), kperm_x_reference(x, 128))


PREFILL_TILES = [  # prefill code shapes on the GPU (bf16, inline-PTX dequant): default_config's, then the old ones
    {},
    {"swap_ab": False, "kperm": False, "block_n2": 64, "num_warps2": 4},
    {"block_m": 128, "block_n2": 64, "num_warps2": 4},
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", PREFILL_TILES)
def test_nvfp4_moe_gpu_prefill_tiles(cuda_device, variant):
    """Full Inkling-Small widths, ~96 pairs per expert (row blocks of 64 and 128 pairs, partly filled): the prefill
    tiles give the reference result."""
    gen = torch.Generator().manual_seed(17)
    e, h, i, k, t = 16, 4096, 2048, 6, 256
    w13 = nvfp4_stack(e, 2 * i, h, gen, cuda_device)
    w2 = nvfp4_stack(e, h, i, gen, cuda_device)
    w13, w2 = (w13[0], w13[1], w13[2] * 1e-3), (w2[0], w2[1], w2[2] * 1e-3)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(cuda_device)
    ids, wts = routing(t, e, k, gen, cuda_device)
    cfg = replace(default_config(moe_module.PREFILL_MIN_PAIRS), **variant)
    out = nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg)
    err = rel_err(out, moe_reference(x, ids, wts, *w13, *w2))
    print(f"nvfp4_moe prefill tiles {variant}: rel {err:.2e}")
    assert err < 1e-2


SHUFFLED_WGMMA_TILES = [  # tiles whose MMA takes the weights as a wgmma register operand: prefill, 16-row decode
    {},
    {"block_m": 128, "block_n2": 64, "num_warps2": 4},
    {"block_m": 16, "kperm": False, "block_k13": 256, "block_k2": 256, "block_n2": 64, "num_warps2": 4},
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SHUFFLED_WGMMA_TILES)
def test_shuffled_nvfp4_moe_gpu_wgmma_tiles(cuda_device, variant):
    """Full widths, ~96 pairs per expert: on the tiles whose wgmma register operand holds 4-byte groups of two rows,
    the whole-word unpack of the shuffled layout gives the reference result and exactly the canonical layout's."""
    gen = torch.Generator().manual_seed(19)
    e, h, i, k, t = 16, 4096, 2048, 6, 256
    w13 = odd_scales(nvfp4_stack(e, 2 * i, h, gen, cuda_device), gen)
    w2 = odd_scales(nvfp4_stack(e, h, i, gen, cuda_device), gen)
    w13, w2 = (w13[0], w13[1], w13[2] * 1e-3), (w2[0], w2[1], w2[2] * 1e-3)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(cuda_device)
    ids, wts = routing(t, e, k, gen, cuda_device)
    cfg = replace(default_config(moe_module.PREFILL_MIN_PAIRS), **variant)
    out = nvfp4_moe(x, ids, wts, *shuffled(w13), *shuffled(w2), config=cfg, shuffled=True)
    err = rel_err(out, moe_reference(x, ids, wts, *w13, *w2))
    same = torch.equal(out, nvfp4_moe(x, ids, wts, *w13, *w2, config=cfg))
    drained = replace(cfg, wgmma_drain=not cfg.wgmma_drain)  # the waits inside each K step change no sum
    flipped = nvfp4_moe(x, ids, wts, *shuffled(w13), *shuffled(w2), config=drained, shuffled=True)
    same_drained = torch.equal(out, flipped)
    print(f"shuffled nvfp4_moe wgmma tiles {variant}: rel {err:.2e}, equal to the canonical layout's: {same}, with "
          f"wgmma_drain={drained.wgmma_drain}: {same_drained}")  # fmt: skip
    assert err < 1e-2 and same and same_drained


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4, 16])
def test_bf16_moe_gpu(cuda_device, t):
    gen = torch.Generator().manual_seed(3)
    e, h, i, k = 8, 4096, 2048, 6
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.02).to(torch.bfloat16).to(cuda_device)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.02).to(torch.bfloat16).to(cuda_device)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(cuda_device)
    ids, wts = routing(t, e, k, gen, cuda_device)
    out = bf16_moe(x, ids, wts, w13, w2)
    err = rel_err(out, moe_reference(x, ids, wts, w13, None, None, w2, None, None))
    print(f"bf16_moe T={t}: rel {err:.2e}")
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64])
def test_masked_routes_reach_no_expert_gpu_full_width(cuda_device, t):
    """Inkling-Small widths with half the routes masked (expert parallelism over 2): identity (T=1, 8) and sorted
    (T=64) routing; a token with every route masked has a NaN input and gets exactly 0."""
    gen = torch.Generator().manual_seed(t + 100)
    e, h, i, k = 16, 4096, 2048, 6
    w13 = nvfp4_stack(e, 2 * i, h, gen, cuda_device)
    w2 = nvfp4_stack(e, h, i, gen, cuda_device)
    w13, w2 = (w13[0], w13[1], w13[2] * 1e-3), (w2[0], w2[1], w2[2] * 1e-3)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids, wts = routing(t, e, k, gen)
    ids = masked(ids, gen)
    ids[0], x[0] = MASKED_ROUTE, float("nan")
    x, ids, wts = x.to(cuda_device), ids.to(cuda_device), wts.to(cuda_device)
    align = moe_align(ids, e, 8)
    assert all(torch.equal(a, b) for a, b in zip(align, moe_align_reference(ids, e, 8), strict=True))
    out = nvfp4_moe(x, ids, wts, *w13, *w2)
    assert torch.equal(out[0].float().cpu(), torch.zeros(h))
    if t > 1:
        ref = moe_reference(x[1:], ids[1:], wts[1:], *w13, *w2)
        assert rel_err(out[1:], ref) < 1e-2
