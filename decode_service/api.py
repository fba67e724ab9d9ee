"""The decode service's native request and event types: the gRPC server converts protobuf to and from these, the
service consumes and produces them. No gRPC. Sampling is the engine's own `SamplingParams` (validated once, by
`SamplingParams.validate`, plus the service's limits)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.errors import InklingError
from common.media import MediaInput
from common.settings import ServiceLimits
from common.wire import EncodedItem
from decode_service.chat import ChatMessage, ToolSpec
from decode_service.engine.request import SamplingParams
from decode_service.output_parser import ParsedToolCall
from decode_service.structured.constraint import Constraint

__all__ = [  # MediaInput, SamplingParams and ServiceLimits are re-exported: the service's input vocabulary
    "DeltaEvent",
    "EngineFailure",
    "Event",
    "FinalEvent",
    "GenerateInput",
    "LoadSnapshot",
    "MediaEncoder",
    "MediaInput",
    "ModelInfo",
    "SamplingParams",
    "ServiceLimits",
    "Timings",
    "TokenLogprob",
    "Usage",
]


@dataclass(frozen=True)
class GenerateInput:
    """A chat (`messages`, media referenced by `MediaPart.index`), a token prompt (`prompt_token_ids` with ONE
    image/audio placeholder token per media item, in item order) or a raw text prompt (`prompt_text`, tokenized
    as ordinary text without the chat template; no media)."""

    request_id: str
    messages: tuple[ChatMessage, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    reasoning_effort: float | None = None  # None: DEFAULT_REASONING_EFFORT
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    media: tuple[MediaInput, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str = ""
    priority: int = 0
    timeout_s: float | None = None  # remaining deadline of the call
    constraint: Constraint | None = None  # structured output or a forced tool call (decode_service/structured)
    return_prompt_token_ids: bool = False  # echo the rendered prompt in `FinalEvent.prompt_token_ids`


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class DeltaEvent:
    token_ids: tuple[int, ...] = ()
    text: str = ""
    channel: str | None = None  # "reasoning", "content", "tool_call"; None for tokens without text
    tool_call: ParsedToolCall | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens_gpu: int = 0
    cached_tokens_redis: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    mm_items_cached: int = 0
    mm_items_encoded: int = 0
    draft_tokens: int = 0  # MTP drafts verified for this request
    accepted_draft_tokens: int = 0  # of which accepted

    @property
    def cached_tokens(self) -> int:
        return self.cached_tokens_gpu + self.cached_tokens_redis


@dataclass(frozen=True)
class Timings:
    queue_s: float = 0.0
    encode_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True)
class FinalEvent:
    finish_reason: str  # stop, length, tool_calls, abort
    usage: Usage
    timings: Timings
    matched_stop: str = ""
    matched_stop_token_id: int | None = None
    finish_detail: str = ""  # why an output is incomplete (a constraint unmet within max_tokens)
    prompt_token_ids: tuple[int, ...] = ()  # only with `GenerateInput.return_prompt_token_ids`


Event = DeltaEvent | FinalEvent


@dataclass(frozen=True)
class LoadSnapshot:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    free_kv_pages: int = 0
    prefix_cache_hit_rate: float = 0.0
    inflight_encode_items: int = 0


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_fingerprint: bytes
    encoder_fingerprint: bytes
    max_context_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    image_token_id: int
    audio_token_id: int
    modalities: tuple[str, ...]


class EngineFailure(InklingError):
    """The engine finished a request with an error (a failed forward step)."""


class MediaEncoder(Protocol):
    """What the service needs from the encoder client (or an in-process encoder)."""

    async def encode(
        self, items: Sequence[MediaInput], request_id: str = "", timeout_s: float | None = None
    ) -> list[EncodedItem]: ...

    @property
    def inflight_items(self) -> int: ...

    @property
    def pool_fingerprint(self) -> bytes | None: ...
