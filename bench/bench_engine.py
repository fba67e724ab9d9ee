"""Engine control-plane benchmark: scheduling overhead per step, and prefix-cache savings on multi-turn media chats.

    python bench/bench_engine.py [--running 256] [--steps 50]
    python3 -m bench.bench_engine --gpu [--gpu-running 64 256] [--steps 50] [--modes sync async]

Part 1 runs the engine with a model whose forward costs nothing, so the measured step time is the engine's own
CPU work (scheduler, page tables, batch packing, sampling). It is printed next to the HBM-traffic floor of an
Inkling-Small decode step at the same batch size on H200 bandwidth (`decode_step_floor_ms`), since the goal is
< 5% of a GPU decode step at batch 64.
Part 2 replays a multi-turn multimodal conversation on the tiny random checkpoint and reports how many prompt
tokens the prefix cache served.
`--gpu` instead runs the whole engine on the GPU over the Small-L6 proxy (`bench/proxy.py`, CUDA graphs) at each
`--gpu-running` count of greedy decoding requests (32-token prompts, context ~100), the same engine and requests in
each of `--modes` (sync, async: `EngineSettings.async_scheduling`), twice in alternation: decode tokens/s, wall ms
per step, host ms per step (the step's wall time less the time it blocks reading sampled tokens), the steps of
each kind the engine ran, next to the step's byte floor at the copy bandwidth measured in the same run; under each
row, the ms per step spent in each of `HOST_PARTS` and in Python's garbage collections. The engine's startup heap is
frozen out of the collector as `DecodeService.start` does (`--no-gc-freeze`: as older services left it).
`--modes sync` runs on engines without async scheduling (a same-run baseline from another tree).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch

from bench.floors import expected_experts
from common.checkpoint import CheckpointFiles, load_decoder_weights
from common.config import load_model_config
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import MultimodalItem, Request, SamplingParams
from decode_service.model.batch import ForwardBatch
from decode_service.model.inkling import InklingDecoder
from tools.make_tiny_checkpoint import make_tiny_checkpoint

# Inkling-Small decode-step bytes (DESIGN.md performance model, spec inkling-text 1.6 / 6.4): 10.3 GB of bf16
# weights outside the routed experts, plus the routed experts the batch touches: 40 MoE layers of 256 experts with
# 3*H*I = 3*4096*2048 parameters each, layer 2 in bf16 (2 bytes/param), layers 3-41 in NVFP4 (0.5 byte + one e4m3
# scale per 16 = 0.5625 byte/param); KV at short context is negligible next to these. H200 copy bandwidth as
# measured in DESIGN.md.
SMALL_DENSE_BYTES = 10.3e9
SMALL_EXPERT_PARAMS = 3 * 4096 * 2048
SMALL_EXPERTS, SMALL_TOP_K = 256, 6
SMALL_EXPERT_BYTES_PER_LAYER_PARAM = 2.0 + 39 * 0.5625  # one bf16 layer + 39 NVFP4 layers
H200_BYTES_PER_S = 4.22e12


def decode_step_floor_ms(batch: int) -> float:
    """HBM-traffic floor of one Inkling-Small decode step: expected distinct experts per layer for `batch` tokens
    choosing top-6 of 256 uniformly (`expected_experts`)."""
    touched = expected_experts(SMALL_EXPERTS, SMALL_TOP_K, batch)
    expert_bytes = touched * SMALL_EXPERT_PARAMS * SMALL_EXPERT_BYTES_PER_LAYER_PARAM
    return (SMALL_DENSE_BYTES + expert_bytes) / H200_BYTES_PER_S * 1e3


class NullDecoder:
    """Does no model work: hidden and logits are zeros, so greedy always picks token 0 (not an EOS here)."""

    def __init__(self, hidden: int, vocab: int):
        self.hidden, self.vocab, self.dtype = hidden, vocab, torch.float32

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return torch.zeros(batch.num_tokens, self.hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.vocab)


class Stopwatch:
    """Accumulates the wall time spent inside wrapped callables (the data-plane parts of a step)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


# The parts of a step's wall time `--gpu` prints (column, owner of the method as a path from the engine, method):
# the runner's synchronous step ("execute", which holds the sync read of the tokens) or its launch and the read of
# the step in flight ("resolve": the read, stop checks and the tokens' bookkeeping), then nested parts: "prepare"
# and "graph step" inside the runner's, "fill" and "upload" inside "graph step". Methods a tree lacks are skipped,
# so the same table runs on older engines.
HOST_PARTS = (
    ("schedule", "scheduler", "schedule"),
    ("execute", "runner", "execute"),
    ("launch", "runner", "launch"),
    ("resolve", "", "_resolve"),
    ("commit", "scheduler", "commit"),
    ("emit", "", "_emit"),
    ("prepare", "runner", "_prepare"),
    ("graph step", "runner.decode_graphs", "_step"),
    ("fill", "runner.decode_graphs", "_fill"),
    ("upload", "runner.decode_graphs", "_upload"),
)


