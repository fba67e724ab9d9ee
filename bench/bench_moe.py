"""Routed-expert MoE decode benchmark (Inkling-Small shapes: H=4096, I=2048, E=256, k=6) against its floor.

Floor = bytes that must move / measured copy bandwidth, bytes = unique experts touched x (packed weights +
block scales + scale2 of w13 and w2) + activations in and out. Each timing is a CUDA graph replaying the op
over ``SETS`` independent routings (different experts, so weights do not sit in the 60 MB L2), divided by
SETS. The full op runs with ``default_config`` and with round 1's tiles (``round1``) side by side, then each
kernel alone with the default; also the torch baseline (per touched expert: dequantise to bf16, then bf16
matmuls; eager). ``--prefill`` times the prefill sizes (T = 2048, 4096 tokens: ~48-96 pairs per expert; 1024) each
kernel alone per tile variant (``PREFILL_VARIANTS``) against both floors (FLOPs at the measured bf16 peak, bytes
at the copy bandwidth), the routing and slot-sum stages, and bf16-weight experts through the Triton kernels and
through ``torch._grouped_mm`` (the GEMM half of "dequantise to bf16, then grouped bf16 GEMMs"). ``--sweep``
times the gate/up and the down kernel alone for each tile variant (``W13_VARIANTS``, ``W2_VARIANTS``, ...)
against its own byte floor; ``--jobs N`` compiles the configs in N
processes first (Triton's disk cache).

``--align`` times ``moe_align`` alone (the torch sort, its kernels, the grid path's tiles).

    python3 -m bench.bench_moe [--quick] [--sweep] [--prefill] [--align] [--jobs N]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
from dataclasses import replace

import torch
import torch.nn.functional as F

from bench.floors import Ceilings, measure_ceilings, row, time_eager_ms, time_graph_ms
from common.nvfp4 import dequant_nvfp4
from inkling_kernels.moe import (
    MoeConfig,
    bf16_moe,
    default_config,
    moe_reference,
    moe_routing,
    moe_sum,
    moe_w2,
    moe_w13,
    nvfp4_moe,
    shuffle_nvfp4,
)
from inkling_kernels.moe_align import moe_align, moe_align_grid, moe_align_reference

H, I, E, TOPK = 4096, 2048, 256, 6
SETS = 8
WIDTHS = [5, 10, 10, 8, 10, 10, 7, 8]
WIDTHS2 = [5, 7, 12, 9, 8, 9, 8, 6, 8]
# round 1's choice (issue 17 before this sweep): the few-pairs tiles below 64 pairs, the class defaults above
ROUND1_FEW = MoeConfig(block_n13=32, block_n2=32, num_warps13=2, num_warps2=2, n_fast13=False, n_fast2=False,
                       split_acc=True)  # fmt: skip
ROUND1_MANY = MoeConfig(block_m=8, block_n13=64, block_n2=64, num_warps13=4, num_warps2=4, n_fast13=True, n_fast2=True)
# per-kernel tile variants, overrides of the ROUND1 tiles of the routing they run with (`--sweep`)
W13_VARIANTS = {
    "base": {},
    "m_fast": {"n_fast13": False},
    "n_fast": {"n_fast13": True},
    "n128w4": {"block_n13": 128, "num_warps13": 4},
    "n64w2": {"block_n13": 64, "num_warps13": 2},
    "n64w4": {"block_n13": 64, "num_warps13": 4},
    "n128w8": {"block_n13": 128, "num_warps13": 8},
    "n32w2": {"block_n13": 32, "num_warps13": 2},
    "n16w1": {"block_n13": 16, "num_warps13": 1},
    "stages2": {"num_stages": 2},
    "stages4": {"num_stages": 4},
    "reg128": {"maxnreg": 128},
    "k128": {"block_k13": 128},
    "acc2": {"split_acc": True},
}
W2_VARIANTS = {
    "base": {},
    "m_fast": {"n_fast2": False},
    "n_fast": {"n_fast2": True},
    "n128w4": {"block_n2": 128, "num_warps2": 4},
    "n64w2": {"block_n2": 64, "num_warps2": 2},
    "n64w4": {"block_n2": 64, "num_warps2": 4},
    "n32w2": {"block_n2": 32, "num_warps2": 2},
    "n16w1": {"block_n2": 16, "num_warps2": 1},
    "stages4": {"num_stages": 4},
    "reg128": {"maxnreg": 128},
}
SORTED_ONLY = {  # row-block sizes (both kernels' variants); 2 warps keep 16-row blocks on mma.sync
    "b16": {"block_m": 16},
    "b16n32w2": {"block_m": 16, "block_n13": 32, "block_n2": 32, "num_warps13": 2, "num_warps2": 2},
    "b4": {"block_m": 4},
}
IDENTITY_ONLY = {  # split-K of the gate/up kernel (its partials are per row block: few blocks only)
    "split2": {"split_k13": 2},
    "split4": {"split_k13": 4},
    "n64w4s2": {"block_n13": 64, "num_warps13": 4, "split_k13": 2},
    "n64w2s4": {"block_n13": 64, "num_warps13": 2, "split_k13": 4},
}
MODES = {1: ["identity"], 8: ["identity", "sorted"], 64: ["sorted"], 256: ["sorted"]}


def round1(n_pairs: int) -> MoeConfig:
    return ROUND1_FEW if n_pairs < ROUND1_FEW.sorted_min_pairs else ROUND1_MANY


def variant(overrides: dict, mode: str) -> MoeConfig:
    """A sweep config: ``overrides`` on round 1's tiles of ``mode`` ("identity" or "sorted") routing."""
    base = ROUND1_FEW if mode == "identity" else ROUND1_MANY
    return MoeConfig(**{**base.__dict__, **overrides, "sorted_min_pairs": 1 << 30 if mode == "identity" else 1})


