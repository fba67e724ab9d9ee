"""Inkling decoder building blocks, written like the math of spec/inkling-text.md sections 2-5 and 9.

Packed batches: activations are `[T, H]` with the sequences of a `ForwardBatch` back to back. Everything that
mixes tokens over time (the short convs and attention) goes through the step's `PreparedBatch` (`backend.py`),
which knows where each sequence's caches live; everything else runs on all T rows at once, on the `Ops` bundle
(`ops.py`) each module is built with.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from common.config import TextConfig
from decode_service.model.backend import PreparedBatch
from decode_service.model.collectives import SINGLE, TPGroup
from decode_service.model.ops import REFERENCE, Ops
from decode_service.model.state import ATTN_CONV, K_CONV, MLP_CONV, V_CONV, LayerCache


class RMSNorm(nn.Module):
    """`w * round(x * rsqrt(mean(x^2) + eps))`: normalise in fp32, round to the activation dtype, then scale."""

    def __init__(self, width: int, eps: float, ops: Ops = REFERENCE):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """`y = x W^T` (no bias) on the op bundle (`Ops.linear`); the weight is an `nn.Linear`'s."""

    def __init__(self, in_features: int, out_features: int, ops: Ops = REFERENCE):
        super().__init__(in_features, out_features, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)


def tap_major(weight: torch.Tensor) -> torch.Tensor:
    """A conv weight `[C, 1, K]` with its storage in `[K, 1, C]` order (a view when it already is): each tap's
    weights are one contiguous channel vector, as the conv kernels load them."""
    return weight.permute(2, 1, 0).contiguous().permute(2, 1, 0)


