"""Prefill of the Small-L6 proxy (bench/proxy.py) against its FLOP floor, and the prefill attention kernel's tiles.

Whole prefill: one `--tokens`-token prompt (default 8192) in `--chunk`-token steps (default 2048; a comma list
times each) on the packed path with the fast kernels, through a contiguous state (attention over the keys its cache
returns) and through the engine's paged KV cache (attention over the pools in place); tokens/s and the share of the
bf16 matmul peak measured in the same run (`bench/floors.py`) in model FLOPs (`bench_decode.prefill_flops`), then
the GPU time by kernel of the first and the last chunk of the prompt. `--moe-tiles a,b` also times the same
weights with the routed experts' prefill-sized calls on `bench_moe`'s PREFILL_VARIANTS a, b ("default": the tiles
of before issue 17's MoE prefill work), side by side.

Attention: `prefill_attention` on the proxy's chunk shapes (2048 queries, 32 query / 8 KV heads of 128, d_rel 16,
R 1024) for each `PrefillConfig` side by side: a sliding layer (W 512), the global layer (tau) on the first and
the last chunk of the prompt; attention FLOPs (4 nH hd per visible pair) over time, next to the bf16 peak, and
the error against the fp32 reference.

`--glue`: only the per-chunk glue ops, each from a CUDA graph next to its byte floor, the kernel against the torch
reference it replaced: the relative-bias table of a 2048-token chunk (`rel_bias_table`, sliding R' 512 and global
1024, r a view of the stacked projection) against the fp32 `r.float() @ P.float()`, the NVFP4 gate/up kernel's
x permutation (`kperm_x`, [chunk, 4096]) against torch's permute copy, and the lm_head's fp32 cast of B=256
unpadded logit rows (`float_rows`) against `.float()` of the view.

    python3 -m bench.bench_prefill [--tokens 8192] [--chunk 2048[,4096]] [--moe-tiles default,...]
        [--no-model] [--no-attention] [--glue]
"""

from __future__ import annotations

import argparse
import itertools
import math
from functools import partial

import torch

from bench.bench_decode import count_launches, prefill_flops
from bench.bench_moe import PREFILL_VARIANTS, prefill_variant
from bench.floors import Ceilings, measure_ceilings, time_eager_ms, time_graph_ms
from bench.proxy import NVFP4_LAYERS, PAGE, proxy_config, random_proxy
from decode_service.engine.core.pages import KVAllocator
from decode_service.engine.worker.kv_cache import CacheSpec, KVCache, SequenceView
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.fast_path import TritonOps
from decode_service.model.inkling import InklingDecoder
from inkling_kernels.float_rows import float_rows, float_rows_reference
from inkling_kernels.moe import PREFILL_MIN_PAIRS, MoeConfig, bf16_moe, kperm_x, kperm_x_reference, nvfp4_moe
from inkling_kernels.prefill_attention import (
    PrefillConfig,
    prefill_attention,
    prefill_attention_reference,
)
from inkling_kernels.rel_bias import rel_bias_table, rel_bias_table_reference


class TilesOps(TritonOps):
    """`TritonOps` with the routed experts' prefill-sized calls (from PREFILL_MIN_PAIRS pairs) on `config`."""

    def __init__(self, config: MoeConfig):
        self.config = config

    def bf16_experts(self, hidden: int, width: int):
        fast = super().bf16_experts(hidden, width)

        def experts(x, ids, weights, w13, w2):
            if ids.numel() < PREFILL_MIN_PAIRS:
                return fast(x, ids, weights, w13, w2)
            return bf16_moe(x, ids.to(torch.int32), weights.float(), w13, w2, config=self.config)

        return experts

    def nvfp4_experts(self, hidden: int, width: int):
        fast = super().nvfp4_experts(hidden, width)

        def experts(x, ids, weights, *stacks):
            if ids.numel() < PREFILL_MIN_PAIRS:
                return fast(x, ids, weights, *stacks)
            return nvfp4_moe(x, ids.to(torch.int32), weights.float(), *stacks, config=self.config)

        return experts


