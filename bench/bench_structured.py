"""Structured outputs per decode step, as the engine pays them: the runner's order of a step (the sampler's
`prefill_masks` before the forward, the forward, `Sampler.sample`: join, copy, mask kernel, draw, matcher
advance), at batch 1 and 64, next to the decode step.

Every row holds a JSON-schema constraint over the full Inkling vocabulary (200058 logits), walked by a "random
model": the logits are random and greedy sampling picks the best allowed token, so the matchers pass through
strings, numbers, enums and object boundaries like a weak model's output would; a finished matcher restarts.
Compilation (cold, then from the cache) is timed once per schema.

The forward is a stand-in of known length: on CUDA a device sleep of the step's HBM floor (bench_engine's
`decode_step_floor_ms`; a GPU decode step runs at about that floor with CUDA graphs, asynchronously, so the host
is free meanwhile), then random logits; on CPU nothing (a CPU forward is synchronous: nothing to hide behind).
Three runs of the same steps: unconstrained rows (the baseline), constrained rows as the engine runs them
(prefill), and constrained rows without the prefill (the fill serial after the forward, as before the overlap).
The engine's structured cost is (prefill step - baseline step): the non-hidden part of the fill, the copy and
mask kernel, the advance; it is the share of the step floor (goal < 5%). The raw host fill is timed alone on the
same matcher states, with xgrammar's thread counts side by side, and the hidden part is (serial - prefill).

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
from decode_service.chat import MESSAGE_USER
from decode_service.engine.request import SamplingParams
from decode_service.engine.worker.runner import WorkerRequest
from decode_service.engine.worker.sampler import Sampler
from decode_service.structured.compiler import CompiledConstraint, ConstraintCompiler
from decode_service.structured.constraint import OutputConstraint
from decode_service.structured.matcher import ConstraintMatcher, fill_bitmasks, fill_threads

VOCAB = 200058  # Inkling's unpadded vocabulary: the logits width
EOS = (200006,)
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


@dataclass
class BatchRow:
    batch: int
    floor_ms: float  # the decode-step floor the share is of
    forward_ms: float  # the stand-in forward the fill hides behind (0 on CPU)
    plain_ms: float  # a step of unconstrained rows
    prefill_ms: float  # a step of constrained rows, as the engine runs it
    serial_ms: float  # the same without the prefill
    fill_ms: float  # the host fill alone (the sampler's thread count)
    fill_by_threads: dict[str, float]

    @property
    def structured_ms(self) -> float:
        """What the engine pays per step for the constraints."""
        return max(0.0, self.prefill_ms - self.plain_ms)

    @property
    def hidden_ms(self) -> float:
        """The part of the host fill the forward hid."""
        return max(0.0, self.serial_ms - self.prefill_ms)

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
    """A stand-in forward: `sleep(ms)` keeps the device busy that long, asynchronously (nothing on CPU)."""
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


class Walk:
    """`batch` requests walking their schemas; `constrained=False`: the same requests without constraints."""

    def __init__(self, compiled: Sequence[CompiledConstraint], batch: int, constrained: bool):
        self.compiled, self.constrained = compiled, constrained
        self.requests = [self.fresh(i) for i in range(batch)]

    def fresh(self, i: int) -> WorkerRequest:
        matcher = ConstraintMatcher(self.compiled[i % len(self.compiled)], PROMPT, EOS) if self.constrained else None
        return WorkerRequest(f"r{i}", list(PROMPT), SamplingParams(temperature=0.0), constraint=matcher)

    def restart_finished(self, finished: Sequence[bool]) -> None:
        self.requests = [
            self.fresh(i) if done else r for i, (r, done) in enumerate(zip(self.requests, finished, strict=True))
        ]


def run_steps(walk: Walk, sampler: Sampler, steps: int, forward_ms: float, sleep, device, prefill: bool) -> list[float]:
    """Steps in the runner's order; the wall time of each, from the prefill to the sampled tokens."""
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if prefill:
            sampler.prefill_masks(walk.requests)
        sleep(forward_ms)
        logits = torch.randn(len(walk.requests), VOCAB, generator=gen, device=device)  # [B, V]
        results = sampler.sample(logits, walk.requests)
        times.append((time.perf_counter() - t0) * 1e3)
        walk.restart_finished([r.constraint_finished for r in results])
    return times


def fill_times(walk: Walk, sampler: Sampler, steps: int, device) -> dict[str, float]:
    """The host fill alone on the walk's states (advanced by the sampler between fills), by thread count."""
    scratch = torch.full((len(walk.requests), -(-VOCAB // 32)), -1, dtype=torch.int32)
    variants: dict[str, Callable[[list[ConstraintMatcher], list[int]], None]] = {
        str(n): (lambda ms, rows, n=n: fill_bitmasks(ms, scratch, rows, n)) for n in FILL_THREADS
    }
    auto = xgr.BatchGrammarMatcher("auto")
    variants["auto"] = lambda ms, rows: auto.batch_fill_next_token_bitmask(
        [m.grammar_matcher for m in ms], scratch, rows
    )
    times: dict[str, list[float]] = {name: [] for name in variants}
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(steps):
        matchers = [r.constraint for r in walk.requests]
        rows = list(range(len(matchers)))
        for name, fill in variants.items():
            t0 = time.perf_counter()
            fill(matchers, rows)
            times[name].append((time.perf_counter() - t0) * 1e3)
        logits = torch.randn(len(walk.requests), VOCAB, generator=gen, device=device)
        walk.restart_finished([r.constraint_finished for r in sampler.sample(logits, walk.requests)])
    return {name: statistics.median(t) for name, t in times.items()}


def run_batch(compiled, batch: int, steps: int, device: torch.device, sleep) -> BatchRow:
    floor = decode_step_floor_ms(batch)
    forward = floor if device.type == "cuda" else 0.0
    sampler = Sampler(max_rows=batch, device=device)
    warmup = max(2, steps // 10)  # kernel compilation, the buffers' first allocation
    medians = {}
    for name, constrained, prefill in (("plain", False, False), ("prefill", True, True), ("serial", True, False)):
        walk = Walk(compiled, batch, constrained)
        run_steps(walk, sampler, warmup, forward, sleep, device, prefill)
        medians[name] = statistics.median(run_steps(walk, sampler, steps, forward, sleep, device, prefill))
    fills = fill_times(Walk(compiled, batch, True), sampler, steps, device)
    return BatchRow(
        batch,
        floor,
        forward,
        medians["plain"],
        medians["prefill"],
        medians["serial"],
        fills[str(fill_threads())],
        fills,
    )


def main(argv: Sequence[str] | None = None) -> list[BatchRow]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
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
        "| B | step floor ms | forward ms (stand-in) | host fill ms | fill hidden ms | step ms: plain / prefill / "
        "serial | structured ms (not hidden) | share of floor | serial share |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            f"{r.floor_ms:.2f}",
            f"{r.forward_ms:.2f}",
            f"{r.fill_ms:.3f}",
            f"{r.hidden_ms:.3f}",
            f"{r.plain_ms:.3f} / {r.prefill_ms:.3f} / {r.serial_ms:.3f}",
            f"{r.structured_ms:.3f}",
            f"{r.share:.1%}",
            f"{max(0.0, r.serial_ms - r.plain_ms) / r.floor_ms:.1%}",
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
