"""The sampler's grammar masks: filled on the host at sampling, applied to the logits in place, matchers advanced after.

One `GrammarMasks` per sampler owns a persistent packed int32 bitmask `[max_rows, cdiv(V, 32)]` on the host (pinned
on CUDA) and its device mirror, allocated on the first constrained step and reused by every later one:

* `apply(logits, requests)`, at sampling: each constrained row's mask for its next token is filled on the host
  (xgrammar, rows in parallel, the GIL released), only the rows used are copied to the device with an index of
  each logits row's bitmask row (-1: unconstrained), and `inkling_kernels.token_mask` masks the logits in place (Triton
  on CUDA, torch elsewhere);
* `advance(requests, tokens)` moves the matchers.

The fill needs no thread of its own: the sampler enqueues everything behind the forward without waiting for the
device, so on CUDA the host fills while the GPU still runs the forward (decisions.md: filling here measured cheaper
than a fill started before the forward on a thread). Host rows are rewritten only after the device copies that read
them completed (an event per copy batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from decode_service.structured.matcher import ConstraintMatcher, fill_bitmasks
from inkling_kernels.token_mask import apply_token_mask, token_mask_reference


class Constrained(Protocol):
    """What the masks read of a request (the data plane's `WorkerRequest`)."""

    constraint: ConstraintMatcher | None


class GrammarMasks:
    """`max_rows`: the most rows one step samples at once (the engine's `max_num_seqs`); `device`: the logits'."""

    def __init__(self, max_rows: int, device: torch.device | str = "cpu", threads: int | None = None):
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.threads = threads  # xgrammar's fill threads (None: `fill_threads()`)
        self.host: torch.Tensor | None = None  # [R, W] int32: row i holds the mask of the i-th constrained row
        self._device_rows: torch.Tensor | None = None  # [R, W] on the device (the host buffer itself on CPU)
        self._index_host: torch.Tensor | None = None  # [R] int32: each logits row's bitmask row, -1 unconstrained
        self._index: torch.Tensor | None = None  # its device mirror
        self._copied: torch.cuda.Event | None = None  # after the last copies out of the host buffers
        self.masked_rows = 0  # constrained rows masked so far

    def apply(self, logits: torch.Tensor, requests: Sequence[Constrained]) -> bool:
        """logits `[N, V]`, one row per request: the disallowed tokens of constrained rows -> -inf, in place.
        Returns whether any row was constrained."""
        constrained = [(i, r.constraint) for i, r in enumerate(requests) if r.constraint is not None]
        if not constrained:
            return False
        self._check_rows(len(requests))
        self._allocate(constrained[0][1].vocab_size)
        index = [-1] * len(requests)
        for row, (i, _) in enumerate(constrained):
            index[i] = row
        self.masked_rows += len(constrained)
        self._wait_for_copies()
        fill_bitmasks([m for _, m in constrained], self.host, range(len(constrained)), self.threads)
        self._index_host[: len(index)] = torch.tensor(index, dtype=torch.int32)
        if self.device.type == "cpu":
            token_mask_reference(logits, self.host, self._index_host[: len(index)])
            return True
        self._device_rows[: len(constrained)].copy_(self.host[: len(constrained)], non_blocking=True)
        self._index[: len(index)].copy_(self._index_host[: len(index)], non_blocking=True)
        self._copied.record()
        apply_token_mask(logits, self._device_rows, self._index[: len(index)])
        return True

    def advance(self, requests: Sequence[Constrained], token_ids: Sequence[int]) -> None:
        """Each constrained request accepts its chosen token."""
        for request, token in zip(requests, token_ids, strict=True):
            if request.constraint is not None:
                request.constraint.accept(token)

    def _allocate(self, vocab_size: int) -> None:
        words = -(-vocab_size // 32)
        if self.host is not None:
            assert self.host.shape[1] == words, f"grammars over {vocab_size} tokens, buffer for {self.host.shape[1]}"
            return
        pin = self.device.type == "cuda"
        self.host = torch.full((self.max_rows, words), -1, dtype=torch.int32, pin_memory=pin)
        self._index_host = torch.full((self.max_rows,), -1, dtype=torch.int32, pin_memory=pin)
        if self.device.type == "cpu":
            self._device_rows, self._index = self.host, self._index_host
            return
        self._device_rows = torch.full_like(self.host, -1, device=self.device)
        self._index = torch.full_like(self._index_host, -1, device=self.device)
        self._copied = torch.cuda.Event()

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _check_rows(self, rows: int) -> None:
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows to mask, the grammar mask buffer holds {self.max_rows} (max_rows)")