CONFIGS = [
    PrefillConfig(64, 64, 4, 2),  # the default
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(128, 64, 8, 2),
    PrefillConfig(64, 128, 4, 2),
]
REL_TABLE_SWEEP = [(128, 128, 8), (64, 64, 4), (256, 64, 8), (128, 32, 4)]
BREAKDOWN_ROWS = 32  # kernels listed by name in a chunk's breakdown
# (name, q_start, k_first, window, log_scaling) of a 2048-token chunk of an 8192-token prompt
LAYOUTS = [
    ("sliding, first chunk", 0, 0, 512, None),
    ("global+tau, first chunk", 0, 0, None, (0.1, 128000.0)),
    ("global+tau, last chunk", 6144, 0, None, (0.1, 128000.0)),
]


def attention_pairs(n: int, q_start: int, k_first: int, window: int | None) -> int:
    """(query, key) pairs visible to n queries at q_start.. over keys from k_first."""
    return sum(min(p + 1 - k_first, window or p + 1) for p in range(q_start, q_start + n))


def bench_attention(ceil: Ceilings, n: int = 2048, heads: int = 32, kv_heads: int = 8, hd: int = 128) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    print("# prefill_attention, 2048 queries, 32/8 heads of 128, d_rel 16, R 1024 (TFLOP/s, rel err vs fp32 ref)")
    names = [f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}" for c in CONFIGS]
    print(f"# {'layout':<24} " + "  ".join(f"{name:>22}" for name in names), flush=True)
    for name, q_start, k_first, window, log_scaling in LAYOUTS:
        m = q_start + n - k_first
        q, r, keys, values = rand(n, heads, hd), rand(n, heads, 16), rand(m, kv_heads, hd), rand(m, kv_heads, hd)
        rel_proj = rand(16, 1024, scale=0.5)
        args = (q, r, rel_proj, keys, values, q_start, k_first, window, log_scaling)
        ref = prefill_attention_reference(*args).float()
        flops = 4.0 * heads * hd * attention_pairs(n, q_start, k_first, window)
        cells = []
        for config in CONFIGS:
            try:
                out = prefill_attention(*args, config=config).float()
                err = ((out - ref).norm() / ref.norm()).item()
                ms = time_eager_ms(lambda c=config, a=args: prefill_attention(*a, config=c), reps=10)
                cells.append(f"{ms * 1e3:6.0f}us {flops / ms / 1e9:4.0f}TF {err:.0e}")
            except Exception as e:  # a tile that does not compile on this GPU is reported, not fatal
                cells.append(f"{type(e).__name__:>22}")
        print(f"# {name:<24} " + "  ".join(f"{c:>22}" for c in cells), flush=True)
    print(f"# (bf16 matmul peak {ceil.bf16_tflops:.0f} TFLOP/s)", flush=True)