def time_host_parts(engine: Engine) -> dict[str, Stopwatch]:
    """Wrap each of `HOST_PARTS` the engine has, and Python's garbage collections ("gc"), in a stopwatch."""
    watches = {}
    for column, path, name in HOST_PARTS:
        owner = engine
        for attr in filter(None, path.split(".")):
            owner = getattr(owner, attr, None)
        if owner is not None and hasattr(owner, name):
            watches[column] = Stopwatch()
            setattr(owner, name, watches[column].wrap(getattr(owner, name)))
    watches["gc"] = collections = Stopwatch()
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.seconds += time.perf_counter() - started[0]

    gc.callbacks.append(on_gc)
    return watches


def scheduling_overhead(config, running: int, steps: int) -> tuple[float, float]:
    """(control-plane ms per step, whole step ms): the control plane excludes forward, logits and sampling math,
    which run on the GPU in production (argmax over a 200k vocabulary on this CPU would dominate otherwise)."""
    # Eight logit columns: greedy still picks token 0, and freeing a [B, 200058] tensor every step (an artefact of
    # a CPU null model, not engine work) stays out of the control-plane time.
    model = NullDecoder(config.text.hidden_size, 8)
    settings = EngineSettings(
        kv_cache_bytes=2 << 30, max_num_seqs=running, max_num_batched_tokens=running * 8, enable_prefix_cache=True
    )
    engine = Engine(model, config, settings)
    sampling = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(running):
        engine.add_request(Request(f"r{i}", list(range(1, 65)), sampling))
    while any(r.num_computed_tokens < 64 for r in engine.requests.values()):
        engine.step()  # finish every prefill first
    watch = Stopwatch()
    model.forward, model.logits = watch.wrap(model.forward), watch.wrap(model.logits)
    engine.runner.sampler.sample = watch.wrap(engine.runner.sampler.sample)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    return (total - watch.seconds) / steps * 1e3, total / steps * 1e3


def multi_turn_savings(checkpoint: str, turns: int) -> tuple[int, int]:
    config = load_model_config(checkpoint)
    weights, _ = load_decoder_weights(CheckpointFiles(checkpoint), config, dtype=torch.float32, device="cpu")
    model = InklingDecoder.from_weights(config.text, weights, torch.float32)
    engine = Engine(model, config, EngineSettings(kv_cache_bytes=256 << 20, page_size=16, snapshot_interval_blocks=4))
    gen = torch.Generator().manual_seed(0)
    history: list[int] = []
    items: list[MultimodalItem] = []
    prompt_total = cached_total = 0
    for turn in range(turns):
        image_rows = torch.randn(48, config.text.hidden_size, generator=gen)
        start = len(history) + 2
        history += [200000, 200005] + [config.image_token_id] * 48 + [200010]
        items.append(MultimodalItem(bytes([turn]) * 32, start, image_rows))
        history += [200000, 200004] + torch.randint(0, 199_000, (40,), generator=gen).tolist() + [200010]
        request = Request(
            f"turn{turn}", list(history), SamplingParams(temperature=0.0, max_tokens=8), mm_items=tuple(items)
        )
        (out,) = engine.generate([request])
        prompt_total += out.num_prompt_tokens
        cached_total += out.num_cached_tokens
        history += out.token_ids
    return prompt_total, cached_total


