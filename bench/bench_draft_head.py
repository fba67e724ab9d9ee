"""The MTP drafter's lm_head alone: the bf16 shared head against its FP8 copy (`inkling_kernels.fp8_head`) by rows.

Shapes: Inkling-Small's unembedding (`bench.proxy`: 201024 x 4096, the unpadded vocabulary rows read), the muP division
and fp32 logits as the drafter computes them. Per M rows (default 1 / 8 / 64, the drafter's batch buckets): "bf16
cuBLAS" is the torch reference op (`Ops.logits`: F.linear, what the drafter ran before), "bf16 op" the trunk's
`TritonOps.logits` (the skinny GEMV at one row, cuBLAS above), "fp8" the FP8 kernel at its `default_config`, then each
tile of a short sweep: the tensor-core tiles at every M (named with the MMA Triton lowers them to at that M: mma.sync or
wgmma). Floor = (weight bytes once + scales + x + fp32 logits) / the copy bandwidth measured in the same run
(`bench.floors`); "x cuBLAS" = time / bf16 cuBLAS's. Each figure is the median replay of a CUDA graph holding the op
(the weight is 1.6 / 0.8 GB, far past L2). The fp8 logits are checked against their torch reference, and the share of
rows whose argmax equals the bf16 head's is printed (random weights: a lower bound of agreement).

    python3 -m bench.bench_draft_head [--rows 1 8 64] [--skip-sweep]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from bench.floors import measure_ceilings, row, time_graph_ms
from bench.proxy import proxy_config
from decode_service.model.collectives import SINGLE
from decode_service.model.fast_path import TritonOps
from decode_service.model.ops import REFERENCE
from inkling_kernels.fp8_head import (
    Fp8HeadConfig,
    default_config,
    dot_block_rows,
    fp8_logits,
    fp8_logits_reference,
    quantize_rows_fp8,
    uses_wgmma,
)

# The tensor-core tiles at every M (x padded to 8 / 16 / 32 / 64 rows). Under mma.sync (8 rows, or 32-row tiles, or
# 2 warps) ~3.0-3.8 instructions per weight, 48-154 registers, spilling at 64 rows; under wgmma 4.2-4.9 (the e4m3
# operand read as 2-byte pairs), 126-172 registers at 64 rows (Triton 3.6, sm_90, counted in the compiled loops).
# x is re-read from L2 by every program: 2 * rows / block_n bytes per weight byte.
DOT_SWEEP = [
    Fp8HeadConfig(block_n=32, block_k=256, num_warps=2, num_stages=3),  # mma.sync, the MoE decode shape
    Fp8HeadConfig(block_n=64, block_k=256, num_warps=2, num_stages=3),  # mma.sync
    Fp8HeadConfig(block_n=64, block_k=128, num_warps=4, num_stages=4),
    Fp8HeadConfig(block_n=64, block_k=256, num_warps=4, num_stages=3),
    Fp8HeadConfig(block_n=128, block_k=128, num_warps=4, num_stages=3),
    Fp8HeadConfig(block_n=128, block_k=128, num_warps=8, num_stages=3),
    Fp8HeadConfig(block_n=256, block_k=128, num_warps=8, num_stages=3),
    Fp8HeadConfig(block_n=256, block_k=128, num_warps=8, num_stages=4),
]


def config_name(config: Fp8HeadConfig, m: int) -> str:
    tile = f"{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages}"
    block_m = dot_block_rows(m)
    return f"fp8 {tile} {'wgmma' if uses_wgmma(config, block_m) else 'mma'}{block_m}"


def run(rows: Sequence[int], sweep: bool) -> None:
    ceil = measure_ceilings(copy_bytes=1 << 30)
    print(ceil.line(), flush=True)
    config = proxy_config(6)
    h, vocab, mup = config.hidden_size, config.unpadded_vocab_size, config.mup_multiplier
    gen = torch.Generator("cuda").manual_seed(0)
    weight = (torch.randn(config.vocab_size, h, generator=gen, device="cuda") * h**-0.5).bfloat16()
    w8, scale = quantize_rows_fp8(weight[:vocab])
    fast = TritonOps()
    print(f"# lm_head {vocab} x {h}: bf16 {vocab * h * 2 / 1e9:.2f} GB, fp8 copy {vocab * h / 1e9:.2f} GB "
          f"(+{vocab * 4 / 1e6:.1f} MB scales)", flush=True)  # fmt: skip
    widths = [4, 30, 9, 9, 7, 8]
    print(row(["M", "head", "us", "floor us", "x floor", "x cuBLAS"], widths))
    for m in rows:
        x = torch.randn(m, h, generator=gen, device="cuda").bfloat16()
        io = m * h * 2 + m * vocab * 4
        floors = {"bf16": ceil.floor_us(vocab * h * 2 + io), "fp8": ceil.floor_us(vocab * h + vocab * 4 + io)}
        cases = [
            ("bf16 cuBLAS", "bf16", lambda x=x: REFERENCE.logits(x, weight, mup, SINGLE, vocab)),
            ("bf16 op", "bf16", lambda x=x: fast.logits(x, weight, mup, SINGLE, vocab)),
        ]
        default = default_config(m)
        tiles = [(f"{config_name(default, m)} (default)", default)]
        if sweep:
            tiles += [(config_name(c, m), c) for c in DOT_SWEEP]
        for name, c in tiles:
            cases.append((name, "fp8", lambda x=x, c=c: fp8_logits(x, w8, scale, divisor=mup, config=c)))
        cublas_us = float("nan")
        for name, kind, fn in cases:
            try:
                us = time_graph_ms(fn, reps=20) * 1e3
            except Exception as exc:  # a tile that does not compile on this device: say so, time the others
                print(f"# M={m} {name}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
                continue
            floor = floors[kind]
            if name == "bf16 cuBLAS":
                cublas_us = us
            cells = [str(m), name, f"{us:.1f}", f"{floor:.1f}", f"{us / floor:.2f}", f"{us / cublas_us:.2f}"]
            print(row(cells, widths), flush=True)
        out = fp8_logits(x, w8, scale, divisor=mup)
        ref = fp8_logits_reference(x, w8, scale, divisor=mup)
        bf16 = REFERENCE.logits(x, weight, mup, SINGLE, vocab)
        same = (out.argmax(-1) == bf16.argmax(-1)).float().mean().item()
        print(f"# M={m}: fp8 max |kernel - reference| {(out - ref).abs().max().item():.2e} "
              f"(logits up to {ref.abs().max().item():.2f}); argmax = bf16 head's on {same:.0%} of rows; "
              f"max |fp8 - bf16| {(out - bf16).abs().max().item():.3f}", flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--skip-sweep", action="store_true", help="only the default tiles")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    run(args.rows, not args.skip_sweep)


if __name__ == "__main__":
    main()
