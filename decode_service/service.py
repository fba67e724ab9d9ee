"""The decode service (no gRPC): a request with media in, a stream of output deltas and one final event out.

    service = DecodeService(engine, encoder)
    await service.start()                     # engine thread + warm-up generation; then `ready`
    async for event in service.generate(GenerateInput(...)): ...   # DeltaEvent..., FinalEvent

One request: validate limits and sampling -> media rows (the encoder client: Redis or an encoder replica) ->
render the chat with the real per-item row counts (`chat.render_chat`; raw token prompts go through
`chat.attach_media` after their one-placeholder-per-item is expanded) -> an engine `Request` with the rows at
their spans -> token outputs through `OutputParser` (stop strings, channels, tool calls) -> deltas, then a
final event with finish reason, usage and timings.

The `Engine` is not thread-safe and is driven by ONE background thread: requests and aborts enter through a
queue, outputs go back to each request's asyncio queue with `loop.call_soon_threadsafe`. Closing a `generate`
iterator early (client cancel) aborts the engine request at once, which frees its KV pages and conv slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.checkpoint import CheckpointFiles, load_decoder_weights, load_mtp_weights
from common.config import load_model_config
from common.dtypes import torch_dtype
from common.errors import ConfigError, InvalidInputError, ResourceExhaustedError, UnavailableError
from common.fingerprint import model_fingerprint
from common.media import MediaInput
from common.request_ids import check_request_id
from common.settings import DecodeEngineSettings
from common.wire import KIND_EMBEDDINGS, EncodedItem
from decode_service.api import (
    DeltaEvent,
    EngineFailure,
    Event,
    FinalEvent,
    GenerateInput,
    LoadSnapshot,
    MediaEncoder,
    ModelInfo,
    ServiceLimits,
    Timings,
    TokenLogprob,
    Usage,
)
from decode_service.chat import (
    AUDIO_PLACEHOLDER,
    CONTENT_IMAGE,
    CONTENT_TEXT,
    CONTENT_THINKING,
    END_MESSAGE,
    IMAGE_PLACEHOLDER,
    MESSAGE_USER,
    MODEL_END_SAMPLING,
    MediaSpan,
    RenderedPrompt,
    attach_media,
    encode_text,
    render_chat,
)
from decode_service.engine.engine import Engine, EngineSettings, RequestOutput, SpeculationSnapshot
from decode_service.engine.parallel import PrefixConnection, launch_engine
from decode_service.engine.redis_prefix import PrefixStore
from decode_service.engine.request import MultimodalItem, Request, RequestStatus, SamplingParams
from decode_service.engine.worker.ranks import RankFailure
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter
from decode_service.output_parser import OutputParser
from decode_service.structured.compiler import ConstraintCompiler
from decode_service.structured.matcher import ConstraintMatcher, finish_detail
from encoder_service.codebook import AudioCodebook

log = logging.getLogger(__name__)

DEFAULT_REASONING_EFFORT = 0.9  # proto ChatPrompt.reasoning_effort unset


# ---------------------------------------------------------------------------------------------------------
# The engine thread's side of a request


@dataclass(frozen=True)
class _Add:
    """Add `request` to the engine; its outputs go to `sink`."""

    request: Request
    sink: _Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: unblocks the engine thread (shutdown)."""


_Command = _Add | _Abort | _Wake


