"""MTP speculation: verify-step and draft-chain cost, then tokens/s per sequence with vLLM's published acceptance.

Model: on CUDA the "Small-L6" proxy of `bench.proxy` (its builder, exact Inkling-Small layer shapes over
6 layers, full 201024 vocabulary) plus 8 MTP depths of real shape (H=4096, one decoder layer each with the dense
MLP of I=16384, depths 1 and 3 global, the others sliding, spec 1.5), random weights; on `--device cpu` the
make-tiny shapes, so the whole run takes seconds (for CI, not for figures).

For each B (default 1/8/64) at context `--ctx`:
- plain step: the trunk forward of B sequences with 1 new token each through the engine's paged KV cache, plus
  the lm_head of the B rows; verify step: the same with D+1 tokens per sequence (the bonus token and D drafts)
  and the lm_head of all B(D+1) rows, on CUDA replayed from the engine's verify CUDA graph (`DecodeGraphs` of
  width D+1) followed by its conv commit, on the CPU the packed path, eager; on CUDA both steps as the engine
  runs greedy rows: the lm_head and argmax replayed from the head graph and the B(D+1) token ids read;
- draft chain: depth 0..D-1 each over `r` rows per sequence (the rows the round verified: 1 + the expected
  accepted drafts, rounded) and its draft logits for the B last rows, through the shared lm_head or its FP8 copy
  (`--draft-head`). Timed twice: as the engine runs it when the trunk has the paged decode kernels
  (`PagedMTPSpeculator` over the depths' paged pools: per depth the verified and the provisional rows as one
  multi-row paged step, then its draft, the whole round replayed from the chain's CUDA graph for B's bucket, D and
  r; "from its CUDA graph", the figure used below) and the old way (per-request contiguous caches, each depth's rows
  one eager packed forward: "eager per request");
- a synthetic acceptor: per sequence and round one uniform u accepts draft k iff u < rate_k, with vLLM's
  published cumulative per-position rates for Inkling (GSM8K, concurrency 64, greedy: 75.7 / 60.1 / 49.8 / 41.1 /
  35.4 / 29.8 / 26.1 / 22.3 %), so a round emits 1 + accepted tokens and costs verify(D) + chain(D);
  tokens/s per sequence = mean tokens per round / round time, vs 1 / plain step without speculation (on CUDA
  the plain step replayed from the engine's decode CUDA graph, which is what the engine runs without drafts;
  the verify step and the chain replayed from their CUDA graphs, as in the engine).
The one-token byte floor (`bench.proxy.step_bytes`: every non-routed weight once, the routed experts the plain
step touches, K/V and conv state, fp32 logits, over the copy bandwidth measured in the same run) is printed next
to the per-token time: speculation is how the per-token time goes below it.

Floors of a round (`bench.proxy`, over the copy bandwidth; "roofline": per op the larger of its bytes over it and
its FLOPs over the bf16 matmul peak, both measured in the run), one line per (B, D) after the measured one:
- verify byte floor: `step_bytes` at width D+1: every non-routed weight once, the routed experts the verify
  batch's own routing touches (B(D+1) rows), each sequence's K/V history read once (its D+1 rows share it) and
  the new rows' K/V written, conv states, the fp32 logits of all B(D+1) rows;
- draft chain byte floor: `chain_ops`: per depth j < D its own weights once, its K/V over the rows a round gives
  it (the verified rows and j provisional ones), one read of the head the drafts use for B rows (the bf16 lm_head,
  or its FP8 copy where the drafter uses it: `--draft-head fp8`, up to 2 rows);
- round byte floor = verify + chain; per token = round floor / tokens per round (the simulated acceptance);
  "speedup at floors" = the baseline as measured (the plain step) / the per-token floor: the most speculation can
  give against today's plain step if the verify step and the chain ran at their byte floors ("at rooflines" the
  same over the rooflines); "plain floor over it": the one-token byte floor / the per-token floor, what it gives
  against a plain step at its own floor; the measured verify step and chain over their byte floors;
- at B in `GOALS` (issue 16: >= 1.5x at B=1, >= 2x at B=64): the round time the goal allows at this D and its
  ratio to the round's byte floor, i.e. how close to the floor the verify step and chain must run together.

What the proxy's lm_head share does: the proxy has 6 of Inkling-Small's 42 layers but its whole lm_head (201024 x
4096 bf16, 1.6 GB), so the lm_head is a far larger share of a proxy step than of a full-depth one. Every depth of
the draft chain re-reads it, so the chain costs much more relative to a proxy step than to a full step: the
proxy understates the speedup, most at B=1 where the step is pure weight reads (at full depth the trunk step is
about 7x the proxy's non-lm_head bytes while each depth's cost stays the same). The verify step re-reads the
lm_head once either way. The measured figures are therefore a lower bound for the full model at the same
acceptance. What full depth would give is printed as an estimate ("at 42 layers"): the lm_head is timed alone over
the plain and the verify rows, the rest of each trunk step is scaled by 42 / 6 and the draft chain kept as measured
(first order: the proxy's layer mix, 5 sliding / 1 global and 3 of 6 NVFP4, stands for the full 35 / 7 split).
That scales layer 2's bf16 experts (one of 40 MoE layers in the model, a third of the proxy's expert bytes) and
the two dense layers with the rest, so it understates what full depth gives. `--deep-layers N` (N > 6) measures
instead: it also builds the first N layers of Inkling-Small (layers 6..N-1: NVFP4 experts, every 6th global, the mix
of the model's remaining layers) and times their plain and verify steps the same way; "from the N-layer proxy" is
then each step at 6 layers plus (42 - 6) / (N - 6) times what layers 6..N-1 add, the draft chain as measured.
Acceptance itself is not measured (random weights), only assumed. `--full-floors` prints, without a GPU, what the
whole model's byte floors allow (`full_depth_floors`).

    python3 -m bench.bench_mtp [--device cuda|cpu] [--batches 1 8 64] [--ctx 1024] [--depths 1 2 ... 8]
        [--draft-head bf16|fp8] [--skip-eager-chain] [--host-only] [--breakdown] [--deep-layers N] [--full-floors]

`--breakdown` (CUDA) also prints one verify step's and one chain round's GPU time by kernel (the torch profiler's
CUDA events of a call, as bench_decode's breakdown). `--host-only` times only the host side of a chain round
(`host_only`: the drafter's forward and the round's device work stubbed out, the make-tiny drafter, on either
device) for each batch and depth, and nothing else.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bench.floors import Ceilings, count_launches, expected_experts, measure_ceilings, time_host_ms, time_ms
from bench.mtp_models import FULL_LAYERS, PROXY_LAYERS, build, build_trunk, full_model, model_config, random_drafter
from bench.mtp_steps import DraftChain, GraphedChain, graph_step, host_before_replay_ms, paged_batch, trunk_step
from bench.proxy import (
    chain_ops,
    paged_decode_batch,
    random_proxy,
    roofline_us,
    step_bytes,
    step_ops,
    touched_experts,
)
from common.settings import MTP_DRAFT_HEADS
from decode_service.model import fast_path
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter

# vLLM, Inkling, GSM8K, concurrency 64, greedy: cumulative acceptance of draft position k = 1..8.
VLLM_RATES = (0.757, 0.601, 0.498, 0.411, 0.354, 0.298, 0.261, 0.223)
NOMINAL_GBS = 4200.0  # H200 copy bandwidth as measured in these runs, for `--full-floors`' times (not its ratios)
GOALS = {1: 1.5, 64: 2.0}  # issue 16: tokens/s per sequence vs no speculation at these B, best D


def ceilings(device: str) -> Ceilings:
    """Copy bandwidth and bf16 matmul peak measured here: `bench.floors.measure_ceilings` on CUDA; on the CPU a
    64 MiB copy and a 256^3 bf16 matmul (CI figures, not the machine's)."""
    if device == "cuda":
        ceil = measure_ceilings()
    else:
        n, m = 64 << 20, 256
        src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        a = torch.randn(m, m, dtype=torch.bfloat16)
        gbs = 2 * n / (time_host_ms(lambda: dst.copy_(src), reps=5) * 1e-3) / 1e9
        tflops = 2 * m**3 / (time_host_ms(lambda: a @ a, reps=5) * 1e-3) / 1e12
        ceil = Ceilings(copy_gbs=gbs, bf16_tflops=tflops, device="cpu")
    print(ceil.line(), flush=True)
    return ceil


def full_depth_floors(
    batches: Sequence[int], ctx: int, depths: Sequence[int], head: str, gbs: float = NOMINAL_GBS
) -> dict[tuple[int, int], float]:
    """`--full-floors`: the byte floors of the whole model, no GPU: Inkling-Small's 42 layers and 8 MTP depths built
    on the meta device, the routed experts a step touches as uniform routing's expected count (`expected_experts`
    per MoE layer), the draft head `head`; per B the plain step's floor, per D the verify step's
    and the chain's (`step_bytes`, `chain_ops`: the round's floors as `round_floors` counts them) and "speedup at
    floors" = plain floor x tokens per round (vLLM's rates, expected) / round floor: the most speculation can give
    when every step runs at its floor. Times at `gbs` GB/s; the ratio does not depend on it. -> {(B, D): ratio}."""
    trunk, drafter = full_model(max(depths), head)
    config = trunk.config
    moe = [i for i, layer in enumerate(trunk.layers) if hasattr(layer.mlp, "experts")]
    e, k = config.n_routed_experts, config.num_experts_per_tok

    def ms(ops_or_bytes) -> float:
        return ops_or_bytes / (gbs * 1e9) * 1e3

    def touched(rows: int) -> dict[int, int]:
        return dict.fromkeys(moe, round(expected_experts(e, k, rows)))

    results = {}
    for b in batches:
        plain = ms(step_bytes(trunk, b, ctx, touched(b)))
        parts = []
        for d in depths:
            rows = 1 + round(expected_accepted(d))
            verify = ms(step_bytes(trunk, b, ctx, touched(b * (d + 1)), d + 1))
            chain = ms(sum(n for n, _ in chain_ops(drafter, b, ctx, rows, d)))
            tokens = 1 + expected_accepted(d)
            results[b, d] = ratio = plain * tokens / (verify + chain)
            parts.append(f"D={d} verify {verify:.3f} + chain {chain:.3f} ms, {tokens:.2f} tokens/round: {ratio:.2f}x")
        best = max(depths, key=lambda d: results[b, d])
        print(
            f"# full depth ({FULL_LAYERS} layers, {head} draft head, byte floors at {gbs:.0f} GB/s, ctx {ctx}): B={b} "
            f"plain {plain:.3f} ms; " + "; ".join(parts) + f"; best D={best}, {results[b, best]:.2f}x at floors",
            flush=True,
        )
    return results


def host_only(device: str, batches: Sequence[int], ctx: int, depths: Sequence[int], reps: int) -> dict:
    """`--host-only`: the host time of one chain round (the inputs as the runner hands them over, then `extend`) with
    the drafter's forward and the round's device work stubbed out (the drafter returns its input rows, the round's
    step leaves the drafts as they are), eagerly on the static buffers: what the speculator's Python and
    numpy cost per round, without a GPU (`--device cpu`) or beside one. The make-tiny drafter (the host work does
    not depend on the layer shapes). -> {(B, D): median ms}."""
    if min(depths) < 1 or ctx < 1 or min(batches) < 1:
        raise ValueError(f"--host-only: expected depths, ctx and batches >= 1, got {depths}, {ctx}, {batches}")
    parsed = model_config(max(depths), small=False)
    assert parsed.mtp is not None
    drafter = random_drafter(parsed.mtp, random_proxy(parsed.text, frozenset(), device))
    drafter.forward = lambda depth, hidden, batch: hidden  # rows in, rows out: only the host work is left
    results = {}
    for b in batches:
        growth = 4 * (reps + 4) * sum(1 + round(expected_accepted(d)) for d in depths)
        chain = GraphedChain(drafter, b, ctx, growth, use_graphs=False)
        chain.graphs._forward = lambda *args: None
        for d in depths:
            rows = 1 + round(expected_accepted(d))
            results[b, d] = ms = time_host_ms(chain.step(d, rows), reps=reps, warmup=3)
            print(f"# host only: B={b} D={d} ({rows} rows/seq) {ms:.3f} ms per round (inputs + extend)", flush=True)
    return results


def step_ms(model: InklingDecoder, batch: int, ctx: int, width: int, device: str, reps: int) -> float:
    """A plain (`width` 1) or verify step of B sequences at `ctx` as the run times the trunk's: on CUDA from the
    engine's graphs (`plain_graph_ms`, `graph_step`), on the CPU the packed path, eager."""
    if device != "cuda":
        return time_ms(trunk_step(model, paged_batch(model, batch, ctx, width)), device, reps)
    if width == 1:
        return plain_graph_ms(model, batch, ctx, reps)
    return time_ms(graph_step(model, batch, ctx, width), "cuda", reps, warmup=3)


def plain_graph_ms(model: InklingDecoder, batch: int, ctx: int, reps: int) -> float:
    """The engine's plain greedy decode step for B sequences at `ctx` (`DecodeGraphs` replay, then the lm_head and
    argmax from the head graph and the B token ids read), as in `bench.bench_decode`."""
    fb, graphs, handles = paged_decode_batch(model, batch, ctx, ctx + 1)
    tokens = fb.token_ids.tolist()

    def step() -> list[int]:
        with torch.inference_mode():
            return graphs.greedy_tokens(graphs.run(tokens, handles)).tolist()

    return time_ms(step, "cuda", reps, warmup=3)  # the first run captures B's graph


def print_breakdown(label: str, fn: Callable[[], object], top: int = 14) -> None:
    """`--breakdown`: the GPU time of one call of `fn` (a verify step or a chain round, graphs already captured) by
    kernel, as bench_decode prints a step's."""
    kernels, copies, busy_ms, by_name = count_launches(fn)
    names = "; ".join(f"{name[:60]} x{n} {us:.0f}" for name, n, us in by_name[:top])
    print(f"# {label}: {busy_ms * 1e3:.0f} us GPU busy, {kernels} kernels + {copies} copies; by kernel "
          f"(launches, us): {names}", flush=True)  # fmt: skip


def expected_accepted(depth: int, rates: Sequence[float] = VLLM_RATES) -> float:
    return sum(rates[:depth])


def simulate_accepted(depth: int, sequences: int, rounds: int, seed: int = 0) -> float:
    """Mean accepted drafts per round of the synthetic acceptor: one uniform u per sequence and round accepts draft
    k iff u < rate_k (the rates are cumulative, so the accepted run is a prefix)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(rounds, sequences, 1, generator=gen)
    rates = torch.tensor(VLLM_RATES[:depth])
    return float((u < rates).sum(-1).float().mean())


@dataclass
class Row:
    batch: int
    depth: int
    verify_ms: float
    chain_ms: float
    rows: int
    tokens_per_round: float
    plain_ms: float  # the packed path, eager
    floor_ms: float  # one-token byte floor: the plain step's `step_bytes`
    verify_floor_ms: float  # the verify step's byte floor: `step_bytes` at width D+1
    chain_floor_ms: float  # the draft chain's byte floor: `chain_ops`
    verify_roofline_ms: float  # the same two, per op the larger of bytes and FLOPs at the bf16 peak
    chain_roofline_ms: float
    plain_graph_ms: float | None = None  # CUDA: the engine's plain decode step replayed from its CUDA graph
    lm_plain_ms: float = 0.0  # the lm_head alone over the plain step's B rows
    lm_verify_ms: float = 0.0  # ... over the verify step's B(D+1) rows
    chain_graph_ms: float | None = None  # the chain as the engine runs it (paged pools, CUDA graph); None: eager
    pre_replay_ms: float | None = None  # its host time from the call to the graph replay (CUDA)
    deep_layers: int = 0  # `--deep-layers`: the deeper proxy's layers (0: not run)
    deep_plain_ms: float | None = None  # its plain step, timed as `baseline_ms`
    deep_verify_ms: float | None = None  # its verify step, timed as `verify_ms`

    @property
    def draft_ms(self) -> float:
        """The chain as the engine runs it: from its CUDA graph when measured, else the eager one."""
        return self.chain_graph_ms if self.chain_graph_ms is not None else self.chain_ms

    @property
    def round_ms(self) -> float:
        return self.verify_ms + self.draft_ms

    @property
    def per_token_ms(self) -> float:
        return self.round_ms / self.tokens_per_round

    @property
    def baseline_ms(self) -> float:
        """Non-speculative time per token: what the engine runs without drafts (graph replay on CUDA)."""
        return self.plain_graph_ms if self.plain_graph_ms is not None else self.plain_ms

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.per_token_ms

    @property
    def round_floor_ms(self) -> float:
        """A round's byte floor: the verify step's plus the draft chain's."""
        return self.verify_floor_ms + self.chain_floor_ms

    @property
    def round_roofline_ms(self) -> float:
        return self.verify_roofline_ms + self.chain_roofline_ms

    @property
    def per_token_floor_ms(self) -> float:
        return self.round_floor_ms / self.tokens_per_round

    @property
    def floor_speedup(self) -> float:
        """Speedup at floors: the baseline as measured over the per-token byte floor, the speedup if the verify
        step and the chain ran at their byte floors and the plain step stayed as it is."""
        return self.baseline_ms / self.per_token_floor_ms

    @property
    def floor_to_floor(self) -> float:
        """The one-token byte floor over the per-token floor: the speedup if the plain step ran at its floor too."""
        return self.floor_ms / self.per_token_floor_ms

    @property
    def roofline_speedup(self) -> float:
        return self.baseline_ms * self.tokens_per_round / self.round_roofline_ms

    @property
    def verify_over_floor(self) -> float:
        return self.verify_ms / self.verify_floor_ms

    @property
    def chain_over_floor(self) -> float:
        """The chain as the engine runs it over its byte floor."""
        return self.draft_ms / self.chain_floor_ms

    def round_budget_ms(self, goal: float) -> float:
        """The round time at which tokens/s per sequence is `goal` x the baseline's, the acceptance as simulated."""
        return self.baseline_ms * self.tokens_per_round / goal

    def full_depth_speedup(self, layer_scale: float) -> float:
        """The speedup with the trunk's layer time (step minus lm_head) scaled by `layer_scale` (full / proxy
        layers) and the lm_head and the draft chain as measured: a first-order estimate of full depth."""
        baseline = self.lm_plain_ms + (self.baseline_ms - self.lm_plain_ms) * layer_scale
        verify = self.lm_verify_ms + (self.verify_ms - self.lm_verify_ms) * layer_scale
        return baseline / ((verify + self.draft_ms) / self.tokens_per_round)

    def marginal_speedup(self, full_layers: int, layers: int = PROXY_LAYERS) -> float | None:
        """The speedup at `full_layers` from the deeper proxy: each step at the proxy's `layers` plus
        (full - layers) / (deep - layers) times what the deeper proxy's extra layers add, the draft chain as
        measured. None: no deeper proxy timed."""
        if self.deep_plain_ms is None or self.deep_verify_ms is None:
            return None
        k = (full_layers - layers) / (self.deep_layers - layers)
        baseline = self.baseline_ms + k * (self.deep_plain_ms - self.baseline_ms)
        verify = self.verify_ms + k * (self.deep_verify_ms - self.verify_ms)
        return baseline / ((verify + self.draft_ms) / self.tokens_per_round)


def round_floors(
    trunk: InklingDecoder, drafter: MTPDrafter, batch: int, ctx: int, depth: int, rows: int, ceil: Ceilings
) -> tuple[float, float, float, float]:
    """(verify byte floor, chain byte floor, verify roofline, chain roofline) in ms of a round of B sequences at
    `ctx` with D drafts: `step_ops` at width D+1 with the routed experts the verify batch's own routing touches,
    `chain_ops` for `rows` verified rows per sequence."""
    verify_fb = paged_batch(trunk, batch, ctx, depth + 1)
    verify = step_ops(trunk, batch, ctx, touched_experts(trunk, verify_fb), depth + 1)
    chain = chain_ops(drafter, batch, ctx, rows, depth)
    return (
        ceil.floor_us(sum(n for n, _ in verify)) / 1e3,
        ceil.floor_us(sum(n for n, _ in chain)) / 1e3,
        roofline_us(verify, ceil) / 1e3,
        roofline_us(chain, ceil) / 1e3,
    )


def lm_head_ms(model: InklingDecoder, rows: int, device: str, reps: int) -> float:
    hidden = torch.randn(rows, model.config.hidden_size, device=model.embed.weight.device, dtype=model.dtype)

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model.logits(hidden)

    return time_ms(run, device, reps)


def run(
    device: str,
    batches: Sequence[int],
    ctx: int,
    depths: Sequence[int],
    reps: int,
    rounds: int,
    full_layers: int = FULL_LAYERS,
    head: str = "bf16",
    eager_chain: bool = True,
    breakdown: bool = False,
    deep_layers: int = 0,
) -> list[Row]:
    if not depths or min(depths) < 1 or max(depths) > len(VLLM_RATES):
        raise ValueError(f"--depths: expected values in 1..{len(VLLM_RATES)}, got {list(depths)}")
    if ctx < 1:
        raise ValueError(f"--ctx: expected >= 1, got {ctx}")
    if deep_layers and not PROXY_LAYERS < deep_layers < full_layers:
        raise ValueError(f"--deep-layers: expected {PROXY_LAYERS} < N < {full_layers}, got {deep_layers}")
    ceil = ceilings(device)
    trunk, drafter = build(device, max(depths), head)
    deep = build_trunk(device, deep_layers)[0] if deep_layers else None
    print(f"# draft head: {head}", flush=True)
    layer_scale = full_layers / trunk.config.num_layers
    results = []
    for b in batches:
        if b < 1:
            raise ValueError(f"--batches: expected values >= 1, got {b}")
        plain_fb = paged_batch(trunk, b, ctx, 1)
        plain = time_ms(trunk_step(trunk, plain_fb), device, reps)
        floor = ceil.floor_us(step_bytes(trunk, b, ctx, touched_experts(trunk, plain_fb))) / 1e3
        graphed = plain_graph_ms(trunk, b, ctx, reps) if device == "cuda" else None
        deep_plain = step_ms(deep, b, ctx, 1, device, reps) if deep is not None else None
        lm_plain = lm_head_ms(trunk, b, device, reps)
        chain = DraftChain(drafter, b, ctx) if eager_chain else None
        growth = 4 * (reps + 4) * sum(1 + round(expected_accepted(d)) for d in depths)
        graphed_chain = GraphedChain(drafter, b, ctx, growth) if fast_path.supports_batched_decode(trunk) else None
        graph_text = f", from its CUDA graph {graphed:.3f} ms (the baseline below)" if graphed is not None else ""
        verify_how = "from its CUDA graph, with the conv commit" if device == "cuda" else "eager (packed path)"
        print(
            f"# B={b} ctx={ctx}: plain step {plain:.3f} ms eager{graph_text}, of which lm_head {lm_plain:.3f} ms; "
            f"one-token byte floor {floor:.3f} ms",
            flush=True,
        )
        for d in depths:
            if device == "cuda":
                verify_step = graph_step(trunk, b, ctx, d + 1)
                verify = time_ms(verify_step, "cuda", reps, warmup=3)
            else:
                verify = time_ms(trunk_step(trunk, paged_batch(trunk, b, ctx, d + 1)), device, reps)
            rows = 1 + round(expected_accepted(d))
            chain_ms = time_ms(chain.step(d, rows), device, reps) if chain is not None else math.nan
            chain_graph = time_ms(graphed_chain.step(d, rows), device, reps) if graphed_chain is not None else None
            graphed_round = graphed_chain is not None and device == "cuda"
            pre = host_before_replay_ms(graphed_chain.step(d, rows), reps) if graphed_round else None
            tokens = 1.0 + simulate_accepted(d, b, rounds)
            lm_verify = lm_head_ms(trunk, b * (d + 1), device, reps)
            deep_verify = step_ms(deep, b, ctx, d + 1, device, reps) if deep is not None else None
            verify_floor, chain_floor, verify_roof, chain_roof = round_floors(trunk, drafter, b, ctx, d, rows, ceil)
            row = Row(
                batch=b, depth=d, verify_ms=verify, chain_ms=chain_ms, rows=rows, tokens_per_round=tokens,
                plain_ms=plain, floor_ms=floor, verify_floor_ms=verify_floor, chain_floor_ms=chain_floor,
                verify_roofline_ms=verify_roof, chain_roofline_ms=chain_roof, plain_graph_ms=graphed,
                lm_plain_ms=lm_plain, lm_verify_ms=lm_verify, chain_graph_ms=chain_graph, pre_replay_ms=pre,
                deep_layers=deep_layers, deep_plain_ms=deep_plain, deep_verify_ms=deep_verify,
            )  # fmt: skip
            results.append(row)
            eager_text = f" (eager per request {chain_ms:.3f} ms)" if chain is not None else ""
            chain_text = (
                f"draft chain {chain_graph:.3f} ms from its CUDA graph{eager_text}"
                + (f", host {pre:.3f} ms before the replay" if pre is not None else "")
                if chain_graph is not None
                else f"draft chain {chain_ms:.3f} ms eager"
            )
            print(
                f"# B={b} D={d}: verify {verify:.3f} ms {verify_how} ({verify / row.baseline_ms:.2f}x the plain step), "
                f"{chain_text} "
                f"({rows} rows/seq), {tokens:.2f} tokens/round (expected {1 + expected_accepted(d):.2f}); "
                f"{1e3 / row.per_token_ms:.0f} tokens/s per sequence = {row.speedup:.2f}x no speculation "
                f"({1e3 / row.baseline_ms:.0f}); "
                f"per-token {row.per_token_ms:.3f} ms vs floor {floor:.3f} ms ({row.per_token_ms / floor:.2f}x); "
                f"at {full_layers} layers ~{row.full_depth_speedup(layer_scale):.2f}x"
                + (
                    f" (from the {deep_layers}-layer proxy, plain {deep_plain:.3f} ms, verify {deep_verify:.3f} ms: "
                    f"~{row.marginal_speedup(full_layers):.2f}x)"
                    if deep is not None
                    else ""
                ),
                flush=True,
            )
            if breakdown:
                print_breakdown(f"B={b} D={d} verify", verify_step)
                if graphed_chain is not None:
                    print_breakdown(f"B={b} D={d} chain ({rows} rows/seq)", graphed_chain.step(d, rows))
            budget = row.round_budget_ms(GOALS[b]) if b in GOALS else None
            goal = (
                f"; goal {GOALS[b]}x: round <= {budget:.3f} ms = {budget / row.round_floor_ms:.2f}x its byte floor"
                if budget is not None
                else ""
            )
            print(
                f"# B={b} D={d} floors: verify byte floor {verify_floor:.3f} ms, roofline {verify_roof:.3f} "
                f"(verify {row.verify_over_floor:.2f}x the byte floor); draft chain byte floor {chain_floor:.3f} ms, "
                f"roofline {chain_roof:.3f} (chain {row.chain_over_floor:.2f}x); round byte floor "
                f"{row.round_floor_ms:.3f} ms (round {row.round_ms / row.round_floor_ms:.2f}x), per token "
                f"{row.per_token_floor_ms:.3f} ms; speedup at floors {row.floor_speedup:.2f}x, at rooflines "
                f"{row.roofline_speedup:.2f}x (the baseline as measured), plain floor over it "
                f"{row.floor_to_floor:.2f}x{goal}",
                flush=True,
            )
        best = max((r for r in results if r.batch == b), key=lambda r: r.speedup)
        full = max((r for r in results if r.batch == b), key=lambda r: r.full_depth_speedup(layer_scale))
        bound = max((r for r in results if r.batch == b), key=lambda r: r.floor_speedup)
        print(
            f"# B={b}: best D={best.depth}, {best.speedup:.2f}x tokens/s per sequence; at {full_layers} layers "
            f"best D={full.depth}, ~{full.full_depth_speedup(layer_scale):.2f}x; at floors best D={bound.depth}, "
            f"{bound.floor_speedup:.2f}x",
            flush=True,
        )
        if deep is not None:
            deepest = max((r for r in results if r.batch == b), key=lambda r: r.marginal_speedup(full_layers) or 0)
            print(
                f"# B={b}: at {full_layers} layers from the {deep_layers}-layer proxy best D={deepest.depth}, "
                f"~{deepest.marginal_speedup(full_layers):.2f}x",
                flush=True,
            )
        del plain_fb, chain, graphed_chain
    return results


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--ctx", type=int, default=1024, help="committed tokens per sequence")
    parser.add_argument("--depths", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--reps", type=int, default=20, help="timed calls per figure (median)")
    parser.add_argument("--rounds", type=int, default=2000, help="synthetic acceptor rounds per (B, D)")
    parser.add_argument("--full-layers", type=int, default=FULL_LAYERS, help="trunk depth of the full-depth estimate")
    parser.add_argument("--draft-head", choices=MTP_DRAFT_HEADS, default="bf16", help="the drafter's lm_head")
    parser.add_argument(
        "--skip-eager-chain", action="store_true", help="time the chain only as the engine runs it (CUDA graphs)"
    )
    parser.add_argument(
        "--host-only", action="store_true", help="time only the chain round's host work (forward stubbed), then exit"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="also the verify step's and the chain round's GPU time by kernel"
    )
    parser.add_argument(
        "--deep-layers", type=int, default=0, help="also time the first N layers' steps for the full-depth estimate"
    )
    parser.add_argument(
        "--full-floors", action="store_true", help="only the whole model's byte floors per B and D (no GPU), then exit"
    )
    args = parser.parse_args(argv)
    if args.host_only:
        host_only(args.device, args.batches, args.ctx, args.depths, args.reps)
        return []
    if args.full_floors:
        full_depth_floors(args.batches, args.ctx, args.depths, args.draft_head)
        return []
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu for the tiny shapes)")
    if args.device != "cuda" and (args.skip_eager_chain or args.breakdown):
        raise SystemExit("--skip-eager-chain, --breakdown: the CPU run has only the eager chain and no GPU kernels")
    return run(
        args.device, args.batches, args.ctx, args.depths, args.reps, args.rounds, args.full_layers, args.draft_head,
        not args.skip_eager_chain, args.breakdown, args.deep_layers,
    )  # fmt: skip


if __name__ == "__main__":
    main()
