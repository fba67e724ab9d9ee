"""Decode step of a depth-reduced Inkling-Small against its byte floor: reference path, fast path, transformers.

Model "Small-L6" (`--layers 6`, the default) is the first 6 layers of Inkling-Small with its exact layer shapes
(H=4096, 32 query / 8 KV heads of 128, d_rel 16, window 512, rel_extent 1024, 256 routed experts of I=2048, top-6,
2 shared, full 201024 vocabulary): 0-1 dense (Id=16384), 2 bf16 routed experts, 3-5 NVFP4 routed experts, 5 global.
`--layers 8` is "Small-L8", the first 8 layers: 0-1 dense, 2 bf16, 3-7 NVFP4, 5 global (Inkling-Small's rule: every
6th layer global, only layer 2's experts bf16). Random weights are generated on the GPU, the NVFP4 stacks directly
in their packed form.

A step is what the runner does for B decoding sequences: the decoder forward (one new token each, at context
`ctx`, through the engine's paged KV cache holding random history) and the lm_head of the B rows, timed three ways:
the packed reference path (B <= `--ref-max-batch` only), the packed path with the fast kernels, and the engine's
batched step replayed from its CUDA graph (`DecodeGraphs`, wall time including the metadata fill), alone and
back to back (`BACK_TO_BACK` steps queued without a sync between them: each step's host fill overlaps the GPU's
previous step, the async engine's steady state; the time per step); kernels per step and GPU time by kernel come
from the same batched step run eagerly. The table covers B 1/8/64/256 x ctx
1k/8k/32k unless `--batches`/`--contexts` say otherwise, each row with its own cache sized for it. Floor = bytes
that must move / copy bandwidth measured in the same run, bytes = every non-routed weight once (attention, dense
MLP, shared experts, router, lm_head; B embedding rows) + the routed experts this step's routing touches (packed
codes + block scales for NVFP4) + every visible K/V + conv states read and written + fp32 logits written. The
roofline column (`bench.proxy.step_roofline_us`) takes per op the larger of its bytes and its FLOPs at the bf16
peak measured in the same run: at large B the lm_head and dense GEMMs are compute-bound, so the byte floor alone
understates what a step can cost. Kernel launches are counted with the torch profiler (kernels, plus memcpy/memset,
per step). A second line per row times a greedy step with its tokens read on the host: the graphs step then an
eager lm_head + argmax (the least the runner's host sampling does), or the decode graphs' in-graph argmax
(`DecodeGraphs.greedy_tokens`, B ints read).

`--hf` then times transformers' Inkling at the same (B, ctx) grid (`bench.hf_decode`: bf16, sdpa, its own random
init) with each of its experts backends (grouped_mm, batched_mm, eager; `--hf-experts`): the table shows the
fastest, named, and the speedup column is that step over our graphs step; rows it cannot fit say so.

`--prefill N` (default 8192) prefills one N-token prompt in each of `--prefill-chunks` (512 1024 2048 4096) and
compares tokens/s with the FLOP floor at the measured bf16 peak. `--plot PATH` writes a PNG: graphs / floor
against B (one line per ctx) and prefill tokens/s against chunk size. `--check` first runs the engine on the proxy
(graph replay must give the eager step's tokens), then compares the two paths module by module on identical inputs
(attention of every layer, routed experts at T=2 and 600) and over greedy decode runs, next to a control: the
reference path against itself with 2^-8 noise on embed_norm. On random weights that control already moves the
logits by O(1) (router top-k flips), so only the per-module figures measure the kernels.

    python3 -m bench.bench_decode [--layers 8] [--batches 1 8 64 256] [--contexts 1024 8192 32768] [--hf]
        [--plot decode.png] [--check] [--check-fp32]

`--tensor-parallel-size N` (or `--tiny --device cpu`) runs `bench.bench_decode_tp` instead: full-depth
Inkling-Small (`--model small`) or Inkling (`--model inkling`) shapes over N ranks, B 1/8/64/256 at ctx 8k/32k
unless given, eager vs graphs, the per-GPU byte floor plus the measured all-reduce latency.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch

from bench import hf_decode
from bench.decode_plot import write_plot
from bench.floors import Ceilings, count_launches, measure_ceilings, time_eager_ms, time_ms
from bench.hf_decode import HFResult
from bench.proxy import (
    layer_mix,
    paged_decode_batch,
    proxy_config,
    proxy_nvfp4_layers,
    proxy_raw_text,
    proxy_shapes,
    random_proxy,
    step_bytes,
    step_roofline_us,
    touched_experts,
)
from common.config import parse_model_config
from decode_service.engine.worker.decode_graphs import DecodeGraphs
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.inkling import InklingDecoder
from tools.make_tiny_checkpoint import raw_config


def greedy_logits(model: InklingDecoder, prompts: list[list[int]], steps: int, ops: str) -> list[torch.Tensor]:
    """Prefill each prompt alone, decode all together greedily on `model`'s weights built with `ops`; the logits of
    every decode step."""
    model = model.with_ops(ops)
    states = [model.new_state() for _ in prompts]
    dev = model.embed.weight.device
    last, out = [], []
    with torch.inference_mode():
        for p, s in zip(prompts, states, strict=True):
            hidden = model(ForwardBatch(torch.tensor(p, device=dev), [SequenceSlice(0, len(p), s.layers)]))
            last.append(int(model.logits(hidden[-1:]).argmax()))
        lengths = [len(p) for p in prompts]
        for _ in range(steps):
            seqs = [SequenceSlice(n, 1, s.layers) for n, s in zip(lengths, states, strict=True)]
            logits = model.logits(model(ForwardBatch(torch.tensor(last, device=dev), seqs)))
            out.append(logits)
            last = logits.argmax(-1).tolist()
            lengths = [n + 1 for n in lengths]
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.inference_mode()
def module_errors(model: InklingDecoder, prompts: list[list[int]]) -> None:
    """Every attention and routed-expert module fed identical inputs on both paths (no error propagation), and
    how often bf16-level noise on a router input changes its top-k set (what makes whole-model runs diverge)."""
    dev = model.embed.weight.device
    reference, fast_model = model.with_ops("reference"), model.with_ops("fast")
    states = [model.new_state() for _ in prompts]
    for p, s in zip(prompts, states, strict=True):
        reference(ForwardBatch(torch.tensor(p, device=dev), [SequenceSlice(0, len(p), s.layers)]))
    h = model.config.hidden_size
    parts = []
    for i, layer in enumerate(model.layers):
        u = torch.randn(len(prompts), h, device=dev).to(model.dtype)
        outs = []
        for built in (reference, fast_model):
            seqs = [SequenceSlice(len(p), 1, s.clone().layers) for p, s in zip(prompts, states, strict=True)]
            step = built.packed.prepare(ForwardBatch(torch.zeros(len(seqs), dtype=torch.long), seqs))
            outs.append(built.layers[i].attn(u, step))
        parts.append(f"attn{i} {rel(outs[1], outs[0]):.1e}")
        if getattr(layer.mlp, "experts", None) is None:
            continue
        for t in (2, 600):
            x = torch.randn(t, h, device=dev).to(model.dtype)
            ids, weights, _ = layer.mlp.gate(x)
            ref = reference.layers[i].mlp.experts(x, ids, weights)
            fast = fast_model.layers[i].mlp.experts(x, ids, weights)
            parts.append(f"moe{i}/T{t} {rel(fast, ref):.1e}")
        x = torch.randn(600, h, device=dev).to(model.dtype)
        noisy = (x.float() * (1 + 2**-8 * torch.randn_like(x.float()))).to(x.dtype)
        a, b = layer.mlp.gate(x)[0].sort(-1).values, layer.mlp.gate(noisy)[0].sort(-1).values
        parts.append(f"route{i} flips {(a != b).any(-1).float().mean().item():.0%}")
    print("# per-module fast vs reference rel err (same inputs): " + ", ".join(parts), flush=True)


def check(model: InklingDecoder, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200000, (n,), generator=gen).tolist() for n in (600, 37)]  # 600 > window 512
    module_errors(model, prompts)
    ref = greedy_logits(model, prompts, steps, "reference")
    fast = greedy_logits(model, prompts, steps, "fast")
    errs = [rel(f, r) for f, r in zip(fast, ref, strict=True)]
    # Control: the reference path against itself with 2^-8 noise on embed_norm (random weights are chaotic).
    w = model.embed_norm.weight
    saved = w.data.clone()
    w.data = (w.data.float() * (1 + 2**-8 * torch.randn_like(w.data.float()))).to(w.dtype)
    noisy = greedy_logits(model, prompts, steps, "reference")
    w.data = saved
    print(
        "# control: reference vs reference with 2^-8 noise on embed_norm, logits rel err per step "
        + " ".join(f"{rel(n, r):.1e}" for n, r in zip(noisy, ref, strict=True)),
        flush=True,
    )
    same = sum(int(torch.equal(f.argmax(-1), r.argmax(-1))) for f, r in zip(fast, ref, strict=True))
    print(
        f"# check Small-L6 {model.dtype} (prompts 600 + 37 tokens, {steps} greedy steps): fast vs reference logits "
        f"rel err max {max(errs):.2e} mean {statistics.mean(errs):.2e}; "
        f"steps with identical greedy tokens {same}/{steps}",
        flush=True,
    )


def prefill_flops(model: InklingDecoder, tokens: int) -> float:
    """Model FLOPs of prefilling `tokens` tokens: 2 x active weights per token (top-k routed experts, every other
    matrix but the embedding; the lm_head for the last token only) + QK and PV over the causal/windowed keys."""
    config = model.config
    h, i = config.hidden_size, config.moe_intermediate_size
    active = 0
    for name, t in model.named_parameters():
        if name.startswith(("embed.", "unembed.")) or ".mlp.experts." in name or t.dim() < 2:
            continue
        active += t.numel()
    for layer in model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            active += config.num_experts_per_tok * 3 * h * i
    flops = 2.0 * active * tokens + 2.0 * h * config.vocab_size
    for layer in range(config.num_layers):
        geo = config.layer_geometry(layer)
        keys = tokens * min(geo.window, tokens) if geo.window else tokens * (tokens + 1) / 2  # summed over queries
        flops += 4.0 * geo.num_heads * geo.head_dim * keys
    return flops


def prefill_rate(model: InklingDecoder, tokens: int, chunk: int) -> float:
    """Tokens/s of one `tokens`-token prompt prefilled in `chunk`-token steps on the packed path (fast kernels
    where they apply), through a contiguous state; the median of two runs after a warm-up."""
    dev = model.embed.weight.device
    ids = torch.randint(0, model.config.unpadded_vocab_size, (tokens,), device=dev)

    def run() -> None:
        state = model.new_state()
        with torch.inference_mode():
            for start in range(0, tokens, chunk):
                n = min(chunk, tokens - start)
                hidden = model(ForwardBatch(ids[start : start + n], [SequenceSlice(start, n, state.layers)]))
            model.logits(hidden[-1:])

    ms = time_ms(run, str(dev), reps=2, warmup=1)
    return tokens / ms * 1e3


def engine_check(model: InklingDecoder, steps: int = 64) -> None:
    """The engine on the proxy: greedy tokens of 3 sequences with decode steps from CUDA graphs, the same
    static-buffer step eagerly, and the reference path; graphs and eager must agree exactly."""
    from decode_service.engine.engine import Engine, EngineSettings
    from decode_service.engine.request import Request, SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 200000, (n,), generator=gen).tolist() for n in (600, 37, 5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    config = parse_model_config(raw_config(**proxy_shapes(model.config.num_layers)))
    tokens = {}
    for name, ops, graphs in (("graphs", "auto", True), ("eager", "auto", False), ("reference", "reference", False)):
        settings = EngineSettings(kv_cache_bytes=4 << 30, max_num_seqs=4, device="cuda", cuda_graphs=graphs,
                                  enable_prefix_cache=False)  # fmt: skip
        engine = Engine(model.with_ops(ops), config, settings)
        tokens[name] = [o.token_ids for o in engine.generate(Request(f"r{i}", p, greedy)
                                                             for i, p in enumerate(prompts))]  # fmt: skip
        del engine
        torch.cuda.empty_cache()
    agree = [
        next((i for i, (a, b) in enumerate(zip(ra, rb, strict=True)) if a != b), len(ra))
        for ra, rb in zip(tokens["reference"], tokens["graphs"], strict=True)
    ]
    same = tokens["graphs"] == tokens["eager"]
    print(
        f"# engine check Small-L6 bf16, {steps} greedy steps x 3 sequences: graphs == eager step: {same}; "
        f"graphs vs reference path equal for the first {agree} steps",
        flush=True,
    )
    assert same, "CUDA-graph replay changed the tokens"


def prefill_chunk(model: InklingDecoder, tokens: int) -> None:
    """One fresh `tokens`-token chunk on the packed path (what the kernel breakdown profiles)."""
    ids = torch.randint(0, model.config.unpadded_vocab_size, (tokens,), device=model.embed.weight.device)
    state = model.new_state()
    with torch.inference_mode():
        model(ForwardBatch(ids, [SequenceSlice(0, tokens, state.layers)]))


BACK_TO_BACK = 8  # steps per back-to-back timing


@dataclass(frozen=True)
class Row:
    ctx: int
    batch: int
    experts: str  # distinct routed experts touched per MoE layer, "a/b/c"
    floor_ms: float
    reference: str  # ms, or why not timed
    fast_ms: float
    graphs_ms: float
    kernels: int
    copies: int
    busy_ms: float
    roofline_ms: float  # per op the larger of bytes / copy bandwidth and FLOPs / bf16 peak
    back_to_back_ms: float  # graphs step time with BACK_TO_BACK steps queued

    @property
    def ratio(self) -> float:
        return self.graphs_ms / self.floor_ms


def decode_row(model: InklingDecoder, reference: InklingDecoder, batch: int, ctx: int, max_model_len: int,
               ceil: Ceilings, ref_max_batch: int, breakdown: bool) -> Row:  # fmt: skip
    """One (B, ctx) decode step timed on the packed reference path, the packed fast path and the engine's graphs."""
    fb, graphs, handles = paged_decode_batch(model, batch, ctx, max_model_len)
    tokens = fb.token_ids.tolist()
    eager = DecodeGraphs(model, graphs.cache, max_num_seqs=batch, max_model_len=max_model_len, use_graphs=False)

    def packed(built: InklingDecoder = model) -> torch.Tensor:
        with torch.inference_mode():
            return built.logits(built(fb))

    def batched(runner: DecodeGraphs = graphs) -> torch.Tensor:
        with torch.inference_mode():
            return model.logits(runner.run(tokens, handles))

    def sampled_on_host() -> list:  # the least the host path does (the sampler's own launches come on top)
        with torch.inference_mode():
            return model.logits(graphs.run(tokens, handles)).argmax(-1).tolist()

    def argmax_in_graph() -> list:
        with torch.inference_mode():
            return graphs.greedy_tokens(graphs.run(tokens, handles)).tolist()

    touched = touched_experts(model, fb)
    floor = ceil.floor_us(step_bytes(model, batch, ctx, touched)) / 1e3
    roofline = step_roofline_us(model, batch, ctx, touched, ceil) / 1e3
    fast = time_eager_ms(packed, reps=3, warmup=1)
    graphed = time_eager_ms(batched, reps=30, warmup=3)  # the first run captures B's graph
    back_to_back = time_eager_ms(lambda: [batched() for _ in range(BACK_TO_BACK)], reps=5, warmup=1) / BACK_TO_BACK
    host, in_graph = time_eager_ms(sampled_on_host, reps=30), time_eager_ms(argmax_in_graph, reps=30)
    same = sampled_on_host() == argmax_in_graph()  # one step's inputs: the head graph must give the host's tokens
    kernels, copies, busy, top = count_launches(partial(batched, runner=eager))
    ref = f"skipped (B > --ref-max-batch {ref_max_batch})"
    if batch <= ref_max_batch:
        ref = f"{time_eager_ms(partial(packed, built=reference), reps=3, warmup=1):.2f}"
    row = Row(ctx, batch, "/".join(str(touched[i]) for i in sorted(touched)), floor, ref, fast, graphed,
              kernels, copies, busy, roofline, back_to_back)  # fmt: skip
    if breakdown:
        by_kernel = "; ".join(f"{name[:60]} x{n} {us:.0f}" for name, n, us in top[:14])
        print(f"# ctx={ctx} B={batch} GPU time by kernel (launches, us): {by_kernel}", flush=True)
    print(
        f"# ctx={ctx} B={batch}: experts {row.experts}, floor {floor:.2f} ms (roofline {roofline:.2f}), reference "
        f"{ref} ms, packed fast {fast:.2f} ms, graphs {graphed:.2f} ms ({row.ratio:.2f}x floor; back to back "
        f"{back_to_back:.2f} ms, {back_to_back / floor:.2f}x), kernels {kernels} + "
        f"{copies} copies per step, GPU busy {busy:.2f} ms",
        flush=True,
    )
    print(
        f"# ctx={ctx} B={batch}: greedy tokens (graphs step + tokens on the host) from an eager lm_head + argmax "
        f"{host:.3f} ms, from the argmax in the head graph {in_graph:.3f} ms ({host / in_graph:.2f}x); same "
        f"tokens: {same}",
        flush=True,
    )
    return row


