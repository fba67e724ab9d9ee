"""The explicit batch description the decoder runs on: packed sequences, no padding, no prefill/decode branch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_service.model.state import LayerCache


@dataclass
class SequenceSlice:
    """One sequence's new tokens inside the packed batch."""

    start_position: int  # absolute position of the first new token
    num_tokens: int  # new tokens of this sequence in this step (a prefill chunk or 1 for decode)
    layers: list[LayerCache]  # this sequence's per-layer caches; the forward writes the new tokens into them


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64, sequences packed back to back in `sequences` order
    sequences: list[SequenceSlice]
    mm_rows: torch.Tensor | None = None  # [M, H] encoder rows (already tower-normed), scattered after embed_norm
    mm_index: torch.Tensor | None = None  # [M] int64 positions inside the packed T that receive mm_rows

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
