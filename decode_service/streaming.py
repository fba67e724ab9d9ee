"""One request's engine outputs -> its `DeltaEvent`s, then one `FinalEvent` with finish reason, usage and timings.

The tokens go through `OutputParser` (stop strings, channels, tool calls); a stop string ends the stream at once
(the caller's `abort` stops the engine request), otherwise the engine's finish does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from common.wire import EncodedItem
from decode_service.api import DeltaEvent, EngineFailure, Event, FinalEvent, Timings, TokenLogprob, Usage
from decode_service.chat import CONTENT_THINKING, END_MESSAGE, MODEL_END_SAMPLING, RenderedPrompt
from decode_service.engine.request import SamplingParams
from decode_service.engine_thread import Sink
from decode_service.output_parser import OutputParser
from decode_service.structured.matcher import finish_detail


@dataclass(frozen=True)
class MediaCounts:
    """A prompt's media, as its usage reports them."""

    image_tokens: int = 0
    audio_tokens: int = 0
    cached: int = 0
    encoded: int = 0

    @classmethod
    def of(cls, prompt: RenderedPrompt, items: Sequence[EncodedItem]) -> MediaCounts:
        image = sum(s.length for s in prompt.media_spans if s.modality != "audio")
        audio = sum(s.length for s in prompt.media_spans if s.modality == "audio")
        cached = sum(item.cache_hit for item in items)
        return cls(image, audio, cached, len(items) - cached)


async def stream_events(
    rid: str,
    params: SamplingParams,
    sink: Sink,
    counts: MediaCounts,
    started: float,
    encoded_at: float,
    abort: Callable[[], None],
) -> AsyncIterator[Event]:
    """The events of request `rid` from the outputs arriving at `sink` (an exception there is raised here);
    `started` / `encoded_at`: when the request arrived and when its media rows were ready."""
    parser = OutputParser(params.stop, params.min_tokens)
    completion = reasoning = 0
    thinking = False
    first_token_at: float | None = None
    last_token: int | None = None
    matched_stop = ""
    cached_gpu = cached_redis = 0
    while True:
        item = await sink.queue.get()
        if isinstance(item, BaseException):
            raise item
        out = item
        if first_token_at is None and out.new_token_ids:
            first_token_at = time.monotonic()
            cached_gpu, cached_redis = out.num_cached_tokens_gpu, out.num_cached_tokens_redis
        logprobs = [
            TokenLogprob(t, lp.logprob, lp.top) for t, lp in zip(out.new_token_ids, out.new_logprobs, strict=False)
        ]
        events: list[DeltaEvent] = []
        for n, token in enumerate(out.new_token_ids):
            completion += 1
            last_token = token
            if token == CONTENT_THINKING:
                thinking = True
            elif token in (END_MESSAGE, MODEL_END_SAMPLING):
                thinking = False
            elif thinking:
                reasoning += 1
            was_done = parser.done
            deltas = parser.feed(token)
            events += _token_events(token, logprobs[n : n + 1], deltas)
            if not was_done and parser.matched_stop:
                matched_stop = parser.matched_stop
                break
        for event in events:
            yield event
        if matched_stop:
            abort()
            reason = "stop"
        elif out.finished:
            reason = out.finish_reason or "stop"
            if reason.startswith("error:"):
                raise EngineFailure(f"request {rid}: generation failed: {reason[len('error:') :]}")
        else:
            continue
        for delta in parser.finish(reason):
            yield DeltaEvent(text=delta.text, channel=delta.channel, tool_call=delta.tool_call)
        finished_at = time.monotonic()
        stop_id = (
            last_token
            if (
                reason == "stop" and not matched_stop and last_token is not None and last_token in params.stop_token_ids
            )
            else None
        )
        usage = Usage(
            prompt_tokens=out.num_prompt_tokens,
            cached_tokens_gpu=cached_gpu,
            cached_tokens_redis=cached_redis,
            image_tokens=counts.image_tokens,
            audio_tokens=counts.audio_tokens,
            completion_tokens=completion,
            reasoning_tokens=reasoning,
            mm_items_cached=counts.cached,
            mm_items_encoded=counts.encoded,
            draft_tokens=out.num_draft_tokens,
            accepted_draft_tokens=out.num_accepted_draft_tokens,
        )
        scheduled = sink.scheduled_at or sink.submitted_at
        first = first_token_at or finished_at
        timings = Timings(
            queue_s=max(0.0, scheduled - sink.submitted_at),
            encode_s=encoded_at - started,
            prefill_s=max(0.0, first - scheduled),
            ttft_s=first - started,
            decode_s=finished_at - first,
        )
        detail = finish_detail(sink.request.constraint if sink.request else None, reason, completion)
        yield FinalEvent(parser.finish_reason or reason, usage, timings, matched_stop, stop_id, detail)
        return


def _token_events(token: int, logprobs: list[TokenLogprob], deltas: list) -> list[DeltaEvent]:
    """One sampled token -> delta events: the first carries the token (and its logprob), later ones only text."""
    if not deltas:
        return [DeltaEvent((token,), logprobs=tuple(logprobs))]
    first, *rest = deltas
    events = [DeltaEvent((token,), first.text, first.channel, first.tool_call, tuple(logprobs))]
    events += [DeltaEvent(text=d.text, channel=d.channel, tool_call=d.tool_call) for d in rest]
    return events
