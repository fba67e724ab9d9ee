"""Inkling MoE gate (spec inkling-text 5.2, ``decode_service.model.ops.Ops.route``) in two launches.

    logits  = x W^T                                        fp32 [T, E+S] (W rows: E routed, then S shared)
    ids     = top-k over e < E of sigmoid(logits_e) + bias_e     (largest first, like ``torch.topk``)
    active  = logsigmoid([logits[ids], logits[E:]])                [T, k+S]
    weights = softmax(active) * route_scale * global_scale  ->  routed [T, k], shared gammas [T, S]

Launch 1 reads the weight in its stored dtype with fp32 accumulation and fp32 output (split over H when
there are few tokens, so the weight read is spread over many programs); launch 2 does everything else per
token. Among equal selection scores the lowest expert id wins (a stable argmax; torch.topk does not
promise an order for ties). Nothing is read back to the host and the grids depend on shapes only, so the
call can be captured in a CUDA graph. Excluded from this slice: fusing both launches into one for a
handful of tokens (SGLang's last-block epilogue), packing ids and weights for the expert kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inkling_kernels.pdl import pdl

_TARGET_PROGRAMS = 264  # ~2 waves of the H200's 132 SMs
_MAX_SPLIT = 8  # K splits of the logits launch (the top-k launch loads all of them at once)
_MAX_BCAST_TOKENS = 2  # up to this many tokens: broadcast-multiply GEMV; more: tl.dot on 16+ token rows


@dataclass(frozen=True)
class GateTiles:
    """Tile shape of the logits launch. ``split_k`` None: split H until about ``_TARGET_PROGRAMS`` programs
    (at most ``_MAX_SPLIT``). ``block_t`` >= 16 runs on the tensor cores, smaller is the broadcast GEMV."""

    block_t: int
    block_n: int
    block_k: int
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_tiles(t: int, h: int) -> GateTiles:
    """Best measured on an H200 (bench/bench_router.py, H=4096, E+S=258, bf16): one or two tokens use the
    broadcast GEMV with the weight split over ~260 programs; from 3 tokens on, tensor-core tiles (padding to
    16 token rows costs nothing there) that widen with T."""
    hp = max(16, _next_pow2(h))
    if t <= _MAX_BCAST_TOKENS:
        return GateTiles(block_t=_next_pow2(t), block_n=4, block_k=min(hp, 1024))
    if t <= 16:
        return GateTiles(block_t=16, block_n=32, block_k=min(hp, 256))
    if t <= 64:
        return GateTiles(block_t=32, block_n=32, block_k=min(hp, 128))
    if t <= 256:
        return GateTiles(block_t=64, block_n=32, block_k=min(hp, 64))
    return GateTiles(block_t=128, block_n=64, block_k=min(hp, 64), num_warps=8)


def _check(x, weight, bias, top_k, global_scale):
    if x.dim() != 2 or weight.dim() != 2 or bias.dim() != 1:
        raise ValueError(
            f"x [T,H], weight [E+S,H], bias [E] expected, got {tuple(x.shape)}, {tuple(weight.shape)}, "
            f"{tuple(bias.shape)}"
        )
    e = bias.shape[0]
    if weight.shape[1] != x.shape[1] or weight.shape[0] < e:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)} and bias [E]={e}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, E={e}]")
    if bias.dtype != torch.float32 or global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(
            f"bias and global_scale must be fp32 (global_scale [1]), got {bias.dtype}, {global_scale.dtype} "
            f"{tuple(global_scale.shape)}"
        )
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16) or t.stride(-1) != 1:
            raise ValueError(f"{name} must be fp32/fp16/bf16 with unit last stride, got {t.dtype} {t.stride()}")
    for name, t in (("weight", weight), ("bias", bias), ("global_scale", global_scale)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return e, weight.shape[0] - e


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float,
    global_scale: torch.Tensor,
    tiles: GateTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[T, H]``, weight ``[E+S, H]`` (model dtype), bias fp32 ``[E]``, global_scale fp32 ``[1]`` (device).

    Returns expert ids int64 ``[T, k]`` (descending selection score), routed weights fp32 ``[T, k]`` and
    shared gammas fp32 ``[T, S]``. ``tiles`` overrides ``default_tiles`` for the logits launch.
    """
    from inkling_kernels import _triton_router as tk

    e, s = _check(x, weight, bias, top_k, global_scale)
    t, h = x.shape
    n = e + s
    dev = x.device
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    gammas = torch.empty((t, s), dtype=torch.float32, device=dev)
    if t == 0:
        return ids, weights, gammas

    cfg = tiles or default_tiles(t, h)
    use_dot = cfg.block_t >= 16
    if use_dot and min(cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"tensor-core tiles need block_n and block_k >= 16, got {cfg}")
    grid_n, grid_t = -(-n // cfg.block_n), -(-t // cfg.block_t)
    k_blocks = -(-h // cfg.block_k)
    split = cfg.split_k or min(_MAX_SPLIT, max(1, -(-_TARGET_PROGRAMS // (grid_n * grid_t))))
    chunk = -(-k_blocks // min(split, k_blocks)) * cfg.block_k
    split = -(-h // chunk)
    partial = torch.empty((split, t, n), dtype=torch.float32, device=dev)
    tk.router_logits_kernel[(grid_n, grid_t, split)](
        x,
        weight,
        partial,
        t,
        n,
        h,
        chunk,
        x.stride(0),
        weight.stride(0),
        partial.stride(0),
        partial.stride(1),
        BLOCK_T=cfg.block_t,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_DOT=use_dot,
        DOT_FP32=x.dtype != weight.dtype or x.dtype == torch.float32,
        EVEN_K=h % cfg.block_k == 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl(x),
    )

    block_e, block_s = _next_pow2(e), _next_pow2(split)
    tk.router_topk_kernel[(t,)](
        partial,
        bias,
        global_scale,
        ids,
        weights,
        gammas,
        e,
        s,
        split,
        float(route_scale),
        partial.stride(0),
        partial.stride(1),
        ids.stride(0),
        weights.stride(0),
        gammas.stride(0),
        TOPK=top_k,
        BLOCK_E=block_e,
        BLOCK_A=_next_pow2(top_k + s),
        BLOCK_S=block_s,
        num_warps=min(4, max(1, block_e * block_s // 2048)),
        **pdl(partial),
    )
    return ids, weights, gammas


def route_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float,
    global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 torch reference of ``route`` (same arguments), the exact math of ``Router.forward``."""
    e = bias.shape[0]
    logits = x.float() @ weight.float().T  # [T, E+S]
    routed, shared = logits[:, :e], logits[:, e:]
    choice = torch.sigmoid(routed) + bias.float()
    ids = torch.topk(choice, top_k, dim=-1).indices  # [T, k]
    active = F.logsigmoid(torch.cat([routed.gather(-1, ids), shared], dim=-1))  # [T, k+S]
    w = torch.exp(active - torch.logsumexp(active, dim=-1, keepdim=True))
    w = w * route_scale * global_scale.float()
    return ids, w[:, :top_k], w[:, top_k:]
