"""transformers' Inkling on the decode benchmark's proxy: the same layer shapes, bf16 everywhere, its own random
init, sdpa attention and the grouped_mm experts backend (`config._experts_implementation = "grouped_mm"`, what
transformers 5.24 picks by default for a `@use_experts_implementation` MoE; requested explicitly so that it fails
loudly instead of falling back to the per-expert loop).

For each context one sequence is prefilled in chunks through a `DynamicCache`; the cache is then repeated to B rows
(`reorder_cache` with B zeros: the same history in every row, each row decoding its own random token) and the
median decode step is timed with CUDA events. A row whose cache plus the step's transient (sdpa repeats K/V to
the query heads when a float bias mask is given) would not fit in free GPU memory is skipped and says so.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass

import torch

from bench.floors import time_ms

EXPERTS = "grouped_mm"
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class HFResult:
    ms: float | None  # median decode step, None when skipped or failed
    note: str  # why it has no figure ("" when it has one)

    def cell(self) -> str:
        return f"{self.ms:.2f}" if self.ms is not None else self.note


def build(raw_text: dict, device: str = "cuda"):
    """InklingForCausalLM on `device`, bf16, sdpa, grouped_mm experts."""
    from transformers import InklingForCausalLM, InklingTextConfig

    cfg = InklingTextConfig(**raw_text)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = EXPERTS
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = InklingForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    implementation = model.config._experts_implementation
    if implementation != EXPERTS:
        raise RuntimeError(f"transformers chose experts implementation {implementation!r}, not {EXPERTS!r}")
    return model


def step_bytes_needed(cfg, batch: int, ctx: int) -> int:
    """Device bytes a decode step at (B, ctx) needs beyond the weights: the B-row cache (every layer's K/V in bf16,
    windowed for sliding layers) + the largest layer's transient: its K/V again (`DynamicCache` concatenates the new
    token), K/V repeated to the query heads (sdpa does when given a float bias mask) and the fp32 bias mask."""
    total, transient = 0, 0
    for layer_type in cfg.layer_types:
        sliding = layer_type == "hybrid_sliding"
        kv_heads = cfg.swa_num_key_value_heads if sliding else cfg.num_key_value_heads
        heads = cfg.swa_num_attention_heads if sliding else cfg.num_attention_heads
        head_dim = cfg.swa_head_dim if sliding else cfg.head_dim
        keys = min(ctx + 1, cfg.sliding_window_size) if sliding else ctx + 1
        kv = 2 * batch * keys * kv_heads * head_dim * 2
        total += kv
        transient = max(transient, kv + 2 * batch * keys * heads * head_dim * 2 + batch * heads * keys * 4)
    return total + transient


@torch.inference_mode()
def prefill(model, ctx: int, seed: int = 0):
    """A `DynamicCache` holding one random `ctx`-token sequence, prefilled `PREFILL_CHUNK` tokens at a time."""
    from transformers import DynamicCache

    device = model.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, ctx), generator=gen).to(device)
    cache = DynamicCache(config=model.config)
    for start in range(0, ctx, PREFILL_CHUNK):
        model(input_ids=ids[:, start : start + PREFILL_CHUNK], cache=cache, use_cache=True, logits_to_keep=1)
    return cache


@torch.inference_mode()
def decode_ms(model, cache, batch: int, reps: int = 5) -> float:
    """Median ms of a B-row decode step on a copy of the one-row `cache` repeated B times."""
    device = model.device
    rows = copy.deepcopy(cache)
    rows.reorder_cache(torch.zeros(batch, dtype=torch.long, device=device))
    tokens = [torch.randint(0, model.config.vocab_size, (batch, 1), device=device)]

    def step() -> None:
        out = model(input_ids=tokens[-1], cache=rows, use_cache=True, logits_to_keep=1)
        tokens.append(out.logits[:, -1:].argmax(-1))

    return time_ms(step, str(device), reps=reps, warmup=1)


def time_grid(
    raw_text: dict, batches: list[int], contexts: list[int], device: str = "cuda"
) -> dict[tuple[int, int], HFResult]:
    """{(ctx, B): HFResult} over the grid; prints one line per row as it goes."""
    import transformers

    model = build(raw_text, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"# transformers {transformers.__version__} InklingForCausalLM built: {weights / 2**30:.1f} GiB of bf16 "
        f"weights, attention {model.config._attn_implementation}, experts {model.config._experts_implementation}",
        flush=True,
    )
    results = {}
    for ctx in contexts:
        try:
            cache = prefill(model, ctx)
        except torch.OutOfMemoryError:
            cache = None
        for b in batches:
            free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else float("inf")
            need = step_bytes_needed(model.config, b, ctx)
            if cache is None:
                results[ctx, b] = HFResult(None, f"skipped: its {ctx}-token prefill ran out of memory")
            elif need > 0.9 * free:
                results[ctx, b] = HFResult(None, f"skipped: needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
            else:
                try:
                    results[ctx, b] = HFResult(decode_ms(model, cache, b), "")
                except torch.OutOfMemoryError:
                    results[ctx, b] = HFResult(None, f"out of memory (estimated {need / 2**30:.0f} GiB)")
            release()
            print(f"# transformers ctx={ctx} B={b}: {results[ctx, b].cell()} ms", flush=True)
        del cache
        release()
    del model
    release()
    return results


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
