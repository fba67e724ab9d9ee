"""Inkling decode attention alone, as the engine runs it (one layer's paged pool of 16-key pages, block tables in a
random page order; nH=32, nKV=8, hd=128, d_rel=16), against its floor.

Floor = bytes that must move / measured copy bandwidth, bytes = K and V of every visible key (window 512 in
sliding layers, R = 512; the whole context in global ones, R = 1024, with tau) + q, r, P and the output. Every
sequence of a case is at length ``ctx``. Timings are CUDA graphs that rotate over enough copies of the case (own
pages of one pool each) to keep the working set out of L2 where it fits in memory; each output is checked against
the fp32 reference (B <= 8) or against the default configuration's output.

Default: ``default_config`` of each shape. ``--sweep``: tile variants (keys per step, warps, stages) x splits per
shape, compiled in parallel worker processes first, each variant's time and the best per shape; ``--budget-s``
stops starting new measurements after that many seconds.

    python3 -m bench.bench_attention [--batches 1 8 64 256] [--contexts 1024 8192 32768] [--sweep]
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.floors import measure_ceilings, row, time_graph_ms
from inkling_kernels.attention import DecodeConfig, paged_attention_reference, paged_decode_attention

NH, NKV, HD, DREL, PAGE = 32, 8, 128, 16, 16
WINDOW, REL_SLIDING, REL_GLOBAL = 512, 512, 1024
LOG_SCALING = (0.1, 128000.0)
L2_BYTES = 60 << 20
MAX_COPIES = 64
# (keys per step, warps, stages) swept by --sweep
TILES = ((128, 4, 2), (64, 4, 2), (64, 4, 3), (64, 2, 3), (32, 2, 2), (32, 2, 3), (32, 4, 3))
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
# also compiled by --sweep, for bench_verify_attention --tiles
VERIFY_TILES = ((128, 4, 2), (64, 4, 2), (32, 2, 3), (32, 4, 3))


@dataclass(frozen=True)
class Case:
    kind: str  # "sliding" or "global"
    ctx: int
    batch: int

    @property
    def window(self) -> int | None:
        return WINDOW if self.kind == "sliding" else None

    @property
    def extent(self) -> int:
        return REL_SLIDING if self.kind == "sliding" else REL_GLOBAL

    @property
    def log_scaling(self) -> tuple[float, float] | None:
        return None if self.window else LOG_SCALING

    @property
    def visible(self) -> int:
        return min(self.ctx, self.window or self.ctx)

    def floor_bytes(self) -> int:
        kv = 2 * self.batch * self.visible * NKV * HD * 2
        return kv + self.batch * NH * (2 * HD + DREL) * 2 + DREL * self.extent * 2


def case_inputs(case: Case, copies: int, device: str = "cuda") -> list[tuple]:
    """``copies`` argument tuples of ``paged_decode_attention`` over one pool: each copy's sequences own the pages
    of their visible keys (drawn in a random order), every other table entry points at the scratch page."""
    b, ctx = case.batch, case.ctx
    cols = ctx // PAGE
    first = (ctx - case.visible) // PAGE  # the first page holding a visible key
    used = cols - first
    pages = copies * b * used
    k_pool = torch.randn((pages + 1) * PAGE, NKV, HD, device=device, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    order = torch.randperm(pages, device=device, dtype=torch.int32).view(copies, b, used)
    sets = []
    for c in range(copies):
        table = torch.full((b, cols), pages, dtype=torch.int32, device=device)
        table[:, first:] = order[c]
        q = torch.randn(b, NH, HD, device=device).to(torch.bfloat16)
        r = torch.randn(b, NH, DREL, device=device).to(torch.bfloat16)
        rel_proj = (torch.randn(DREL, case.extent, device=device) * 0.3).to(torch.bfloat16)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        sets.append((q, r, rel_proj, k_pool, v_pool, table, lens, PAGE))
    return sets


def copies_for(case: Case) -> int:
    return max(1, min(MAX_COPIES, math.ceil(4 * L2_BYTES / case.floor_bytes()), (40 << 30) // case.floor_bytes()))


def run(case: Case, args: tuple, config: DecodeConfig | None) -> torch.Tensor:
    tiles = {} if config is None else {"config": config}
    return paged_decode_attention(*args, case.window, case.log_scaling, case.ctx, **tiles)


def time_us(case: Case, sets: list[tuple], config: DecodeConfig | None, reps: int) -> float:
    return 1e3 * time_graph_ms(lambda: [run(case, a, config) for a in sets], reps=reps, warmup=2) / len(sets)


def splits_for(case: Case) -> list[int]:
    """Split counts worth a try: one, and those that keep the grid between ~1 and ~32 programs per SM."""
    pairs = case.batch * NKV
    blocks = -(-case.visible // 32)
    return [s for s in SPLITS if s <= blocks and (s == 1 or 128 <= pairs * s <= 132 * 32)]


def _compile(job: tuple) -> None:
    """Worker: one layer kind at ``rows`` query rows per sequence, once per split count, on a tiny input (fills
    Triton's on-disk cache)."""
    config, window, log_scaling, extent, rows, splits = job
    q = torch.randn(rows, NH, HD, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, NH, DREL, device="cuda", dtype=torch.bfloat16)
    rel_proj = torch.randn(DREL, extent, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4 * PAGE, NKV, HD, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(1, 64, dtype=torch.int32, device="cuda")
    lens = torch.full((rows,), 16, dtype=torch.int32, device="cuda")
    for s in splits:
        tiles = DecodeConfig(config.block_n, config.num_warps, config.num_stages, num_splits=s)
        paged_decode_attention(q, r, rel_proj, k, k, table, lens, PAGE, window, log_scaling, 1024, rows_per_seq=rows,
                               config=tiles)  # fmt: skip
    torch.cuda.synchronize()


def precompile(configs: list[DecodeConfig], verify: list[DecodeConfig] = (), timeout_s: float = 15.0) -> None:
    """Compile the variants in parallel processes (forked before this process touches CUDA); what is not done
    within ``timeout_s`` compiles on first use. ``verify``: tiles also compiled for 3 and 5 rows per sequence
    (bench_verify_attention's shapes: no tau)."""
    kinds = ((WINDOW, None, REL_SLIDING), (None, LOG_SCALING, REL_GLOBAL))
    jobs = [(c, *kind, 1, (1, 2, 4, 8) if i == 0 else (1, 2)) for i, c in enumerate(configs) for kind in kinds]
    jobs += [(c, w, None, e, rows, (1, 2)) for c in verify for w, _, e in kinds for rows in (3, 5)]
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 2))
    started = time.perf_counter()
    with torch.multiprocessing.get_context("fork").Pool(workers) as pool:
        result = pool.map_async(_compile, jobs, chunksize=1)
        result.wait(timeout_s)
        state = ("done" if result.successful() else "failed") if result.ready() else "timed out"
        pool.terminate()
    print(f"# compiled {len(jobs)} (tile, layer, rows) variants in {workers} processes: {state}, "
          f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip


def check(case: Case, args: tuple, out: torch.Tensor, ref: torch.Tensor | None) -> float:
    if ref is None:
        ref = paged_attention_reference(*args, case.window, case.log_scaling).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"{case}: rel err {err:.2e}"
    return err


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--kinds", nargs="+", choices=("sliding", "global"), default=["sliding", "global"])
    parser.add_argument("--sweep", action="store_true", help="time tile x split variants per shape")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no measurement after this many s")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tiles = [DecodeConfig(*t) for t in TILES]
    if args.sweep:
        precompile(tiles, [DecodeConfig(*t) for t in VERIFY_TILES])
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    # the large batches first; sliding layers at one ctx (their visible keys are the window)
    batches = sorted(args.batches, key=lambda b: (b < 64, -b))
    cases = [Case(k, ctx, b) for b in batches for k in args.kinds for ctx in args.contexts]
    cases = [c for c in cases if c.kind == "global" or c.ctx == max(args.contexts)]
    widths = [8, 6, 4, 7, 8, 9, 9, 7, 6, 9]
    print(row(["layer", "ctx", "B", "copies", "MB", "floor_us", "time_us", "of_KV", "ratio", "rel_err"], widths))
    summary = []
    for case in cases:
        if time.perf_counter() - started > args.budget_s:
            print(f"# budget reached: {case} and later not run", flush=True)
            break
        sets = case_inputs(case, copies_for(case))
        floor = ceil.floor_us(case.floor_bytes())
        default = run(case, sets[0], None).float()
        err = check(case, sets[0], default, None if case.batch <= 8 else default)
        us = time_us(case, sets, None, reps=20)
        cells = [case.kind, str(case.ctx), str(case.batch), str(len(sets)), f"{case.floor_bytes() / 1e6:.1f}"]
        print(row([*cells, f"{floor:.1f}", f"{us:.1f}", f"{floor / us:.0%}", f"{us / floor:.2f}", f"{err:.1e}"],
                  widths), flush=True)  # fmt: skip
        if args.sweep:
            best = (us, "default")
            for tile in tiles:
                timed = []
                for s in splits_for(case):
                    if time.perf_counter() - started > args.budget_s:
                        break
                    config = DecodeConfig(tile.block_n, tile.num_warps, tile.num_stages, num_splits=s)
                    try:
                        check(case, sets[0], run(case, sets[0], config), default)
                    except Exception as e:  # a failed check or compile is reported, and the variant is not timed
                        timed.append(f"s{s}:FAILED({str(e)[:80]})")
                        continue
                    t = time_us(case, sets, config, reps=10)
                    timed.append(f"s{s}:{t:.1f}")
                    best = min(best, (t, f"{tile.block_n}/{tile.num_warps}w/{tile.num_stages}st/s{s}"))
                print(f"#   {tile.block_n}/{tile.num_warps}w/{tile.num_stages}st " + " ".join(timed), flush=True)
            summary.append((case, floor, us, *best))
    if summary:
        print("# best per shape: layer ctx B floor_us default_us best_us of_KV config")
        for case, floor, us, t, name in summary:
            print(f"{case.kind} {case.ctx} B={case.batch} {floor:.1f} {us:.1f} {t:.1f} {floor / t:.0%} {name}")
    print(ceil.line())
    print(f"# bench_attention took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
