"""Structured outputs per decode step, as the engine pays them: `Engine.step` (scheduler, `ModelRunner`: the forward,
the logits read, `Sampler.sample`: the masks' host fill, copy, mask kernel, draw, matcher advance) on a stand-in
decoder of known cost, at batch 1 and 64, next to the decode step.

Every row holds a JSON-schema constraint over the full Inkling vocabulary (200058 logits), walked by a "random
model": the logits are random and greedy sampling picks the best allowed token, so the matchers pass through
strings, numbers, enums and object boundaries like a weak model's output would; a finished request is replaced.
Compilation (cold, then from the cache) is timed once per schema.

The stand-in forward keeps the device busy for the step's HBM floor (bench_engine's `decode_step_floor_ms`; a GPU
decode step runs at about that floor with CUDA graphs, asynchronously, so the host is free meanwhile) with a CUDA
sleep; on CPU it does nothing (a CPU forward is synchronous: nothing to hide behind). Two engines step in turn:
unconstrained rows (the baseline) and constrained rows. The engine's structured cost is (constrained step -
baseline step): what of the fill, the copies, the mask kernel and the advance the forward does not hide; its share
of the step floor is the figure (goal < 5%). The raw host fill is timed alone on the walked matcher states, with
xgrammar's thread counts side by side; (fill - structured cost) is at least what the forward hid of it. On CUDA the
copy bandwidth and bf16 matmul peak of the run are printed first.

    python -m bench.bench_structured [--batches 1 64] [--steps 50] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from bench.bench_engine import decode_step_floor_ms
from bench.floors import measure_ceilings
from common.config import ModelConfig, parse_model_config
from decode_service.chat import MESSAGE_USER
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import Request, SamplingParams
from decode_service.engine.worker.runner import WorkerRequest
from decode_service.engine.worker.sampler import Sampler
from decode_service.model.batch import ForwardBatch
from decode_service.structured.compiler import CompiledConstraint, ConstraintCompiler
from decode_service.structured.constraint import OutputConstraint
from decode_service.structured.matcher import ConstraintMatcher, fill_bitmasks, fill_threads
from tools.make_tiny_checkpoint import raw_config

CONFIG = parse_model_config(raw_config())  # the tiny text config: its vocabulary is Inkling's
VOCAB = CONFIG.text.unpadded_vocab_size  # 200058: the logits width
EOS = CONFIG.eos_token_ids
PROMPT = [MESSAGE_USER]
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["circle", "square", "triangle"]},
            "size": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        },
        "required": ["kind", "meta"],
    },
]
FILL_THREADS = (1, 2, 4, 8)  # xgrammar fill threads timed side by side (and its "auto")
VARIANTS = ("plain", "constrained")


@dataclass
class BatchRow:
    batch: int
    floor_ms: float  # the decode-step floor the share is of
    forward_ms: float  # the stand-in forward the fill hides behind (0 on CPU)
    step_ms: dict[str, float]  # median engine step of each variant
    fill_ms: float  # the host fill alone (the sampler's thread count)
    fill_by_threads: dict[str, float]

    @property
    def structured_ms(self) -> float:
        """What the engine pays per step for the constraints."""
        return max(0.0, self.step_ms["constrained"] - self.step_ms["plain"])

    @property
    def hidden_ms(self) -> float:
        """At least this much of the host fill the forward hid."""
        return max(0.0, self.fill_ms - self.structured_ms)

    @property
    def share(self) -> float:
        return self.structured_ms / self.floor_ms


def compile_times(compiler: ConstraintCompiler) -> list[tuple[float, float]]:
    out = []
    for schema in SCHEMAS:
        constraint = OutputConstraint("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        compiler.compile_sync(constraint)
        t1 = time.perf_counter()
        compiler.compile_sync(constraint)
        out.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    return out


def device_sleep(device: torch.device) -> Callable[[float], None]:
    """`sleep(ms)` keeps the device busy that long, asynchronously (nothing on CPU)."""
    if device.type != "cuda":
        return lambda ms: None
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_ms = cycles / start.elapsed_time(end)
    return lambda ms: torch.cuda._sleep(int(ms * per_ms))


class StandInDecoder:
    """The runner's model of known cost: the forward is `sleep(forward_ms)` and zeros `[T, H]`, the logits random
    scores `[N, V]` on the device."""

    def __init__(self, config: ModelConfig, device: torch.device, forward_ms: float, sleep: Callable[[float], None]):
        self.hidden, self.vocab, self.dtype = config.text.hidden_size, config.text.unpadded_vocab_size, torch.float32
        self.device, self.forward_ms, self.sleep = device, forward_ms, sleep
        self.generator = torch.Generator(device=device).manual_seed(0)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.sleep(self.forward_ms)
        return torch.zeros(batch.num_tokens, self.hidden, device=self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.randn(hidden.shape[0], self.vocab, generator=self.generator, device=self.device)


class EngineRun:
    """An engine on the stand-in decoder keeping `batch` requests running (a finished one is replaced);
    `compiled` None: unconstrained requests."""

    def __init__(self, batch: int, device: torch.device, forward_ms: float, sleep, compiled=None):
        settings = EngineSettings(
            kv_cache_bytes=64 << 20,
            max_num_seqs=batch,
            max_num_batched_tokens=max(64, batch),
            enable_prefix_cache=False,
            device=str(device),
        )
        self.engine = Engine(StandInDecoder(CONFIG, device, forward_ms, sleep), CONFIG, settings)
        self.compiled, self.added = compiled, 0
        for _ in range(batch):
            self.add()

    def add(self) -> None:
        matcher = None
        if self.compiled is not None:
            matcher = ConstraintMatcher(self.compiled[self.added % len(self.compiled)], PROMPT, EOS)
        sampling = SamplingParams(temperature=0.0, max_tokens=512)
        self.engine.add_request(Request(f"r{self.added}", list(PROMPT), sampling, constraint=matcher))
        self.added += 1

    def step(self) -> float:
        """One engine step's wall time, ms, to its sampled tokens on the host."""
        t0 = time.perf_counter()
        outputs = self.engine.step()
        elapsed = (time.perf_counter() - t0) * 1e3
        for out in outputs:
            if out.finished:
                assert out.finish_reason in ("stop", "length"), f"{out.request_id}: {out.finish_reason}"
                self.add()
        return elapsed


