"""GPU fast path of the decoder: the same math as `layers.py`, with the hot ops on the Triton kernels of `kernels/`.

`layers.py` hands these ops over whenever `enabled(x)`:

* `rms_norm`, `route` (the MoE gate in two launches), `routed_experts` (`nvfp4_moe` on the packed weights as
  loaded, or `bf16_moe`, with tiles shrunk to divide H and I), `shared_experts` (two GEMMs over the stacked
  experts);
* for a `PagedDecode` batch (one new token per sequence, caches in the engine's pools; always routed here, with
  the kernels' torch references when the fast path is off): `conv_decode` (short conv + in-place state update)
  and `paged_decode_attention` (the prologue: k/v convs, k-norm, KV write; then split-KV attention through the
  block tables). Every op of that path is free of host syncs, so the engine captures it in CUDA graphs;
* for packed batches in which every sequence brings one token (`use_decode_attention`): `decode_attention` over
  the visible keys each `LayerCache` returns, padded into one `[B, S, nKV, hd]` buffer (two copies of the visible
  KV per layer; the paged path above avoids them);
* for the other packed batches (`use_prefill_attention`): `prefill_attention`, one flash-style launch per sequence
  over the visible keys its `LayerCache` returns.

`mode()` decides: "auto" (default) takes the fast path for CUDA tensors when Triton is installed, "reference" never
does (benchmarks and parity checks on the GPU), "fast" always does (CPU tests under `TRITON_INTERPRET=1`).

Not yet here: prefill over the paged pools in place (the engine's cache gathers a chunk's visible keys first), and
one launch for all the sequences of a packed batch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from decode_service.model.state import K_CONV, V_CONV

if TYPE_CHECKING:  # layers.py imports this module
    from decode_service.model.batch import PagedDecode, SequenceSlice
    from decode_service.model.inkling import InklingDecoder
    from decode_service.model.layers import Attention, Experts, RMSNorm, Router, SharedExperts, ShortConv

log = logging.getLogger(__name__)

MODES = ("auto", "reference", "fast")
_mode = "auto"
_MIN_TILE = 16  # smallest tile edge the kernels are written for
_MIN_D_REL = 16  # the attention kernel wants a power-of-two d_rel >= 16; smaller banks are zero-padded


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """Run a block with the fast path forced on ("fast"), off ("reference"), or chosen per device ("auto")."""
    global _mode
    if name not in MODES:
        raise ValueError(f"fast-path mode {name!r}: expected one of {MODES}")
    previous, _mode = _mode, name
    try:
        yield
    finally:
        _mode = previous


@functools.cache
def _triton_available() -> bool:
    """Asked only for CUDA tensors, so a missing Triton is said once rather than silently running slow."""
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("Triton is not importable: the decoder runs its torch reference path on CUDA (slow)")
        return False
    return True


def enabled(x: torch.Tensor) -> bool:
    if _mode == "reference":
        return False
    if _mode == "fast":
        return True
    return x.is_cuda and _triton_available()


# -- norms and gate ----------------------------------------------------------------------------------------------


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`RMSNorm.forward` in one launch; x `[..., C]` (per-head norms pass `[T, nH, hd]`)."""
    from kernels.rms_norm import rms_norm as kernel

    rows = x.reshape(-1, x.shape[-1])  # a view for contiguous rows (and for T = 1 of a strided projection)
    return kernel(rows, norm.weight, norm.eps).view(x.shape)


