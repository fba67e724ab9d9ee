"""The decoder's hot ops as one bundle, chosen once when the model is built.

`Ops` is the torch reference (the math of spec/inkling-text.md sections 2-5, what test_parity compares with
transformers); `decode_service.model.fast_path.TritonOps` overrides the same methods with the Triton kernels of
`inkling_kernels/`. The modules of `layers.py` take their bundle at construction and never ask which one it is; where a
kernel does not take a layer's shapes, the bundle hands that layer the reference at build time
(`bf16_experts`, `nvfp4_experts`).
Attention and the short convs run through an attention backend instead (`backend.py`), which asks only
`attention_kernels`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from common.nvfp4 import dequant_nvfp4
from inkling_kernels.fp8_head import fp8_logits_reference
from inkling_kernels.moe import MASKED_ROUTE, unshuffle_nvfp4
from inkling_kernels.rms_norm import rms_norm_reference
from inkling_kernels.router import route_reference
from inkling_kernels.skinny_gemm import skinny_linear_reference, skinny_swiglu_reference

if TYPE_CHECKING:
    from decode_service.model.collectives import TPGroup

# x [T, H], ids [T, k], weights [T, k], then the expert stacks (and `plus=` [T, H] or None) -> [T, H] in x's
# dtype, `+ plus` when given; a route of id MASKED_ROUTE (expert parallelism: another rank's expert) reaches no
# expert and adds nothing
RoutedExperts = Callable[..., torch.Tensor]


def add_plus(routed: torch.Tensor, plus: torch.Tensor | None) -> torch.Tensor:
    """`routed + plus` (torch's add: an fp32 sum of the two, rounded), or routed alone."""
    return routed if plus is None else routed + plus


class Ops:
    """The torch reference of every op."""

    name = "reference"
    attention_kernels = False  # the attention backends' kernels (packed prefill/decode, the paged decode step)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`w * round(x * rsqrt(mean(x^2) + eps))` over the last axis: normalise in fp32, round to x's dtype."""
        return rms_norm_reference(x, weight, eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x `[T, K]`, weight `[N, K]` -> `x W^T` `[T, N]` in x's dtype, times the one-element `scale` if given."""
        return skinny_linear_reference(x, weight, scale=scale)

    def swiglu(
        self, x: torch.Tensor, w13: torch.Tensor, width: int, gammas: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x `[T, K]`, w13 `[G*2I, K]` (G groups of [gate; up] rows, I = width) -> `silu(gate) * up` `[T, G*I]`,
        group g times `gammas[:, g]` (fp32 `[T, G]`, rounded to x's dtype) if given."""
        return skinny_swiglu_reference(x, w13, width, gammas=gammas)

    def unembed(
        self, hidden: torch.Tensor, weight: torch.Tensor, divisor: float, tp: TPGroup, vocab: int
    ) -> torch.Tensor:
        """`[N, H]` final-normed rows, the (vocab-parallel) unembedding `[V/n, H]` -> their product `[N, vocab]` in
        the rows' dtype: the muP division (a true division, spec 9.8), the product gathered over `tp`, padded
        columns dropped (a view)."""
        z = hidden / divisor
        return tp.gather_vocab(F.linear(z, weight))[:, :vocab]

    def logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, divisor: float, tp: TPGroup, vocab: int
    ) -> torch.Tensor:
        """`unembed` as fp32 logits `[N, vocab]`."""
        return self.unembed(hidden, weight, divisor, tp, vocab).float()

    def argmax_logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, divisor: float, tp: TPGroup, vocab: int
    ) -> torch.Tensor:
        """`logits(...).argmax(-1)` as int64 `[N]` without the fp32 copy: the argmax of `unembed` (the cast to fp32
        is exact, so the values, their ties and the first index among them are the same)."""
        return self.unembed(hidden, weight, divisor, tp, vocab).argmax(-1)

    def argmax_rows(self, values: torch.Tensor) -> torch.Tensor:
        """`[N, V]` -> int64 `[N]`, `values.argmax(-1)` (the first of equal values, NaN above everything)."""
        return values.argmax(-1)

    def fp8_logits(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        divisor: float,
        tp: TPGroup,
        vocab: int,
    ) -> torch.Tensor:
        """`logits` through an FP8 copy of the unembedding (e4m3 `[V/n, H]`, fp32 row scales `[V/n]`,
        `inkling_kernels.fp8_head.quantize_rows_fp8`): the same division, products in fp32, logits not rounded."""
        return tp.gather_vocab(fp8_logits_reference(hidden, weight, scale, divisor=divisor))[:, :vocab]

    def route(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        top_k: int,
        route_scale: float,
        global_scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[T, H]`, gate weight `[E+S, H]`, bias `[E]` -> (ids `[T, k]`, routed weights `[T, k]`, shared gammas
        `[T, S]`), weights fp32: sigmoid + bias top-k, renormalised with the shared experts as a sink (spec 5.2)."""
        return route_reference(x, weight, bias, top_k, route_scale, global_scale)

    def moe_kernels(self, hidden: int, width: int) -> bool:
        """Whether routed experts of these widths run on fused kernels."""
        return False

    def bf16_experts(self, hidden: int, width: int) -> RoutedExperts:
        """The routed-expert op for plain stacks `w13 [E, 2I, H]`, `w2 [E, H, I]` of these widths."""
        return bf16_experts_reference

    def nvfp4_experts(self, hidden: int, width: int) -> RoutedExperts:
        """The routed-expert op for NVFP4 stacks (packed, scale, scale2 for w13 and w2) of these widths."""
        return nvfp4_experts_reference

    def nvfp4_shuffled(self, hidden: int, width: int) -> bool:
        """Whether `NVFP4Experts` of these widths keep their stacks in `inkling_kernels.moe.shuffle_nvfp4`'s layout (the
        kernels'; every NVFP4 op also takes it, told by its uint8 block scales)."""
        return False

    def shared_experts(
        self,
        x: torch.Tensor,
        gammas: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        """x `[T, H]`, gammas `[T, S]`, w13 `[S, 2I, H]`, w2 `[S, H, I]` -> `[T, H]`: the S SwiGLU experts weighted
        by their gammas, summed in fp32 (spec 5.3); the routed experts add it (`plus`)."""
        width = w2.shape[-1]
        gate, up = (x[None] @ w13.transpose(1, 2)).split(width, dim=-1)  # [S, T, I] x2
        act = F.silu(gate) * up * gammas.to(x.dtype).T[:, :, None]
        return (act @ w2.transpose(1, 2)).float().sum(0).to(x.dtype)  # [T, H]


def _experts_loop(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """`out[t] = sum_i w[t, i] * W2_e (silu(Wg_e x_t) * (Wu_e x_t))`, one used expert at a time (masked routes
    skipped)."""
    out = torch.zeros_like(x)  # [T, H]
    weights = weights.to(x.dtype)
    for e in ids.unique().tolist():
        if e == MASKED_ROUTE:
            continue
        token, slot = torch.where(ids == e)
        w13, w2 = expert(e)  # [2I, H], [H, I] in x's dtype
        gate, up = (x[token] @ w13.T).split(w2.shape[1], dim=-1)
        y = (F.silu(gate) * up) @ w2.T  # [n_e, H]
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def bf16_experts_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    plus: torch.Tensor | None = None,
) -> torch.Tensor:
    return add_plus(_experts_loop(x, ids, weights, lambda e: (w13[e], w2[e])), plus)


def _canonical(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's stack in the checkpoint's layout (a shuffled one, uint8 scales, read back)."""
    return unshuffle_nvfp4(packed, scale) if scale.dtype == torch.uint8 else (packed, scale)


def nvfp4_experts_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale2: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale2: torch.Tensor,
    plus: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each used expert dequantised (`common.nvfp4`) to x's dtype, then the bf16 math."""

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        g13 = dequant_nvfp4(*_canonical(w13[e], w13_scale[e]), w13_scale2[e])
        g2 = dequant_nvfp4(*_canonical(w2[e], w2_scale[e]), w2_scale2[e])
        return g13.to(x.dtype), g2.to(x.dtype)

    return add_plus(_experts_loop(x, ids, weights, expert), plus)


REFERENCE = Ops()