def engine_throughput(
    running_counts: list[int], steps: int, modes: list[str], gc_freeze: bool = True, layers: int = 6
) -> None:
    """`--gpu`: decode steps of the whole engine on the proxy, per running count and mode (module docstring)."""
    import dataclasses

    from bench.floors import measure_ceilings
    from bench.proxy import (
        layer_mix,
        paged_decode_batch,
        proxy_config,
        proxy_nvfp4_layers,
        proxy_shapes,
        random_proxy,
        step_bytes,
        touched_experts,
    )
    from common.config import parse_model_config
    from tools.make_tiny_checkpoint import raw_config

    ceil = measure_ceilings()
    print(ceil.line(), flush=True)
    config, nvfp4 = proxy_config(layers), proxy_nvfp4_layers(layers)
    model = random_proxy(config, nvfp4).with_ops("fast")
    model_config = parse_model_config(raw_config(**proxy_shapes(layers)))
    n = max(running_counts)
    settings = EngineSettings(kv_cache_bytes=4 << 30, max_num_seqs=n, max_num_batched_tokens=4096, max_model_len=2048,
                              device="cuda")  # fmt: skip
    started = time.perf_counter()
    engine = Engine(model, model_config, settings)
    if gc_freeze:
        gc.freeze()  # as DecodeService.start does once its engine is up
    print(f"# Small-L{layers} ({layer_mix(config, nvfp4)}): engine up in {time.perf_counter() - started:.1f} s "
          f"(graphs of buckets {engine.runner.decode_graphs.buckets})", flush=True)  # fmt: skip
    blocked = Stopwatch()  # the host waiting for the tokens: the async read, the sync path's .tolist()
    runner = engine.runner
    for name in ("collect", "_greedy_samples"):
        if hasattr(runner, name):
            setattr(runner, name, blocked.wrap(getattr(runner, name)))
    parts = time_host_parts(engine)
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    print("| running | mode | tokens/s | step ms | host ms/step | floor ms (ctx) | step/floor | steps sync/async |")
    print("|---|---|---|---|---|---|---|---|")
    for running in running_counts:
        ids = [f"b{running}-{i}" for i in range(running)]
        for rid in ids:
            engine.add_request(Request(rid, torch.randint(10, 200000, (32,), generator=gen).tolist(), sampling))
        while any(r.num_computed_tokens < 32 for r in engine.requests.values()):
            engine.step()
        for _ in range(3):
            engine.step()  # every sequence decoding
        ctx = max(r.num_tokens for r in engine.requests.values()) + 2 * steps
        fb, graphs, _ = paged_decode_batch(model, running, ctx, ctx + 1)
        floor = ceil.floor_us(step_bytes(model, running, ctx, touched_experts(model, fb))) / 1e3
        del fb, graphs
        for mode in modes * 2:
            if mode == "async":
                engine.settings = dataclasses.replace(settings, async_scheduling=True)
            elif hasattr(settings, "async_scheduling"):
                engine.settings = dataclasses.replace(settings, async_scheduling=False)
            for _ in range(3):
                engine.step()
            counts = dict(getattr(engine, "num_steps", {}))
            torch.cuda.synchronize()
            blocked.seconds, tokens = 0.0, 0
            for watch in parts.values():
                watch.seconds = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                tokens += sum(len(o.new_token_ids) for o in engine.step())
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            after = getattr(engine, "num_steps", {})
            kinds = "/".join(str(after.get(k, 0) - counts.get(k, 0)) for k in ("sync", "async")) if after else "-"
            step_ms, host_ms = wall / steps * 1e3, (wall - blocked.seconds) / steps * 1e3
            print(f"| {running} | {mode} | {tokens / wall:.0f} | {step_ms:.3f} | {host_ms:.3f} | {floor:.3f} ({ctx}) | "
                  f"{step_ms / floor:.2f} | {kinds} |", flush=True)  # fmt: skip
            by_part = ", ".join(f"{k} {w.seconds / steps * 1e3:.3f}" for k, w in parts.items())
            print(f"#   ms/step by part: read {blocked.seconds / steps * 1e3:.3f}, {by_part}", flush=True)
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished:
            engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--gpu", action="store_true", help="the engine on the GPU over the Small-L6 proxy instead")
    parser.add_argument("--gpu-running", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--modes", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    parser.add_argument("--no-gc-freeze", action="store_true", help="--gpu: leave the startup heap to the collector")
    args = parser.parse_args()
    if args.gpu:
        engine_throughput(args.gpu_running, args.steps, args.modes, gc_freeze=not args.no_gc_freeze)
        return
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(tmp, nvfp4=True, seed=0)
        config = load_model_config(tmp)
        print(
            "| running requests | control plane ms/step | whole step ms (CPU, null model) | "
            "Inkling-Small decode-step floor ms (H200) | control/floor |"
        )
        print("|---|---|---|---|---|")
        for running in sorted({1, 64, args.running}):
            control_ms, step_ms = scheduling_overhead(config, running, args.steps)
            floor = decode_step_floor_ms(running)
            print(f"| {running} | {control_ms:.2f} | {step_ms:.2f} | {floor:.2f} | {control_ms / floor:.1%} |")
        prompt, cached = multi_turn_savings(tmp, args.turns)
        print()
        print("| turns | prompt tokens | served by prefix cache | hit rate |")
        print("|---|---|---|---|")
        print(f"| {args.turns} | {prompt} | {cached} | {cached / prompt:.1%} |")


if __name__ == "__main__":
    main()