def prefill_rates(model: InklingDecoder, tokens: int, chunks: list[int], ceil: Ceilings) -> list[tuple[int, float]]:
    """[(chunk, tokens/s)] of one `tokens`-token prefill per chunk size, next to the FLOP floor; the kernel
    breakdown of one chunk of the largest size."""
    floor = prefill_flops(model, tokens) / (ceil.bf16_tflops * 1e12)
    rates = []
    for chunk in chunks:
        rate = prefill_rate(model, tokens, chunk)
        rates.append((chunk, rate))
        print(
            f"# prefill {tokens} tokens in {chunk}-token chunks (packed path, fast kernels): {rate:.0f} tokens/s = "
            f"{tokens / rate * 1e3:.1f} ms vs FLOP floor {floor * 1e3:.1f} ms at the measured bf16 peak "
            f"({floor / (tokens / rate):.0%} of peak in model FLOPs)",
            flush=True,
        )
    chunk = min(tokens, max(chunks))
    _, _, busy, top = count_launches(lambda: prefill_chunk(model, chunk))
    kernels = "; ".join(f"{name[:50]} x{n} {us:.0f}" for name, n, us in top[:12])
    print(f"# prefill of one {chunk}-token chunk, {busy:.1f} ms GPU busy; by kernel (launches, us): {kernels}")
    return rates


