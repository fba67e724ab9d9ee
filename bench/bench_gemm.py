"""The decode step's dense linears at M = 1..64 rows: cuBLAS against `inkling_kernels.skinny_gemm`, by the byte floor.

Shapes are the Small-L6 proxy's (`bench.proxy`, exact Inkling-Small layers): per decoder layer the stacked q/k/v/r
projection and the output projection, the dense MLP's gate+up and down (layers 0-1), the two shared experts'
stacked gate+up and K-concatenated down (MoE layers), and once per step the lm_head over the unpadded vocabulary.
Floor = (weight bytes once + x + y) / the copy bandwidth measured in the same run (`bench.floors`).

Timing: CUDA graphs replaying the op over rotating copies of the weight (at least 4x the 50 MB L2 in all, as the
next layer's weights are never L2-resident in a real step), median per launch. Part 1 sweeps the kernel's tiles
on the plain product `x @ W^T` of every shape and prints, per M, each shape's best tile and the tile with the
least summed time over one step's launches (what `default_config` should hold). Part 2 times the ops the model
calls (`TritonOps`: SwiGLU epilogues, the dense down's global scale, the shared down's add of the routed experts,
the lm_head's muP division and fp32 logits) at `default_config` against the torch reference ops they replace
(cuBLAS plus the elementwise launches), and checks them against that reference. Part 3 times the greedy head (the
lm_head's argmax) at `--head-rows` as `TritonOps` runs it, with and without the fp32 logits.

    python3 -m bench.bench_gemm [--rows 1 2 4 8 16 64] [--skip-sweep] [--head-rows 1 8 64 256]
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch

from bench.floors import measure_ceilings, row, time_graph_ms
from bench.proxy import proxy_config
from common.config import TextConfig
from inkling_kernels.skinny_gemm import (
    MAX_ROWS,
    SkinnyConfig,
    default_config,
    skinny_linear,
    skinny_linear_reference,
    skinny_swiglu,
    skinny_swiglu_reference,
)

_L2_BYTES = 50 << 20
# part 2, M=1: short K blocks (the multi-row default), against the one-row default's long ones
ONE_ROW_TILE = SkinnyConfig(block_n=8, block_k=512, num_warps=4)
SWEEP = [  # the bytes in flight per program are block_n * block_k * 2
    SkinnyConfig(block_n=8, block_k=512, num_warps=4),
    SkinnyConfig(block_n=4, block_k=1024, num_warps=4),
    SkinnyConfig(block_n=16, block_k=512, num_warps=8),
    SkinnyConfig(block_n=8, block_k=1024, num_warps=4),
    SkinnyConfig(block_n=16, block_k=256, num_warps=4),
    SkinnyConfig(block_n=4, block_k=2048, num_warps=4),  # long K blocks: most of a program's rows in flight
    SkinnyConfig(block_n=4, block_k=2048, num_warps=8),
    SkinnyConfig(block_n=2, block_k=2048, num_warps=4),
    SkinnyConfig(block_n=2, block_k=4096, num_warps=4),
    SkinnyConfig(block_n=2, block_k=4096, num_warps=8),
    SkinnyConfig(block_n=4, block_k=4096, num_warps=8),
    SkinnyConfig(block_n=1, block_k=4096, num_warps=4),
]


@dataclass(frozen=True)
class Linear:
    """One decode linear: W ``[rows, k]`` (``n`` output columns; a SwiGLU's are half its rows), launches per step."""

    name: str
    rows: int
    k: int
    per_step: int
    width: int = 0  # SwiGLU: I, with rows = G * 2I
    groups: int = 1
    scale: bool = False  # DenseMLP's global_scale
    lm_head: float | None = None  # muP divisor; fp32 logits

    @property
    def n(self) -> int:
        return self.rows // 2 if self.width else self.rows

    def bytes(self, m: int, elem: int = 2) -> int:
        out = 4 if self.lm_head else elem
        return self.rows * self.k * elem + m * self.k * elem + m * self.n * out


def decode_linears(config: TextConfig) -> list[Linear]:
    """The dense linears one decode step runs, with how often (layers of equal shapes counted together)."""
    h, counts = config.hidden_size, defaultdict(int)
    for layer in range(config.num_layers):
        geo = config.layer_geometry(layer)
        counts[("qkvr", geo.q_width + 2 * geo.kv_width + geo.num_heads * config.d_rel, h)] += 1
        counts[("wo_ud", h, geo.q_width)] += 1
        if config.dense_layers[layer]:
            counts[("dense_w13", 2 * config.dense_intermediate_size, h)] += 1
            counts[("dense_w2", h, config.dense_intermediate_size)] += 1
        else:
            counts[("shared_w13", config.n_shared_experts * 2 * config.moe_intermediate_size, h)] += 1
            counts[("shared_w2", h, config.n_shared_experts * config.moe_intermediate_size)] += 1
    out = []
    for (name, rows, k), n in counts.items():
        if name == "dense_w13":
            out.append(Linear(name, rows, k, n, width=config.dense_intermediate_size))
        elif name == "shared_w13":
            width = config.moe_intermediate_size
            out.append(Linear(name, rows, k, n, width=width, groups=config.n_shared_experts))
        else:
            out.append(Linear(name, rows, k, n, scale=name == "dense_w2"))
    out.append(Linear("lm_head", config.unpadded_vocab_size, h, 1, lm_head=config.mup_multiplier))
    return out


def weight_copies(lin: Linear, dtype: torch.dtype) -> list[torch.Tensor]:
    copies = max(1, math.ceil(4 * _L2_BYTES / (lin.rows * lin.k * 2)))
    return [torch.randn(lin.rows, lin.k, device="cuda").mul_(lin.k**-0.5).to(dtype) for _ in range(copies)]


def per_launch_us(op, weights: list[torch.Tensor], reps: int = 3) -> float:
    """Median us of one op launch inside a CUDA graph cycling through `weights` (`reps` rounds per replay)."""

    def cycle():
        for _ in range(reps):
            for w in weights:
                op(w)

    return time_graph_ms(cycle, reps=10) * 1e3 / (reps * len(weights))


def sweep(lins: list[Linear], rows: list[int], ceil) -> None:
    widths = [11, 3, 9, 16, 16, 50]
    print("\n## part 1: tiles of the plain product x @ W^T (us; x floor)")
    print(row(["linear", "M", "floor us", "cuBLAS", "best kernel", "best tile (block_n, block_k, warps, stages)"],
              widths))  # fmt: skip
    step_us: dict[int, dict[SkinnyConfig, float]] = {m: defaultdict(float) for m in rows}
    cublas_step, default_step, best_step = defaultdict(float), defaultdict(float), defaultdict(float)
    for lin in lins:
        weights = weight_copies(lin, torch.bfloat16)
        for m in rows:
            x = torch.randn(m, lin.k, device="cuda").to(torch.bfloat16)
            floor = ceil.floor_us(lin.rows * lin.k * 2 + m * (lin.k + lin.rows) * 2)
            cublas = per_launch_us(lambda w, x=x: torch.nn.functional.linear(x, w), weights)
            cublas_step[m] += cublas * lin.per_step
            best = None
            if m <= MAX_ROWS:
                chosen = default_config(m, lin.rows, lin.k)
                tiles = SWEEP if chosen in SWEEP else [*SWEEP, chosen]
                for cfg in tiles:
                    us = per_launch_us(lambda w, x=x, cfg=cfg: skinny_linear(x, w, config=cfg), weights)
                    step_us[m][cfg] += us * lin.per_step
                    default_step[m] += us * lin.per_step if cfg == chosen else 0.0
                    if best is None or us < best[0]:
                        best = (us, cfg)
                best_step[m] += best[0] * lin.per_step
            kernel = f"{best[0]:.1f} ({best[0] / floor:.2f}x)" if best else "-"
            tile = _tile(best[1]) if best else "-"
            print(row([lin.name, str(m), f"{floor:.1f}", f"{cublas:.1f} ({cublas / floor:.2f}x)", kernel, tile],
                      widths), flush=True)  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    print("\n# per M: the tile with the least summed time over one step's plain products (every linear x launches)")
    for m in rows:
        if not step_us[m]:
            print(f"# M={m}: cuBLAS {cublas_step[m]:.0f} us per step (beyond MAX_ROWS)")
            continue
        cfg, us = min(step_us[m].items(), key=lambda kv: kv[1])
        print(f"# M={m}: best single tile {_tile(cfg)} {us:.0f} us per step; each shape's best {best_step[m]:.0f} "
              f"us; default_config {default_step[m]:.0f} us; cuBLAS {cublas_step[m]:.0f} us", flush=True)  # fmt: skip


def _tile(cfg: SkinnyConfig) -> str:
    return f"({cfg.block_n}, {cfg.block_k}, {cfg.num_warps}, {cfg.num_stages})"


def model_ops(lins: list[Linear], rows: list[int], ceil) -> None:
    """The fused ops as the model calls them, default tiles, against the reference ops they replace."""
    widths = [11, 3, 9, 16, 16, 9, 16]
    print("\n## part 2: the model's ops at default_config vs the torch reference ops (cuBLAS + elementwise)")
    print(row(["linear", "M", "floor us", "reference", "kernel", "rel err", f"one row at {_tile(ONE_ROW_TILE)}"],
              widths))  # fmt: skip
    totals: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for lin in lins:
        weights = weight_copies(lin, torch.bfloat16)
        for m in (r for r in rows if r <= MAX_ROWS):
            x = torch.randn(m, lin.k, device="cuda").to(torch.bfloat16)
            kwargs: dict = {}
            if lin.width and lin.groups > 1:
                kwargs["gammas"] = torch.rand(m, lin.groups, device="cuda") + 0.5
            if lin.scale:
                kwargs["scale"] = torch.tensor([1.25], dtype=torch.bfloat16, device="cuda")
            if lin.lm_head:
                kwargs |= {"divisor": lin.lm_head, "out_dtype": torch.float32}
            if lin.width:
                kernel = partial(skinny_swiglu, x, width=lin.width, **kwargs)
                reference = partial(skinny_swiglu_reference, x, width=lin.width, **kwargs)
            else:
                kernel = partial(skinny_linear, x, **kwargs)
                reference = partial(skinny_linear_reference, x, **kwargs)
            got, want = kernel(weights[0]).float(), reference(weights[0]).float()
            err = ((got - want).norm() / want.norm()).item()
            floor = ceil.floor_us(lin.bytes(m))
            ref_us, us = per_launch_us(reference, weights), per_launch_us(kernel, weights)
            alt = per_launch_us(partial(kernel, config=ONE_ROW_TILE), weights) if m == 1 else float("nan")
            totals[m][0] += ref_us * lin.per_step
            totals[m][1] += us * lin.per_step
            totals[m][2] += alt * lin.per_step
            print(row([lin.name, str(m), f"{floor:.1f}", f"{ref_us:.1f} ({ref_us / floor:.2f}x)",
                       f"{us:.1f} ({us / floor:.2f}x)", f"{err:.1e}", f"{alt:.1f} ({alt / floor:.2f}x)"],
                      widths), flush=True)  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    for m, (ref_us, us, alt) in totals.items():
        floor = sum(ceil.floor_us(lin.bytes(m)) * lin.per_step for lin in lins)
        print(f"# M={m}: one step's dense linears {us:.0f} us on the kernel vs {ref_us:.0f} us reference ops, "
              f"floor {floor:.0f} us ({us / floor:.2f}x); at {_tile(ONE_ROW_TILE)} {alt:.0f} us",
              flush=True)  # fmt: skip


def greedy_head(config: TextConfig, rows: list[int], ceil) -> None:
    """The decode graphs' greedy head at the ops' own dispatch (`TritonOps`): `logits(...).argmax(-1)`, what it
    was, against `argmax_logits` (no fp32 logits; the argmax fused into the GEMV where it takes the rows,
    `argmax_rows` after cuBLAS otherwise) and the reference's (torch's argmax of the bf16 product), each in a CUDA
    graph over the full unembedding (1.6 GB: no L2 reuse between replays). Floor: the unpadded rows once."""
    from decode_service.model.collectives import SINGLE
    from decode_service.model.fast_path import FAST
    from decode_service.model.ops import REFERENCE

    h, vocab, mup = config.hidden_size, config.unpadded_vocab_size, config.mup_multiplier
    weight = torch.randn(config.vocab_size, h, device="cuda").mul_(h**-0.5).to(torch.bfloat16)
    widths = [5, 9, 22, 22, 22, 6]
    print(f"\n## part 3: the greedy head over {vocab} of {config.vocab_size} lm_head rows (us; x floor)")
    print(row(["M", "floor us", "logits + argmax", "argmax_logits", "Ops (torch argmax)", "same"], widths))
    for m in rows:
        hidden = torch.randn(m, h, device="cuda").to(torch.bfloat16)
        heads = [partial(_logits_argmax, FAST, hidden, weight, mup, SINGLE, vocab),
                 partial(FAST.argmax_logits, hidden, weight, mup, SINGLE, vocab),
                 partial(REFERENCE.argmax_logits, hidden, weight, mup, SINGLE, vocab)]  # fmt: skip
        same = torch.equal(heads[0](), heads[1]())
        floor = ceil.floor_us(vocab * h * 2 + m * h * 2 + m * 8)
        cells = [f"{us:.1f} ({us / floor:.2f}x)" for us in (time_graph_ms(head, reps=20) * 1e3 for head in heads)]
        print(row([str(m), f"{floor:.1f}", *cells, str(same)], widths), flush=True)
    del weight, heads
    torch.cuda.empty_cache()


def _logits_argmax(ops, *args) -> torch.Tensor:
    return ops.logits(*args).argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--skip-sweep", action="store_true", help="no part 1 (the tile sweep)")
    parser.add_argument("--head-rows", type=int, nargs="*", default=[1, 8, 64, 256], help="part 3's M (none: skip)")
    args = parser.parse_args()
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    lins = decode_linears(proxy_config())
    print("# Small-L6 decode linears (name rows x K, per step): "
          + ", ".join(f"{lin.name} {lin.rows}x{lin.k} x{lin.per_step}" for lin in lins))  # fmt: skip
    if not args.skip_sweep:
        sweep(lins, args.rows, ceil)
    model_ops(lins, [m for m in args.rows if m in (1, 8)] or args.rows[:1], ceil)
    if args.head_rows:
        greedy_head(proxy_config(), args.head_rows, ceil)


if __name__ == "__main__":
    main()
