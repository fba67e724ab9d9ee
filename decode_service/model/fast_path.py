"""The decoder's Triton op bundle (`TritonOps`), and which bundle a model is built with (`resolve_ops`).

`TritonOps` is `Ops` with the hot ops on the kernels of `inkling_kernels/`: the dense linears where `skinny_gemm` beats
cuBLAS (`skinny_gemm.preferred`: one row), i.e. the projections, the dense MLP and the shared experts with their
SwiGLU, scale and gammas in the epilogue (for more rows cuBLAS, the SwiGLU in one pass of `inkling_kernels.swiglu`), and
the lm_head with its muP division and fp32 logits (the MTP drafter's FP8 copy of it on `fp8_head`, any rows);
`rms_norm`, `route` (the MoE gate in two launches), the routed experts (`nvfp4_moe` on the packed weights re-laid
at load by `inkling_kernels.moe.shuffle_nvfp4`, or `bf16_moe`, tiles shrunk to divide H and I; layers whose widths no
tile divides keep the reference, decided when the layer is built), the shared experts as two GEMMs over the stacked
experts (the routed experts' sum adds their output: `plus`), and `attention_kernels`, which gives the attention
backends their kernels (`packed.py`: prefill / one-token-per-sequence attention over each `LayerCache`'s visible
keys; `paged.py`: the decode step over the engine's pools, which the engine captures in CUDA graphs).

`resolve_ops` maps a name to a bundle once, at build: "auto" (the default) takes the kernels for a CUDA device when
Triton is installed, "reference" never does (benchmarks and parity checks on the GPU), "fast" always does (CPU
tests under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from decode_service.model.ops import REFERENCE, Ops, RoutedExperts

log = logging.getLogger(__name__)

OPS = ("auto", "reference", "fast")
_MIN_TILE = 16  # smallest tile edge the kernels are written for


@functools.cache
def _triton_available() -> bool:
    """Asked only for CUDA devices, so a missing Triton is said once rather than silently running slow."""
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("Triton is not importable: the decoder runs its torch reference ops on CUDA (slow)")
        return False
    return True


def _fit(tile: int, dim: int) -> int | None:
    """The largest power-of-two divisor of `tile` (>= 16) that divides `dim`, or None."""
    while tile >= _MIN_TILE and dim % tile:
        tile //= 2
    return tile if tile >= _MIN_TILE else None


@functools.cache
def _moe_config(n_pairs: int, hidden: int, width: int, fp32: bool = False, fp4: bool = True, shuffled: bool = False):
    """The kernels' measured default tiles for this many (token, slot) pairs (and layout), shrunk to divide H and I;
    fp32 activations get two pipeline stages (three overflow the H200's shared memory at Inkling-Small widths)."""
    from inkling_kernels.moe import MoeConfig, default_config

    base = default_config(n_pairs, fp4, shuffled)
    tiles = {
        "num_stages": min(base.num_stages, 2) if fp32 else base.num_stages,
        "block_n13": _fit(base.block_n13, width),
        "block_k13": _fit(base.block_k13, hidden),
        "block_n2": _fit(base.block_n2, hidden),
        "block_k2": _fit(base.block_k2, width),
    }
    if None in tiles.values():
        return None
    split_k13 = base.split_k13 if hidden % (tiles["block_k13"] * base.split_k13) == 0 else 1
    if base.kperm and min(tiles["block_k13"], tiles["block_k2"]) < 32:  # kperm permutes K in steps of 32
        tiles["kperm"] = False
    return MoeConfig(**{**base.__dict__, **tiles, "split_k13": split_k13})


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight^T` takes the skinny-GEMM kernel: rows and weight rows where it beat cuBLAS
    (`skinny_gemm.preferred`), one float dtype, unit last strides."""
    from inkling_kernels.skinny_gemm import preferred

    return (
        x.dim() == 2
        and preferred(x.shape[0], weight.shape[0])
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def _bf16_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    plus: torch.Tensor | None = None,
) -> torch.Tensor:
    from inkling_kernels.moe import bf16_moe

    config = _moe_config(ids.numel(), x.shape[1], w2.shape[-1], x.dtype == torch.float32, fp4=False)
    return bf16_moe(x, ids, weights.float(), w13, w2, config=config, plus=plus)


def _nvfp4_moe(x, ids, weights, w13, w13_scale, w13_scale2, w2, w2_scale, w2_scale2, plus=None) -> torch.Tensor:
    from inkling_kernels.moe import nvfp4_moe

    shuffled = w13_scale.dtype == torch.uint8
    config = _moe_config(ids.numel(), x.shape[1], 2 * w2.shape[-1], x.dtype == torch.float32, shuffled=shuffled)
    return nvfp4_moe(
        x, ids, weights.float(),
        w13, w13_scale, w13_scale2, w2, w2_scale, w2_scale2,
        config=config, shuffled=shuffled, plus=plus,
    )  # fmt: skip


class TritonOps(Ops):
    """`Ops` on the Triton kernels (same math; the kernels' tests bound the difference)."""

    name = "fast"
    attention_kernels = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """One launch; x `[..., C]` (per-head norms pass `[T, nH, hd]`, read in place from a projection's view)."""
        from inkling_kernels.rms_norm import rms_norm

        if x.dim() == 3 and x.stride(-1) == 1:
            return rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1])  # [N, C], a view for contiguous rows
        return rms_norm(rows, weight, eps).view(x.shape)

    def linear(self, x, weight, scale=None):
        """One launch for decode rows (`skinny_linear`, the scale fused); cuBLAS for more rows."""
        from inkling_kernels.skinny_gemm import skinny_linear

        if _skinny(x, weight) and (scale is None or (scale.numel() == 1 and scale.dtype == x.dtype)):
            return skinny_linear(x, weight, scale=scale)
        return super().linear(x, weight, scale)

    def swiglu(
        self, x: torch.Tensor, w13: torch.Tensor, width: int, gammas: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One launch for decode rows (`skinny_swiglu`: both products and the SwiGLU); for more rows cuBLAS, then
        the SwiGLU (and gammas) in one pass (`inkling_kernels.swiglu`)."""
        from inkling_kernels.skinny_gemm import skinny_swiglu
        from inkling_kernels.swiglu import swiglu

        if x.dim() != 2 or (gammas is not None and gammas.dtype != torch.float32):
            return super().swiglu(x, w13, width, gammas)
        if _skinny(x, w13):
            return skinny_swiglu(x, w13, width, gammas=gammas)
        return swiglu(F.linear(x, w13), width, gammas)  # [T, G*I]

    def logits(self, hidden, weight, divisor, tp, vocab):
        """One launch for decode rows on one rank (`skinny_linear` over the unpadded vocabulary rows, the division
        fused, the rounded logits stored as fp32); for more rows the reference's product (`unembed`), its unpadded
        columns cast by `float_rows` (one pass over the strided view, exact)."""
        from inkling_kernels.float_rows import float_rows
        from inkling_kernels.skinny_gemm import skinny_linear

        if tp.size == 1 and _skinny(hidden, weight):
            return skinny_linear(hidden, weight[:vocab], divisor=divisor, out_dtype=torch.float32)
        product = self.unembed(hidden, weight, divisor, tp, vocab)
        if product.dim() == 2 and product.dtype in (torch.float16, torch.bfloat16) and product.stride(-1) == 1:
            return float_rows(product)
        return product.float()

    def argmax_logits(self, hidden, weight, divisor, tp, vocab):
        """On one rank: for decode rows the argmax fused into the lm_head's launch (`skinny_argmax`: the products of
        `logits`' kernel, per program the largest, and a reduce launch; no logits stored), for more rows
        `inkling_kernels.argmax.argmax_rows` over `unembed` (the reference's product); the reference otherwise."""
        from inkling_kernels.argmax import argmax_rows
        from inkling_kernels.skinny_gemm import skinny_argmax

        if tp.size > 1 or hidden.dim() != 2 or hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return super().argmax_logits(hidden, weight, divisor, tp, vocab)
        if _skinny(hidden, weight):
            return skinny_argmax(hidden, weight[:vocab], divisor=divisor)
        return argmax_rows(self.unembed(hidden, weight, divisor, tp, vocab))

    def argmax_rows(self, values):
        """One reduction over each row in place (`inkling_kernels.argmax.argmax_rows`: torch.argmax's ties and NaN
        order, no copy of a strided view such as the product's unpadded columns)."""
        from inkling_kernels.argmax import argmax_rows
        from inkling_kernels.float_rows import is_float_rows

        if is_float_rows(values) and values.shape[1]:
            return argmax_rows(values)
        return super().argmax_rows(values)

    def fp8_logits(self, hidden, weight, scale, divisor, tp, vocab):
        """One launch for any number of rows (`inkling_kernels.fp8_head`: the division fused, fp32 logits)."""
        from inkling_kernels.fp8_head import fp8_logits

        if hidden.dtype in (torch.float32, torch.float16, torch.bfloat16) and hidden.stride(-1) == 1:
            return tp.gather_vocab(fp8_logits(hidden, weight, scale, divisor=divisor))[:, :vocab]
        return super().fp8_logits(hidden, weight, scale, divisor, tp, vocab)

    def route(self, x, weight, bias, top_k, route_scale, global_scale):
        """Two launches: fp32 logits GEMV, then sigmoid/top-k/sink renorm/scales."""
        from inkling_kernels.router import route

        return route(x, weight, bias, top_k, route_scale, global_scale)

    def moe_kernels(self, hidden: int, width: int) -> bool:
        return _moe_config(1, hidden, width) is not None

    def bf16_experts(self, hidden: int, width: int) -> RoutedExperts:
        return _bf16_moe if self.moe_kernels(hidden, width) else super().bf16_experts(hidden, width)

    def nvfp4_experts(self, hidden: int, width: int) -> RoutedExperts:
        return _nvfp4_moe if self.moe_kernels(hidden, width) else super().nvfp4_experts(hidden, width)

    def nvfp4_shuffled(self, hidden: int, width: int) -> bool:
        """The kernels' layout wherever they run the experts on K tiles it takes (~25% fewer instructions per weight
        than the checkpoint's; decisions 2026-12-01, issue 17): every default K tile (128 or 256) shrinks to
        `SHUFFLED_MIN_BLOCK_K` or more exactly when H and I are multiples of it."""
        from inkling_kernels.moe import SHUFFLED_MIN_BLOCK_K

        return self.moe_kernels(hidden, width) and hidden % SHUFFLED_MIN_BLOCK_K == width % SHUFFLED_MIN_BLOCK_K == 0

    def shared_experts(self, x, gammas, w13, w2):
        """Two GEMMs: every expert's [gate; up] rows stacked along N, then the gamma-scaled activations against the
        down weights concatenated along K, whose reduction sums the experts (in fp32). Needs w2 `[S, H, I]` stored
        as `[H, S, I]` (what `SharedExperts` and `InklingDecoder.from_weights` keep)."""
        if not w2.permute(1, 0, 2).is_contiguous():
            raise ValueError(f"shared_w2_weight: expected [S, H, I] viewed from [H, S, I] storage, got strides "
                             f"{w2.stride()} for shape {tuple(w2.shape)}")  # fmt: skip
        h = x.shape[1]
        s, i = gammas.shape[1], w2.shape[-1]
        w2 = w2.permute(1, 0, 2).reshape(h, s * i)  # [H, S*I], a view
        act = self.swiglu(x, w13.view(s * 2 * i, h), i, gammas.float())  # [T, S*I], the gammas applied
        return self.linear(act, w2)  # [T, H]; the routed experts' sum adds it (`plus`)


FAST = TritonOps()


def resolve_ops(ops: Ops | str, device: torch.device | str) -> Ops:
    """The bundle a model built on `device` runs: an `Ops` as given, or one of `OPS` by name."""
    if isinstance(ops, Ops):
        return ops
    if ops not in OPS:
        raise ValueError(f"ops {ops!r}: expected one of {OPS} or an Ops instance")
    if ops == "auto":
        return FAST if torch.device(device).type == "cuda" and _triton_available() else REFERENCE
    return FAST if ops == "fast" else REFERENCE


class _BuiltModel(Protocol):
    paged: object | None  # `InklingDecoder.paged`: its `PagedBackend`, or None


def supports_batched_decode(model: _BuiltModel) -> bool:
    """Whether the engine may run this model's decode steps through `PagedDecode` (and capture them): the model
    was built with a paged backend, i.e. kernels for every op of such a step (no host-syncing reference inside)."""
    return model.paged is not None