class _Sink:
    """Where the engine thread delivers one request's outputs (an asyncio queue of another thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.submitted_at = time.monotonic()
        self.scheduled_at: float | None = None  # written by the engine thread before the first delivery
        self.request: Request | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone; nobody is listening any more
            pass


class DecodeService:
    def __init__(
        self,
        engine: Engine,
        encoder: MediaEncoder | None = None,
        limits: ServiceLimits | None = None,
        model_id: str = "",
        audio_codebook: AudioCodebook | None = None,
    ) -> None:
        self.engine = engine
        self.encoder = encoder
        self.audio_codebook = audio_codebook  # turns audio items' dMel codes into rows (`_item_rows`)
        self.limits = limits or ServiceLimits()
        self.model_id = model_id
        self.config = engine.config
        self.dtype: torch.dtype = getattr(engine.runner.model, "dtype", torch.float32)
        self.ready = False
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._live: dict[str, bool] = {}  # event loop only: request id -> aborted
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._load = LoadSnapshot()
        self._speculation = SpeculationSnapshot()
        self._prompt_tokens_seen = 0
        self._cached_tokens_seen = 0
        self._wake = threading.Event()
        self.failure: RankFailure | None = None  # a tensor-parallel rank died: every stream fails UNAVAILABLE
        self.on_failure: Callable[[], None] | None = None  # called once, from the engine thread (server: health)
        self.structured = ConstraintCompiler(self.config.text.unpadded_vocab_size, self.config.eos_token_ids)

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self, warm_up: bool = True) -> None:
        """Start the engine thread; run one short generation; then `ready` (the server reports SERVING)."""
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()
        if warm_up:
            prompt = (MESSAGE_USER, CONTENT_TEXT, *encode_text("warm up"), END_MESSAGE)
            warm = GenerateInput(
                request_id=f"warmup-{uuid.uuid4().hex[:8]}",
                prompt_token_ids=prompt,
                sampling=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            )
            async for _ in self._generate(warm):
                pass
            self._prompt_tokens_seen = self._cached_tokens_seen = 0
        self.ready = True
        log.info("decode service ready (context %d tokens)", self.engine.max_model_len)

    async def close(self) -> None:
        self.ready = False
        self._stopping.set()
        self._commands.put(_Wake())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        if self.engine.ranks is not None:
            await asyncio.to_thread(self.engine.ranks.close)
        self.structured.close()

    # -- public API ------------------------------------------------------------------------------------------

    async def generate(self, inp: GenerateInput) -> AsyncIterator[Event]:
        """Deltas, then exactly one `FinalEvent`. Raises `InvalidInputError` (naming the field or item),
        `ResourceExhaustedError`, `UnavailableError`, `TimeoutError` or `EngineFailure`."""
        if not self.ready:
            raise UnavailableError("decode service is not ready (loading or shutting down)")
        async for event in self._generate(inp):
            yield event

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort live requests (queued, encoding or running); returns the ids that were found."""
        found = [rid for rid in request_ids if rid in self._live]
        for rid in found:
            self._live[rid] = True
            self._commands.put(_Abort(rid))
        return found

    def load(self) -> LoadSnapshot:
        snapshot = self._load
        inflight = self.encoder.inflight_items if self.encoder is not None else 0
        rate = self._cached_tokens_seen / self._prompt_tokens_seen if self._prompt_tokens_seen else 0.0
        return LoadSnapshot(
            snapshot.running, snapshot.waiting, snapshot.kv_usage, snapshot.free_kv_pages, rate, inflight
        )

    def model_info(self) -> ModelInfo:
        prefix = self.engine.prefix_cache
        fingerprint = self.engine.settings.model_fingerprint or (prefix.fingerprint if prefix is not None else b"")
        modalities = tuple(
            m
            for m, present in (
                ("image", self.config.vision),
                ("audio", self.config.audio),
                ("video", self.config.vision),
            )
            if present is not None
        )
        encoder_fp = (self.encoder.pool_fingerprint if self.encoder is not None else None) or b""
        return ModelInfo(
            self.model_id,
            fingerprint,
            encoder_fp,
            self.engine.max_model_len,
            self.config.text.unpadded_vocab_size,
            tuple(self.config.eos_token_ids),
            self.config.image_token_id,
            self.config.audio_token_id,
            modalities,
        )

    # -- one request -----------------------------------------------------------------------------------------

    async def _generate(self, inp: GenerateInput) -> AsyncIterator[Event]:
        started = time.monotonic()
        rid = check_request_id(inp.request_id) or uuid.uuid4().hex
        if rid in self._live:
            raise InvalidInputError(f"request_id: {rid!r} is already in flight")
        if len(self._live) >= self.limits.max_live_requests:
            raise ResourceExhaustedError(
                f"server busy: {len(self._live)} requests in flight (limit {self.limits.max_live_requests})"
            )
        sampling = self._sampling(inp.sampling)
        self._check_media(inp)
        compiled = None if inp.constraint is None else await self.structured.compile(inp.constraint, inp.tools)
        self._live[rid] = False
        submitted = False
        finished = False
        try:
            encoded = await self._encode(inp, rid)
            encoded_at = time.monotonic()
            # Rendering and row conversion are CPU work: off the event loop, which serves every stream.
            prompt, mm_items = await asyncio.to_thread(self._prepare, inp, encoded)
            limit = self.limits.max_prompt_tokens
            if limit is not None and len(prompt.token_ids) > limit:
                raise ResourceExhaustedError(f"prompt: {len(prompt.token_ids)} tokens exceeds the limit of {limit}")
            if sampling.max_tokens is None:
                room = max(1, self.engine.max_model_len - len(prompt.token_ids))
                cap = self.limits.max_completion_tokens
                default = min(room, self.limits.default_max_tokens, cap if cap is not None else room)
                sampling = dataclasses.replace(sampling, max_tokens=default)
            matcher = None
            if compiled is not None:
                matcher = ConstraintMatcher(
                    compiled, prompt.token_ids, self.config.eos_token_ids, sampling.stop_token_ids
                )
            request = Request(
                rid, prompt.token_ids, sampling, mm_items, inp.priority, inp.cache_salt or None, constraint=matcher
            )
            counts = _MediaCounts.of(prompt, encoded)
            echo = tuple(prompt.token_ids) if inp.return_prompt_token_ids else ()
            if self._live.get(rid):
                finished = True
                usage, timings = Usage(prompt_tokens=len(prompt.token_ids)), Timings(encode_s=encoded_at - started)
                yield FinalEvent("abort", usage, timings, prompt_token_ids=echo)
                return
            sink = _Sink(asyncio.get_running_loop())
            self._commands.put(_Add(request, sink))
            submitted = True
            log.debug(
                "request %s submitted: %d prompt tokens, %d media items", rid, len(prompt.token_ids), len(encoded)
            )
            async for event in self._stream(rid, sampling, sink, counts, started, encoded_at):
                if isinstance(event, FinalEvent):
                    finished = True
                    event = dataclasses.replace(event, prompt_token_ids=echo)
                yield event
        finally:
            if submitted and not finished:
                self._commands.put(_Abort(rid))
                log.info("request %s: cancelled, aborting it in the engine", rid)
            self._live.pop(rid, None)

    async def _stream(
        self, rid: str, params: SamplingParams, sink: _Sink, counts: _MediaCounts, started: float, encoded_at: float
    ) -> AsyncIterator[Event]:
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
                self._commands.put(_Abort(rid))
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
            self._prompt_tokens_seen += out.num_prompt_tokens
            self._cached_tokens_seen += cached_gpu + cached_redis
            stop_id = (
                last_token
                if (
                    reason == "stop"
                    and not matched_stop
                    and last_token is not None
                    and last_token in params.stop_token_ids
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

    # -- validation and prompt building ----------------------------------------------------------------------

    def _sampling(self, s: SamplingParams) -> SamplingParams:
        """The request's sampling, checked once: its own ranges (`SamplingParams.validate`), then this
        service's limits."""
        s.validate(self.config.text.unpadded_vocab_size)
        if s.logprobs is not None and s.logprobs > self.limits.max_logprobs:
            raise InvalidInputError(f"sampling.logprobs={s.logprobs} exceeds the limit of {self.limits.max_logprobs}")
        cap = self.limits.max_completion_tokens
        if s.max_tokens is not None and cap is not None and s.max_tokens > cap:
            raise InvalidInputError(f"sampling.max_tokens={s.max_tokens} exceeds the limit of {cap}")
        if len(s.stop) > self.limits.max_stop_strings:
            raise InvalidInputError(
                f"sampling.stop: {len(s.stop)} strings exceeds the limit of {self.limits.max_stop_strings}"
            )
        for i, stop in enumerate(s.stop):
            if not stop or len(stop) > self.limits.max_stop_string_chars:
                raise InvalidInputError(
                    f"sampling.stop[{i}]: must have 1 to {self.limits.max_stop_string_chars} characters"
                )
        return s

    def _check_media(self, inp: GenerateInput) -> None:
        if len(inp.media) > self.limits.max_media_items:
            raise InvalidInputError(f"media: {len(inp.media)} items exceeds the limit of {self.limits.max_media_items}")
        if inp.prompt_token_ids is None and inp.prompt_text is None and not inp.messages:
            raise InvalidInputError("prompt: no chat messages, token ids or text were given")
        if inp.prompt_text is not None and inp.media:
            raise InvalidInputError("media: a text prompt takes no media (send a token prompt with placeholders)")
        for i, item in enumerate(inp.media):
            if item.modality not in ("image", "audio", "video"):
                raise InvalidInputError(f"media[{i}].modality: unknown modality {item.modality!r}")
            if not item.data:
                raise InvalidInputError(f"media[{i}] ({item.modality}): no media data")

    async def _encode(self, inp: GenerateInput, rid: str) -> list[EncodedItem]:
        if not inp.media:
            return []
        if self.encoder is None:
            raise UnavailableError("media: this decode replica has no encoder pool and no local encoder")
        encoded = await self.encoder.encode(inp.media, rid, inp.timeout_s)
        dim = self.config.text.hidden_size
        for i, item in enumerate(encoded):
            if item.dim != dim:
                raise UnavailableError(f"media[{i}]: encoder rows have dim {item.dim}, the decoder needs {dim}")
            if item.modality == "video" and any(s.modality != "image" for s in item.spans):
                raise InvalidInputError(
                    f"media[{i}] (video): audio tracks of videos are not supported in "
                    "prompts yet; set include_audio=false"
                )
        return encoded

    def _prepare(
        self,
        inp: GenerateInput,
        encoded: Sequence[EncodedItem],
    ) -> tuple[RenderedPrompt, tuple[MultimodalItem, ...]]:
        prompt = self._prompt(inp, encoded)
        return prompt, self._mm_items(prompt, encoded)

    def _prompt(self, inp: GenerateInput, encoded: Sequence[EncodedItem]) -> RenderedPrompt:
        counts: list[int | list[int]] = [
            [s.rows for s in item.spans] if item.modality == "video" else item.rows for item in encoded
        ]
        if inp.prompt_text is not None:
            return RenderedPrompt(token_ids=encode_text(inp.prompt_text), media_spans=[])
        if inp.prompt_token_ids is None:
            effort = DEFAULT_REASONING_EFFORT if inp.reasoning_effort is None else inp.reasoning_effort
            return render_chat(list(inp.messages), list(inp.tools), effort, counts)
        expanded = _expand_placeholders(list(inp.prompt_token_ids), encoded)
        return attach_media(expanded, [item.modality for item in encoded], counts)

    def _mm_items(self, prompt: RenderedPrompt, encoded: Sequence[EncodedItem]) -> tuple[MultimodalItem, ...]:
        rows = {item.item_index: self._item_rows(item).to(self.dtype) for item in encoded}
        items = []
        for span in prompt.media_spans:
            item = encoded[span.item_index]
            key = (
                item.mm_key
                if span.row_offset == 0
                else hashlib.sha256(item.mm_key + span.row_offset.to_bytes(8, "little")).digest()
            )
            items.append(
                MultimodalItem(key, span.start, rows[span.item_index][span.row_offset : span.row_offset + span.length])
            )
        return tuple(items)

    def _item_rows(self, item: EncodedItem) -> torch.Tensor:
        """bf16 rows as sent, or the audio tower's codebook sum of an audio item's dMel codes."""
        if item.kind == KIND_EMBEDDINGS:
            return _bf16_rows(item)
        name = f"media[{item.item_index}] ({item.modality})"
        if self.audio_codebook is None:
            raise UnavailableError(f"{name}: the encoder sent dMel codes and this replica has no audio tower")
        return self.audio_codebook.rows(item, name)

    # -- the engine thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain(block=self.failure is not None or not self.engine.has_unfinished)
            ranks = self.engine.ranks
            if self.failure is None and ranks is not None and ranks.failure is not None:
                self._lost(RankFailure(ranks.failure))
            if self.failure is None and self.engine.has_unfinished:
                step_started = time.monotonic()
                try:
                    outputs = self.engine.step()
                except RankFailure as exc:
                    self._lost(exc)
                    continue
                except Exception as exc:  # a bug below the engine's own error handling: fail, never hang
                    log.exception("engine step raised; failing the %d live requests", len(self._sinks))
                    self._fail_all(EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}"))
                    continue
                self._note_scheduled(step_started)
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is None:
                        continue
                    if out.finished:
                        del self._sinks[out.request_id]
                    sink.put(out)
            self._update_load()
        self._fail_all(UnavailableError("decode service is shutting down"))

    def _lost(self, failure: RankFailure) -> None:
        """The replica cannot serve any more: not ready, every stream (and every later one) fails UNAVAILABLE."""
        log.error(
            "decode replica lost a tensor-parallel rank (%s); failing %d live requests", failure, len(self._sinks)
        )
        self.failure = failure
        self.ready = False
        self._fail_all(failure)
        if self.on_failure is not None:
            self.on_failure()

    def _fail_all(self, error: BaseException) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            sink.put(error)
        self._sinks.clear()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            if self.failure is not None:
                command.sink.put(self.failure)
                return
            try:
                self.engine.add_request(command.request)
            except Exception as exc:  # validation errors go back to the caller, the engine carries on
                command.sink.put(exc)
                return
            command.sink.request = command.request
            self._sinks[command.request.request_id] = command.sink
        elif isinstance(command, _Abort):
            self.engine.abort(command.request_id)

    def speculation(self) -> SpeculationSnapshot:
        """MTP acceptance since the engine started (the engine thread refreshes it after every step)."""
        return self._speculation

    def _note_scheduled(self, step_started: float) -> None:
        """Requests that left WAITING in the step that began at `step_started` were scheduled then."""
        for sink in self._sinks.values():
            if (
                sink.scheduled_at is None
                and sink.request is not None
                and sink.request.status is not RequestStatus.WAITING
            ):
                sink.scheduled_at = step_started

    def _update_load(self) -> None:
        cache = self.engine.cache
        total = sum(pool.num_pages for pool in cache.pools.values())
        free = sum(pool.num_free for pool in cache.pools.values())
        scheduler = self.engine.scheduler
        self._load = LoadSnapshot(
            len(scheduler.running), len(scheduler.waiting), 1.0 - free / total if total else 0.0, free
        )
        self._speculation = self.engine.speculation.snapshot(self.engine.speculation_depth)


@dataclass(frozen=True)
class _MediaCounts:
    image_tokens: int = 0
    audio_tokens: int = 0
    cached: int = 0
    encoded: int = 0

    @classmethod
    def of(cls, prompt: RenderedPrompt, items: Sequence[EncodedItem]) -> _MediaCounts:
        image = sum(s.length for s in prompt.media_spans if s.modality != "audio")
        audio = sum(s.length for s in prompt.media_spans if s.modality == "audio")
        cached = sum(item.cache_hit for item in items)
        return cls(image, audio, cached, len(items) - cached)


def _bf16_rows(item: EncodedItem) -> torch.Tensor:
    """Raw little-endian bf16 bytes -> a `[rows, dim]` tensor."""
    return torch.frombuffer(bytearray(item.payload), dtype=torch.bfloat16).view(item.rows, item.dim)


def _expand_placeholders(token_ids: list[int], items: Sequence[EncodedItem]) -> list[int]:
    """A token prompt's single placeholder per item -> the item's full placeholder run(s).

    Images and videos use the image placeholder, audio the audio placeholder; items of each kind are matched
    to placeholders in order. A video's frames are separate image messages, as in chat rendering.
    """
    visual = [item for item in items if item.modality != "audio"]
    audio = [item for item in items if item.modality == "audio"]
    found_visual = token_ids.count(IMAGE_PLACEHOLDER)
    found_audio = token_ids.count(AUDIO_PLACEHOLDER)
    if found_visual != len(visual) or found_audio != len(audio):
        raise InvalidInputError(
            f"prompt.token_ids: {found_visual} image and {found_audio} audio placeholders, but the media are "
            f"{len(visual)} image/video and {len(audio)} audio items (one placeholder token per item)"
        )
    queues = {IMAGE_PLACEHOLDER: iter(visual), AUDIO_PLACEHOLDER: iter(audio)}
    out: list[int] = []
    for token in token_ids:
        if token not in queues:
            out.append(token)
            continue
        item = next(queues[token])
        for n, span in enumerate(item.spans):
            if n:
                out += [END_MESSAGE, MESSAGE_USER, CONTENT_IMAGE]
            out += [token] * span.rows
    return out


def _token_events(token: int, logprobs: list[TokenLogprob], deltas: list) -> list[DeltaEvent]:
    """One sampled token -> delta events: the first carries the token (and its logprob), later ones only text."""
    if not deltas:
        return [DeltaEvent((token,), logprobs=tuple(logprobs))]
    first, *rest = deltas
    events = [DeltaEvent((token,), first.text, first.channel, first.tool_call, tuple(logprobs))]
    events += [DeltaEvent(text=d.text, channel=d.channel, tool_call=d.tool_call) for d in rest]
    return events


# ---------------------------------------------------------------------------------------------------------
# Construction


def build_engine(
    checkpoint: str | Path,
    settings: DecodeEngineSettings | None = None,
    prefix_store: PrefixStore | None = None,
    prefix_connection: PrefixConnection | None = None,
) -> Engine:
    """Load the decoder weights of a checkpoint and wrap them in an `Engine` (`prefix_store`: the shared Redis
    prefix tier). The prefix and Redis keys carry `common.fingerprint.model_fingerprint` (config, dtype, weights).
    With `tensor_parallel_size` > 1 the other ranks start as child processes (`engine/parallel.py`) and this
    process holds rank 0; with a `prefix_store` they connect their own from `prefix_connection`."""
    settings = settings or DecodeEngineSettings()
    dtype = torch_dtype(settings.dtype)
    engine_settings = EngineSettings(
        kv_cache_bytes=settings.kv_cache_bytes,
        page_size=settings.page_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        enable_prefix_cache=settings.enable_prefix_cache,
        snapshot_interval_blocks=settings.snapshot_interval_blocks,
        device=settings.device,
        seed=settings.seed,
        model_fingerprint=model_fingerprint(checkpoint, settings.dtype),
        cuda_graphs=settings.cuda_graphs,
        mtp_depth=settings.mtp_depth,
        mtp_acceptance=settings.mtp_acceptance,
        mtp_draft_head=settings.mtp_draft_head,
    )
    if settings.tensor_parallel_size > 1:
        return launch_engine(
            checkpoint,
            engine_settings,
            dtype,
            settings.tensor_parallel_size,
            settings.expert_parallel,
            prefix_store,
            prefix_connection,
        )
    config = load_model_config(checkpoint)
    weights, _ = load_decoder_weights(CheckpointFiles(checkpoint), config, dtype=dtype, device=settings.device)
    model = InklingDecoder.from_weights(config.text, weights, dtype, settings.device)
    drafter = None
    if settings.mtp_depth:
        if config.mtp is None:
            raise ConfigError(f"--mtp-depth={settings.mtp_depth}: the checkpoint has no MTP drafter (mtp_config)")
        mtp, _ = load_mtp_weights(CheckpointFiles(checkpoint), config, dtype=dtype, device=settings.device)
        drafter = MTPDrafter.from_weights(mtp, config.mtp, model, head=settings.mtp_draft_head)
    return Engine(model, config, engine_settings, prefix_store, drafter)


__all__ = [
    "DecodeService",
    "DeltaEvent",
    "EngineFailure",
    "FinalEvent",
    "GenerateInput",
    "LoadSnapshot",
    "MediaEncoder",
    "MediaInput",
    "MediaSpan",
    "ModelInfo",
    "SamplingParams",
    "ServiceLimits",
    "Timings",
    "TokenLogprob",
    "Usage",
    "build_engine",
]
