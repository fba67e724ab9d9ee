"""The decode benchmarks' shared pieces: the "Small-L6" proxy (exact Inkling-Small layer shapes over 6 layers,
random weights generated on the device, NVFP4 stacks in their packed form) and its deeper cousins, paged decode
batches over the engine's pools, the bytes a decode step must move (the floor) and its roofline (bytes or FLOPs,
per op): the plain step (one new row per sequence), the verify step (D+1 rows per sequence) and an MTP draft
chain. Used by `bench_decode`, `bench_decode_tp` and `bench_mtp`."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from bench.floors import Ceilings
from common.config import TextConfig, parse_model_config
from decode_service.engine.core.pages import KVAllocator
from decode_service.engine.worker.decode_graphs import DecodeGraphs
from decode_service.engine.worker.kv_cache import CacheSpec, KVCache, SequenceView
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.inkling import InklingDecoder
from decode_service.model.layers import Bf16Experts, NVFP4Experts
from decode_service.model.mtp import MTPDrafter
from tools.make_tiny_checkpoint import raw_config
from tools.model_shapes import INKLING_SMALL

PAGE = 16


def proxy_shapes(layers: int) -> dict:
    """The first `layers` layers of Inkling-Small, in raw config keys: its layer rule unchanged (0-1 dense MLP,
    every later layer routed experts; every 6th layer, 5, 11, ..., global, the rest sliding)."""
    if layers <= INKLING_SMALL["dense_mlp_idx"]:
        raise ValueError(f"proxy layers {layers}: need more than the {INKLING_SMALL['dense_mlp_idx']} dense layers")
    return INKLING_SMALL | {"num_hidden_layers": layers, "local_layer_ids": [i for i in range(layers) if (i + 1) % 6]}


def proxy_nvfp4_layers(layers: int) -> frozenset[int]:
    """As in Inkling-Small's checkpoint: layer 2's routed experts bf16, every later layer's NVFP4."""
    return frozenset(range(INKLING_SMALL["dense_mlp_idx"] + 1, layers))


# Small-L6: 0-1 dense, 2 bf16 experts, 3-5 NVFP4, 5 global
SMALL_L6 = proxy_shapes(6)
NVFP4_LAYERS = proxy_nvfp4_layers(6)


def proxy_raw_text(layers: int = 6) -> dict:
    return raw_config(**proxy_shapes(layers))["text_config"]


def proxy_config(layers: int = 6) -> TextConfig:
    return parse_model_config(raw_config(**proxy_shapes(layers))).text


def layer_mix(config: TextConfig, nvfp4_layers: frozenset[int]) -> str:
    """'dense 0-1, bf16 experts 2, NVFP4 experts 3-7, global 5' for the table header."""
    n = config.num_layers

    def spans(ids: list[int]) -> str:
        runs: list[list[int]] = []
        for i in ids:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs) or "none"

    dense = [i for i in range(n) if config.dense_layers[i]]
    bf16 = [i for i in range(n) if not config.dense_layers[i] and i not in nvfp4_layers]
    glob = [i for i in range(n) if not config.sliding_layers[i]]
    return (
        f"dense {spans(dense)}, bf16 experts {spans(bf16)}, NVFP4 experts {spans(sorted(nvfp4_layers))}, "
        f"global {spans(glob)} (the rest sliding)"
    )


