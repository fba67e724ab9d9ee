"""The explicit batch description the decoder runs on.

Two descriptions of the same thing: `sequences` (packed per-sequence slices with their `LayerCache`s; any mix of
prefill chunks and decode tokens, the reference layout) or `decode` (the same number of new tokens for every
sequence over the engine's paged pools, every field a device tensor of static shape so the step can be captured in
a CUDA graph). When
`decode` is set the layers read only it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_service.model.state import LayerCache, PagedPools


@dataclass
class SequenceSlice:
    """One sequence's new tokens inside the packed batch."""

    start_position: int  # absolute position of the first new token
    num_tokens: int  # new tokens of this sequence in this step (a prefill chunk or 1 for decode)
    layers: list[LayerCache]  # this sequence's per-layer caches; the forward writes the new tokens into them


@dataclass
class PagedDecode:
    """B sequences each bringing W tokens (W = 1: a decode; W > 1: a verify of the last token and W-1 drafts),
    their caches in paged pools. Rows are sequence-major: row b*W + j is token j of sequence b, at position
    start_b + j. Layer kinds are keyed True = sliding."""

    pools: PagedPools
    seq_lens: torch.Tensor  # [B*W] int32: each row's absolute position + 1 (its own key and those before visible)
    conv_slots: torch.Tensor  # [B] int64: each sequence's row in every conv-state pool
    kv_rows: dict[bool, torch.Tensor]  # per kind [B*W] int64: the pool row receiving each row's k/v
    block_tables: dict[bool, torch.Tensor]  # per kind [B, max_pages] int32: physical page of each absolute page
    max_seq_len: int  # static upper bound on seq_lens (sizes the attention grid)
    width: int = 1  # W
    # W > 1: per (layer, conv index) `[B, K-1+W, C]`: the convs leave the states as they are and write each
    # sequence's window (state ++ W inputs) here, committed once acceptance is known (`inkling_kernels.conv_verify`).
    conv_windows: dict[tuple[int, int], torch.Tensor] | None = None


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64, sequences packed back to back in `sequences` order
    sequences: list[SequenceSlice]
    mm_rows: torch.Tensor | None = None  # [M, H] encoder rows (already tower-normed), scattered after embed_norm
    mm_index: torch.Tensor | None = None  # [M] int64 positions inside the packed T that receive mm_rows
    decode: PagedDecode | None = None  # set: a uniform decode or verify step over paged pools (`sequences` unused)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