class ShortConv(nn.Module):
    """Depthwise causal conv over time with an identity residual, in fp32 (spec 4.2):
    `y[t] = x[t] + sum_j w[:, j] * x[t - (K-1) + j]`, with the last K-1 inputs carried in the cache. The weight
    `[C, 1, K]` is stored tap-major (`tap_major`); a checkpoint's `[C, 1, K]` tensor is re-laid when adopted."""

    def __init__(self, channels: int, kernel_size: int, layer: int, index: int):
        super().__init__()
        self.weight = nn.Parameter(tap_major(torch.zeros(channels, 1, kernel_size, dtype=torch.float32)))
        self.layer, self.index = layer, index  # where this conv's state lives in a sequence's caches

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if not self.weight.permute(2, 1, 0).is_contiguous():  # adopted in the checkpoint's layout
            self.weight = nn.Parameter(tap_major(self.weight.detach()), requires_grad=self.weight.requires_grad)

    def step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[n, C]` new inputs, state `[K-1, C]` previous inputs -> (y `[n, C]`, new state `[K-1, C]`)."""
        n, k = x.shape[0], self.weight.shape[-1]
        window = torch.cat([state.to(x.dtype), x]).float()  # [K-1+n, C]
        w = self.weight[:, 0, :].float()  # [C, K]
        conv = sum(window[j : j + n] * w[:, j] for j in range(k))  # [n, C]
        y = (x.float() + conv).to(x.dtype)
        return y, window[-(k - 1) :].to(x.dtype)

    def forward(self, x: torch.Tensor, step: PreparedBatch, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x `[T, C]` -> `[T, C]` (`residual + y` when given), each sequence continuing from (and updating) its
        own conv state."""
        return step.conv(self, x, residual)


class RelativeLogits(nn.Module):
    """Per-query relative-position bias `L_j(p, d) = r_j(p) . P[:, d]` for backward distances d < R (spec 3.4)."""

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(d_rel, extent))

    def forward(self, r: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """r `[n, nH, d_rel]`, distance `[n, m]` (query pos - key pos) -> bias `[nH, n, m]` (0 outside [0, R))."""
        extent = self.proj.shape[1]
        table = (r @ self.proj).transpose(0, 1)  # [nH, n, R]
        index = distance.clamp(0, extent - 1).expand(table.shape[0], -1, -1)  # [nH, n, m]
        bias = table.gather(-1, index)
        return bias.masked_fill((distance < 0) | (distance >= extent), 0.0)


class Attention(nn.Module):
    """q/k/v/r projections, k/v short convs, per-head q/k RMSNorm, 1/hd scores + relative bias, tau on globals."""

    def __init__(self, config: TextConfig, layer: int, ops: Ops = REFERENCE):
        super().__init__()
        geo = config.layer_geometry(layer)
        h, d = config.hidden_size, geo.head_dim
        self.geo, self.layer = geo, layer
        self.log_scaling = (config.log_scaling_n_floor, config.log_scaling_alpha) if geo.log_scaling else None
        # q, k, v and r projections (wq_du, wk_dv, wv_dv, wr_du of the checkpoint) as one stack of rows
        self.widths = (geo.q_width, geo.kv_width, geo.kv_width, geo.num_heads * config.d_rel)
        self.qkvr = Linear(h, sum(self.widths), ops)
        self.wo_ud = Linear(geo.q_width, h, ops)
        self.k_sconv = ShortConv(geo.kv_width, config.conv_kernel_size, layer, K_CONV)
        self.v_sconv = ShortConv(geo.kv_width, config.conv_kernel_size, layer, V_CONV)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, ops)
        self.rel_logits_proj = RelativeLogits(config.d_rel, geo.rel_extent)

    def tau(self, positions: torch.Tensor) -> torch.Tensor:
        """Log-scaling factor per absolute query position, fp32 (spec 3.5)."""
        n_floor, alpha = self.log_scaling
        return 1.0 + alpha * torch.log(((positions + 1).float() / n_floor).clamp(min=1.0))

    def project(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """u `[T, H]` -> q `[T, nH, hd]`, r `[T, nH, d_rel]`, k0, v0 `[T, nKV*hd]` (one GEMM)."""
        geo, t = self.geo, u.shape[0]
        q, k0, v0, r = self.qkvr(u).split(self.widths, dim=-1)  # [T, nH*hd], [T, nKV*hd] x2, [T, nH*d_rel]
        return q.view(t, geo.num_heads, geo.head_dim), r.view(t, geo.num_heads, -1), k0, v0

    def forward(self, u: torch.Tensor, step: PreparedBatch) -> torch.Tensor:
        q, r, k0, v0 = self.project(u)
        out = step.attention(self, q, r, k0, v0)  # [T, nH, hd]: q/k norms, k/v convs, KV write, attention
        return self.wo_ud(out.reshape(u.shape[0], self.geo.q_width))  # [T, H]

    def store_kv(
        self, k0: torch.Tensor, v0: torch.Tensor, start: int, cache: LayerCache
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Convolve and k-norm the new keys/values, append them; -> every visible key/value and its first position."""
        geo, n = self.geo, k0.shape[0]
        k, k_state = self.k_sconv.step(k0, cache.conv_state(K_CONV))
        v, v_state = self.v_sconv.step(v0, cache.conv_state(V_CONV))
        cache.set_conv_state(K_CONV, k_state)
        cache.set_conv_state(V_CONV, v_state)
        k = self.k_norm(k.view(n, geo.num_kv_heads, geo.head_dim))  # [n, nKV, hd]
        v = v.view(n, geo.num_kv_heads, geo.head_dim)  # [n, nKV, hd]
        return cache.append_kv(k, v, start)  # [m, nKV, hd] x2, position of keys[0]

    def attend(
        self, q: torch.Tensor, r: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor, first: int
    ) -> torch.Tensor:
        """q `[n, nH, hd]`, r `[n, nH, d_rel]` of queries at `start..` against keys from `first` -> `[n, nH, hd]`."""
        geo, n = self.geo, q.shape[0]
        q_pos = torch.arange(start, start + n, device=q.device)
        k_pos = torch.arange(first, first + keys.shape[0], device=q.device)
        distance = q_pos[:, None] - k_pos[None, :]  # [n, m]
        bias = self.rel_logits_proj(r, distance)  # [nH, n, m]
        if self.log_scaling is not None:
            tau = self.tau(q_pos)  # [n]
            q = (q.float() * tau[:, None, None]).to(q.dtype)
            bias = (bias.float() * tau[None, :, None]).to(bias.dtype)

        group = geo.num_heads // geo.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [nH, m, hd]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)  # [nH, m, hd]
        scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) * (1.0 / geo.head_dim) + bias  # [nH, n, m]
        hidden = distance < 0
        if geo.window is not None:
            hidden |= distance >= geo.window  # a query sees itself and W-1 previous tokens
        scores = scores.masked_fill(hidden, -math.inf)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return (probs @ values).transpose(0, 1)  # [n, nH, hd]


class DenseMLP(nn.Module):
    """`global_scale * W2 (silu(Wg x) * (Wu x))`; `w13_dn` holds [gate; up] rows (de-interleaved at load)."""

    def __init__(self, hidden: int, width: int, ops: Ops = REFERENCE):
        super().__init__()
        self.width = width
        self.w13_dn = nn.Linear(hidden, 2 * width, bias=False)
        self.w2_md = nn.Linear(width, hidden, bias=False)
        self.global_scale = nn.Parameter(torch.ones(1))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.ops.swiglu(x, self.w13_dn.weight, self.width)  # silu(Wg x) * (Wu x)  [T, I]
        return self.ops.linear(act, self.w2_md.weight, scale=self.global_scale)  # [T, H]


class Router(nn.Module):
    """Sigmoid + bias top-k over routed experts, weights renormalised with the shared experts as a sink,
    times route_scale * global_scale; all fp32 (spec 5.2, `Ops.route`)."""

    def __init__(self, config: TextConfig, ops: Ops = REFERENCE):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.route_scale = config.route_scale
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts + config.n_shared_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))
        self.global_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> (expert ids `[T, k]`, routed weights `[T, k]`, shared gammas `[T, S]`), weights fp32."""
        return self.ops.route(x, self.weight, self.bias, self.top_k, self.route_scale, self.global_scale)


class Bf16Experts(nn.Module):
    """Routed SwiGLU experts, stacks `w13_weight [E, 2I, H]` ([gate; up] rows) and `w2_weight [E, H, I]`."""

    def __init__(self, config: TextConfig, ops: Ops = REFERENCE, tp: TPGroup = SINGLE):
        super().__init__()
        (e, i), h = tp.expert_shape(config.n_routed_experts, config.moe_intermediate_size), config.hidden_size
        self.w13_weight = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.w2_weight = nn.Parameter(torch.zeros(e, h, i))
        self.moe = ops.bf16_experts(h, i)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, plus: torch.Tensor | None = None):
        """x `[T, H]`, ids / weights `[T, k]` -> `[T, H]` (`+ plus` when given)."""
        return self.moe(x, ids, weights, self.w13_weight, self.w2_weight, plus=plus)


class NVFP4Experts(nn.Module):
    """Routed SwiGLU experts as the checkpoint stores them in NVFP4 (`common/nvfp4.py`): per stack the packed codes
    (uint8 `[E, R, C/2]`), e4m3 block scales `[E, R, C/16]` and an fp32 scale per expert `[E]`. Where the ops ask
    for it (`Ops.nvfp4_shuffled`), the stacks are re-laid in `inkling_kernels.moe.shuffle_nvfp4`'s layout when loaded
    (the same values; uint8 block scales say so): adopted tensors in the checkpoint's layout are replaced by new
    ones."""

    def __init__(self, config: TextConfig, ops: Ops = REFERENCE, tp: TPGroup = SINGLE):
        super().__init__()
        (e, i), h = tp.expert_shape(config.n_routed_experts, config.moe_intermediate_size), config.hidden_size
        for name, rows, cols in (("w13_weight", 2 * i, h), ("w2_weight", h, i)):
            self.register_buffer(name, torch.zeros(e, rows, cols // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.zeros(e, rows, cols // 16, dtype=torch.float8_e4m3fn))
            self.register_buffer(f"{name}_scale2", torch.zeros(e, dtype=torch.float32))
        self.moe = ops.nvfp4_experts(h, i)
        self.shuffled = ops.nvfp4_shuffled(h, i)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if not self.shuffled:
            return
        from inkling_kernels.moe import shuffle_nvfp4

        for stack in ("w13_weight", "w2_weight"):
            packed, scale = getattr(self, stack), getattr(self, f"{stack}_scale")
            if scale.dtype == torch.float8_e4m3fn and not packed.is_meta and not scale.is_meta:
                packed, scale = shuffle_nvfp4(packed, scale)
                setattr(self, stack, packed)
                setattr(self, f"{stack}_scale", scale)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, plus: torch.Tensor | None = None):
        """x `[T, H]`, ids / weights `[T, k]` -> `[T, H]` (`+ plus` when given)."""
        return self.moe(
            x, ids, weights,
            self.w13_weight, self.w13_weight_scale, self.w13_weight_scale2,
            self.w2_weight, self.w2_weight_scale, self.w2_weight_scale2,
            plus=plus,
        )  # fmt: skip


class SharedExperts(nn.Module):
    """S always-on SwiGLU experts weighted by their router gammas, summed in fp32 (spec 5.3). The down weights
    `[S, H, I]` live in `[H, S, I]` storage (the K-concatenated down projection the fast ops run as one GEMM)."""

    def __init__(self, config: TextConfig, ops: Ops = REFERENCE):
        super().__init__()
        s, i, h = config.n_shared_experts, config.moe_intermediate_size, config.hidden_size
        self.shared_w13_weight = nn.Parameter(torch.zeros(s, 2 * i, h))
        self.shared_w2_weight = nn.Parameter(torch.zeros(h, s, i).permute(1, 0, 2))  # [S, H, I]
        self.ops = ops

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        """x `[T, H]`, gammas `[T, S]` -> `[T, H]`."""
        return self.ops.shared_experts(x, gammas, self.shared_w13_weight, self.shared_w2_weight)


class MoE(nn.Module):
    def __init__(self, config: TextConfig, ops: Ops = REFERENCE, nvfp4: bool = False, tp: TPGroup = SINGLE):
        super().__init__()
        self.gate = Router(config, ops)
        self.experts = NVFP4Experts(config, ops, tp) if nvfp4 else Bf16Experts(config, ops, tp)
        self.shared_experts = SharedExperts(config, ops)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights, gammas = self.gate(x)  # [T, k], [T, k], [T, S]
        ids, weights = self.tp.local_routes(ids, weights)  # expert parallel: other ranks' experts masked
        return self.experts(x, ids, weights, plus=self.shared_experts(x, gammas))  # routed + shared


class DecoderLayer(nn.Module):
    """With tensor parallelism (`tp`, `config` holding the rank's local sizes) attention and the MLP return partial
    sums, completed by one all-reduce each; the residual convs and norms run on the full hidden."""

    def __init__(self, config: TextConfig, layer: int, ops: Ops = REFERENCE, nvfp4: bool = False, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        h, k = config.hidden_size, config.conv_kernel_size
        self.attn_norm = RMSNorm(h, config.rms_norm_eps, ops)
        self.attn = Attention(config, layer, ops)
        self.attn_sconv = ShortConv(h, k, layer, ATTN_CONV)
        self.mlp_norm = RMSNorm(h, config.rms_norm_eps, ops)
        if config.dense_layers[layer]:
            self.mlp = DenseMLP(h, config.dense_intermediate_size, ops)
        else:
            self.mlp = MoE(config, ops, nvfp4, tp)
        self.mlp_sconv = ShortConv(h, k, layer, MLP_CONV)

    def forward(self, h: torch.Tensor, step: PreparedBatch) -> torch.Tensor:
        """h `[T, H]` -> `[T, H]`."""
        reduce = self.tp.all_reduce  # sums the ranks' partial outputs (identity at size 1)
        h = self.attn_sconv(reduce(self.attn(self.attn_norm(h), step)), step, residual=h)  # h + attn_sconv(attn(.))
        h = self.mlp_sconv(reduce(self.mlp(self.mlp_norm(h))), step, residual=h)  # h + mlp_sconv(mlp(mlp_norm(h)))
        return h
