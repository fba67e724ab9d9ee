"""Checks of one request against its own ranges and this replica's `ServiceLimits`; each error names the field.

`check_sampling` and `check_media` run before any work is done for the request, `check_encoded` on the encoder's
answer, `check_prompt` once the prompt is built (it also resolves an unset `max_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from common.errors import InvalidInputError, ResourceExhaustedError, UnavailableError
from common.wire import EncodedItem
from decode_service.api import GenerateInput, ServiceLimits
from decode_service.engine.request import SamplingParams


def check_sampling(s: SamplingParams, limits: ServiceLimits, vocab_size: int) -> SamplingParams:
    """The request's sampling, checked once: its own ranges (`SamplingParams.validate`), then the limits."""
    s.validate(vocab_size)
    if s.logprobs is not None and s.logprobs > limits.max_logprobs:
        raise InvalidInputError(f"sampling.logprobs={s.logprobs} exceeds the limit of {limits.max_logprobs}")
    cap = limits.max_completion_tokens
    if s.max_tokens is not None and cap is not None and s.max_tokens > cap:
        raise InvalidInputError(f"sampling.max_tokens={s.max_tokens} exceeds the limit of {cap}")
    if len(s.stop) > limits.max_stop_strings:
        raise InvalidInputError(f"sampling.stop: {len(s.stop)} strings exceeds the limit of {limits.max_stop_strings}")
    for i, stop in enumerate(s.stop):
        if not stop or len(stop) > limits.max_stop_string_chars:
            raise InvalidInputError(f"sampling.stop[{i}]: must have 1 to {limits.max_stop_string_chars} characters")
    return s


def check_media(inp: GenerateInput, limits: ServiceLimits) -> None:
    """A prompt is given, and media only beside chat messages or token ids, within the limits."""
    if len(inp.media) > limits.max_media_items:
        raise InvalidInputError(f"media: {len(inp.media)} items exceeds the limit of {limits.max_media_items}")
    if inp.prompt_token_ids is None and inp.prompt_text is None and not inp.messages:
        raise InvalidInputError("prompt: no chat messages, token ids or text were given")
    if inp.prompt_text is not None and inp.media:
        raise InvalidInputError("media: a text prompt takes no media (send a token prompt with placeholders)")
    for i, item in enumerate(inp.media):
        if item.modality not in ("image", "audio", "video"):
            raise InvalidInputError(f"media[{i}].modality: unknown modality {item.modality!r}")
        if not item.data:
            raise InvalidInputError(f"media[{i}] ({item.modality}): no media data")


def check_encoded(encoded: Sequence[EncodedItem], hidden_size: int) -> None:
    """The encoder's rows fit the decoder; videos bring no audio track."""
    for i, item in enumerate(encoded):
        if item.dim != hidden_size:
            raise UnavailableError(f"media[{i}]: encoder rows have dim {item.dim}, the decoder needs {hidden_size}")
        if item.modality == "video" and any(s.modality != "image" for s in item.spans):
            raise InvalidInputError(
                f"media[{i}] (video): audio tracks of videos are not supported in prompts yet; set include_audio=false"
            )


def check_prompt(
    sampling: SamplingParams, prompt_tokens: int, max_model_len: int, limits: ServiceLimits
) -> SamplingParams:
    """The prompt within `max_prompt_tokens`; an unset `max_tokens` resolved to `default_max_tokens`, capped by
    the room left in the context and by `max_completion_tokens`."""
    limit = limits.max_prompt_tokens
    if limit is not None and prompt_tokens > limit:
        raise ResourceExhaustedError(f"prompt: {prompt_tokens} tokens exceeds the limit of {limit}")
    if sampling.max_tokens is not None:
        return sampling
    room = max(1, max_model_len - prompt_tokens)
    cap = limits.max_completion_tokens
    default = min(room, limits.default_max_tokens, cap if cap is not None else room)
    return dataclasses.replace(sampling, max_tokens=default)
