"""MoE gate benchmark (Inkling-Small shapes: H=4096, E=256, S=2, k=6, bf16) against its floor.

Floor = bytes that must move / measured copy bandwidth, bytes = gate weight ``[E+S, H]`` + x ``[T, H]`` (the
outputs are a few bytes a token). ``mma_us`` beside it is the bf16 matmul time at the measured TFLOP/s,
which is what bounds large T. Each timing is a CUDA graph replaying the op over ``SETS`` gate weights (one
per layer, together larger than the 60 MB L2, so the weight comes from HBM as in a decode step), divided by
SETS. The unfused torch ``route_reference`` (= ``Router.forward``: fp32 upcast of x and the weight, GEMM,
sigmoid, topk, gather, cat, logsigmoid, logsumexp, scales) is timed the same way.

    python3 -m bench.bench_router [--sweep]
"""

from __future__ import annotations

import argparse

import torch

from bench.floors import Ceilings, measure_ceilings, row, time_graph_ms
from inkling_kernels.router import GateTiles, default_tiles, route, route_reference

H, E, S, TOPK, ROUTE_SCALE = 4096, 256, 2, 6, 8.0
SETS = 32  # 32 x 2.1 MB of gate weights > L2
BATCHES = [1, 8, 64, 256, 320, 512, 4096]  # 320, 512: MTP verify steps at B=64 (D=4, 7)
WIDTHS = [5, 26, 7, 9, 8, 8, 7]
SWEEP = [
    GateTiles(block_t=1, block_n=4, block_k=1024),
    GateTiles(block_t=8, block_n=4, block_k=1024),
    GateTiles(block_t=8, block_n=8, block_k=512),
    GateTiles(block_t=16, block_n=16, block_k=256),
    GateTiles(block_t=16, block_n=32, block_k=128),
    GateTiles(block_t=16, block_n=32, block_k=256),
    GateTiles(block_t=32, block_n=32, block_k=128),
    GateTiles(block_t=32, block_n=32, block_k=256),
    GateTiles(block_t=64, block_n=32, block_k=64),
    GateTiles(block_t=64, block_n=64, block_k=64),
    GateTiles(block_t=64, block_n=64, block_k=64, split_k=2),
    GateTiles(block_t=128, block_n=64, block_k=64, split_k=1, num_warps=8),
    GateTiles(block_t=128, block_n=64, block_k=64, split_k=4, num_warps=8),
    GateTiles(block_t=128, block_n=128, block_k=64, num_warps=8),
]


def gate_sets(t: int, gen: torch.Generator, dev: str = "cuda"):
    sets = []
    for _ in range(SETS):
        x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
        weight = (torch.randn(E + S, H, generator=gen) * H**-0.5).to(torch.bfloat16)
        bias = torch.randn(E, generator=gen) * 0.1
        sets.append((x.to(dev), weight.to(dev), bias.to(dev), torch.tensor([1.3], device=dev)))
    return sets


def check(t: int, gen: torch.Generator) -> str:
    x, weight, bias, gs = gate_sets(t, gen)[0]
    ids, w, g = route(x, weight, bias, TOPK, ROUTE_SCALE, gs)
    rids, rw, rg = route_reference(x, weight, bias, TOPK, ROUTE_SCALE, gs)
    same = (ids == rids).all(dim=-1)
    w_err = (w - rw)[same].abs().max().item() if same.any() else float("nan")
    g_err = (g - rg)[same].abs().max().item() if same.any() else float("nan")
    return f"T={t}: ids equal on {int(same.sum())}/{t} rows (others: near-ties), max |dw| {w_err:.1e}, |dg| {g_err:.1e}"


def bench(ceil: Ceilings, t: int, sweep: bool, gen: torch.Generator) -> None:
    sets = gate_sets(t, gen)
    n_bytes = (E + S) * H * 2 + t * H * 2
    floor = ceil.floor_us(n_bytes)
    mma = 2 * t * (E + S) * H / (ceil.bf16_tflops * 1e12) * 1e6
    impls: dict[str, GateTiles | None] = {f"route {_name(default_tiles(t, H))}": None}
    if sweep:
        impls.update({f"route {_name(c)}": c for c in SWEEP if (c.block_t <= 16 if t <= 8 else c.block_t >= 16)})
    for name, tiles in impls.items():

        def run(sets=sets, tiles=tiles):
            return [route(*s[:3], TOPK, ROUTE_SCALE, s[3], tiles=tiles) for s in sets]

        try:
            us = 1e3 * time_graph_ms(run) / SETS
        except Exception as exc:  # a tile shape that does not compile on this Triton: report, go on
            print(f"T={t} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        cells = [str(t), name, f"{n_bytes / 1e6:.2f}", f"{us:.2f}", f"{floor:.2f}", f"{mma:.2f}"]
        print(row([*cells, f"{us / floor:.2f}"], WIDTHS), flush=True)
    us = 1e3 * time_graph_ms(lambda: [route_reference(*s[:3], TOPK, ROUTE_SCALE, s[3]) for s in sets]) / SETS
    cells = [str(t), "torch Router (unfused)", f"{n_bytes / 1e6:.2f}", f"{us:.2f}", f"{floor:.2f}", f"{mma:.2f}"]
    print(row([*cells, f"{us / floor:.2f}"], WIDTHS), flush=True)


def _name(c: GateTiles) -> str:
    split = "auto" if c.split_k is None else str(c.split_k)
    return f"t{c.block_t}n{c.block_n}k{c.block_k}s{split}w{c.num_warps}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP tile shapes")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    print("# correctness vs route_reference (bf16 inputs)")
    for t in BATCHES:
        print(check(t, gen), flush=True)
    print(f"# MoE gate (logits + top-{TOPK} + sink renorm), CUDA graph, L2 rotated over {SETS} gate weights")
    print(row(["T", "impl", "MB", "time_us", "floor", "mma_us", "ratio"], WIDTHS))
    for t in BATCHES:
        bench(ceil, t, args.sweep, gen)
    print(ceil.line())


if __name__ == "__main__":
    main()
