"""Data plane: SchedulerOutput -> ForwardBatch -> model -> logits of the sequences that sample -> tokens."""

from __future__ import annotations

from typing import Protocol

import torch

from decode_service.engine.decode_graphs import DecodeGraphs
from decode_service.engine.request import Request
from decode_service.engine.sampler import Sampler, SampleResult
from decode_service.engine.scheduler import SchedulerOutput
from decode_service.model.batch import ForwardBatch, SequenceSlice


class DecoderModel(Protocol):
    """What the runner needs from `decode_service.model.inkling.InklingDecoder`."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def build_batch(output: SchedulerOutput, device: torch.device | str = "cpu") -> tuple[ForwardBatch, list[int]]:
    """Pack the scheduled sequences: the batch and the packed row of each sequence's last token.

    Multimodal rows go to the packed rows of their placeholder tokens inside this step's chunk only; a chunk
    may start or end inside a media span, in which case just the overlapping rows are placed.
    """
    token_ids: list[int] = []
    slices: list[SequenceSlice] = []
    last_rows: list[int] = []
    mm_rows: list[torch.Tensor] = []
    mm_index: list[torch.Tensor] = []
    for seq in output.sequences:
        offset, start, end = len(token_ids), seq.start_position, seq.start_position + seq.num_tokens
        for item in seq.request.mm_items:
            lo, hi = max(start, item.start), min(end, item.end)
            if lo < hi:
                mm_rows.append(item.rows[lo - item.start : hi - item.start])
                mm_index.append(torch.arange(offset + lo - start, offset + hi - start))
        token_ids.extend(seq.token_ids)
        slices.append(SequenceSlice(start, seq.num_tokens, seq.handle.layers))
        last_rows.append(len(token_ids) - 1)
    batch = ForwardBatch(torch.tensor(token_ids, dtype=torch.int64, device=device), slices)
    if mm_rows:
        batch.mm_rows = torch.cat(mm_rows).to(device)
        batch.mm_index = torch.cat(mm_index).to(device)
    return batch, last_rows


def is_uniform_decode(output: SchedulerOutput) -> bool:
    """Every sequence brings one text token (a decode, or a one-token chunk outside any media span)."""
    return all(
        seq.num_tokens == 1 and not any(item.start <= seq.start_position < item.end for item in seq.request.mm_items)
        for seq in output.sequences
    )


class ModelRunner:
    """`decode_graphs`: uniform decode steps go there (batched paged path, CUDA graphs); the rest is packed."""

    def __init__(
        self,
        model: DecoderModel,
        sampler: Sampler,
        device: torch.device | str = "cpu",
        decode_graphs: DecodeGraphs | None = None,
    ):
        self.model = model
        self.sampler = sampler
        self.device = device
        self.decode_graphs = decode_graphs

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, SampleResult]:
        """Run one step; every scheduled sequence's cache advances; sampled tokens keyed by request id."""
        if not output.sequences:
            return {}
        if self.decode_graphs is not None and is_uniform_decode(output):
            seqs = output.sequences
            hidden = self.decode_graphs.run([s.token_ids[0] for s in seqs], [s.handle for s in seqs])  # [B, H]
            last_rows = list(range(len(seqs)))
        else:
            batch, last_rows = build_batch(output, self.device)
            hidden = self.model.forward(batch)  # [T, H]
        sampling = [
            (seq.request, row) for seq, row in zip(output.sequences, last_rows, strict=True) if seq.needs_logits
        ]
        if not sampling:
            return {}
        requests: list[Request] = [r for r, _ in sampling]
        rows = torch.tensor([row for _, row in sampling], device=hidden.device)
        logits = self.model.logits(hidden.index_select(0, rows))  # [N, V] fp32
        results = self.sampler.sample(logits, requests)
        return {r.request_id: res for r, res in zip(requests, results, strict=True)}
