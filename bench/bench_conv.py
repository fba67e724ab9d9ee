"""The decode step's short convs from CUDA graphs, next to their byte floors (issue 17).

`conv_decode` (a residual conv of the Small proxy: C=4096, K=4, bf16 activations and conv states, fp32 weights,
the residual add) and `kv_prologue` (the k and v convs of 8 kv heads of 128, the k-norm and the KV pool write, the
q-norm of 32 query heads) at B = 1, 8, 64, 256. Each is timed in a CUDA graph of `SETS` launches on as many
distinct sets of operands (a decode step's 12 residual convs, or its prologues), per launch: back to back, and
after an L2 flush each (a memset of twice the L2, whose own graph is subtracted), as a step's convs run between
weight-streaming GEMMs. Floor: the launch's bytes (x, residual and output rows, the state rows read and written,
the weights once; for the prologue also the pool rows written and the queries read and written) at the copy
bandwidth measured in the same run; at B=1 a launch is latency-bound (~2 us) well above it.

`--sweep` times every candidate tile per B, the one the wrapper picks marked, and checks each against that one's
results bit for bit. `--baseline MODULE` also times a module with the same `conv_decode` / `kv_prologue` (an
earlier `inkling_kernels/short_conv.py` with its `_triton_short_conv`, say) on the checkpoint's `[C, K]` weights, the
layout it ran on, next to this tree's kernels on those and on the tap-major weights they are loaded in, and says
whether its results are bitwise this tree's (a norm's statistics may round differently in another reduction
order: the elements that differ are counted, with the largest difference in units of the last place).

    python3 -m bench.bench_conv [--batches 1 8 64 256] [--sweep] [--baseline MODULE]
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from functools import partial

import torch

from bench.floors import Ceilings, measure_ceilings, time_graph_ms
from decode_service.model.layers import tap_major
from inkling_kernels import short_conv
from inkling_kernels.short_conv import CONV_TILES, KV_TILES, tiles_for

C, K, N_KV, HEAD_DIM, N_HEADS = 4096, 4, 8, 128, 32
SETS = 12  # launches per graph, each on its own operands
SPARE_SLOTS = 7  # conv-state slots of a pool beyond the batch's
CONV_SWEEP = [(1, 256, 1), (1, 512, 1), (1, 512, 2), (1, 1024, 4), (2, 512, 2), (2, 1024, 4), (4, 512, 2),
              (4, 1024, 4), (8, 512, 2)]  # fmt: skip
KV_SWEEP = [(1, 1), (2, 1), (4, 1), (4, 2), (8, 2), (8, 4)]


def conv_operands(b: int, gen: torch.Generator) -> dict:
    """One residual conv's operands: x and the residual `[B, C]`, a state pool with spare slots, shuffled slots,
    fp32 weights `[C, 1, K]` in the checkpoint's layout."""
    slots = torch.randperm(b + SPARE_SLOTS, generator=gen, device="cuda")[:b]
    return dict(
        x=torch.randn(b, C, generator=gen, device="cuda").to(torch.bfloat16),
        states=torch.randn(b + SPARE_SLOTS, K - 1, C, generator=gen, device="cuda").to(torch.bfloat16),
        slots=slots,
        weight=0.1 * torch.randn(C, 1, K, generator=gen, device="cuda"),
        residual=torch.randn(b, C, generator=gen, device="cuda").to(torch.bfloat16),
    )


def conv_bytes(b: int) -> int:
    return b * C * 2 * (3 + 2 * (K - 1)) + C * K * 4 + b * 8