def bench_glue(ceil: Ceilings, chunk: int = 2048, heads: int = 32, hd: int = 128, d_rel: int = 16) -> None:
    """Each glue op's kernel and the torch reference it replaced, us from a CUDA graph, next to the op's byte floor
    (the bytes it must read and write at the measured copy bandwidth)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(chunk, heads * (hd + d_rel) + 2048, generator=gen, device="cuda").to(torch.bfloat16)
    r = proj[:, heads * hd : heads * (hd + d_rel)].unflatten(1, (heads, d_rel))  # [n, nH, d_rel] view
    rel_proj = (torch.randn(d_rel, 1024, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    x = torch.randn(chunk, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    vocab, padded = 200058, 201024
    logits = torch.randn(256, padded, generator=gen, device="cuda").to(torch.bfloat16)[:, :vocab]
    cases = [
        (f"bias table n={chunk} R'=512", partial(rel_bias_table, r, rel_proj, 512),
         partial(rel_bias_table_reference, r, rel_proj, 512), r.numel() * 2 + r.numel() // d_rel * 512 * 4),
        (f"bias table n={chunk} R'=1024", partial(rel_bias_table, r, rel_proj, 1024),
         partial(rel_bias_table_reference, r, rel_proj, 1024), r.numel() * 2 + r.numel() // d_rel * 1024 * 4),
        (f"kperm x [{chunk}, 4096]", partial(kperm_x, x, 128), partial(kperm_x_reference, x, 128), x.numel() * 4),
        ("fp32 logits [256, 200058]", partial(float_rows, logits), partial(float_rows_reference, logits),
         logits.numel() * 6),
    ]  # fmt: skip
    for extent, tiles in itertools.product((512, 1024), REL_TABLE_SWEEP):  # the table per (rows, distances, warps)
        cases.append((f"bias table n={chunk} R'={extent} tiles {tiles}",
                      partial(rel_bias_table, r, rel_proj, extent, tiles),
                      partial(rel_bias_table_reference, r, rel_proj, extent), cases[extent // 1024][3]))  # fmt: skip
    for name, new, old, n_bytes in cases:
        same = torch.equal(new(), old()) if "bias" not in name else bool(torch.allclose(new(), old(), atol=1e-5))
        before, after = time_graph_ms(old) * 1e3, time_graph_ms(new) * 1e3
        floor = ceil.floor_us(n_bytes)
        print(
            f"# glue {name}: torch {before:.1f} us ({before / floor:.2f}x floor), kernel {after:.1f} us "
            f"({after / floor:.2f}x); floor {floor:.1f} us ({n_bytes / 1e6:.0f} MB); same values: {same}",
            flush=True,
        )


def bench_model(ceil: Ceilings, tokens: int, chunks: list[int], tiles: list[str]) -> None:
    """The prefill rate per chunk size with the model as built, then with each `tiles` variant (`bench_moe`'s
    PREFILL_VARIANTS) on the NVFP4 experts' prefill-sized calls; the breakdown of the model as built."""
    model = random_proxy(proxy_config(), NVFP4_LAYERS)
    for chunk in chunks:
        bench_prefill_rate(ceil, model, tokens, chunk, "MoE tiles of default_config")
        for name in tiles:
            variant = model.with_ops(TilesOps(prefill_variant(name)))
            bench_prefill_rate(ceil, variant, tokens, chunk, f"MoE prefill tiles {name}")
        breakdown(model, tokens, chunk)


def prefill_fn(model: InklingDecoder, ids: torch.Tensor, chunk: int):
    """`prefill(end)`: the prompt's chunks up to token `end` on a fresh state -> (state, last hidden rows)."""

    def prefill(end: int):
        state, hidden = model.new_state(), None
        with torch.inference_mode():
            for start in range(0, end, chunk):
                n = min(chunk, end - start)
                hidden = model(ForwardBatch(ids[start : start + n], [SequenceSlice(start, n, state.layers)]))
        return state, hidden

    return prefill


def prompt(model: InklingDecoder, tokens: int) -> torch.Tensor:
    gen = torch.Generator(device=model.embed.weight.device).manual_seed(0)
    vocab = model.config.unpadded_vocab_size
    return torch.randint(0, vocab, (tokens,), device=model.embed.weight.device, generator=gen)


def bench_prefill_rate(ceil: Ceilings, model: InklingDecoder, tokens: int, chunk: int, what: str) -> None:
    ids = prompt(model, tokens)
    prefill = prefill_fn(model, ids, chunk)

    def run() -> None:
        _, hidden = prefill(tokens)
        with torch.inference_mode():
            model.logits(hidden[-1:])

    floor_ms = prefill_flops(model, tokens) / (ceil.bf16_tflops * 1e12) * 1e3
    for where, fn in (("contiguous state", run), ("engine's paged cache", engine_prefill(model, ids, chunk))):
        ms = time_eager_ms(fn, reps=3, warmup=1)
        print(
            f"# prefill {tokens} tokens in {chunk}-token chunks ({what}; packed path, fast kernels, {where}): "
            f"{tokens / ms * 1e3:.0f} tokens/s = {ms:.1f} ms vs FLOP floor {floor_ms:.1f} ms at the measured bf16 "
            f"peak ({floor_ms / ms:.0%} of peak in model FLOPs)",
            flush=True,
        )