def make_nvfp4(e: int, rows: int, cols: int, dev: str):
    packed = torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, device=dev)
    scale = (torch.rand(e, rows, cols // 16, device=dev) * 1.5 + 0.25).to(torch.float8_e4m3fn)
    scale2 = torch.rand(e, device=dev) * 1e-3 + 1e-3
    return packed, scale, scale2


def routings(t: int, dev: str, gen: torch.Generator, n: int = SETS):
    sets = []
    for _ in range(n):
        ids = torch.argsort(torch.rand(t, E, generator=gen), dim=1)[:, :TOPK].to(torch.int32)
        wts = torch.softmax(torch.randn(t, TOPK, generator=gen), dim=-1)
        x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
        sets.append((x.to(dev), ids.to(dev), wts.to(dev)))
    return sets


def expert_bytes(fp4: bool) -> int:
    if fp4:
        return 3 * H * I // 2 + 3 * H * I // 16 + 2 * 4
    return 3 * H * I * 2


def must_bytes(ids: torch.Tensor, fp4: bool) -> int:
    t = ids.shape[0]
    return torch.unique(ids).numel() * expert_bytes(fp4) + 2 * t * H * 2


def baseline(x, ids, wts, w13, s13, s13b, w2, s2, s2b):
    """Per touched expert: dequantise to bf16 in torch, bf16 matmuls (the naive path)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        g13 = dequant_nvfp4(w13[e], s13[e], s13b[e]).to(torch.bfloat16)
        g2 = dequant_nvfp4(w2[e], s2[e], s2b[e]).to(torch.bfloat16)
        gate, up = (x[tok] @ g13.T).chunk(2, dim=-1)
        out.index_add_(0, tok, ((F.silu(gate) * up) @ g2.T).float() * wts[tok, slot, None])
    return out.to(x.dtype)


def w13_bytes(ids: torch.Tensor) -> int:
    """Must-move bytes of the gate/up kernel: touched experts' w13 (+ scales), x in, the intermediate out."""
    return (
        torch.unique(ids).numel() * (2 * I * H // 2 + 2 * I * H // 16 + 4) + ids.shape[0] * H * 2 + ids.numel() * I * 2
    )


def w2_bytes(ids: torch.Tensor) -> int:
    """Must-move bytes of the down kernel: touched experts' w2 (+ scales), the intermediate in, fp32 partials out."""
    return torch.unique(ids).numel() * (H * I // 2 + H * I // 16 + 4) + ids.numel() * (I * 2 + H * 4)


@functools.cache
def _shuffled(w13, s13, w2, s2):
    return (*shuffle_nvfp4(w13, s13), *shuffle_nvfp4(w2, s2))


def shuffle_weights(weights: tuple) -> tuple:
    """The stacks in ``shuffle_nvfp4``'s layout (made once per weight set)."""
    w13, s13, s13b, w2, s2, s2b = weights
    a, b, c, d = _shuffled(w13, s13, w2, s2)
    return a, b, s13b, c, d, s2b


def bench_nvfp4(ceil: Ceilings, batches: list[int], gen: torch.Generator, shuffled: bool = False) -> tuple:
    dev = "cuda"
    weights = (*make_nvfp4(E, 2 * I, H, dev), *make_nvfp4(E, H, I, dev))
    print("# correctness vs fp32 moe_reference (bf16 activations): rel = |out-ref|/|ref|, max_abs")
    for t in batches:
        x, ids, wts = routings(t, dev, gen)[0]
        ref = moe_reference(x, ids, wts, *weights).float()
        cases = [("default", None, False), *((m, variant({}, m), False) for m in MODES.get(t, ["sorted"]))]
        for mode, cfg, sh in cases + [("shuffled", None, True)] * shuffled:
            w = shuffle_weights(weights) if sh else weights
            out = nvfp4_moe(x, ids, wts, *w, config=cfg, shuffled=sh).float()
            rel = ((out - ref).norm() / ref.norm()).item()
            print(
                f"T={t:4d} {mode:8s} rel={rel:.2e} max_abs={(out - ref).abs().max().item():.3e} "
                f"(|ref|max={ref.abs().max().item():.3e})",
                flush=True,
            )

    print(f"# NVFP4 MoE (w13+SwiGLU+w2+slot sum), CUDA graph, L2 rotated over {SETS} routings")
    print(row(["T", "config", "routing", "experts", "MB", "time_us", "floor", "ratio"], WIDTHS))
    for t in batches:
        sets = routings(t, dev, gen)
        mb = sum(must_bytes(ids, True) for _, ids, _ in sets) / SETS
        n_exp = sum(torch.unique(ids).numel() for _, ids, _ in sets) / SETS
        floor = ceil.floor_us(mb)
        rows = [("default", default_config(t * TOPK), False), ("round1", round1(t * TOPK), False)]
        for name, cfg, sh in rows + [("shuffled", default_config(t * TOPK, shuffled=True), True)] * shuffled:
            w = shuffle_weights(weights) if sh else weights

            def run(cfg=cfg, sets=sets, w=w, sh=sh):
                return [nvfp4_moe(x, ids, wts, *w, config=cfg, shuffled=sh) for x, ids, wts in sets]

            us = 1e3 * time_graph_ms(run) / SETS
            mode = "identity" if t * TOPK < cfg.sorted_min_pairs else "sorted"
            cells = [str(t), name, mode, f"{n_exp:.1f}", f"{mb / 1e6:.1f}", f"{us:.1f}", f"{floor:.1f}"]
            print(row([*cells, f"{us / floor:.2f}"], WIDTHS), flush=True)
        x, ids, wts = sets[0]
        mb0 = must_bytes(ids, True)
        us_base = 1e3 * time_eager_ms(lambda x=x, ids=ids, wts=wts: baseline(x, ids, wts, *weights), reps=5)
        f0 = ceil.floor_us(mb0)
        cells = [str(t), "torch", "dequant+mm", str(torch.unique(ids).numel()), f"{mb0 / 1e6:.1f}"]
        print(row([*cells, f"{us_base:.1f}", f"{f0:.1f}", f"{us_base / f0:.2f}"], WIDTHS), flush=True)
    return weights


def time_kernel(kind: str, cfg: MoeConfig, sets, weights, reps: int, sh: bool = False) -> tuple[float, torch.Tensor]:
    """us per routing of the gate/up ("w13") or the down ("w2") kernel alone, in a CUDA graph over the sets, and
    its result for the first set (the intermediate, or the down projection's fp32 rows); ``sh``: the weights in
    ``shuffle_nvfp4``'s layout."""
    w13, s13, s13b, w2, s2, s2b = shuffle_weights(weights) if sh else weights
    routes = [moe_routing(ids, wts, E, cfg) for _, ids, wts in sets]
    inters = [moe_w13(x, r, w13, (s13, s13b), cfg, sh) for (x, _, _), r in zip(sets, routes, strict=True)]
    if kind == "w13":

        def run():
            return [moe_w13(x, r, w13, (s13, s13b), cfg, sh) for (x, _, _), r in zip(sets, routes, strict=True)]

        first = inters[0]
    else:

        def run():
            return [moe_w2(h, r, w2, (s2, s2b), cfg, sh) for h, r in zip(inters, routes, strict=True)]

        first = moe_w2(inters[0], routes[0], w2, (s2, s2b), cfg, sh)
    return 1e3 * time_graph_ms(run, reps=reps) / len(sets), first.float()


def kernels_table(ceil: Ceilings, batches: list[int], weights, gen: torch.Generator, configs: list) -> None:
    """Each kernel alone per config (``configs``: (kernels, name, T -> MoeConfig or None[, shuffled layout])),
    against its own byte floor; then the fastest config per kernel and batch."""
    print(f"# each kernel alone, CUDA graph over {SETS} routings; floor = its must-move bytes / copy bandwidth")
    print("# rel: |result - default config's result| / |default's| on the first routing (accumulation order only)")
    print(row(["T", "kernel", "config", "routing", "MB", "time_us", "floor", "ratio", "rel"], WIDTHS2))
    best: dict[tuple[int, str], tuple[float, str]] = {}
    reps = 50 if len(configs) < 4 else 15
    for t in batches:
        sets = routings(t, "cuda", gen)
        for kind, nbytes in (("w13", w13_bytes), ("w2", w2_bytes)):
            mb = sum(nbytes(ids) for _, ids, _ in sets) / SETS
            floor = ceil.floor_us(mb)
            ref = time_kernel(kind, default_config(t * TOPK), sets[:1], weights, 1)[1]
            for kinds, name, pick, *sh in configs:
                cfg = pick(t)
                if cfg is None or kind not in kinds:
                    continue
                mode = "identity" if t * TOPK < cfg.sorted_min_pairs else "sorted"
                try:
                    us, first = time_kernel(kind, cfg, sets, weights, reps, bool(sh and sh[0]))
                except Exception as exc:  # a variant that does not compile on this Triton: report, go on
                    print(f"T={t} {kind} {name} {mode}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                rel = ((first - ref).norm() / ref.norm()).item()
                cells = [str(t), kind, name, mode, f"{mb / 1e6:.1f}", f"{us:.1f}", f"{floor:.1f}", f"{us / floor:.2f}"]
                print(row([*cells, f"{rel:.1e}"], WIDTHS2), flush=True)
                if rel < 1e-2 and us < best.get((t, kind), (float("inf"), ""))[0]:
                    best[(t, kind)] = (us, f"{name}/{mode}, floor {floor:.1f} us, {100 * floor / us:.0f}% of it")
    print("# best per kernel and batch")
    for (t, kind), (us, what) in best.items():
        print(f"T={t:4d} {kind:3s} {us:7.1f} us  {what}")


def sweep_configs() -> list:
    """(kernels, name, T -> MoeConfig or None) of every distinct per-kernel variant with each routing of ``MODES``."""
    configs, seen = [], set()
    for kind, variants in (("w13", {**W13_VARIANTS, **IDENTITY_ONLY}), ("w2", W2_VARIANTS)):
        for name, over in {**variants, **SORTED_ONLY}.items():
            only = "sorted" if name in SORTED_ONLY else "identity" if name in IDENTITY_ONLY else None
            for mode in (only,) if only else ("identity", "sorted"):
                if (kind, variant(over, mode)) in seen:
                    continue
                seen.add((kind, variant(over, mode)))

                def pick(t, over=over, mode=mode):
                    return variant(over, mode) if mode in MODES.get(t, ["sorted"]) else None

                configs.append(((kind,), name, pick))
    return configs


# 16-row blocks in the kperm K order (wgmma with the weights as its register operand), 64-row tiles of 4 warps
B16KP = {"block_m": 16, "kperm": True, "block_k13": 128, "block_k2": 128, "pair_blocks": False, "wgmma_drain": True,
         "block_n13": 64, "block_n2": 64, "num_warps13": 4, "num_warps2": 4}  # fmt: skip
SHUFFLED_VARIANTS = {  # overrides of default_config timed on the shuffled layout (``--shuffled``)
    "sh_w4": {"num_warps13": 4, "num_warps2": 4},
    "sh_w2": {"num_warps13": 2, "num_warps2": 2},
    "sh_n64": {"block_n13": 64, "block_n2": 64},
    "sh_n128_w4": {"block_n13": 128, "block_n2": 128, "num_warps13": 4, "num_warps2": 4},  # 128 weight rows
    "sh_n64_w2": {"block_n13": 64, "block_n2": 64, "num_warps13": 2, "num_warps2": 2},  # the paired tiles before
    "sh_pair": {"pair_blocks": True},  # two row blocks of one expert per program
    "sh_single": {"pair_blocks": False},  # one row block per program
    "sh_b16kp": B16KP,
    "sh_b16kp_nd": {**B16KP, "wgmma_drain": False},
    "sh_b16kp_n128w8": {**B16KP, "block_n13": 128, "block_n2": 128, "num_warps13": 8, "num_warps2": 8},
    "sh_b16kp_k256": {**B16KP, "block_k13": 256, "block_k2": 256},
}


def shuffled_variants() -> list:
    """(kernels, name, T -> MoeConfig or None, shuffled) of each ``SHUFFLED_VARIANTS`` entry that changes the
    default at T."""

    def pick(t, over):
        base = default_config(t * TOPK, shuffled=True)
        cfg = replace(base, **over)
        return None if cfg == base else cfg

    return [(("w13", "w2"), name, lambda t, o=over: pick(t, o), True) for name, over in SHUFFLED_VARIANTS.items()]


def _compile_one(job) -> str:
    """Worker of ``precompile``: one MoE call with this config on a small expert stack (fills the disk cache)."""
    cfg, t, fp4, sh = (*job, True, False)[:4] if len(job) == 2 else (*job, False)[:4]
    gen = torch.Generator().manual_seed(0)
    e = 8
    ids = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :TOPK].to(torch.int32).cuda()
    wts = torch.softmax(torch.randn(t, TOPK, generator=gen), dim=-1).cuda()
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16).cuda()
    try:
        if fp4:
            w = (*make_nvfp4(e, 2 * I, H, "cuda"), *make_nvfp4(e, H, I, "cuda"))
            nvfp4_moe(x, ids, wts, *(shuffle_weights(w) if sh else w), config=cfg, shuffled=sh)
        else:
            w13 = torch.randn(e, 2 * I, H, dtype=torch.bfloat16, device="cuda")
            bf16_moe(x, ids, wts, w13, torch.randn(e, H, I, dtype=torch.bfloat16, device="cuda"), config=cfg)
        torch.cuda.synchronize()
    except Exception as exc:  # reported; the timing run reports it again
        return f"{cfg}: {type(exc).__name__}"
    return ""


def precompile(configs: list, batches: list[int], jobs: int, extra: list = ()) -> None:
    """Compile every config the run will time in ``jobs`` processes (Triton caches the binaries on disk), once
    per routing mode; ``extra``: more (config, T, fp4[, shuffled]) jobs."""
    work, seen = list(extra), set()
    for _, _, pick, *sh in configs:
        for t in batches:
            cfg = pick(t)
            key = (cfg, t * TOPK < cfg.sorted_min_pairs, bool(sh and sh[0])) if cfg is not None else None
            if key is not None and key not in seen:
                seen.add(key)
                work.append((cfg, t, True, key[2]))
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        failed = [f for f in pool.map(_compile_one, work, chunksize=1) if f]
    print(f"# precompiled {len(work)} configs in {jobs} processes" + (f"; failed: {failed}" if failed else ""))


PREFILL_BATCHES = [2048, 4096, 1024]  # 1024: 24 pairs per expert, below PREFILL_MIN_PAIRS (the crossover)
BF16_VARIANTS = ["default", "swap", "m128w8"]  # also timed with bf16 weights (kperm is NVFP4 only)
PREFILL_SETS = 2  # routings per graph (the 3.6 GB NVFP4 stack is far beyond L2 anyway)
WIDTHS3 = [5, 4, 12, 9, 7, 8, 8, 6, 8]
# tile variants of the prefill kernels: overrides of default_config at prefill sizes (both kernels timed alone)
KP = {"swap_ab": True, "kperm": True}  # weights as the MMA's M operand, K in the kperm order
W8 = {"num_warps13": 8, "num_warps2": 8}
# measured in round 1 (issue 17, decisions.md); "chosen" is default_config's NVFP4 prefill choice since
PREFILL_VARIANTS = {
    "default": {},  # the base: the prefill tiles before this work
    "chosen": {**KP, "block_n2": 128, "num_warps2": 8},
    "swap_kp": KP,
    "swap_kp_n128w8": {**KP, **W8, "block_n13": 128, "block_n2": 128},
    "swap_kp_s4": {**KP, "num_stages": 4},
    "swap": {"swap_ab": True},
    "m128w8": {**W8, "block_m": 128},
    "n128w8": {**W8, "block_n13": 128, "block_n2": 128},
    "w8": W8,
    "stages4": {"num_stages": 4},
    "chosen_drain": {**KP, "block_n2": 128, "num_warps2": 8, "wgmma_drain": True},  # no wgmma across K steps
    "chosen_drain_s4": {**KP, "block_n2": 128, "num_warps2": 8, "wgmma_drain": True, "num_stages": 4},
    # an expert's consecutive 64-row blocks through each dequantised weight tile (``pair_blocks``)
    "drain_pair": {**KP, "block_n2": 128, "num_warps2": 8, "wgmma_drain": True, "pair_blocks": True},
    "drain_pair_w8": {**KP, **W8, "block_n2": 128, "wgmma_drain": True, "pair_blocks": True},
    "drain_m128_w8": {**KP, **W8, "block_m": 128, "block_n2": 128, "wgmma_drain": True},
}


# the prefill tiles before issue 17's MoE prefill work (default_config from PREFILL_MIN_PAIRS pairs then), the base
# of every PREFILL_VARIANTS entry
PREFILL_BASE = MoeConfig(block_m=64, swap_ab=False, block_k13=128, block_k2=128)


def prefill_variant(name: str) -> MoeConfig:
    return replace(PREFILL_BASE, **PREFILL_VARIANTS[name])


def time_any_ms(fn, reps: int = 10) -> float:
    """``time_graph_ms``, or eager timing where the op cannot be captured (reported)."""
    try:
        return time_graph_ms(fn, reps=reps)
    except Exception as exc:  # e.g. a host sync inside a torch op
        print(f"# (not capturable: {type(exc).__name__}; timed eagerly)", flush=True)
        torch.cuda.synchronize()
        return time_eager_ms(fn, reps=reps)


def prefill_floors(ceil: Ceilings, kind: str, ids: torch.Tensor, fp4: bool) -> tuple[float, float]:
    """(FLOP floor, byte floor) in us of one kernel ("w13", "w2") on routing ``ids``: its MMA FLOPs at the
    measured bf16 peak; its must-move bytes (``w13_bytes``/``w2_bytes``, bf16 weights: 4x the packed) at the
    copy bandwidth."""
    flops = 2.0 * ids.numel() * H * I * (2 if kind == "w13" else 1)
    nbytes = (w13_bytes if kind == "w13" else w2_bytes)(ids)
    if not fp4:  # 2 bytes per weight instead of 9/16
        nbytes += torch.unique(ids).numel() * (2 if kind == "w13" else 1) * H * I * (2 - 9 / 16)
    return flops / (ceil.bf16_tflops * 1e12) * 1e6, ceil.floor_us(nbytes)


def prefill_row(ceil, t, kind, name, us, floors, rel="") -> str:
    flops_us, bytes_us = floors
    tflops = flops_us * ceil.bf16_tflops / us
    cells = [str(t), kind, name, f"{us:.0f}", f"{tflops:.0f}", f"{flops_us:.0f}", f"{bytes_us:.0f}"]
    return row([*cells, f"{us / max(floors):.2f}", rel], WIDTHS3)


def bench_prefill_kernels(
    ceil: Ceilings, batches: list[int], gen: torch.Generator, variants: list[str], shuffled: bool = False
) -> None:
    """NVFP4 prefill sizes: the whole op, its stages, then each kernel alone per tile variant; ``shuffled``: also
    the whole op and each variant on ``shuffle_nvfp4``'s layout (``name+sh``, rel vs the variant's canonical run)."""
    dev = "cuda"
    weights = (*make_nvfp4(E, 2 * I, H, dev), *make_nvfp4(E, H, I, dev))
    print(f"# NVFP4 MoE at prefill sizes, CUDA graph over {PREFILL_SETS} routings; floors: FLOPs at the bf16 peak,")
    print("# bytes at the copy bandwidth; ratio = time / the larger floor; rel vs the default config's result (w13:")
    print("# kperm variants store the intermediate in their own column order, so only their w2 rel compares)")
    print(row(["T", "kern", "config", "time_us", "TFLOP/s", "flop_fl", "byte_fl", "ratio", "rel"], WIDTHS3))
    for t in batches:
        sets = routings(t, dev, gen, PREFILL_SETS)
        x, ids, wts = sets[0]
        cfg = default_config(ids.numel())
        ref = moe_reference(x, ids, wts, *weights).float()
        out = nvfp4_moe(x, ids, wts, *weights).float()
        rel = f"{((out - ref).norm() / ref.norm()).item():.1e}"
        both = tuple(a + b for a, b in zip(*(prefill_floors(ceil, k, ids, True) for k in ("w13", "w2")), strict=True))
        us = 1e3 * time_any_ms(lambda sets=sets: [nvfp4_moe(*s, *weights) for s in sets]) / len(sets)
        print(prefill_row(ceil, t, "all", "now", us, both, rel + "(fp32 ref)"), flush=True)
        if shuffled:
            sh = shuffle_weights(weights)
            out_sh = nvfp4_moe(x, ids, wts, *sh, shuffled=True).float()
            rel_sh = f"{((out_sh - ref).norm() / ref.norm()).item():.1e}(fp32 ref), equal {torch.equal(out_sh, out)}"
            runs = [(*s, *sh) for s in sets]
            us = 1e3 * time_any_ms(lambda runs=runs: [nvfp4_moe(*r, shuffled=True) for r in runs]) / len(sets)
            print(prefill_row(ceil, t, "all", "now+sh", us, both, rel_sh), flush=True)
        run = [(x_, i_, w_, PREFILL_BASE) for x_, i_, w_ in sets]
        us = 1e3 * time_any_ms(lambda run=run: [nvfp4_moe(*s[:3], *weights, config=s[3]) for s in run]) / len(sets)
        print(prefill_row(ceil, t, "all", "before", us, both), flush=True)
        us = 1e3 * time_any_ms(lambda cfg=cfg, sets=sets: [moe_routing(i, w, E, cfg) for _, i, w in sets]) / len(sets)
        print(f"T={t} routing (moe_align): {us:.0f} us", flush=True)
        r = moe_routing(ids, wts, E, cfg)
        part = moe_w2(moe_w13(x, r, weights[0], weights[1:3], cfg), r, weights[3], weights[4:6], cfg)
        us = 1e3 * time_graph_ms(lambda part=part, r=r: moe_sum(part, r, torch.bfloat16), reps=10)
        print(f"T={t} slot sum: {us:.0f} us (floor {ceil.floor_us(part.numel() * 4 + t * H * 2):.0f})", flush=True)
        for kind in ("w13", "w2"):
            floors = prefill_floors(ceil, kind, ids, True)
            base = None
            for name in variants:
                try:
                    us, first = time_kernel(kind, prefill_variant(name), sets, weights, 10)
                except Exception as exc:  # a variant that does not compile on this Triton: report, go on
                    print(f"T={t} {kind} {name}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                base = first if base is None else base
                rel = f"{((first - base).norm() / base.norm()).item():.1e}"
                print(prefill_row(ceil, t, kind, name, us, floors, rel), flush=True)
                if shuffled:
                    us, mine = time_kernel(kind, prefill_variant(name), sets, weights, 10, sh=True)
                    rel = f"{((mine - first).norm() / first.norm()).item():.1e}"
                    print(prefill_row(ceil, t, kind, name + "+sh", us, floors, rel), flush=True)


def grouped_mm_moe(x, ids, wts, w13, w2):
    """bf16 experts through ``torch._grouped_mm``: pairs sorted by expert, the [gate; up] GEMM, SwiGLU in fp32,
    the down GEMM, the slot sum in fp32 (the GEMM half of dequantise-then-GEMM; bf16 GEMM outputs)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0).to(torch.int32)
    tok = order // k
    gate, up = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs).float().chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(gate) * up).to(x.dtype), w2.transpose(1, 2), offs=offs)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * wts.reshape(-1)[order, None])
    return out.to(x.dtype)


def bench_prefill_bf16(ceil: Ceilings, batches: list[int], gen: torch.Generator, variants: list[str]) -> None:
    """bf16-weight experts at prefill sizes: the Triton kernels (per variant, each alone) and torch._grouped_mm."""
    dev = "cuda"
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device=dev) * 0.02
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16, device=dev) * 0.02
    weights = (w13, None, None, w2, None, None)
    print("# bf16-weight MoE at prefill sizes (Triton kernels vs torch._grouped_mm); floors as above, bf16 bytes")
    print(row(["T", "kern", "config", "time_us", "TFLOP/s", "flop_fl", "byte_fl", "ratio", "rel"], WIDTHS3))
    for t in batches:
        sets = routings(t, dev, gen, PREFILL_SETS)
        x, ids, wts = sets[0]
        ref = moe_reference(x, ids, wts, w13, None, None, w2, None, None).float()
        both = tuple(a + b for a, b in zip(*(prefill_floors(ceil, k, ids, False) for k in ("w13", "w2")), strict=True))
        for name, fn in (("triton", bf16_moe), ("grouped_mm", grouped_mm_moe)):
            try:
                rel = f"{((fn(x, ids, wts, w13, w2).float() - ref).norm() / ref.norm()).item():.1e}(fp32 ref)"
                us = 1e3 * time_any_ms(lambda fn=fn, sets=sets: [fn(*s, w13, w2) for s in sets]) / len(sets)
                print(prefill_row(ceil, t, "all", name, us, both, rel), flush=True)
            except Exception as exc:
                print(f"T={t} bf16 {name}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        order = torch.argsort(ids.reshape(-1), stable=True)
        offs = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=E), 0).to(torch.int32)
        xs = x[order // TOPK]
        inter = torch.randn(ids.numel(), I, device=dev).to(torch.bfloat16)
        for kind, a, b in (("w13", xs, w13), ("w2", inter, w2)):
            floors = prefill_floors(ceil, kind, ids, False)
            try:
                us = 1e3 * time_graph_ms(
                    lambda a=a, b=b, offs=offs: torch._grouped_mm(a, b.transpose(1, 2), offs=offs), reps=10
                )
                print(prefill_row(ceil, t, kind, "grouped_mm", us, floors), flush=True)
            except Exception as exc:
                print(f"T={t} grouped_mm {kind}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            for name in variants:
                try:
                    us, _ = time_kernel(kind, prefill_variant(name), sets[:1], weights, 10)
                except Exception as exc:
                    print(f"T={t} {kind} {name}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                print(prefill_row(ceil, t, kind, name, us, floors), flush=True)


def bench_bf16(ceil: Ceilings, batches: list[int], gen: torch.Generator) -> None:
    """bf16-weight experts (checkpoint layer 2): the same kernels with FP4 off."""
    dev = "cuda"
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device=dev) * 0.02
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16, device=dev) * 0.02
    cfg = MoeConfig(**{**default_config(1).__dict__, "sorted_min_pairs": 1 << 30})
    print("# bf16-weight MoE, CUDA graph, L2 rotated")
    print(row(["T", "config", "routing", "experts", "MB", "time_us", "floor", "ratio"], WIDTHS))
    for t in batches:
        sets = routings(t, dev, gen)
        x, ids, wts = sets[0]
        ref = moe_reference(x, ids, wts, w13, None, None, w2, None, None).float()
        out = bf16_moe(x, ids, wts, w13, w2, config=cfg).float()
        print(f"T={t} bf16 weights rel={((out - ref).norm() / ref.norm()).item():.2e}")
        mb = sum(must_bytes(i, False) for _, i, _ in sets) / SETS
        floor = ceil.floor_us(mb)
        us = 1e3 * time_graph_ms(lambda sets=sets: [bf16_moe(*s, w13, w2, config=cfg) for s in sets]) / SETS
        cells = [str(t), "n32w2", "identity", "", f"{mb / 1e6:.1f}", f"{us:.1f}", f"{floor:.1f}"]
        print(row([*cells, f"{us / floor:.2f}"], WIDTHS), flush=True)


ALIGN_BATCHES = [11, 32, 64, 128, 170, 256, 320, 512, 682, 1024, 2048, 4096, 8192]  # T at k=6: 66 .. 49152 pairs
ALIGN_GRID = [(32, 16), (32, 32), (64, 32), (64, 64), (128, 64), (256, 32)]  # (pairs per program, per step)


def bench_align(ceil: Ceilings, gen: torch.Generator) -> None:
    """``moe_align`` at decode and prefill sizes (``default_config``'s block_m there), each in a CUDA graph over
    SETS routings: the torch sort (the reference), the path moe_align takes, the grid kernels per (chunk, sub).
    Floor: the ids read and the blocks written at the copy bandwidth (launch latency bounds it in practice)."""
    print("# moe_align (us per call; CUDA graph over routings): torch sort | moe_align | grid chunk/sub ...")
    print("# " + "  ".join(["T", "pairs", "bm", "floor", "sort", "align"] + [f"g{c}/{s}" for c, s in ALIGN_GRID]))
    for t in ALIGN_BATCHES:
        sets = [ids for _, ids, _ in routings(t, "cuda", gen)]
        bm = default_config(sets[0].numel()).block_m
        ref = moe_align_reference(sets[0], E, bm)
        n_bytes = sets[0].numel() * 4 + sum(r.numel() * 4 for r in ref)
        fns = [moe_align_reference, moe_align]
        fns += [lambda i, e, b, c=c, s=s: moe_align_grid(i, e, b, chunk=c, sub=s) for c, s in ALIGN_GRID]
        cells = [str(t), str(sets[0].numel()), str(bm), f"{ceil.floor_us(n_bytes):.1f}"]
        for fn in fns:
            same = all(torch.equal(a, b) for a, b in zip(fn(sets[0], E, bm), ref, strict=True))
            us = 1e3 * time_any_ms(lambda fn=fn, bm=bm, sets=sets: [fn(i, E, bm) for i in sets]) / len(sets)
            cells.append(f"{us:.1f}" + ("" if same else "(WRONG)"))
        print("# " + "  ".join(cells), flush=True)


def profile(t: int, shuffled: bool = False) -> None:
    """Three eager calls at T tokens with the default config (compile, then two to profile); ``shuffled``: on
    ``shuffle_nvfp4``'s layout (the model's) with its default tiles."""
    weights = (*make_nvfp4(E, 2 * I, H, "cuda"), *make_nvfp4(E, H, I, "cuda"))
    if shuffled:
        weights = shuffle_weights(weights)
    x, ids, wts = routings(t, "cuda", torch.Generator().manual_seed(0))[0]
    for _ in range(3):
        nvfp4_moe(x, ids, wts, *weights, shuffled=shuffled)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T = 1 and 64 only")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16-weight variant")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="T: just run the op 3 times (for ncu), no timing; with --shuffled on the model's layout",
    )
    ap.add_argument("--sweep", action="store_true", help="time each kernel's tile variants alone")
    ap.add_argument("--shuffled", action="store_true", help="also time the default tiles on shuffle_nvfp4's layout")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="T values (default 1 8 64 256)")
    ap.add_argument("--jobs", type=int, default=1, help="compile the configs in this many processes first")
    ap.add_argument("--prefill", action="store_true", help="the prefill sizes only: variants, stages, grouped_mm")
    ap.add_argument("--align", action="store_true", help="only moe_align: the torch sort, the kernels, grid tiles")
    ap.add_argument("--variants", default=",".join(PREFILL_VARIANTS), help="--prefill: the tile variants to time")
    args = ap.parse_args()
    if args.profile:
        profile(args.profile, args.shuffled)
        return
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if args.align:
        ceil = measure_ceilings()
        print(ceil.line(), flush=True)
        bench_align(ceil, gen)
        return
    if args.prefill:
        variants = args.variants.split(",")
        if args.jobs > 1:
            jobs = [(prefill_variant(v), 512, True) for v in variants]
            jobs += [(prefill_variant(v), 512, True, True) for v in variants if args.shuffled]
            jobs += [(prefill_variant(v), 512, False) for v in BF16_VARIANTS if not args.no_bf16]
            precompile([], [], args.jobs, jobs)
        ceil = measure_ceilings()
        print(ceil.line(), flush=True)
        bench_prefill_kernels(ceil, args.batches or PREFILL_BATCHES, gen, variants, args.shuffled)
        if not args.no_bf16:
            bench_prefill_bf16(ceil, args.batches or PREFILL_BATCHES, gen, BF16_VARIANTS)
        print(ceil.line())
        return
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    batches = args.batches or ([1, 8, 64, 256] if not args.quick else [1, 64])
    configs = [(("w13", "w2"), "default", lambda t: default_config(t * TOPK))]
    if args.shuffled:
        configs.append((("w13", "w2"), "shuffled", lambda t: default_config(t * TOPK, shuffled=True), True))
        configs += shuffled_variants()
    if args.sweep:
        configs += sweep_configs()
    if args.jobs > 1:
        precompile([*configs, ((), "round1", lambda t: round1(t * TOPK))], batches, args.jobs)
    weights = bench_nvfp4(ceil, batches, gen, args.shuffled)
    kernels_table(ceil, batches, weights, gen, configs)
    del weights
    torch.cuda.empty_cache()
    if not args.no_bf16:
        bench_bf16(ceil, [1, 8], gen)
    print(ceil.line())


if __name__ == "__main__":
    main()
