"""Structured outputs per decode step: grammar mask computation (xgrammar, host) + its application to the logits
(`kernels/token_mask`: Triton on CUDA, torch on CPU, on a copy of the logits) + matcher advance, at batch 1 and
64, next to the decode step. The host fill (xgrammar's bitmask rows) is also timed alone.

Every row of the batch holds a JSON-schema constraint over the full Inkling vocabulary (200058 logits), walked by
a "random model": each step the masked logits of random scores pick the token, so the matchers pass through
strings, numbers, enums and object boundaries like a weak model's output would; a finished matcher restarts.
Compilation (cold, then from the cache) is timed once per schema. The step budget is the HBM floor of an
Inkling-Small decode step at that batch (bench_engine's `decode_step_floor_ms`; a GPU decode step runs at about
that floor with CUDA graphs), and the goal is structured overhead < 5% of it.

    python -m bench.bench_structured [--batches 1 64] [--steps 50] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.bench_engine import decode_step_floor_ms
from decode_service.chat import MESSAGE_USER
from decode_service.engine.request import Request
from decode_service.structured.compiler import ConstraintCompiler
from decode_service.structured.constraint import OutputConstraint
from decode_service.structured.matcher import ConstraintMatcher, fill_bitmasks
from decode_service.structured.sampling import advance_matchers, mask_logits

VOCAB = 200058  # Inkling's unpadded vocabulary: the logits width
EOS = (200006,)
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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


def run_batch(compiler: ConstraintCompiler, batch: int, steps: int, device: torch.device) -> dict[str, float]:
    compiled = [compiler.compile_sync(OutputConstraint("json_schema", json.dumps(s))) for s in SCHEMAS]
    prompt = [MESSAGE_USER]

    def fresh(i: int) -> Request:
        return Request(f"r{i}", prompt, constraint=ConstraintMatcher(compiled[i % len(compiled)], prompt, EOS))

    requests = [fresh(i) for i in range(batch)]
    gen = torch.Generator(device=device).manual_seed(0)
    fill_ms, mask_ms, advance_ms = [], [], []
    scratch = torch.empty((batch, -(-VOCAB // 32)), dtype=torch.int32)
    for _ in range(steps):
        logits = torch.randn(batch, VOCAB, generator=gen, device=device)
        t0 = time.perf_counter()
        fill_bitmasks([r.constraint for r in requests], scratch, list(range(batch)))  # the host part alone
        fill_ms.append((time.perf_counter() - t0) * 1e3)
        _sync(device)
        t0 = time.perf_counter()
        masked = mask_logits(logits, requests)
        tokens = masked.argmax(-1).tolist()  # the sampler's host read of the chosen tokens
        t1 = time.perf_counter()
        advance_matchers(requests, tokens)
        t2 = time.perf_counter()
        mask_ms.append((t1 - t0) * 1e3)
        advance_ms.append((t2 - t1) * 1e3)
        requests = [fresh(i) if r.constraint.is_terminated else r for i, r in enumerate(requests)]
    baseline = []
    for _ in range(max(3, steps // 5)):  # the same argmax + host read without any mask: subtracted below
        logits = torch.randn(batch, VOCAB, generator=gen, device=device)
        _sync(device)
        t0 = time.perf_counter()
        logits.argmax(-1).tolist()
        baseline.append((time.perf_counter() - t0) * 1e3)
    return {
        "fill_ms": statistics.median(fill_ms),
        "mask_ms": statistics.median(mask_ms) - statistics.median(baseline),
        "advance_ms": statistics.median(advance_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    compiler = ConstraintCompiler(VOCAB, EOS)
    t0 = time.perf_counter()
    compiler._xgr()  # the tokenizer info: built once per process
    print(f"# device {device}; tokenizer info for {VOCAB} tokens: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    print("| schema | compile ms (cold) | compile ms (cached) |")
    print("|---|---|---|")
    for i, (cold, cached) in enumerate(compile_times(compiler)):
        print(f"| {i} | {cold:.1f} | {cached:.3f} |")
    print()
    print("| B | host fill ms | mask fill + apply ms | advance ms | structured ms | decode step floor ms | share |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batches:
        r = run_batch(compiler, batch, args.steps, device)
        total = r["mask_ms"] + r["advance_ms"]
        floor = decode_step_floor_ms(batch)
        cells = [
            f"{r['fill_ms']:.3f}",
            f"{r['mask_ms']:.3f}",
            f"{r['advance_ms']:.3f}",
            f"{total:.3f}",
            f"{floor:.2f}",
            f"{total / floor:.1%}",
        ]
        print(f"| {batch} | " + " | ".join(cells) + " |")
    compiler.close()


if __name__ == "__main__":
    main()
