"""Decode attention of an MTP verify step (W query rows per sequence, nH=32, nKV=8, hd=128, d_rel=16) against its
floor, the two ways the paged kernel can serve it.

``rows_per_seq``: ``paged_decode_attention(..., rows_per_seq=W)``, one program per (sequence, KV head, split) for
the W rows (what the engine's verify step runs); ``as_seqs``: every row a sequence of its own over its sequence's
block table repeated per row (the one-row kernel as it is). ``W=1`` is the plain decode step. Floor = bytes that
must move once / measured copy bandwidth: K and V of every key visible to some row of a sequence, plus q, r, P and
the output of the B*W rows. Timings are CUDA-graph replays (median), one layer's pool of 16-key pages in random
order, the rows of sequence b at positions ctx-W .. ctx-1; each variant's output is checked against as_seqs'.

``--splits``: rows_per_seq also at these split counts per (sequence, KV head); ``--tiles``: also at these tiles
(keys per step/warps/stages, e.g. ``64/4/2``), splits from the target grid; ``--bias-table``: also the default tiles
with the bias read from the rows' precomputed ``r @ P`` table (its launch included), or formed in the kernel,
whichever the default is not.

    python3 -m bench.bench_verify_attention [--batches 1 64] [--widths 1 3 5] [--splits 1 4 16] [--tiles 64/4/2]
        [--bias-table]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch

from bench.floors import measure_ceilings, row, time_graph_ms
from inkling_kernels.attention import default_config, paged_decode_attention

NH, NKV, HD, DREL, PAGE = 32, 8, 128, 16, 16
CASES = (("global", 1024, None), ("global", 8192, None), ("sliding", 1024, 512))  # layer, ctx, window


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--splits", type=int, nargs="*", default=[], help="also rows_per_seq at these split counts")
    parser.add_argument("--tiles", nargs="*", default=[], help="also rows_per_seq at these keys/warps/stages")
    parser.add_argument("--bias-table", action="store_true", help="also the other way of forming the bias")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    widths = [8, 6, 4, 3, 12, 9, 9, 8]
    print(row(["layer", "ctx", "B", "W", "variant", "time_us", "floor", "ratio"], widths))
    for kind, ctx, window in CASES:
        for b in args.batches:
            pages = b * ctx // PAGE
            k = torch.randn(pages * PAGE, NKV, HD, device="cuda").to(torch.bfloat16)
            v = torch.randn_like(k)
            table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, -1)
            rel = (torch.randn(DREL, window or 1024, device="cuda") * 0.3).to(torch.bfloat16)
            for w in args.widths:
                q = torch.randn(b * w, NH, HD, device="cuda").to(torch.bfloat16)
                r = torch.randn(b * w, NH, DREL, device="cuda").to(torch.bfloat16)
                lens = (ctx - w + 1 + torch.arange(w, device="cuda")).repeat(b).to(torch.int32)
                visible = min(ctx, (window or ctx) + w - 1)
                n_bytes = 2 * b * visible * NKV * HD * 2 + b * w * NH * (2 * HD + DREL) * 2 + rel.numel() * 2
                floor = ceil.floor_us(n_bytes)
                per_row = table.repeat_interleave(w, 0)
                variants = {"as_seqs": (per_row, 1, None, None)}
                if args.bias_table:
                    config = default_config(b * w, NKV, ctx, window, NH // NKV)
                    variants[f"as_seqs/table={not config.bias_table}"] = (
                        per_row, 1, None, replace(config, bias_table=not config.bias_table)
                    )  # fmt: skip
                if w > 1:
                    variants["rows_per_seq"] = (table, w, None, None)
                    if args.bias_table:
                        config = default_config(b, NKV, ctx, window, NH // NKV, w)
                        variants[f"rows/table={not config.bias_table}"] = (
                            table, w, None, replace(config, bias_table=not config.bias_table)
                        )  # fmt: skip
                    variants.update({f"rows/s{s}": (table, w, s, None) for s in args.splits})
                    for tile in args.tiles:  # the default's bias and grid, these tiles
                        block_n, warps, stages = (int(x) for x in tile.split("/"))
                        config = replace(default_config(b, NKV, ctx, window, NH // NKV, w), block_n=block_n,
                                         num_warps=warps, num_stages=stages)  # fmt: skip
                        variants[f"rows/{tile}"] = (table, w, None, config)
                ref = None  # the as_seqs output (the kernel tests compare both with the torch reference)
                for name, (t, rows, splits, config) in variants.items():
                    tiles = {} if config is None else {"config": config}
                    call = partial(
                        paged_decode_attention, q, r, rel, k, v, t, lens, PAGE, window, None, ctx, splits, rows, **tiles
                    )
                    out = call().float()
                    ref = out if ref is None else ref
                    err = ((out - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, f"{kind} ctx={ctx} B={b} W={w} {name}: rel diff to as_seqs {err:.2e}"
                    us = 1e3 * time_graph_ms(call, reps=20)
                    cells = [kind, str(ctx), str(b), str(w), name, f"{us:.1f}", f"{floor:.1f}", f"{us / floor:.2f}"]
                    print(row(cells, widths), flush=True)


if __name__ == "__main__":
    main()
