"""A generation request and its lifecycle: WAITING -> RUNNING <-> PREEMPTED -> FINISHED (with a reason).

Control-plane data: this module does not import torch (media rows are the data plane's tensors, only
carried here)."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

    from decode_service.engine.core.pages import SequencePages
    from decode_service.structured.matcher import ConstraintMatcher

_arrival_counter = itertools.count()
PENDING_TOKEN = -1  # a token id the data plane takes from the previous step's samples on the device


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # cache freed, waiting to be recomputed from its prompt + generated tokens
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, the one type from the API edge to the sampler. temperature 0 = greedy; top_k 0 =
    off; logprobs = number of top alternatives; max_tokens None = the server's bounded default (the decode
    service resolves it before the engine sees the request); min_tokens: no EOS / stop-token / stop-string
    stop before that many output tokens; stop strings are matched by the output parser, not the engine."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # over prompt + output (>1 discourages repeats)
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    speculative: bool = True  # False: this request opts out of MTP speculation (engine --mtp-depth > 0)

    _FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Reject non-finite and out-of-range values with an error naming the field."""
        for name in self._FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise InvalidInputError(f"sampling.{name}={getattr(self, name)!r} must be finite")
        checks = (
            ("temperature", self.temperature >= 0.0),
            ("top_k", self.top_k >= 0),
            ("top_p", 0.0 < self.top_p <= 1.0),
            ("min_p", 0.0 <= self.min_p <= 1.0),
            ("repetition_penalty", self.repetition_penalty > 0.0),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1),
            ("min_tokens", self.min_tokens >= 0),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= vocab_size),
            ("stop_token_ids", all(0 <= t < vocab_size for t in self.stop_token_ids)),
        )
        for name, ok in checks:
            if not ok:
                raise InvalidInputError(f"sampling.{name}={getattr(self, name)!r} is out of range")
        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str) or not stop:
                raise InvalidInputError(f"sampling.stop[{i}]={stop!r} must be a non-empty string")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInputError(f"sampling.min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")


@dataclass(frozen=True)
class MultimodalItem:
    """Encoder rows `[length, H]` that replace the placeholder tokens `prompt[start : start + length]`."""

    mm_key: bytes
    start: int
    rows: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.rows.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top-N alternatives (raw model distribution)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    mm_items: tuple[MultimodalItem, ...] = ()
    priority: int = 0  # lower runs first; ties by arrival
    cache_salt: str | None = None
    constraint: ConstraintMatcher | None = None  # structured output: masks the logits, advanced per token
    arrival_time: float = field(default_factory=time.monotonic)

    # Engine-owned state.
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error_message: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV/conv state is in `handle`
    num_pending_tokens: int = 0  # async scheduling: tokens a step in flight samples on the device, not read yet
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the first admission
    num_preemptions: int = 0
    handle: SequencePages | None = None
    draft_token_ids: tuple[int, ...] = ()  # MTP drafts proposed for the next step (verified with the last token)
    num_draft_tokens: int = 0  # MTP drafts verified (acceptance in usage)
    num_accepted_draft_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of the full blocks so far
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt plus generated tokens: what a (re)computation has to prefill."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without concatenating the whole history; `PENDING_TOKEN` for the positions of
        pending tokens."""
        n_prompt = len(self.prompt_token_ids)
        if self.num_pending_tokens and end > n_prompt + len(self.output_token_ids):
            known = n_prompt + len(self.output_token_ids)
            head = self.token_slice(start, known) if start < known else []
            return head + [PENDING_TOKEN] * (end - max(start, known))
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def num_tokens(self) -> int:
        """Prompt, generated and pending tokens: the positions the scheduler plans for."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.arrival_order)

    @property
    def finish_reason_text(self) -> str | None:
        """`stop`, `length`, `abort` or `error:<message>`; None while the request is live."""
        if self.finish_reason is None:
            return None
        if self.finish_reason is FinishReason.ERROR:
            return f"error:{self.error_message}"
        return self.finish_reason.value

    def finish(self, reason: FinishReason, message: str | None = None) -> None:
        assert not self.is_finished, f"request {self.request_id} finished twice"
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error_message = message

    def validate(self, vocab_size: int, hidden_size: int) -> None:
        """Reject malformed input with a message naming the field."""
        if not self.prompt_token_ids:
            raise InvalidInputError(f"request {self.request_id}: prompt_token_ids is empty")
        bad = [t for t in self.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidInputError(f"request {self.request_id}: prompt token ids out of range: {bad[:5]}")
        self.sampling.validate(vocab_size)
        previous_end = 0
        for i, item in enumerate(sorted(self.mm_items, key=lambda it: it.start)):
            if item.rows.dim() != 2 or item.rows.shape[1] != hidden_size or item.length == 0:
                raise InvalidInputError(
                    f"request {self.request_id}: mm item {i} rows have shape "
                    f"{tuple(item.rows.shape)}, expected [n>0, {hidden_size}]"
                )
            if item.start < previous_end or item.end > len(self.prompt_token_ids):
                raise InvalidInputError(
                    f"request {self.request_id}: mm item {i} span [{item.start}, {item.end}) "
                    f"overlaps another item or leaves the prompt"
                )
            previous_end = item.end
