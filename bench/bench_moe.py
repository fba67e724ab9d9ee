"""Routed-expert MoE decode benchmark (Inkling-Small shapes: H=4096, I=2048, E=256, k=6) against its floor.

Floor = bytes that must move / measured copy bandwidth, bytes = unique experts touched x (packed weights +
block scales + scale2 of w13 and w2) + activations in and out. Each timing is a CUDA graph replaying the op
over ``SETS`` independent routings (different experts, so weights do not sit in the 60 MB L2), divided by
SETS. Also times the torch baseline (per touched expert: dequantise to bf16, then bf16 matmuls; eager).

    python3 -m bench.bench_moe [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.floors import Ceilings, measure_ceilings, row, time_eager_ms, time_graph_ms
from common.nvfp4 import dequant_nvfp4
from kernels.moe import MoeConfig, bf16_moe, default_config, moe_reference, nvfp4_moe

H, I, E, TOPK = 4096, 2048, 256, 6
SETS = 8
WIDTHS = [5, 10, 10, 8, 10, 10, 7, 8]
CONFIGS = {
    "b8n64w4": MoeConfig(),  # the many-pairs default: 8-row blocks, swapped MMA, split intermediate
    "n32w2": default_config(1),  # the few-pairs default
    "b8mfast": MoeConfig(n_fast=False),  # row blocks of one N tile adjacent (T=64 vs n_fast: w13 -6%, w2 +18% time)
    "b4n64w4": MoeConfig(block_m=4),
    "n128w8": MoeConfig(block_n13=128, block_n2=128, num_warps=8),
    # the previous default: 16-row blocks, tokens as the MMA's M, 128-wide K tiles (64 B of each weight row)
    "old": MoeConfig(block_m=16, block_k13=128, block_k2=128, identity_block_m=16, swap_ab=False, presplit=False),
}


def make_nvfp4(e: int, rows: int, cols: int, dev: str):
    packed = torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, device=dev)
    scale = (torch.rand(e, rows, cols // 16, device=dev) * 1.5 + 0.25).to(torch.float8_e4m3fn)
    scale2 = torch.rand(e, device=dev) * 1e-3 + 1e-3
    return packed, scale, scale2


def routings(t: int, dev: str, gen: torch.Generator):
    sets = []
    for _ in range(SETS):
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


def bench_nvfp4(ceil: Ceilings, batches: list[int], configs: dict[str, MoeConfig], gen: torch.Generator) -> None:
    dev = "cuda"
    weights = (*make_nvfp4(E, 2 * I, H, dev), *make_nvfp4(E, H, I, dev))
    print("# correctness vs fp32 moe_reference (bf16 activations): rel = |out-ref|/|ref|, max_abs")
    for t in batches:
        x, ids, wts = routings(t, dev, gen)[0]
        ref = moe_reference(x, ids, wts, *weights).float()
        for mode, thr in (("identity", 1 << 30), ("sorted", 1)):
            out = nvfp4_moe(x, ids, wts, *weights, config=MoeConfig(sorted_min_pairs=thr)).float()
            rel = ((out - ref).norm() / ref.norm()).item()
            print(
                f"T={t:4d} {mode:8s} rel={rel:.2e} max_abs={(out - ref).abs().max().item():.3e} "
                f"(|ref|max={ref.abs().max().item():.3e})",
                flush=True,
            )

    print(f"# NVFP4 MoE (w13+SwiGLU+w2+slot sum), CUDA graph, L2 rotated over {SETS} routings")
    print(row(["T", "config", "routing", "experts", "MB", "time_us", "floor", "ratio"], WIDTHS))
    results: dict[tuple[int, str, str], float] = {}
    floors: dict[int, float] = {}
    for t in batches:
        sets = routings(t, dev, gen)
        mb = sum(must_bytes(ids, True) for _, ids, _ in sets) / SETS
        n_exp = sum(torch.unique(ids).numel() for _, ids, _ in sets) / SETS
        floor = floors[t] = ceil.floor_us(mb)
        modes = ["identity", "sorted"] if t * TOPK <= 256 else ["sorted"]
        for name, base in {"default": None, **configs}.items():
            for mode in ["auto"] if base is None else modes:
                thr = 1 << 30 if mode == "identity" else 1
                cfg = None if base is None else MoeConfig(**{**base.__dict__, "sorted_min_pairs": thr})

                def run(cfg=cfg, sets=sets):
                    return [nvfp4_moe(x, ids, wts, *weights, config=cfg) for x, ids, wts in sets]

                try:
                    us = 1e3 * time_graph_ms(run) / SETS
                except Exception as exc:  # a config that does not compile on this Triton: report, go on
                    print(f"T={t} {name} {mode}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                results[(t, name, mode)] = us
                cells = [str(t), name, mode, f"{n_exp:.1f}", f"{mb / 1e6:.1f}", f"{us:.1f}", f"{floor:.1f}"]
                print(row([*cells, f"{us / floor:.2f}"], WIDTHS), flush=True)
        x, ids, wts = sets[0]
        mb0 = must_bytes(ids, True)
        us_base = 1e3 * time_eager_ms(lambda x=x, ids=ids, wts=wts: baseline(x, ids, wts, *weights), reps=5)
        f0 = ceil.floor_us(mb0)
        cells = [str(t), "torch", "dequant+mm", str(torch.unique(ids).numel()), f"{mb0 / 1e6:.1f}"]
        print(row([*cells, f"{us_base:.1f}", f"{f0:.1f}", f"{us_base / f0:.2f}"], WIDTHS), flush=True)

    print("# summary: best NVFP4 config per batch")
    for t in batches:
        cands = {key: v for key, v in results.items() if key[0] == t}
        if cands:
            (_, name, mode), us = min(cands.items(), key=lambda kv: kv[1])
            print(f"T={t:4d} best {name}/{mode}: {us:.1f} us, floor {floors[t]:.1f} us, ratio {us / floors[t]:.2f}")


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


def profile(t: int) -> None:
    """Three eager calls at T tokens with the default config (compile, then two to profile)."""
    weights = (*make_nvfp4(E, 2 * I, H, "cuda"), *make_nvfp4(E, H, I, "cuda"))
    x, ids, wts = routings(t, "cuda", torch.Generator().manual_seed(0))[0]
    for _ in range(3):
        nvfp4_moe(x, ids, wts, *weights)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one config, fewer shapes")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16-weight variant")
    ap.add_argument("--profile", type=int, default=0, help="T: just run the op 3 times (for ncu), no timing")
    args = ap.parse_args()
    if args.profile:
        profile(args.profile)
        return
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    batches = [1, 8, 64, 256] if not args.quick else [1, 64]
    configs = CONFIGS if not args.quick else {k: CONFIGS[k] for k in ("b8n64w4", "old")}
    bench_nvfp4(ceil, batches, configs, gen)
    torch.cuda.empty_cache()
    if not args.no_bf16:
        bench_bf16(ceil, [1, 8], gen)
    print(ceil.line())


if __name__ == "__main__":
    main()