def route(router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Router.forward` in two launches: fp32 logits GEMV, then sigmoid/top-k/sink renorm/scales."""
    from kernels.router import route as kernel

    return kernel(x, router.weight, router.bias, router.top_k, router.route_scale, router.global_scale)


# -- batched decode over the paged pools -------------------------------------------------------------------------


def supports_batched_decode(model: InklingDecoder) -> bool:
    """Whether the engine may run this model's decode steps through `PagedDecode` (and capture them): the fast
    path is on for its device and every op of such a step has its kernel (no host-syncing reference inside)."""
    weight = model.embed.weight
    if not enabled(weight):
        return False
    config = model.config
    for i, layer in enumerate(model.layers):
        hd = config.layer_geometry(i).head_dim
        if hd < 16 or hd & (hd - 1):
            return False
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not use_routed_experts(experts, weight[:1]):
            return False
    return True


def conv_decode(
    conv: ShortConv, x: torch.Tensor, decode: PagedDecode, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`ShortConv.forward` for one token per sequence: x `[B, C]`, states read and written in their pool."""
    from kernels.short_conv import conv_decode as kernel
    from kernels.short_conv import conv_decode_reference

    fn = kernel if enabled(x) else conv_decode_reference
    y, _ = fn(x, decode.pools.conv_pool(conv.layer, conv.index), decode.conv_slots, conv.weight[:, 0, :], residual)
    return y


def paged_decode_attention(
    attn: Attention, q: torch.Tensor, r: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, decode: PagedDecode
) -> torch.Tensor:
    """q `[B, nH, hd]` (q-normed), r `[B, nH, d_rel]`, k0/v0 `[B, nKV*hd]` -> `[B, nH, hd]`: convolve, k-norm and
    store the new keys/values in the layer's pool, then attend through the block tables."""
    from kernels import attention, short_conv

    fast = enabled(q)
    pools, layer = decode.pools, attn.layer
    k_pool, v_pool, sliding = pools.kv_pool(layer)
    prologue = short_conv.kv_prologue if fast else short_conv.kv_prologue_reference
    prologue(
        k0, v0, pools.conv_pool(layer, K_CONV), pools.conv_pool(layer, V_CONV), decode.conv_slots,
        attn.k_sconv.weight[:, 0, :], attn.v_sconv.weight[:, 0, :], attn.k_norm.weight, attn.k_norm.eps,
        k_pool, v_pool, decode.kv_rows[sliding],
    )  # fmt: skip
    rel_proj, r = _rel_bank(attn, r)
    kernel = attention.paged_decode_attention if fast else attention.paged_attention_reference
    kwargs = {"max_seq_len": decode.max_seq_len} if fast else {}
    return kernel(
        q, r, rel_proj.to(q.dtype).contiguous(), k_pool, v_pool, decode.block_tables[sliding],
        decode.seq_lens, pools.page_size, window=attn.geo.window, log_scaling=_log_scaling(attn), **kwargs,
    )  # fmt: skip


def _rel_bank(attn: Attention, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P `[d_rel, R]` and r, zero-padded to the power-of-two d_rel >= 16 the attention kernels want (zero rows of
    P against zero columns of r add nothing to the bias)."""
    rel_proj = attn.rel_logits_proj.proj
    d_rel = rel_proj.shape[0]
    padded = max(_MIN_D_REL, 1 << (d_rel - 1).bit_length())
    if padded != d_rel:
        rel_proj = F.pad(rel_proj, (0, 0, 0, padded - d_rel))
        r = F.pad(r, (0, padded - d_rel))
    return rel_proj, r


def _log_scaling(attn: Attention) -> tuple[float, float] | None:
    """The kernels' `(alpha, n_floor)` for tau, or None on layers without log-scaling."""
    if attn.log_scaling is None:
        return None
    n_floor, alpha = attn.log_scaling
    return alpha, n_floor


# -- routed experts ----------------------------------------------------------------------------------------------


def _fit(tile: int, dim: int) -> int | None:
    """The largest power-of-two divisor of `tile` (>= 16) that divides `dim`, or None."""
    while tile >= _MIN_TILE and dim % tile:
        tile //= 2
    return tile if tile >= _MIN_TILE else None


@functools.cache
def _moe_config(n_pairs: int, hidden: int, width: int, fp32: bool = False):
    """The kernels' measured default tiles for this many (token, slot) pairs, shrunk to divide H and I; fp32
    activations get two pipeline stages (three overflow the H200's shared memory at Inkling-Small widths)."""
    from kernels.moe import MoeConfig, default_config

    base = default_config(n_pairs)
    tiles = {
        "num_stages": min(base.num_stages, 2) if fp32 else base.num_stages,
        "block_n13": _fit(base.block_n13, width),
        "block_k13": _fit(base.block_k13, hidden),
        "block_n2": _fit(base.block_n2, hidden),
        "block_k2": _fit(base.block_k2, width),
    }
    if None in tiles.values():
        return None
    return MoeConfig(**{**base.__dict__, **tiles})


def use_routed_experts(experts: Experts, x: torch.Tensor) -> bool:
    if not enabled(x) or x.dim() != 2:
        return False
    if not experts.nvfp4 and experts.w13_weight.dtype != x.dtype:
        return False
    return _moe_config(1, x.shape[1], experts.width) is not None


def routed_experts(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`Experts.forward` on the MoE kernels: x `[T, H]`, ids/weights `[T, k]` -> `[T, H]` in x's dtype."""
    from kernels.moe import bf16_moe, nvfp4_moe

    config = _moe_config(ids.numel(), x.shape[1], experts.width, x.dtype == torch.float32)
    ids, weights = ids.to(torch.int32), weights.float()
    if experts.nvfp4:
        return nvfp4_moe(
            x, ids, weights,
            experts.w13_weight, experts.w13_weight_scale, experts.w13_weight_scale2,
            experts.w2_weight, experts.w2_weight_scale, experts.w2_weight_scale2,
            config=config,
        )  # fmt: skip
    return bf16_moe(x, ids, weights, experts.w13_weight, experts.w2_weight, config=config)


# -- shared experts ----------------------------------------------------------------------------------------------


def use_shared_experts(shared: SharedExperts, x: torch.Tensor) -> bool:
    """The linearised form needs the down weights stored K-concatenated (`InklingDecoder.from_weights` does)."""
    return enabled(x) and shared.shared_w2_weight.permute(1, 0, 2).is_contiguous()


def shared_experts(shared: SharedExperts, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
    """`SharedExperts.forward` as two GEMMs: every expert's [gate; up] rows stacked along N, then the gamma-scaled
    activations against the down weights concatenated along K, whose reduction sums the experts (in fp32)."""
    t, h = x.shape
    s, i = gammas.shape[1], shared.width
    gate_up = (x @ shared.shared_w13_weight.view(s * 2 * i, h).T).view(t, s, 2, i)
    act = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1] * gammas.to(x.dtype)[:, :, None]  # [T, S, I]
    w2 = shared.shared_w2_weight.permute(1, 0, 2).reshape(h, s * i)  # [H, S*I], a view
    return act.reshape(t, s * i) @ w2.T


# -- decode attention --------------------------------------------------------------------------------------------

VisibleKV = tuple[torch.Tensor, torch.Tensor, int]  # keys, values `[m, nKV, hd]`, absolute position of keys[0]


def use_decode_attention(
    attn: Attention, q: torch.Tensor, seqs: Sequence[SequenceSlice], visible: Sequence[VisibleKV]
) -> bool:
    """One new token per sequence, a power-of-two head_dim >= 16, and, where tau depends on the absolute
    position, caches that start at position 0 (the kernel addresses keys by position)."""
    if not seqs or not enabled(q) or any(seq.num_tokens != 1 for seq in seqs):
        return False
    hd = attn.geo.head_dim
    if hd < 16 or hd & (hd - 1):
        return False
    return attn.log_scaling is None or all(first == 0 for _, _, first in visible)


def decode_attention(attn: Attention, q: torch.Tensor, r: torch.Tensor, visible: Sequence[VisibleKV]) -> torch.Tensor:
    """q `[B, nH, hd]` (q-normed), r `[B, nH, d_rel]`, each sequence's visible keys -> `[B, nH, hd]`.

    Keys are re-addressed from their first visible position: the relative bias and the window depend only on
    query-key distances, so sequence b's query sits at slot `m_b - 1` of a `[B, max m, nKV, hd]` buffer.
    """
    from kernels.attention import decode_attention as kernel

    keys = pad_sequence([k for k, _, _ in visible], batch_first=True).to(q.dtype)  # [B, S, nKV, hd]
    values = pad_sequence([v for _, v, _ in visible], batch_first=True).to(q.dtype)
    lengths = [k.shape[0] for k, _, _ in visible]
    seq_lens = torch.tensor(lengths, dtype=torch.int32).to(q.device, non_blocking=True)
    rel_proj, r = _rel_bank(attn, r)
    return kernel(
        q.contiguous(), r.contiguous(), rel_proj.to(q.dtype).contiguous(), keys, values, seq_lens,
        window=attn.geo.window, log_scaling=_log_scaling(attn), max_seq_len=max(lengths),
    )  # fmt: skip


# -- prefill attention -------------------------------------------------------------------------------------------


def use_prefill_attention(attn: Attention, q: torch.Tensor) -> bool:
    """The flash-style kernel for a sequence's chunk of queries: a power-of-two head_dim >= 16 (keys carry absolute
    positions, so tau needs nothing more)."""
    hd = attn.geo.head_dim
    return enabled(q) and hd >= 16 and not hd & (hd - 1)


def prefill_attention(
    attn: Attention, q: torch.Tensor, r: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor, first: int
) -> torch.Tensor:
    """`Attention.attend` on the prefill kernel: q `[n, nH, hd]` (q-normed) and r `[n, nH, d_rel]` of the queries at
    `start..`, the visible keys/values `[m, nKV, hd]` from position `first` (cast to q's dtype) -> `[n, nH, hd]`."""
    from kernels.attention import prefill_attention as kernel

    rel_proj, r = _rel_bank(attn, r)
    return kernel(
        q, r, rel_proj.to(q.dtype).contiguous(), keys.to(q.dtype), values.to(q.dtype), start, first,
        window=attn.geo.window, log_scaling=_log_scaling(attn),
    )  # fmt: skip
