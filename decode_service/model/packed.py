"""The packed attention backend: the sequences of a `ForwardBatch` back to back, each against its own `LayerCache`.

Any mix of prefill chunks and decode tokens. With the kernels, the k/v convs (with the k-norm) and the residual
convs run once over all the packed rows (`conv_prefill`, the states gathered from and stored back into the
caches), the new keys and values are appended to each sequence's cache, then attention, by one of four ops fixed
when the model is built and by the batch:

* torch (`Attention.attend`, the reference, per sequence: convs, KV append, attention) without attention kernels,
  or for a head_dim the kernels do not take (they want a power of two >= 16);
* with kernels, a batch in which every sequence brings one token: `decode_attention` over the visible keys padded
  into one `[B, S, nKV, hd]` buffer (two copies of the visible KV per layer; the paged backend avoids them), unless
  a log-scaled layer's cache does not start at position 0 (the kernel addresses keys by position);
* otherwise, over the engine's paged caches (`PagedLayerCache`): `paged_prefill_attention`, one launch for all
  the sequences, the visible keys read in place from the pools through each sequence's pages;
* otherwise `prefill_attention` per sequence over the visible keys its cache returns.

Not yet here: one attention launch for all the sequences of a packed batch over contiguous caches (each has its
own tensors), and the KV writes of all sequences in one launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.state import K_CONV, V_CONV, PagedKV, PagedLayerCache

if TYPE_CHECKING:
    from decode_service.model.layers import Attention, ShortConv

_MIN_D_REL = 16  # the attention kernels want a power-of-two d_rel >= 16; smaller banks are zero-padded

VisibleKV = tuple[torch.Tensor, torch.Tensor, int]  # keys, values `[m, nKV, hd]`, absolute position of keys[0]


def kernel_head_dim(head_dim: int) -> bool:
    """Whether the attention kernels take this head_dim (a power of two >= 16)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def rel_bank(attn: Attention, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P `[d_rel, R]` in r's dtype and r, zero-padded to the power-of-two d_rel >= 16 the attention kernels want
    (zero rows of P against zero columns of r add nothing to the bias)."""
    rel_proj = attn.rel_logits_proj.proj
    d_rel = rel_proj.shape[0]
    padded = max(_MIN_D_REL, 1 << (d_rel - 1).bit_length())
    if padded != d_rel:
        rel_proj = F.pad(rel_proj, (0, 0, 0, padded - d_rel))
        r = F.pad(r, (0, padded - d_rel))
    return rel_proj.to(r.dtype).contiguous(), r


def log_scaling(attn: Attention) -> tuple[float, float] | None:
    """The kernels' `(alpha, n_floor)` for tau, or None on layers without log-scaling."""
    if attn.log_scaling is None:
        return None
    n_floor, alpha = attn.log_scaling
    return alpha, n_floor


@dataclass
class PackedBackend:
    kernels: bool  # the Triton attention kernels (`Ops.attention_kernels`) or the torch reference
    name: str = "packed"

    def prepare(self, batch: ForwardBatch) -> PackedBatch:
        rows, offset = [], 0
        for seq in batch.sequences:
            rows.append(slice(offset, offset + seq.num_tokens))
            offset += seq.num_tokens
        one_token_each = bool(batch.sequences) and all(seq.num_tokens == 1 for seq in batch.sequences)
        segments = None
        if self.kernels:
            lengths = torch.tensor([seq.num_tokens for seq in batch.sequences], dtype=torch.int32)
            cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))  # [B+1]
            seq_ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)  # [T]
            meta = torch.cat([seq_ids, cu_seqlens])  # one upload, from pinned memory on CUDA (no wait on the queue)
            device = batch.token_ids.device
            meta = meta.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else meta
            segments = (meta[: len(seq_ids)], meta[len(seq_ids) :])
        return PackedBatch(self.kernels, batch.sequences, rows, one_token_each, segments)


