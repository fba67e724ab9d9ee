"""transformers' Inkling on the decode benchmark's proxy: the same layer shapes, bf16 everywhere, its own random
init, sdpa attention, timed with each of its MoE experts backends (`model.set_experts_implementation`):
"grouped_mm" (what transformers 5.24 picks by default for a `@use_experts_implementation` MoE: one
`torch.nn.functional.grouped_mm` over all experts, offsets from a histogram), "batched_mm" (what `generate()` switches
to for decoding on GPUs: the selected experts' weights gathered per (token, expert) pair, then a bmm) and "eager"
(the model's loop over the experts hit). Every backend is requested explicitly and checked, so none falls back
silently; the table takes the fastest, named.

For each context one sequence is prefilled in chunks through a `DynamicCache`; the cache is then repeated to B rows
(`reorder_cache` with B zeros: the same history in every row, each row decoding its own random token) and each
backend's median decode step is timed with CUDA events on that copy. A (row, backend) whose memory (cache + the
step's transient, + the weight gather for batched_mm) would not fit in free GPU memory is skipped and says so. On
the first context the fastest backend's step is profiled: GPU busy time against wall time tells host-bound
(launches, syncs) from device-bound.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass, field

import torch

from bench.floors import count_launches, time_ms

EXPERTS = ("grouped_mm", "batched_mm", "eager")
PREFILL_CHUNK = 2048


@dataclass
class HFResult:
    times: dict[str, float] = field(default_factory=dict)  # median decode-step ms by experts implementation
    skipped: dict[str, str] = field(default_factory=dict)  # why not timed, by experts implementation

    @property
    def best(self) -> tuple[str, float] | None:
        return min(self.times.items(), key=lambda kv: kv[1]) if self.times else None

    @property
    def ms(self) -> float | None:
        return self.best[1] if self.best else None

    def cell(self) -> str:
        if self.best:
            return f"{self.best[1]:.2f} ({self.best[0]})"
        reasons = set(self.skipped.values())
        return reasons.pop() if len(reasons) == 1 else "; ".join(f"{k}: {v}" for k, v in self.skipped.items())

    def line(self) -> str:
        timed = [f"{name} {ms:.2f} ms" for name, ms in self.times.items()]
        return ", ".join(timed + [f"{name} {why}" for name, why in self.skipped.items()])


def build(raw_text: dict, device: str = "cuda"):
    """InklingForCausalLM on `device`, bf16, sdpa, grouped_mm experts (switch with `use_experts`)."""
    from transformers import InklingForCausalLM, InklingTextConfig

    cfg = InklingTextConfig(**raw_text)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = EXPERTS[0]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = InklingForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    use_experts(model, EXPERTS[0])
    return model


def use_experts(model, implementation: str) -> None:
    model.set_experts_implementation(implementation)
    chosen = model.config._experts_implementation
    if chosen != implementation:
        raise RuntimeError(f"transformers chose experts implementation {chosen!r}, not {implementation!r}")


def step_bytes_needed(cfg, batch: int, ctx: int, implementation: str) -> int:
    """Device bytes a decode step at (B, ctx) needs beyond the weights: the B-row cache (every layer's K/V in bf16,
    windowed for sliding layers) + the largest layer's transient: its K/V again (`DynamicCache` concatenates the new
    token), K/V repeated to the query heads (sdpa does when given a float bias mask) and the fp32 bias mask; for
    batched_mm the gathered weights of every (token, expert) pair of one layer."""
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
    if implementation == "batched_mm":
        pairs = batch * cfg.num_experts_per_tok
        transient = max(transient, pairs * 3 * cfg.hidden_size * cfg.intermediate_size * 2)
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


def decode_step(model, rows, batch: int):
    """A closure running one B-row decode step on `rows` (a B-row cache), each step feeding the last argmax."""
    tokens = [torch.randint(0, model.config.vocab_size, (batch, 1), device=model.device)]

    def step() -> None:
        out = model(input_ids=tokens[-1], cache=rows, use_cache=True, logits_to_keep=1)
        tokens[-1] = out.logits[:, -1:].argmax(-1)

    return step


@torch.inference_mode()
def time_row(
    model, cache, batch: int, ctx: int, implementations: tuple[str, ...], profile: bool, reps: int = 5
) -> HFResult:
    """Every experts implementation's median decode step at (B, ctx) on one B-row copy of the one-row `cache`."""
    device = str(model.device)
    free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else float("inf")
    result = HFResult()
    fits = {}
    for name in implementations:
        need = step_bytes_needed(model.config, batch, ctx, name)
        fits[name] = need < 0.9 * free
        if not fits[name]:
            result.skipped[name] = f"skipped: needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
    if not any(fits.values()):
        return result
    rows = copy.deepcopy(cache)
    rows.reorder_cache(torch.zeros(batch, dtype=torch.long, device=model.device))
    for name in (n for n in implementations if fits[n]):
        if "out of memory" in result.skipped.values():
            result.skipped[name] = "not timed: an OOM mid-step left the cache rows uneven"
            continue
        use_experts(model, name)
        try:
            result.times[name] = time_ms(decode_step(model, rows, batch), device, reps=reps, warmup=2)
        except torch.OutOfMemoryError:
            result.skipped[name] = "out of memory"
        release()
    uneven = "out of memory" in result.skipped.values()
    if profile and result.best and device.startswith("cuda") and not uneven:
        name, ms = result.best
        use_experts(model, name)
        kernels, copies, busy, top = count_launches(decode_step(model, rows, batch))
        by_kernel = "; ".join(f"{k[:50]} x{n} {us:.0f}" for k, n, us in top[:8])
        print(
            f"# transformers ctx={ctx} B={batch} {name} step: {kernels} kernels + {copies} copies, GPU busy "
            f"{busy:.2f} ms of {ms:.2f} ms wall; by kernel (launches, us): {by_kernel}",
            flush=True,
        )
    use_experts(model, EXPERTS[0])
    return result


def time_grid(
    raw_text: dict,
    batches: list[int],
    contexts: list[int],
    implementations: tuple[str, ...] = EXPERTS,
    device: str = "cuda",
    reps: int = 5,
) -> dict[tuple[int, int], HFResult]:
    """{(ctx, B): HFResult} over the grid; prints one line per row as it goes."""
    import transformers

    model = build(raw_text, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"# transformers {transformers.__version__} InklingForCausalLM built: {weights / 2**30:.1f} GiB of bf16 "
        f"weights, attention {model.config._attn_implementation}, experts timed: {', '.join(implementations)}",
        flush=True,
    )
    results = {}
    for ctx in contexts:
        try:
            cache = prefill(model, ctx)
        except torch.OutOfMemoryError:
            cache = None
        release()
        for b in batches:
            if cache is None:
                results[ctx, b] = HFResult(skipped={"all": f"skipped: its {ctx}-token prefill ran out of memory"})
            else:
                results[ctx, b] = time_row(model, cache, b, ctx, implementations, ctx == contexts[0], reps)
            release()
            print(f"# transformers ctx={ctx} B={b}: {results[ctx, b].line()}", flush=True)
        del cache
        release()
    del model
    release()
    return results


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
