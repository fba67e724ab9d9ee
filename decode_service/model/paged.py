"""The paged attention backend: B sequences each bringing one token, their caches in the engine's paged pools.

Every field of a `PagedDecode` is a device tensor of static shape and every op here is a kernel free of host
syncs, so the engine captures the step in CUDA graphs (`engine/decode_graphs.py`). Per layer: `kv_prologue` (the
k/v short convs with their states updated in place, q- and k-norms, the KV write into the layer's pool) and
`paged_decode_attention` (split-KV attention through the block tables); the residual-stream convs run
`conv_decode`, which also emits the RMSNorm that reads the new residual next (`PagedBackend.for_layers`: a layer's
attention conv feeds its `mlp_norm`, its MLP conv the next layer's `attn_norm` or the final norm); that norm then
costs no launch of its own (`fused_norm`). A model is built with this backend only when its ops have the
attention kernels and every layer's shapes fit them (`InklingDecoder.paged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from decode_service.model.batch import ForwardBatch, PagedDecode
from decode_service.model.packed import log_scaling, rel_bank
from decode_service.model.state import K_CONV, V_CONV

if TYPE_CHECKING:
    from decode_service.model.layers import Attention, DecoderLayer, RMSNorm, ShortConv


@dataclass
class PagedBackend:
    norm_after: dict[ShortConv, RMSNorm] = field(default_factory=dict)  # residual conv -> the norm of its output
    name: str = "paged"

    @classmethod
    def for_layers(cls, layers: Sequence[DecoderLayer], final_norm: RMSNorm) -> PagedBackend:
        """The backend of a decoder running `layers` then `final_norm`: each residual conv fused with the RMSNorm
        that reads its output next."""
        norm_after = {}
        for layer, next_norm in zip(layers, [*(nxt.attn_norm for nxt in layers[1:]), final_norm], strict=True):
            norm_after[layer.attn_sconv] = layer.mlp_norm
            norm_after[layer.mlp_sconv] = next_norm
        return cls(norm_after)

    def prepare(self, batch: ForwardBatch) -> PagedBatch:
        if batch.decode is None:
            raise ValueError("batch.decode: the paged backend runs PagedDecode batches only")
        return PagedBatch(batch.decode, self.norm_after)


@dataclass
class PagedBatch:
    decode: PagedDecode
    norm_after: dict[ShortConv, RMSNorm]
    normed: tuple[torch.Tensor, RMSNorm, torch.Tensor] | None = None  # the last residual conv's (out, norm, normed)

    def attention(
        self, attn: Attention, q: torch.Tensor, r: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor
    ) -> torch.Tensor:
        """q `[B, nH, hd]` (q-normed in the prologue), r `[B, nH, d_rel]`, k0/v0 `[B, nKV*hd]` -> `[B, nH, hd]`."""
        from kernels.attention import paged_decode_attention
        from kernels.short_conv import kv_prologue

        decode = self.decode
        pools, layer = decode.pools, attn.layer
        k_pool, v_pool, sliding = pools.kv_pool(layer)
        q = kv_prologue(
            k0, v0, pools.conv_pool(layer, K_CONV), pools.conv_pool(layer, V_CONV), decode.conv_slots,
            attn.k_sconv.weight[:, 0, :], attn.v_sconv.weight[:, 0, :], attn.k_norm.weight, attn.k_norm.eps,
            k_pool, v_pool, decode.kv_rows[sliding], q, attn.q_norm.weight, attn.q_norm.eps,
        )  # fmt: skip
        rel_proj, r = rel_bank(attn, r)
        return paged_decode_attention(
            q, r, rel_proj, k_pool, v_pool, decode.block_tables[sliding], decode.seq_lens, pools.page_size,
            window=attn.geo.window, log_scaling=log_scaling(attn), max_seq_len=decode.max_seq_len,
        )  # fmt: skip

    def conv(self, conv: ShortConv, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x `[B, C]`, the states read and written in their pool; the residual add, and the RMSNorm that reads the
        new residual next (`norm_after`), fused into the launch."""
        from kernels.short_conv import conv_decode

        pool = self.decode.pools.conv_pool(conv.layer, conv.index)
        norm = self.norm_after.get(conv) if residual is not None else None
        weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        y, normed = conv_decode(x, pool, self.decode.conv_slots, conv.weight[:, 0, :], residual, weight, eps)
        self.normed = (y, norm, normed) if norm is not None else None
        return y

    def fused_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor | None:
        """`norm(x)` as the last residual conv emitted it, when x is that conv's output and `norm` its norm."""
        if self.normed is None or self.normed[0] is not x or self.normed[1] is not norm:
            return None
        return self.normed[2]