def print_table(rows: list[Row], hf: dict[tuple[int, int], HFResult], layers: int, ceil: Ceilings) -> None:
    print()
    print(ceil.line())
    print(
        "| ctx | B | experts touched per MoE layer | floor ms | roofline ms | reference ms | packed fast ms |"
        " graphs ms | graphs / floor | graphs / roofline | back to back ms (/ floor) |"
        " kernels + copies / step (per layer) | GPU busy ms | transformers ms | speedup |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        theirs = hf.get((r.ctx, r.batch))
        hf_cell = theirs.cell() if theirs is not None else "not run (no --hf)"
        speedup = f"{theirs.ms / r.graphs_ms:.1f}x" if theirs is not None and theirs.ms is not None else "-"
        print(
            f"| {r.ctx} | {r.batch} | {r.experts} | {r.floor_ms:.2f} | {r.roofline_ms:.2f} | {r.reference} | "
            f"{r.fast_ms:.2f} | {r.graphs_ms:.2f} | {r.ratio:.2f}x | {r.graphs_ms / r.roofline_ms:.2f}x | "
            f"{r.back_to_back_ms:.2f} ({r.back_to_back_ms / r.floor_ms:.2f}x) | "
            f"{r.kernels} + {r.copies} ({r.kernels / layers:.0f}) | {r.busy_ms:.2f} | {hf_cell} | {speedup} |"
        )


SPEEDUP_GOALS = {1: 15.0, 16: 10.0}  # issue 17: transformers' step / ours at B=1 and B=16 on the same proxy


def print_goals(rows: list[Row], hf: dict[tuple[int, int], HFResult]) -> None:
    """The speedup goals at every ctx where both sides were timed at that B."""
    for r in rows:
        goal, theirs = SPEEDUP_GOALS.get(r.batch), hf.get((r.ctx, r.batch))
        if goal is None or theirs is None or theirs.ms is None:
            continue
        speedup = theirs.ms / r.graphs_ms
        verdict = "met" if speedup >= goal else f"missed: ours {r.graphs_ms:.2f} ms = {r.ratio:.2f}x floor"
        print(f"# goal ctx={r.ctx} B={r.batch}: speedup {speedup:.1f}x vs >= {goal:.0f}x: {verdict}")


def main() -> None:
    from bench import bench_decode_tp

    batches, contexts = [1, 8, 64, 256], [1024, 8192, 32768]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=batches)
    parser.add_argument("--contexts", type=int, nargs="+", default=contexts)
    parser.add_argument("--layers", type=int, default=6, help="the first N layers of Inkling-Small (6 or 8)")
    parser.add_argument("--check", action="store_true", help="fast vs reference logits on the proxy first")
    parser.add_argument("--check-steps", type=int, default=16)
    parser.add_argument("--check-fp32", action="store_true", help="then repeat the check in fp32 and stop")
    parser.add_argument("--hf", action="store_true", help="also time transformers' Inkling at the same shapes")
    parser.add_argument("--hf-experts", nargs="+", choices=hf_decode.EXPERTS, default=list(hf_decode.EXPERTS),
                        help="transformers' experts implementations to time (the table takes the fastest)")  # fmt: skip
    parser.add_argument("--ref-max-batch", type=int, default=8, help="skip the reference path above this B")
    parser.add_argument("--prefill", type=int, default=8192, help="prefill this many tokens (0: skip)")
    parser.add_argument("--prefill-chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--plot", default=None, help="write the PNG (ratio vs batch, prefill vs chunk) here")
    bench_decode_tp.add_args(parser)
    args = parser.parse_args()
    if args.tensor_parallel_size > 1 or args.tiny or args.device == "cpu":
        bench_decode_tp.launch(bench_decode_tp.from_namespace(args, batches, contexts), args.json)
        return

    started = time.perf_counter()
    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    config, nvfp4 = proxy_config(args.layers), proxy_nvfp4_layers(args.layers)
    model = random_proxy(config, nvfp4)
    name = f"Small-L{args.layers}"
    print(f"# {name} built ({layer_mix(config, nvfp4)}): {torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU",
          flush=True)  # fmt: skip
    if args.check:
        engine_check(model)
        check(model, args.check_steps)
    if args.check_fp32:  # the same weights with fp32 activations: separates kernel error from bf16 chaos
        for p in model.parameters():
            p.data = p.data.float() if p.dtype == torch.bfloat16 else p.data
        check(model, args.check_steps)
        return

    reference, model = model.with_ops("reference"), model.with_ops("fast")
    rates = prefill_rates(model, args.prefill, args.prefill_chunks, ceil) if args.prefill else []
    max_model_len = max(args.contexts) + 1
    rows = []
    for ctx in args.contexts:
        for b in args.batches:
            breakdown = ctx == args.contexts[0]
            rows.append(decode_row(model, reference, b, ctx, max_model_len, ceil, args.ref_max_batch, breakdown))
            hf_decode.release()  # the row's cache and graphs
    hf = {}
    if args.hf:
        del model, reference
        hf_decode.release()
        hf = hf_decode.time_grid(proxy_raw_text(args.layers), args.batches, args.contexts, tuple(args.hf_experts))

    print(f"\n# {name}: {layer_mix(config, nvfp4)}")
    print_table(rows, hf, config.num_layers, ceil)
    print_goals(rows, hf)
    if args.plot:
        ratios = {ctx: [(r.batch, r.ratio) for r in rows if r.ctx == ctx] for ctx in args.contexts}
        write_plot(args.plot, ratios, rates, args.prefill, f"{name} on {ceil.device}")
        print(f"# plot written to {args.plot}")
    print(f"# bench_decode took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