@torch.no_grad()
def random_proxy(config: TextConfig, nvfp4_layers: frozenset[int], device: str = "cuda", seed: int = 0):
    """`InklingDecoder` with random weights made on `device`: unit-variance linear outputs, routing ~ uniform."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        shapes = InklingDecoder(config, nvfp4_layers).state_dict()
    weights = {
        name: random_tensor(name, tuple(meta.shape), meta.dtype, config, device) for name, meta in shapes.items()
    }
    return InklingDecoder.from_weights(config, weights, torch.bfloat16, device)


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    config: TextConfig,
    device: str,
    generator: torch.Generator | None = None,
    fan_in: int | None = None,
) -> torch.Tensor:
    """One random weight of the proxy's statistics, drawn on `device`; matrices scaled by 1/sqrt(`fan_in`, default
    their last dim: a row-parallel shard passes the full model's), `config` the full model's."""
    e2m1_rms, scale_mean = 2.93, 1.0  # RMS of the 16 e2m1 codes; block scales drawn in [0.25, 1.75]
    g = {"generator": generator, "device": device}
    if dtype == torch.uint8:  # packed e2m1 codes
        return torch.randint(0, 256, shape, dtype=torch.uint8, **g)
    if dtype == torch.float8_e4m3fn:
        return (torch.rand(shape, **g) * 1.5 + 0.25).to(torch.float8_e4m3fn)
    if name.endswith("_scale2"):  # per-expert scale: W rows of RMS 1/sqrt(fan-in)
        rows_in = config.hidden_size if "w13" in name else config.moe_intermediate_size
        return torch.full(shape, 1.0 / math.sqrt(rows_in) / (e2m1_rms * scale_mean), device=device)
    if name.endswith("mlp.gate.bias"):
        return torch.zeros(shape, device=device)
    if name.endswith("global_scale"):
        return torch.ones(shape, device=device)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, **g)
    if "sconv" in name:
        return 0.1 * torch.randn(shape, **g)
    if name.endswith("rel_logits_proj.proj"):
        return 0.5 * torch.randn(shape, **g)
    return torch.randn(shape, dtype=torch.bfloat16, **g).mul_(1.0 / math.sqrt(fan_in or shape[-1]))


def paged_decode_batch(
    model: InklingDecoder, batch: int, ctx: int, max_model_len: int, device: str = "cuda", seed: int | None = None
):
    """B sequences whose `ctx` committed tokens sit in the engine's paged cache (random K/V, zero conv
    states) -> the packed batch that decodes position `ctx` of each (re-running it rewrites the same slots), and
    the engine's `DecodeGraphs` over the same cache with the sequences' handles. `seed`: the tokens from a seeded
    generator (equal on every rank of a tensor-parallel group)."""
    config = model.config
    window_pages = math.ceil(config.sliding_window / PAGE) + 2
    ctx_pages = math.ceil((ctx + 1) / PAGE)
    spec = CacheSpec(PAGE, batch * window_pages + ctx_pages, batch * ctx_pages, batch, torch.bfloat16, device)
    cache, allocator = KVCache(config, spec), KVAllocator(config, spec)
    for pool in (*cache.k.values(), *cache.v.values()):
        pool.normal_()
    graphs = DecodeGraphs(model, cache, max_num_seqs=batch, max_model_len=max_model_len)  # tables before handles
    seqs, handles = [], []
    for _ in range(batch):
        pages = allocator.new_sequence()
        pages.grow(ctx + 1)
        pages.commit(ctx)  # drops the sliding pages before the window
        handle = SequenceView(cache, pages.slot)
        for sliding, update in zip((True, False), pages.take_updates(), strict=True):
            handle.update(sliding, update)
        handle.num_tokens = ctx
        seqs.append(SequenceSlice(ctx, 1, handle.layers))
        handles.append(handle)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.unpadded_vocab_size, (batch,), generator=gen).to(device)
    return ForwardBatch(tokens, seqs), graphs, handles


def touched_experts(model: InklingDecoder, fb: ForwardBatch) -> dict[int, int]:
    """Distinct routed experts per MoE layer in this step's routing (of this rank's: masked routes not counted)."""
    counts: dict[int, int] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, (Bf16Experts, NVFP4Experts)):
            hooks.append(experts.register_forward_pre_hook(
                lambda _m, args, i=i: counts.__setitem__(i, int(args[1][args[1] >= 0].unique().numel()))
            ))  # fmt: skip
    with torch.inference_mode():
        model(fb)
    for h in hooks:
        h.remove()
    return counts


def weight_ops(named: Iterable[tuple[str, torch.Tensor]], rows: int, vocab: int) -> list[tuple[int, int]]:
    """(bytes, FLOPs) of each tensor in `named` for a step of `rows` rows: the embedding's rows (`embed.weight`),
    each weight matrix read once against all rows (`unembed.weight` over its first `vocab` rows), the other tensors
    read once with no FLOPs; routed experts skipped (their bytes depend on the routing: `step_ops`)."""
    ops = []
    for name, t in named:
        if name == "embed.weight":
            ops.append((rows * t.shape[-1] * t.element_size(), 0))
        elif ".mlp.experts." in name:
            continue
        elif t.dim() >= 2 and "sconv" not in name and "rel_logits" not in name:
            out = min(vocab, t.shape[0]) if name == "unembed.weight" else t.shape[0]
            ops.append((t.numel() * t.element_size(), 2 * rows * out * (t.numel() // t.shape[0])))
        else:
            ops.append((t.numel() * t.element_size(), 0))
    return ops


def cache_ops(config: TextConfig, layer: int, batch: int, ctx: int, width: int = 1) -> list[tuple[int, int]]:
    """(bytes, FLOPs) of layer `layer`'s caches in a step of B sequences with `width` new rows each after `ctx`
    committed: attention reads each SEQUENCE's visible history once (its rows share it: the last W-1 committed
    rows on a sliding layer of window W, all `ctx` on a global one) and writes the new rows' K/V, each row scoring
    the history it sees (causal within the new rows); the conv states read and written once per sequence."""
    geo = config.layer_geometry(layer)
    history = min(ctx, geo.window - 1) if geo.window else ctx
    seen = sum(min(ctx + k + 1, geo.window) if geo.window else ctx + k + 1 for k in range(width))  # keys per seq
    kv_bytes = batch * (history + width) * 2 * geo.kv_width * 2  # K and V, bf16
    conv_bytes = batch * 2 * (config.conv_kernel_size - 1) * (2 * geo.kv_width + 2 * config.hidden_size) * 2
    return [(kv_bytes, 4 * batch * geo.num_heads * seen * geo.head_dim), (conv_bytes, 0)]  # scores and values


def step_ops(
    model: InklingDecoder, batch: int, ctx: int, touched: dict[int, int], width: int = 1
) -> list[tuple[int, int]]:
    """(bytes it must move, FLOPs) per op of a step of B sequences x `width` new rows each (width 1: the plain
    decode step; D+1: the verify step of D drafts): every weight once against the B*width rows (`weight_ops`),
    the routed experts this step's routing touches (B*width x top_k pairs), the layers' K/V and conv states per
    sequence (`cache_ops`), the fp32 logits of every row written."""
    config = model.config
    h, i, rows = config.hidden_size, config.moe_intermediate_size, batch * width
    ops = weight_ops((*model.named_parameters(), *model.named_buffers()), rows, config.unpadded_vocab_size)
    for layer, n in touched.items():
        if isinstance(model.layers[layer].mlp.experts, NVFP4Experts):
            per_expert = 3 * h * i // 2 + 3 * h * i // 16 + 2 * 4  # codes + e4m3 block scales + scale2
        else:
            per_expert = 3 * h * i * 2
        ops.append((n * per_expert, 2 * rows * config.num_experts_per_tok * 3 * h * i))
    for layer in range(config.num_layers):
        ops += cache_ops(config, layer, batch, ctx, width)
    ops.append((rows * min(config.unpadded_vocab_size, config.vocab_size) * 4, 0))  # fp32 logits (this rank's shard)
    return ops


def depth_ops(drafter: MTPDrafter, depth: int, batch: int, ctx: int, rows: int) -> list[tuple[int, int]]:
    """(bytes, FLOPs) per op of MTP depth `depth` in a drafting round of B sequences with `rows` rows each after
    `ctx` committed: the depth's own tensors once against the B*rows rows (input_proj, norms, the decoder layer and
    its dense MLP) with the rows' embeddings and the shared norms (`weight_ops`), its K/V and conv states per
    sequence (`cache_ops`), then one read of the head its draft uses for the B last rows (the shared bf16 lm_head
    or its FP8 copy and row scales: `MTPDrafter.uses_fp8_head`); no draft logits written (an argmax fused into
    the head needs none)."""
    config = drafter.config
    own = (f"layers.{depth}.", "embed.", "embed_norm.", "chain_norm.")
    named = [(n, t) for n, t in (*drafter.named_parameters(), *drafter.named_buffers()) if n.startswith(own)]
    ops = weight_ops(named, batch * rows, config.unpadded_vocab_size)
    ops += cache_ops(config, depth, batch, ctx, rows)
    head = drafter.fp8_head if drafter.uses_fp8_head(batch) else (drafter.unembed.weight,)
    assert head is not None
    vocab = min(config.unpadded_vocab_size, head[0].shape[0])
    ops.append((sum(t.numel() * t.element_size() for t in head), 2 * batch * vocab * config.hidden_size))
    return ops


def chain_ops(drafter: MTPDrafter, batch: int, ctx: int, rows: int, depths: int) -> list[tuple[int, int]]:
    """`depth_ops` of depths 0..D-1 in a round that verified `rows` rows per sequence: depth j runs those rows
    and the j provisional ones behind this round's drafts (`r + j`, as `PagedMTPSpeculator` plans a round), each
    depth's head read once (its draft feeds the next depth)."""
    return [op for j in range(depths) for op in depth_ops(drafter, j, batch, ctx, rows + j)]


def step_bytes(model: InklingDecoder, batch: int, ctx: int, touched: dict[int, int], width: int = 1) -> int:
    return sum(n_bytes for n_bytes, _ in step_ops(model, batch, ctx, touched, width))


def step_roofline_us(
    model: InklingDecoder, batch: int, ctx: int, touched: dict[int, int], ceil: Ceilings, width: int = 1
) -> float:
    """The step's roofline floor: `roofline_us` of `step_ops` (what `step_bytes` alone understates once the GEMMs of
    B rows turn compute-bound: the lm_head at B=256 does 420 GFLOP, 0.55 ms at 761 TFLOP/s against 0.39 ms of
    bytes)."""
    return roofline_us(step_ops(model, batch, ctx, touched, width), ceil)


def roofline_us(ops: Iterable[tuple[int, int]], ceil: Ceilings) -> float:
    """Per op the larger of its bytes over the copy bandwidth and its FLOPs over the bf16 matmul peak, summed."""
    peak = ceil.bf16_tflops * 1e12 / 1e6  # FLOP per us
    return sum(max(ceil.floor_us(n_bytes), flops / peak) for n_bytes, flops in ops)