@dataclass
class PackedBatch:
    kernels: bool
    sequences: list[SequenceSlice]
    rows: list[slice]  # each sequence's rows of the packed T
    one_token_each: bool
    segments: tuple[torch.Tensor, torch.Tensor] | None  # with kernels: seq_ids [T], cu_seqlens [B+1] (int32, device)

    def attention(
        self, attn: Attention, q: torch.Tensor, r: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor
    ) -> torch.Tensor:
        seqs = self.sequences
        q = attn.q_norm(q)
        if not (self.kernels and kernel_head_dim(attn.geo.head_dim)):
            visible = [
                attn.store_kv(k0[rows], v0[rows], seq.start_position, seq.layers[attn.layer])
                for rows, seq in zip(self.rows, seqs, strict=True)
            ]
            return self._per_sequence(attn.attend, q, r, visible)
        k, v = self._convolve_kv(attn, k0, v0)  # [T, nKV, hd] x2
        caches = [seq.layers[attn.layer] for seq in seqs]
        if not self.one_token_each and all(isinstance(cache, PagedLayerCache) for cache in caches):
            paged = [
                cache.append_kv_paged(k[rows], v[rows], seq.start_position)
                for rows, seq, cache in zip(self.rows, seqs, caches, strict=True)
            ]
            return paged_prefill_attention(attn, q, r, seqs, paged)  # [T, nH, hd]
        visible = [
            cache.append_kv(k[rows], v[rows], seq.start_position)
            for rows, seq, cache in zip(self.rows, seqs, caches, strict=True)
        ]
        if self.one_token_each and (attn.log_scaling is None or all(first == 0 for _, _, first in visible)):
            return decode_attention(attn, q, r, visible)  # [T, nH, hd]
        return self._per_sequence(partial(prefill_attention, attn), q, r, visible)

    def _per_sequence(self, attend, q: torch.Tensor, r: torch.Tensor, visible: list[VisibleKV]) -> torch.Tensor:
        """`attend(q, r, start, keys, values, first)` of each sequence's rows, concatenated -> `[T, nH, hd]`."""
        outs = [
            attend(q[rows], r[rows], seq.start_position, *kv)
            for rows, seq, kv in zip(self.rows, self.sequences, visible, strict=True)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def conv(self, conv: ShortConv, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernels:
            y, _ = self._conv(conv.layer, conv.index, conv.weight, x, residual)
            return y
        outputs = []
        for rows, seq in zip(self.rows, self.sequences, strict=True):
            cache = seq.layers[conv.layer]
            y, state = conv.step(x[rows], cache.conv_state(conv.index))
            cache.set_conv_state(conv.index, state)
            outputs.append(y)
        y = torch.cat(outputs)  # [T, C]
        return y if residual is None else residual + y

    def _conv(self, layer: int, index: int, weight: torch.Tensor, x: torch.Tensor, residual=None, norm=None):
        """One `conv_prefill` launch over every sequence's rows, the states gathered from and stored back into
        their caches; `norm` the per-head RMSNorm applied to the output."""
        from inkling_kernels.short_conv_prefill import conv_prefill

        caches = [seq.layers[layer] for seq in self.sequences]
        if len(caches) == 1:
            states = caches[0].conv_state(index)[None]  # [1, K-1, C], a view
        else:
            states = torch.stack([cache.conv_state(index) for cache in caches])  # [B, K-1, C]
        norm_weight, head_dim, eps = (
            (None, None, 1e-6) if norm is None else (norm.weight, norm.weight.shape[0], norm.eps)
        )
        y, new_states = conv_prefill(
            x, states, *self.segments, weight[:, 0, :], residual, norm_weight, head_dim, eps
        )  # [T, C], [B, K-1, C]
        for cache, state in zip(caches, new_states, strict=True):
            cache.set_conv_state(index, state)
        return y, new_states

    def _convolve_kv(self, attn: Attention, k0: torch.Tensor, v0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`Attention.store_kv`'s convs and k-norm for every sequence in two launches -> k, v `[T, nKV, hd]`."""
        geo = attn.geo
        k, _ = self._conv(attn.layer, K_CONV, attn.k_sconv.weight, k0, norm=attn.k_norm)  # [T, nKV*hd]
        v, _ = self._conv(attn.layer, V_CONV, attn.v_sconv.weight, v0)
        return k.view(-1, geo.num_kv_heads, geo.head_dim), v.view(-1, geo.num_kv_heads, geo.head_dim)


def decode_attention(attn: Attention, q: torch.Tensor, r: torch.Tensor, visible: Sequence[VisibleKV]) -> torch.Tensor:
    """q `[B, nH, hd]` (q-normed), r `[B, nH, d_rel]`, each sequence's visible keys -> `[B, nH, hd]`.

    Keys are re-addressed from their first visible position: the relative bias and the window depend only on
    query-key distances, so sequence b's query sits at slot `m_b - 1` of a `[B, max m, nKV, hd]` buffer.
    """
    from inkling_kernels.attention import decode_attention as kernel

    keys = pad_sequence([k for k, _, _ in visible], batch_first=True).to(q.dtype)  # [B, S, nKV, hd]
    values = pad_sequence([v for _, v, _ in visible], batch_first=True).to(q.dtype)
    lengths = [k.shape[0] for k, _, _ in visible]
    seq_lens = torch.tensor(lengths, dtype=torch.int32).to(q.device, non_blocking=True)
    rel_proj, r = rel_bank(attn, r)
    return kernel(
        q.contiguous(), r.contiguous(), rel_proj, keys, values, seq_lens,
        window=attn.geo.window, log_scaling=log_scaling(attn), max_seq_len=max(lengths),
    )  # fmt: skip


def prefill_attention(
    attn: Attention, q: torch.Tensor, r: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor, first: int
) -> torch.Tensor:
    """`Attention.attend` on the prefill kernel: q `[n, nH, hd]` (q-normed) and r `[n, nH, d_rel]` of the queries at
    `start..`, the visible keys/values `[m, nKV, hd]` from position `first` (cast to q's dtype) -> `[n, nH, hd]`."""
    from inkling_kernels.prefill_attention import prefill_attention as kernel

    rel_proj, r = rel_bank(attn, r)
    return kernel(
        q, r, rel_proj, keys.to(q.dtype), values.to(q.dtype), start, first,
        window=attn.geo.window, log_scaling=log_scaling(attn),
    )  # fmt: skip


def paged_prefill_attention(
    attn: Attention, q: torch.Tensor, r: torch.Tensor, seqs: Sequence[SequenceSlice], paged: Sequence[PagedKV]
) -> torch.Tensor:
    """`Attention.attend` of every sequence in one launch, the visible keys read in place from the layer's pools
    (one pool for all: the sequences share the engine's cache); q `[T, nH, hd]` (q-normed), r `[T, nH, d_rel]`."""
    from inkling_kernels.prefill_attention import paged_prefill_attention as kernel

    k_pool, v_pool, page_size = paged[0].k_pool, paged[0].v_pool, paged[0].page_size
    assert all(kv.k_pool.data_ptr() == k_pool.data_ptr() for kv in paged), "sequences of one batch share the pools"
    pages = [kv.pages for kv in paged]
    table = pages[0][None] if len(pages) == 1 else pad_sequence(pages, batch_first=True)  # [B, max_pages]
    rel_proj, r = rel_bank(attn, r)
    return kernel(
        q, r, rel_proj, k_pool, v_pool, table, page_size,
        [seq.num_tokens for seq in seqs], [seq.start_position for seq in seqs], [kv.first for kv in paged],
        window=attn.geo.window, log_scaling=log_scaling(attn),
    )  # fmt: skip
