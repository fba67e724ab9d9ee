"""What the decoder layers ask of an attention backend: the parts of a step that depend on where caches live.

Everything that mixes tokens over time (attention with its KV write, and the short convs with their states) reads
and writes a sequence's caches; everything else in a layer runs on all T rows at once. The model calls
`prepare(batch)` once per forward and hands the result to every layer, which calls `attention` (q/k norms, k/v
convs, KV write, then attention) and `conv` (the residual-stream short convs) on it. Two backends:
`packed.PackedBackend` (per-sequence `LayerCache`s, any mix of prefill chunks and decode tokens) and
`paged.PagedBackend` (the same number of tokens per sequence over the engine's paged pools, CUDA-graph safe).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from decode_service.model.batch import ForwardBatch


class PreparedBatch(Protocol):
    """One batch's attention metadata, computed once and used by every layer."""

    def attention(
        self, attn: nn.Module, q: torch.Tensor, r: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor
    ) -> torch.Tensor:
        """`layers.Attention` `attn`'s q `[T, nH, hd]` (before `attn.q_norm`), r `[T, nH, d_rel]`, k0, v0
        `[T, nKV*hd]` -> `[T, nH, hd]`: q-norm the queries, convolve and k-norm the new keys/values, store them in
        the layer's cache, attend."""
        ...

    def conv(self, conv: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`layers.ShortConv` `conv` over x `[T, C]`, each sequence continuing from (and updating) its state;
        `residual + conv(x)` when a residual `[T, C]` is given (one launch on the paged path)."""
        ...


class AttentionBackend(Protocol):
    name: str

    def prepare(self, batch: ForwardBatch) -> PreparedBatch: ...
