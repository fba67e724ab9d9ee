"""Inkling decode attention benchmark (nH=32, nKV=8, hd=128, d_rel=16) against its floor.

Floor = bytes that must move / measured copy bandwidth, bytes = K and V of every visible key (window 512 in
sliding layers, the whole context in global ones) + q, r, P and the output. Timings are CUDA graphs that
rotate over enough cache copies to keep the working set out of L2 (when it fits in memory). Each case runs
twice: ``contig`` (``decode_attention`` on ``[B, S, nKV, hd]`` caches) and ``paged16`` (``paged_decode_attention``
on the same memory viewed as a pool of 16-key pages, block tables a random permutation of the pages), against
the same floor. Baseline: the batched torch path (bf16 scores, bias gathered from r @ P, fp32 softmax), eager.

    python3 -m bench.bench_attention
"""

from __future__ import annotations

import math

import torch

from bench.floors import measure_ceilings, row, time_eager_ms, time_graph_ms
from kernels.attention import attention_reference, decode_attention, paged_attention_reference, paged_decode_attention

NH, NKV, HD, DREL = 32, 8, 128, 16
WINDOW, REL_GLOBAL = 512, 1024
LOG_SCALING = (0.1, 128000.0)
L2_BYTES = 60 << 20
PAGE = 16


def torch_baseline(q, r, rel_proj, kc, vc, n, window, log_scaling):
    """All sequences of length n: gather the visible keys, materialise the bias, softmax in fp32."""
    p = n - 1
    lo = max(0, p - window + 1) if window else 0
    g = NH // NKV
    k = kc[:, lo:n].transpose(1, 2).repeat_interleave(g, dim=1)  # [B, nH, S, hd]
    v = vc[:, lo:n].transpose(1, 2).repeat_interleave(g, dim=1)
    scores = (q.unsqueeze(2) @ k.transpose(-1, -2)).squeeze(2).float() / HD  # [B, nH, S]
    delta = p - torch.arange(lo, n, device=q.device)
    rel = r.float() @ rel_proj.float()  # [B, nH, R]
    bias = torch.where(delta < rel_proj.shape[1], rel[..., delta.clamp(max=rel_proj.shape[1] - 1)], 0.0)
    scores = scores + bias
    if log_scaling:
        scores = scores * (1.0 + log_scaling[0] * math.log(max((p + 1) / log_scaling[1], 1.0)))
    prob = torch.softmax(scores, dim=-1).to(v.dtype)
    return (prob.unsqueeze(2) @ v).squeeze(2)


def calls(fn, arg_sets, *args):
    """A thunk that runs ``fn(*a, *args)`` for every ``a`` in ``arg_sets`` (what one timed graph replays)."""
    return lambda: [fn(*a, *args) for a in arg_sets]


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    cases = [("sliding", 4096, WINDOW), ("global", 4096, None), ("global", 32768, None)]
    widths = [8, 6, 3, 8, 7, 9, 9, 8, 7, 9, 8]
    print("# decode attention (split-KV + combine), CUDA graph; torch = batched eager baseline")
    head = ["layer", "ctx", "B", "kv", "copies", "MB", "time_us", "floor", "ratio", "torch_us", "t_ratio"]
    print(row(head, widths))
    errors = []
    for kind, ctx, window in cases:
        for b in (1, 8, 32):
            extent = WINDOW if window else REL_GLOBAL
            ls = None if window else LOG_SCALING
            visible = min(ctx, window or ctx)
            kv_bytes = 2 * b * visible * NKV * HD * 2
            alloc = 2 * b * ctx * NKV * HD * 2
            copies = max(1, min(8, math.ceil(4 * L2_BYTES / kv_bytes), (40 << 30) // alloc))
            sets, paged_sets = [], []
            for _ in range(copies):
                q = torch.randn(b, NH, HD, device=dev).to(torch.bfloat16)
                r = torch.randn(b, NH, DREL, device=dev).to(torch.bfloat16)
                rel_proj = (torch.randn(DREL, extent, device=dev) * 0.3).to(torch.bfloat16)
                kc = torch.randn(b, ctx, NKV, HD, device=dev).to(torch.bfloat16)
                vc = torch.randn(b, ctx, NKV, HD, device=dev).to(torch.bfloat16)
                lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
                sets.append((q, r, rel_proj, kc, vc, lens))
                # The same memory as one layer's pool of PAGE-key pages, handed out in a random order.
                table = torch.randperm(b * ctx // PAGE, device=dev).to(torch.int32).view(b, ctx // PAGE)
                pool_k, pool_v = kc.view(b * ctx, NKV, HD), vc.view(b * ctx, NKV, HD)
                paged_sets.append((q, r, rel_proj, pool_k, pool_v, table, lens, PAGE))
            n_bytes = kv_bytes + b * NH * (2 * HD + DREL) * 2 + DREL * extent * 2
            floor = ceil.floor_us(n_bytes)
            for layout in ("contig", f"paged{PAGE}"):
                if layout == "contig":
                    out = decode_attention(*sets[0], window, ls).float()
                    ref = attention_reference(*sets[0], window, ls).float()
                    us = 1e3 * time_graph_ms(calls(decode_attention, sets, window, ls)) / copies
                    us_t = 1e3 * time_eager_ms(calls(torch_baseline, [sets[0][:5]], ctx, window, ls), reps=10)
                    torch_cols = [f"{us_t:.1f}", f"{us_t / floor:.2f}"]
                else:
                    out = paged_decode_attention(*paged_sets[0], window, ls, ctx).float()
                    ref = paged_attention_reference(*paged_sets[0], window, ls).float()
                    us = 1e3 * time_graph_ms(calls(paged_decode_attention, paged_sets, window, ls, ctx)) / copies
                    torch_cols = ["-", "-"]
                rel = ((out - ref).norm() / ref.norm()).item()
                errors.append((kind, ctx, b, layout, rel, (out - ref).abs().max().item()))
                cols = [kind, str(ctx), str(b), layout, str(copies), f"{n_bytes / 1e6:.1f}", f"{us:.1f}"]
                print(row([*cols, f"{floor:.1f}", f"{us / floor:.2f}", *torch_cols], widths), flush=True)
    print("# correctness vs the fp32 references (bf16 inputs): layer ctx B kv rel max_abs")
    for kind, ctx, b, layout, rel, mx in errors:
        print(f"{kind} {ctx} B={b} {layout} rel={rel:.2e} max_abs={mx:.2e}")
    print(ceil.line())


if __name__ == "__main__":
    main()