def kv_operands(b: int, gen: torch.Generator) -> dict:
    """One prologue's operands: q, k0, v0 as views of a projection row `[B, (nH + 2 nKV) hd]`, the k/v state pools,
    norm weights, the layer's KV pools (a row per sequence and spare rows) and shuffled pool rows."""
    width = N_KV * HEAD_DIM
    proj = torch.randn(b, N_HEADS * HEAD_DIM + 2 * width, generator=gen, device="cuda").to(torch.bfloat16)
    q_end = N_HEADS * HEAD_DIM
    rows = 2 * b + SPARE_SLOTS

    def states():
        return torch.randn(b + SPARE_SLOTS, K - 1, width, generator=gen, device="cuda").to(torch.bfloat16)

    def norm_weight():
        return (1.0 + 0.1 * torch.randn(HEAD_DIM, generator=gen, device="cuda")).to(torch.bfloat16)

    return dict(
        k0=proj[:, q_end : q_end + width],
        v0=proj[:, q_end + width :],
        k_states=states(),
        v_states=states(),
        slots=torch.randperm(b + SPARE_SLOTS, generator=gen, device="cuda")[:b],
        k_weight=0.1 * torch.randn(width, 1, K, generator=gen, device="cuda"),
        v_weight=0.1 * torch.randn(width, 1, K, generator=gen, device="cuda"),
        k_norm_weight=norm_weight(),
        k_pool=torch.zeros(rows, N_KV, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
        v_pool=torch.zeros(rows, N_KV, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
        kv_rows=torch.randperm(rows, generator=gen, device="cuda")[:b],
        q=proj[:, :q_end].view(b, N_HEADS, HEAD_DIM),
        q_norm_weight=norm_weight(),
    )


def kv_bytes(b: int) -> int:
    width = N_KV * HEAD_DIM
    per_row = 2 * width * 2 + 2 * 2 * (K - 1) * width * 2 + 2 * width * 2 + 2 * N_HEADS * HEAD_DIM * 2 + 16
    return b * per_row + 2 * width * K * 4 + 2 * HEAD_DIM * 2


def conv_call(module, ops: dict, weights: str, tiles=None) -> Callable[[], object]:
    """`module.conv_decode` on `ops`, its weights `[C, K]` in the checkpoint's layout or tap-major."""
    w = (tap_major(ops["weight"]) if weights == "tap-major" else ops["weight"])[:, 0, :]
    extra = {} if tiles is None else {"tiles": tiles}
    return lambda: module.conv_decode(ops["x"], ops["states"], ops["slots"], w, ops["residual"], **extra)


def kv_call(module, ops: dict, weights: str, tiles=None) -> Callable[[], object]:
    """`module.kv_prologue` on `ops` (the queries normed in the same launch), weights as in `conv_call`."""
    k_w, v_w = ((tap_major(ops[n]) if weights == "tap-major" else ops[n])[:, 0, :] for n in ("k_weight", "v_weight"))
    extra = {} if tiles is None else {"tiles": tiles}
    return lambda: module.kv_prologue(
        ops["k0"], ops["v0"], ops["k_states"], ops["v_states"], ops["slots"], k_w, v_w, ops["k_norm_weight"], 1e-6,
        ops["k_pool"], ops["v_pool"], ops["kv_rows"], ops["q"], ops["q_norm_weight"], 1e-6, **extra,
    )  # fmt: skip


def per_launch_us(calls: list[Callable[[], object]], flush: torch.Tensor | None) -> float:
    """us per launch of a CUDA graph of `calls` in turn, each after a memset of `flush` when given (the graph of
    the memsets alone subtracted)."""

    def run(with_calls: bool = True) -> None:
        for call in calls:
            if flush is not None:
                flush.zero_()
            if with_calls:
                call()

    total = time_graph_ms(run) * 1e3
    if flush is not None:
        total -= time_graph_ms(lambda: run(False)) * 1e3
    return total / len(calls)


WRITTEN = ("states", "k_states", "v_states", "k_pool", "v_pool")  # operands a launch writes in place


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of a's dtype at a."""
    _, exponent = torch.frexp(a.float())  # |a| = m 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.full_like(a, torch.finfo(a.dtype).eps, dtype=torch.float32), exponent - 1)
    return (a.float() - b.float()).abs() / ulp


def compare(ops: dict, call_a: Callable, call_b: Callable) -> str:
    """`call_a` and `call_b` once each on copies of `ops`: 'bitwise equal', or how many of the elements they
    return or write differ, and by how many units in the last place at most."""
    copies = [{k: v.clone() if k in WRITTEN else v for k, v in ops.items()} for _ in range(2)]
    got = []
    for copy, call in zip(copies, (call_a, call_b), strict=True):
        out = call(copy)()
        returned = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]
        got.append(returned + [copy[k] for k in WRITTEN if k in copy])
    differ, worst, total = 0, 0.0, 0
    for a, b in zip(*got, strict=True):
        diff = a != b
        total += a.numel()
        if diff.any():
            differ += int(diff.sum())
            worst = max(worst, float(ulps(a, b)[diff].max()))
    return "bitwise equal" if not differ else f"{differ} of {total} elements differ, at most {worst:.0f} ulp"


def bench_op(ceil: Ceilings, op: str, b: int, sweep: bool, baseline, flush: torch.Tensor) -> None:
    """The lines of one op at one B: this tree's kernel as built, the baseline's, each swept tile."""
    gen = torch.Generator(device="cuda").manual_seed(b)
    if op == "conv":
        name, call, n_bytes, candidates, built = "conv_decode", conv_call, conv_bytes(b), CONV_SWEEP, CONV_TILES
        sets = [conv_operands(b, gen) for _ in range(SETS)]
    else:
        name, call, n_bytes, candidates, built = "kv_prologue", kv_call, kv_bytes(b), KV_SWEEP, KV_TILES
        sets = [kv_operands(b, gen) for _ in range(SETS)]
    built = tiles_for(built, b)
    floor = ceil.floor_us(n_bytes)

    def line(what: str, fn: Callable[[dict], Callable[[], object]]) -> None:
        hot = per_launch_us([fn(ops) for ops in sets], None)
        cold = per_launch_us([fn(ops) for ops in sets], flush)
        print(f"# {name} B={b:<4} {what:<48} {hot:6.2f} us back to back ({hot / floor:5.2f}x floor), "
              f"{cold:6.2f} us after an L2 flush; floor {floor:.2f} us ({n_bytes / 1e6:.2f} MB)",
              flush=True)  # fmt: skip

    mine = partial(call, short_conv, weights="tap-major")
    line(f"this tree, tap-major weights, tiles {built}", mine)
    if baseline is not None:
        theirs = partial(call, baseline, weights="checkpoint")
        line("this tree, [C, K] weights", partial(call, short_conv, weights="checkpoint"))
        line("baseline, [C, K] weights", theirs)
        print(f"# {name} B={b:<4} baseline against this tree: {compare(sets[0], theirs, mine)}", flush=True)
    for tiles in candidates if sweep else []:
        swept = partial(mine, tiles=tiles)
        same = compare(sets[0], swept, mine)
        mark = " (as built)" if tiles == built else ""
        line(f"tiles {tiles}{mark}: {'same bits' if same == 'bitwise equal' else same}", swept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--ops", nargs="+", default=["conv", "kv"], choices=["conv", "kv"])
    parser.add_argument("--sweep", action="store_true", help="also every candidate tile per B")
    parser.add_argument("--baseline", help="a module with conv_decode / kv_prologue to time and compare against")
    args = parser.parse_args()
    baseline = importlib.import_module(args.baseline) if args.baseline else None
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    with torch.inference_mode():
        for op in args.ops:
            for b in args.batches:
                bench_op(ceil, op, b, args.sweep, baseline, flush)


if __name__ == "__main__":
    main()
