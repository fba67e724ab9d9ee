"""The sampler's grammar masks: filled on the host, applied to the logits in place, matchers advanced after.

One `GrammarMasks` per sampler owns a persistent packed int32 bitmask `[2 * max_rows, cdiv(V, 32)]` on the host
(pinned on CUDA) and its device mirror, allocated on the first constrained step and reused by every later one:

* `prefill(requests)`, before the step's forward: the constrained requests' masks for their next token (which
  depend only on the tokens accepted so far) fill rows `[0, max_rows)` on the mask thread (xgrammar, rows in
  parallel, the GIL released), hidden behind the forward;
* `apply(logits, requests)`, at sampling: joins the prefill; a constrained row whose matcher has not moved since
  takes its prefilled row, any other (a verify chunk's later rows, which depend on the tokens accepted before
  them in this step) is filled now into rows `[max_rows, 2 * max_rows)`. Only the rows used are copied to the
  device, with an index of each logits row's bitmask row (-1: unconstrained), and `kernels.token_mask` masks the
  logits in place (Triton on CUDA, torch elsewhere);
* `advance(requests, tokens)` moves the matchers (after joining the prefill, which reads them).

Host rows are rewritten only after the device copies that read them completed (an event per copy batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from decode_service.structured.matcher import ConstraintMatcher, fill_bitmasks
from kernels.token_mask import apply_token_mask, token_mask_reference


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
        self.host: torch.Tensor | None = None  # [2R, W] int32: the prefill's rows, then the rows filled at sampling
        self._device_rows: torch.Tensor | None = None  # [2R, W] on the device (the host buffer itself on CPU)
        self._index_host: torch.Tensor | None = None  # [R] int32: each logits row's bitmask row, -1 unconstrained
        self._index: torch.Tensor | None = None  # its device mirror
        self._copied: torch.cuda.Event | None = None  # after the last copies out of the host buffers
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._pending: Future | None = None
        self._prefilled: dict[ConstraintMatcher, tuple[int, int]] = {}  # matcher -> (row, revision at the fill)
        self._prefill_rows = 0  # rows [0, n) hold the prefill
        self._prefill_on_device = False
        self.prefilled_rows = 0  # rows masked so far with a prefilled row
        self.late_rows = 0  # rows masked so far with a row filled at sampling

    def prefill(self, requests: Sequence[Constrained]) -> None:
        """Start filling the next-token masks of the constrained `requests` (the step about to run)."""
        self.join()
        matchers = [r.constraint for r in requests if r.constraint is not None]
        self._prefilled = {}
        if not matchers:
            return
        self._check_rows(len(matchers))
        self._allocate(matchers[0].vocab_size)
        self._wait_for_copies()
        rows = list(range(len(matchers)))
        self._prefilled = {m: (row, m.revision) for m, row in zip(matchers, rows, strict=True)}
        self._prefill_rows, self._prefill_on_device = len(rows), False
        self._pending = self._executor.submit(fill_bitmasks, matchers, self.host, rows, self.threads)

    def join(self) -> None:
        """Wait for the prefill (re-raising its error): the matchers are the caller's again."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def apply(self, logits: torch.Tensor, requests: Sequence[Constrained]) -> bool:
        """logits `[N, V]`, one row per request: the disallowed tokens of constrained rows -> -inf, in place.
        Returns whether any row was constrained."""
        constrained = [(i, r.constraint) for i, r in enumerate(requests) if r.constraint is not None]
        if not constrained:
            return False
        self._check_rows(len(requests))
        self._allocate(constrained[0][1].vocab_size)
        self.join()
        index = [-1] * len(requests)
        fresh: list[ConstraintMatcher] = []
        uses_prefill = False
        for i, matcher in constrained:
            row, revision = self._prefilled.get(matcher, (-1, -1))
            if revision == matcher.revision:
                index[i], uses_prefill = row, True
            else:  # not prefilled, or moved since (a verify chunk's later row, a rollback)
                index[i] = self.max_rows + len(fresh)
                fresh.append(matcher)
        self.prefilled_rows += len(constrained) - len(fresh)
        self.late_rows += len(fresh)
        self._wait_for_copies()
        if fresh:
            fill_bitmasks(fresh, self.host, range(self.max_rows, self.max_rows + len(fresh)), self.threads)
        self._index_host[: len(index)] = torch.tensor(index, dtype=torch.int32)
        if self.device.type == "cpu":
            token_mask_reference(logits, self.host, self._index_host[: len(index)])
            return True
        if uses_prefill and not self._prefill_on_device:
            self._upload(0, self._prefill_rows)
            self._prefill_on_device = True
        if fresh:
            self._upload(self.max_rows, len(fresh))
        self._index[: len(index)].copy_(self._index_host[: len(index)], non_blocking=True)
        self._copied.record()
        apply_token_mask(logits, self._device_rows, self._index[: len(index)])
        return True

    def advance(self, requests: Sequence[Constrained], token_ids: Sequence[int]) -> None:
        """Each constrained request accepts its chosen token."""
        self.join()
        for request, token in zip(requests, token_ids, strict=True):
            if request.constraint is not None:
                request.constraint.accept(token)

    def _allocate(self, vocab_size: int) -> None:
        words = -(-vocab_size // 32)
        if self.host is not None:
            assert self.host.shape[1] == words, f"grammars over {vocab_size} tokens, buffer for {self.host.shape[1]}"
            return
        pin = self.device.type == "cuda"
        self.host = torch.full((2 * self.max_rows, words), -1, dtype=torch.int32, pin_memory=pin)
        self._index_host = torch.full((self.max_rows,), -1, dtype=torch.int32, pin_memory=pin)
        if self.device.type == "cpu":
            self._device_rows, self._index = self.host, self._index_host
            return
        self._device_rows = torch.full_like(self.host, -1, device=self.device)
        self._index = torch.full_like(self._index_host, -1, device=self.device)
        self._copied = torch.cuda.Event()

    def _upload(self, start: int, rows: int) -> None:
        self._device_rows[start : start + rows].copy_(self.host[start : start + rows], non_blocking=True)

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _check_rows(self, rows: int) -> None:
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows to mask, the grammar mask buffer holds {self.max_rows} (max_rows)")