def fill_times(compiled: Sequence[CompiledConstraint], batch: int, steps: int, device) -> dict[str, float]:
    """The host fill alone, by thread count, on `batch` matchers walked by greedy draws over random logits."""
    scratch = torch.full((batch, -(-VOCAB // 32)), -1, dtype=torch.int32)
    variants: dict[str, Callable[[list[ConstraintMatcher], list[int]], None]] = {
        str(n): (lambda ms, rows, n=n: fill_bitmasks(ms, scratch, rows, n)) for n in FILL_THREADS
    }
    auto = xgr.BatchGrammarMatcher("auto")
    variants["auto"] = lambda ms, rows: auto.batch_fill_next_token_bitmask(
        [m.grammar_matcher for m in ms], scratch, rows
    )

    def fresh(i: int) -> WorkerRequest:
        matcher = ConstraintMatcher(compiled[i % len(compiled)], PROMPT, EOS)
        return WorkerRequest(f"r{i}", list(PROMPT), SamplingParams(temperature=0.0), constraint=matcher)

    requests, sampler = [fresh(i) for i in range(batch)], Sampler(max_rows=batch, device=device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(steps):
        matchers, rows = [r.constraint for r in requests], list(range(batch))
        for name, fill in variants.items():
            t0 = time.perf_counter()
            fill(matchers, rows)
            times[name].append((time.perf_counter() - t0) * 1e3)
        results = sampler.sample(torch.randn(batch, VOCAB, generator=gen, device=device), requests)
        requests = [
            fresh(i) if res.constraint_finished else r for i, (r, res) in enumerate(zip(requests, results, strict=True))
        ]
    return {name: statistics.median(t) for name, t in times.items()}


def run_batch(compiled, batch: int, steps: int, device: torch.device, sleep) -> BatchRow:
    floor = decode_step_floor_ms(batch)
    forward = floor if device.type == "cuda" else 0.0
    runs = {
        "plain": EngineRun(batch, device, forward, sleep),
        "constrained": EngineRun(batch, device, forward, sleep, compiled),
    }
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(max(2, steps // 10) + steps):  # first the prefills, kernel compilation, the buffers' allocation
        for name in VARIANTS:  # in turn, so drifts of clocks and load hit every variant alike
            elapsed = runs[name].step()
            if i >= max(2, steps // 10):
                times[name].append(elapsed)
    assert runs["constrained"].engine.runner.sampler.masks.masked_rows > 0, "the constrained engine masked no row"
    fills = fill_times(compiled, batch, steps, device)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return BatchRow(batch, floor, forward, medians, fills[str(fill_threads())], fills)


def main(argv: Sequence[str] | None = None) -> list[BatchRow]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        print(measure_ceilings().line())
    compiler = ConstraintCompiler(VOCAB, EOS)
    t0 = time.perf_counter()
    compiler._xgr()  # the tokenizer info: built once per process
    print(f"# device {device}; tokenizer info for {VOCAB} tokens: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    cpus = len(os.sched_getaffinity(0))
    print(f"# CPUs: os.cpu_count() {os.cpu_count()}, affinity {cpus}; the sampler fills on {fill_threads()} threads")
    print("| schema | compile ms (cold) | compile ms (cached) |")
    print("|---|---|---|")
    for i, (cold, cached) in enumerate(compile_times(compiler)):
        print(f"| {i} | {cold:.1f} | {cached:.3f} |")
    compiled = [compiler.compile_sync(OutputConstraint("json_schema", json.dumps(s))) for s in SCHEMAS]
    sleep = device_sleep(device)
    rows = [run_batch(compiled, batch, args.steps, device, sleep) for batch in args.batches]
    print()
    print(
        "| B | step floor ms | forward ms (stand-in) | host fill ms | fill hidden ms | engine step ms: plain / "
        "constrained | structured ms (not hidden) | share of floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            f"{r.floor_ms:.2f}",
            f"{r.forward_ms:.2f}",
            f"{r.fill_ms:.3f}",
            f"{r.hidden_ms:.3f}",
            " / ".join(f"{r.step_ms[name]:.3f}" for name in VARIANTS),
            f"{r.structured_ms:.3f}",
            f"{r.share:.1%}",
        ]
        print(f"| {r.batch} | " + " | ".join(cells) + " |")
    print()
    names = list(rows[0].fill_by_threads)
    print("| B | host fill ms by xgrammar threads: " + " / ".join(names) + " |")
    print("|---|---|")
    for r in rows:
        print(f"| {r.batch} | " + " / ".join(f"{r.fill_by_threads[n]:.3f}" for n in names) + " |")
    compiler.close()
    return rows


if __name__ == "__main__":
    main()
