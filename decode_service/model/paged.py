"""The paged attention backend: B sequences each bringing W tokens (a decode, or the verify of W-1 drafts), their
caches in the engine's paged pools.

Every field of a `PagedDecode` is a device tensor of static shape and every op here is a kernel free of host
syncs, so the engine captures the step in CUDA graphs (`engine/decode_graphs.py`). Per layer: `kv_prologue` (the
k/v short convs with their states updated in place, q- and k-norms, the KV write into the layer's pool) and
`paged_decode_attention` (split-KV attention through the block tables); the residual-stream convs run
`conv_decode`. A verify step (W > 1) runs the same attention with W query rows per sequence (each with its own
seq_len), and the `inkling_kernels.conv_verify` variants of the prologue and the convs, which leave the conv states to
the engine's commit. A model is built with this backend only when its ops have the attention kernels and every layer's
shapes fit them (`InklingDecoder.paged`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from decode_service.model.batch import ForwardBatch, PagedDecode
from decode_service.model.packed import log_scaling, rel_bank
from decode_service.model.state import K_CONV, V_CONV

if TYPE_CHECKING:
    from decode_service.model.layers import Attention, ShortConv


@dataclass
class PagedBackend:
    name: str = "paged"

    def prepare(self, batch: ForwardBatch) -> PagedBatch:
        if batch.decode is None:
            raise ValueError("batch.decode: the paged backend runs PagedDecode batches only")
        return PagedBatch(batch.decode)


@dataclass
class PagedBatch:
    decode: PagedDecode

    def attention(
        self, attn: Attention, q: torch.Tensor, r: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor
    ) -> torch.Tensor:
        """q `[B*W, nH, hd]` (q-normed in the prologue), r `[B*W, nH, d_rel]`, k0/v0 `[B*W, nKV*hd]` ->
        `[B*W, nH, hd]`. The prologue writes the k/v of all W rows first; attention then serves the W rows of a
        sequence in one program over its block table, each row's seq_len hiding the later rows' keys."""
        from inkling_kernels.attention import paged_decode_attention
        from inkling_kernels.conv_verify import kv_prologue_verify
        from inkling_kernels.short_conv import kv_prologue

        decode = self.decode
        pools, layer = decode.pools, attn.layer
        k_pool, v_pool, sliding = pools.kv_pool(layer)
        k_states, v_states = pools.conv_pool(layer, K_CONV), pools.conv_pool(layer, V_CONV)
        k_w, v_w = attn.k_sconv.weight[:, 0, :], attn.v_sconv.weight[:, 0, :]
        if decode.conv_windows is None:
            q = kv_prologue(
                k0, v0, k_states, v_states, decode.conv_slots, k_w, v_w, attn.k_norm.weight, attn.k_norm.eps,
                k_pool, v_pool, decode.kv_rows[sliding], q, attn.q_norm.weight, attn.q_norm.eps,
            )  # fmt: skip
        else:
            windows = decode.conv_windows
            q = kv_prologue_verify(
                k0, v0, k_states, v_states, decode.conv_slots, windows[layer, K_CONV], windows[layer, V_CONV],
                k_w, v_w, attn.k_norm.weight, attn.k_norm.eps, k_pool, v_pool, decode.kv_rows[sliding],
                q, attn.q_norm.weight, attn.q_norm.eps,
            )  # fmt: skip
        rel_proj, r = rel_bank(attn, r)
        return paged_decode_attention(
            q, r, rel_proj, k_pool, v_pool, decode.block_tables[sliding], decode.seq_lens, pools.page_size,
            window=attn.geo.window, log_scaling=log_scaling(attn), max_seq_len=decode.max_seq_len,
            rows_per_seq=decode.width,
        )  # fmt: skip

    def conv(self, conv: ShortConv, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x `[B*W, C]`, the states read and written in their pool (W = 1) or read, with the windows written
        (W > 1); the residual add fused into the launch."""
        from inkling_kernels.conv_verify import conv_verify
        from inkling_kernels.short_conv import conv_decode

        decode = self.decode
        pool = decode.pools.conv_pool(conv.layer, conv.index)
        if decode.conv_windows is not None:
            windows = decode.conv_windows[conv.layer, conv.index]
            return conv_verify(x, pool, decode.conv_slots, conv.weight[:, 0, :], windows, residual)
        y, _ = conv_decode(x, pool, decode.conv_slots, conv.weight[:, 0, :], residual)
        return y
