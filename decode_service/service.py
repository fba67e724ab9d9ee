"""The decode service (no gRPC): a request with media in, a stream of output deltas and one final event out.

    service = DecodeService(engine, encoder)
    await service.start()                     # engine thread + warm-up generation; then `ready`
    async for event in service.generate(GenerateInput(...)): ...   # DeltaEvent..., FinalEvent

One request: validate limits and sampling (`validation.py`) -> media rows (the encoder client: Redis or an
encoder replica) -> the prompt with the rows at their spans (`prompt.py`) -> an engine `Request`, run by the
engine thread (`engine_thread.py`) -> its token outputs as deltas, then a final event with finish reason, usage
and timings (`streaming.py`).

Closing a `generate` iterator early (client cancel) aborts the engine request at once, which frees its KV pages
and conv slot. `load`, `speculation` and `model_info` are what health, routing and metrics read.

Once started, the objects alive then (weights, compiled kernels, CUDA graphs, the engine's pools) are frozen out of
Python's garbage collector (`gc.freeze`, until the last service of the process closes): a full collection then
walks only what serving allocated, where it walked the whole startup heap (138 ms once every ~400 steps at 256
running on a CPU probe, a pause of the engine thread; docs/decisions.md, issue 17).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import torch

from common.errors import InvalidInputError, ResourceExhaustedError, UnavailableError
from common.request_ids import check_request_id
from common.wire import EncodedItem
from decode_service.api import (
    Event,
    FinalEvent,
    GenerateInput,
    LoadSnapshot,
    MediaEncoder,
    ModelInfo,
    ServiceLimits,
    Timings,
    Usage,
)
from decode_service.chat import CONTENT_TEXT, END_MESSAGE, MESSAGE_USER, RenderedPrompt, encode_text
from decode_service.engine.engine import Engine, SpeculationSnapshot
from decode_service.engine.request import MultimodalItem, Request, SamplingParams
from decode_service.engine_thread import EngineThread, Sink
from decode_service.prompt import build_prompt, media_items
from decode_service.streaming import MediaCounts, stream_events
from decode_service.structured.compiler import ConstraintCompiler
from decode_service.structured.matcher import ConstraintMatcher
from decode_service.validation import check_encoded, check_media, check_prompt, check_sampling
from encoder_service.codebook import AudioCodebook

log = logging.getLogger(__name__)
_started_services = 0  # started and not closed, in this process: the collector stays frozen while any is


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
        self.audio_codebook = audio_codebook  # turns audio items' dMel codes into rows (`prompt.item_rows`)
        self.limits = limits or ServiceLimits()
        self.model_id = model_id
        self.config = engine.config
        self.dtype: torch.dtype = getattr(engine.runner.model, "dtype", torch.float32)
        self._serving = False
        self._counted = False  # in `_started_services`
        self._live: dict[str, bool] = {}  # event loop only: request id -> aborted
        self._prompt_tokens_seen = 0
        self._cached_tokens_seen = 0
        self._engine_thread = EngineThread(engine, on_lost=self._lost)
        self.on_failure: Callable[[], None] | None = None  # called once, from the engine thread (server: health)
        self.structured = ConstraintCompiler(self.config.text.unpadded_vocab_size, self.config.eos_token_ids)

    @property
    def ready(self) -> bool:
        """Started and serving: not loading, not shutting down, no tensor-parallel rank lost."""
        return self._serving and self._engine_thread.failure is None

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self, warm_up: bool = True) -> None:
        """Start the engine thread; run one short generation; then `ready` (the server reports SERVING)."""
        self._engine_thread.start()
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
        global _started_services
        _started_services += 1
        self._counted = True
        gc.freeze()  # the startup heap out of the collector's walks (module docstring)
        self._serving = True
        log.info("decode service ready (context %d tokens)", self.engine.max_model_len)

    async def close(self) -> None:
        global _started_services
        if self._counted:
            self._counted = False
            _started_services -= 1
            if not _started_services:
                gc.unfreeze()  # the engine's objects are collectable again (a test process builds many)
        self._serving = False
        self._engine_thread.stop()
        await asyncio.to_thread(self._engine_thread.join, 10.0)
        if self.engine.ranks is not None:
            await asyncio.to_thread(self.engine.ranks.close)
        self.structured.close()

    def _lost(self) -> None:
        """A tensor-parallel rank was lost (engine thread): `ready` is False from now on; tell the server."""
        if self.on_failure is not None:
            self.on_failure()

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
            self._engine_thread.abort(rid)
        return found

    def load(self) -> LoadSnapshot:
        snapshot = self._engine_thread.load
        inflight = self.encoder.inflight_items if self.encoder is not None else 0
        rate = self._cached_tokens_seen / self._prompt_tokens_seen if self._prompt_tokens_seen else 0.0
        return LoadSnapshot(
            snapshot.running, snapshot.waiting, snapshot.kv_usage, snapshot.free_kv_pages, rate, inflight
        )

    def speculation(self) -> SpeculationSnapshot:
        """MTP acceptance since the engine started (the engine thread refreshes it after every step)."""
        return self._engine_thread.speculation

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
        sampling = check_sampling(inp.sampling, self.limits, self.config.text.unpadded_vocab_size)
        check_media(inp, self.limits)
        compiled = None if inp.constraint is None else await self.structured.compile(inp.constraint, inp.tools)
        self._live[rid] = False
        submitted = False
        finished = False
        try:
            encoded = await self._encode(inp, rid)
            encoded_at = time.monotonic()
            # Rendering and row conversion are CPU work: off the event loop, which serves every stream.
            prompt, mm_items = await asyncio.to_thread(self._prepare, inp, encoded)
            sampling = check_prompt(sampling, len(prompt.token_ids), self.engine.max_model_len, self.limits)
            matcher = None
            if compiled is not None:
                matcher = ConstraintMatcher(
                    compiled, prompt.token_ids, self.config.eos_token_ids, sampling.stop_token_ids
                )
            request = Request(
                rid, prompt.token_ids, sampling, mm_items, inp.priority, inp.cache_salt or None, constraint=matcher
            )
            counts = MediaCounts.of(prompt, encoded)
            echo = tuple(prompt.token_ids) if inp.return_prompt_token_ids else ()
            if self._live.get(rid):
                finished = True
                usage, timings = Usage(prompt_tokens=len(prompt.token_ids)), Timings(encode_s=encoded_at - started)
                yield FinalEvent("abort", usage, timings, prompt_token_ids=echo)
                return
            sink = Sink(asyncio.get_running_loop())
            self._engine_thread.submit(request, sink)
            submitted = True
            log.debug(
                "request %s submitted: %d prompt tokens, %d media items", rid, len(prompt.token_ids), len(encoded)
            )
            events = stream_events(
                rid, sampling, sink, counts, started, encoded_at, abort=lambda: self._engine_thread.abort(rid)
            )
            async for event in events:
                if isinstance(event, FinalEvent):
                    finished = True
                    self._prompt_tokens_seen += event.usage.prompt_tokens
                    self._cached_tokens_seen += event.usage.cached_tokens_gpu + event.usage.cached_tokens_redis
                    event = dataclasses.replace(event, prompt_token_ids=echo)
                yield event
        finally:
            if submitted and not finished:
                self._engine_thread.abort(rid)
                log.info("request %s: cancelled, aborting it in the engine", rid)
            self._live.pop(rid, None)

    async def _encode(self, inp: GenerateInput, rid: str) -> list[EncodedItem]:
        if not inp.media:
            return []
        if self.encoder is None:
            raise UnavailableError("media: this decode replica has no encoder pool and no local encoder")
        encoded = await self.encoder.encode(inp.media, rid, inp.timeout_s)
        check_encoded(encoded, self.config.text.hidden_size)
        return encoded

    def _prepare(
        self, inp: GenerateInput, encoded: Sequence[EncodedItem]
    ) -> tuple[RenderedPrompt, tuple[MultimodalItem, ...]]:
        prompt = build_prompt(inp, encoded)
        return prompt, media_items(prompt, encoded, self.dtype, self.audio_codebook)