def breakdown(model: InklingDecoder, tokens: int, chunk: int) -> None:
    """GPU time by kernel of the prompt's first and last chunk, and each chunk's wall time (one eager call)."""
    ids = prompt(model, tokens)
    prefill = prefill_fn(model, ids, chunk)
    for start in sorted({0, (tokens - 1) // chunk * chunk}):  # the first chunk and the last
        state, _ = prefill(start)
        n = min(chunk, tokens - start)

        def one_chunk(start=start, n=n, state=state) -> None:
            with torch.inference_mode():
                model(ForwardBatch(ids[start : start + n], [SequenceSlice(start, n, state.layers)]))

        kernels, copies, busy, top = count_launches(one_chunk)
        state, _ = prefill(start)  # the same chunk again on a fresh state, timed: wall time against GPU busy
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        one_chunk(state=state)
        end.record()
        end.synchronize()
        print(f"# chunk at {start} ({n} tokens): {kernels} kernels + {copies} copies, {busy:.1f} ms GPU busy, "
              f"{begin.elapsed_time(end):.1f} ms wall; by kernel (us, launches):", flush=True)  # fmt: skip
        for name, count, us in top[:BREAKDOWN_ROWS]:
            print(f"#   {us:8.0f} us x{count:4d}  {name[:100]}", flush=True)
        rest = top[BREAKDOWN_ROWS:]
        print(f"#   {sum(us for *_, us in rest):8.0f} us x{sum(c for _, c, _ in rest):4d}  (the rest)", flush=True)


def engine_prefill(model: InklingDecoder, ids: torch.Tensor, chunk: int):
    """A prefill of `ids` in chunks through the engine's KV cache (`SequenceView`: paged pools, attention over them
    in place) on a fresh sequence each call, the lm_head on the last row."""
    tokens = ids.shape[0]
    pages = math.ceil(tokens / PAGE) + 2
    spec = CacheSpec(PAGE, pages, pages, 1, model.dtype, str(ids.device))
    cache, allocator = KVCache(model.config, spec), KVAllocator(model.config, spec)

    def run() -> None:
        seq = allocator.new_sequence()
        cache.zero_conv(seq.slot)
        view = SequenceView(cache, seq.slot)
        with torch.inference_mode():
            for start in range(0, tokens, chunk):
                n = min(chunk, tokens - start)
                seq.grow(start + n)
                for sliding, update in zip((True, False), seq.take_updates(), strict=True):
                    view.update(sliding, update)
                hidden = model(ForwardBatch(ids[start : start + n], [SequenceSlice(start, n, view.layers)]))
                view.num_tokens = start + n
                seq.commit(start + n)
            model.logits(hidden[-1:])
        seq.release()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", default="2048", help="chunk tokens, or a comma list of them (each timed)")
    parser.add_argument("--moe-tiles", default="", help=f"also these MoE prefill tiles, of {list(PREFILL_VARIANTS)}")
    parser.add_argument("--no-model", action="store_true", help="only the attention tiles")
    parser.add_argument("--no-attention", action="store_true", help="only the whole prefill")
    parser.add_argument("--glue", action="store_true", help="only the glue ops, kernel vs torch, from graphs")
    args = parser.parse_args()
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    if args.glue:
        bench_glue(ceil)
        return
    if not args.no_model:
        tiles = [t for t in args.moe_tiles.split(",") if t]
        bench_model(ceil, args.tokens, [int(c) for c in args.chunk.split(",")], tiles)
    if not args.no_attention:
        bench_attention(ceil)


if __name__ == "__main__":
    main()
