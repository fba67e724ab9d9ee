"""The encoder engine (no gRPC): media items in, bf16 tower outputs (dMel codes for audio) out, with caching.

Per item: validate the parameters against the limits, compute the `mm_key` (media bytes + preprocessing
fingerprint + encoder fingerprint), look it up in the embedding cache, otherwise preprocess on a CPU thread
pool, run the tower through the cross-request `DynamicBatcher`, store the result in the cache and return it.
An audio clip skips its tower: its dMel codes go out as they are (`common.wire.KIND_DMEL_CODES`, 80 bytes a
frame instead of `2 * dim`) and the decode replica does the codebook sum; a video's audio track still goes
out as rows, with the frames.
Items of one call run concurrently and come back in item order. Concurrent work on the same `mm_key` (in one
call or across calls) is computed once; once every caller waiting for a computation has gone (cancelled
call), the computation is cancelled too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.cache_store import EmbeddingCache, Entry, LruCache, RedisCache, TieredCache
from common.checkpoint import AUDIO, VISUAL, CheckpointFiles, load_tower_weights
from common.config import load_model_config
from common.dtypes import TORCH_DTYPES, torch_dtype
from common.errors import InklingError, InvalidInputError, ResourceExhaustedError
from common.fingerprint import encoder_fingerprint_of
from common.hashing import mm_key
from common.media import MediaInput
from common.metrics import EncoderMetrics
from common.settings import BatcherSettings, EncoderLimits, EncoderSettings
from common.wire import DTYPE_UINT8, KIND_DMEL_CODES, KIND_EMBEDDINGS, EncodedItem, Span, codes_to_bytes
from encoder_service.batcher import DynamicBatcher
from encoder_service.planner import MediaPlanner
from encoder_service.preprocess.audio import AudioPolicy
from encoder_service.preprocess.image import ImagePolicy, image_token_count, probe_image
from encoder_service.preprocess.video import VideoItems, VideoPolicy
from encoder_service.towers import AudioTower, VisionTower, build_towers

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# Requests in native form (the server converts protobuf to these)


@dataclass(frozen=True)
class ItemError:
    """An item that could not be encoded; `error` carries the message (naming the item) and the kind."""

    item_index: int
    error: InklingError


@dataclass(frozen=True)
class EngineInfo:
    fingerprint: bytes
    model_id: str
    dim: int
    modalities: tuple[str, ...]
    limits: EncoderLimits
    max_batch_tokens: int


# ---------------------------------------------------------------------------------------------------------
# Tower plumbing (torch lives here, not in the server)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """Tower output -> bf16 bit patterns as a uint16 numpy array (what `common.wire` ships)."""
    return t.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


# ---------------------------------------------------------------------------------------------------------
# Engine


class EncoderEngine:
    def __init__(
        self,
        *,
        vision: VisionTower | None,
        audio: AudioTower | None,
        dim: int,
        fingerprint: bytes,
        image_policy: ImagePolicy | None = None,
        audio_policy: AudioPolicy | None = None,
        video_policy: VideoPolicy | None = None,
        cache: EmbeddingCache | None = None,
        limits: EncoderLimits | None = None,
        batcher: BatcherSettings | None = None,
        preprocess_workers: int = 4,
        metrics: EncoderMetrics | None = None,
        model_id: str = "",
    ) -> None:
        self.limits = limits or EncoderLimits()
        batcher = batcher or BatcherSettings()
        self.vision, self.audio, self.dim, self.fingerprint = vision, audio, dim, fingerprint
        self.model_id = model_id
        self.planner = MediaPlanner(
            vision is not None, audio is not None, self.limits, image_policy, audio_policy, video_policy
        )
        self.image_policy = self.planner.image_policy
        self.audio_policy = self.planner.audio_policy
        self.video_policy = self.planner.video_policy
        self.cache = cache
        self.metrics = metrics
        self.max_batch_tokens = batcher.max_batch_tokens
        self._preprocess_pool = ThreadPoolExecutor(preprocess_workers, thread_name_prefix="preprocess")
        self._tower_pool = ThreadPoolExecutor(1, thread_name_prefix="tower")
        wait_s = batcher.max_wait_ms / 1000.0
        self._vision_batcher = DynamicBatcher(
            self._run_vision, batcher.max_batch_tokens, wait_s, self._tower_pool, self._observer("vision")
        )
        self._audio_batcher = DynamicBatcher(
            self._run_audio, batcher.max_batch_tokens, wait_s, self._tower_pool, self._observer("audio")
        )
        self._singleflight: dict[bytes, asyncio.Task[Entry]] = {}
        self._waiters: dict[asyncio.Task[Entry], int] = {}  # callers awaiting each computation
        self._inflight = 0

    # -- public ----------------------------------------------------------------------------------------------

    @property
    def modalities(self) -> tuple[str, ...]:
        return self.planner.modalities

    @property
    def inflight_items(self) -> int:
        return self._inflight

    def info(self) -> EngineInfo:
        return EngineInfo(
            self.fingerprint, self.model_id, self.dim, self.modalities, self.limits, self.max_batch_tokens
        )

    async def encode(
        self,
        items: Sequence[MediaInput],
        request_id: str = "",
    ) -> AsyncIterator[EncodedItem | ItemError]:
        """Encode all items concurrently; yield each result (or its `ItemError`) in item order.

        Raises `InvalidInputError` for a malformed call (no items, too many) and `ResourceExhaustedError` when
        the engine is over its in-flight budget. Closing the iterator early cancels the remaining work.
        """
        if not items:
            raise InvalidInputError("Encode: no media items")
        if len(items) > self.limits.max_items_per_request:
            raise InvalidInputError(
                f"Encode: {len(items)} items exceeds the limit of {self.limits.max_items_per_request} per request"
            )
        if self._inflight + len(items) > self.limits.max_inflight_items:
            raise ResourceExhaustedError(
                f"encoder busy: {self._inflight} items in flight (limit {self.limits.max_inflight_items})"
            )
        self._inflight += len(items)
        if self.metrics:
            self.metrics.inflight.set(self._inflight)
        tasks = [
            asyncio.create_task(self._encode_item(i, item), name=f"encode-{request_id}-{i}")
            for i, item in enumerate(items)
        ]
        try:
            for index, task in enumerate(tasks):
                try:
                    result: EncodedItem | ItemError = await task
                except InklingError as exc:
                    result = ItemError(index, exc)
                self._count(items[index].modality, "ok" if isinstance(result, EncodedItem) else "error")
                yield result
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._inflight -= len(items)
            if self.metrics:
                self.metrics.inflight.set(self._inflight)

    async def close(self) -> None:
        await self._vision_batcher.close()
        await self._audio_batcher.close()
        for task in list(self._singleflight.values()):
            task.cancel()
        self._preprocess_pool.shutdown(wait=False, cancel_futures=True)
        self._tower_pool.shutdown(wait=False, cancel_futures=True)
        if self.cache is not None:
            await asyncio.to_thread(self.cache.close)

    # -- per item --------------------------------------------------------------------------------------------

    def preprocess_fingerprint(self, media: MediaInput, item: str = "item") -> dict:
        """The preprocessing part of `media`'s mm_key (`MediaPlanner.preprocess_fingerprint`)."""
        return self.planner.preprocess_fingerprint(media, item)

    async def _encode_item(self, index: int, media: MediaInput) -> EncodedItem:
        item = f"item {index} ({media.modality})"
        fingerprint, preprocess = self.planner.plan(media, item)
        key = mm_key(media.modality, media.data, fingerprint, self.fingerprint)
        entry = await self._lookup(key, media, item)
        hit = entry is not None
        if entry is None:
            task = self._singleflight.get(key)
            shared = task is not None
            if task is None:
                task = asyncio.create_task(self._compute(key, media.modality, preprocess, item))
                self._singleflight[key] = task
                task.add_done_callback(lambda t, k=key: self._computed(k, t))
            self._waiters[task] = self._waiters.get(task, 0) + 1
            try:
                entry = await asyncio.shield(task)
            except InvalidInputError as exc:
                if not shared:
                    raise
                raise InvalidInputError(f"{item}: same media as an item that failed: {exc}") from None
            finally:
                self._release(key, task)
        return EncodedItem(
            item_index=index,
            mm_key=key,
            modality=media.modality,
            rows=entry.rows,
            dim=entry.dim,
            payload=entry.payload,
            spans=entry.spans,
            cache_hit=hit,
            dtype=entry.dtype,
            kind=entry.kind,
            codes_per_row=entry.codes_per_row,
            tower_dtype=entry.tower_dtype,
        )

    def _release(self, key: bytes, task: asyncio.Task[Entry]) -> None:
        """One caller fewer; the last one to go cancels a computation that is still running."""
        self._waiters[task] -= 1
        if self._waiters[task]:
            return
        del self._waiters[task]
        if not task.done():
            task.cancel()
            if self._singleflight.get(key) is task:
                del self._singleflight[key]  # a new caller starts afresh instead of joining a cancelled task

    def _computed(self, key: bytes, task: asyncio.Task) -> None:
        if self._singleflight.get(key) is task:
            del self._singleflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: the callers may all have gone away

    async def _lookup(self, key: bytes, media: MediaInput, item: str) -> Entry | None:
        if self.cache is None:
            return None
        entry = await asyncio.to_thread(self.cache.get, key)
        if entry is None:
            return None
        layout = (entry.kind, entry.codes_per_row, entry.tower_dtype)
        if entry.modality != media.modality or entry.dim != self.dim or layout != self._layout(media.modality):
            log.warning(
                "%s: cached entry does not fit (modality %s, dim %d, %s); recomputing",
                item,
                entry.modality,
                entry.dim,
                entry.kind,
            )
            return None
        if media.modality == "image":
            # A cheap header probe catches a row count that cannot belong to this image (spec serving 2.5).
            policy = self.planner.image_policy_for(media.image, item)
            width, height = probe_image(media.data, policy.exif_transpose, item)
            if entry.rows != image_token_count(width, height, policy):
                log.warning(
                    "%s: cached entry has %d rows, the image needs %d; recomputing",
                    item,
                    entry.rows,
                    image_token_count(width, height, policy),
                )
                return None
        return entry

    async def _compute(self, key: bytes, modality: str, preprocess: Callable[[], Any], item: str) -> Entry:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            prepared = await loop.run_in_executor(self._preprocess_pool, preprocess)
        except InklingError:
            raise
        except Exception as exc:  # decoders meeting hostile bytes: the item is bad, the server is fine
            log.warning("%s: preprocessing failed", item, exc_info=exc)
            raise InvalidInputError(f"{item}: media could not be decoded") from exc  # details: the log above
        if self.metrics:
            self.metrics.preprocess.labels(modality).observe(time.monotonic() - started)
        if modality == "image":
            bits = await self._vision_batcher.submit(prepared)
            spans: tuple[Span, ...] = (Span("image", len(bits)),)
        elif modality == "audio":
            entry = self._codes_entry(prepared)
            if self.cache is not None:
                await asyncio.to_thread(self.cache.put, key, entry)
            return entry
        else:
            clip: VideoItems = prepared
            parts = list(await asyncio.gather(*(self._vision_batcher.submit(f.pixels) for f in clip.frames)))
            spans = tuple(Span("image", len(p)) for p in parts)
            if clip.audio is not None and len(clip.audio):
                parts.append(await self._audio_batcher.submit(clip.audio))
                spans += (Span("audio", len(parts[-1])),)
            bits = np.concatenate(parts)
        payload = np.ascontiguousarray(bits, dtype="<u2").tobytes()
        entry = Entry(modality=modality, rows=len(bits), dim=self.dim, payload=payload, spans=spans)
        if self.cache is not None:
            await asyncio.to_thread(self.cache.put, key, entry)
        return entry

    def _layout(self, modality: str) -> tuple[str, int, str]:
        """(payload kind, codes per row, tower dtype) this engine produces for `modality`."""
        if modality != "audio":
            return KIND_EMBEDDINGS, 0, ""
        assert self.audio is not None  # the planner refuses audio without an audio tower
        tower_dtype = next(n for n, t in TORCH_DTYPES.items() if t == self.audio.encoder.weight.dtype)
        return KIND_DMEL_CODES, self.audio.config.n_mel_bins, tower_dtype

    def _codes_entry(self, codes: np.ndarray) -> Entry:
        kind, per_row, tower_dtype = self._layout("audio")
        assert self.audio is not None and codes.ndim == 2 and codes.shape[1] == per_row, codes.shape
        assert not codes.size or int(codes.max()) < self.audio.config.mel_vocab_size, "the quantiser's range"
        return Entry(
            modality="audio",
            rows=len(codes),
            dim=self.dim,
            payload=codes_to_bytes(codes),
            spans=(Span("audio", len(codes)),),
            dtype=DTYPE_UINT8,
            kind=kind,
            codes_per_row=per_row,
            tower_dtype=tower_dtype,
        )

    # -- towers (run on the single tower thread) -----------------------------------------------------------

    def _device(self, tower: torch.nn.Module) -> torch.device:
        return next(tower.parameters()).device

    def _run_vision(self, pixels: np.ndarray) -> np.ndarray:
        assert self.vision is not None
        with torch.inference_mode():
            return bf16_bits(self.vision(torch.from_numpy(pixels).to(self._device(self.vision))))

    def _run_audio(self, codes: np.ndarray) -> np.ndarray:
        assert self.audio is not None
        with torch.inference_mode():
            return bf16_bits(self.audio(torch.from_numpy(codes).to(self._device(self.audio))))

    def _observer(self, tower: str) -> Callable[[int, int, float, float], None] | None:
        metrics = self.metrics
        if metrics is None:
            return None

        def observe(items: int, rows: int, wait_s: float, run_s: float) -> None:
            metrics.items_per_batch.labels(tower).observe(items)
            metrics.forward.labels(tower).observe(run_s)
            metrics.queue_wait.observe(wait_s)

        return observe

    def _count(self, modality: str, status: str) -> None:
        if self.metrics:
            self.metrics.items.labels(modality, status).inc()


# ---------------------------------------------------------------------------------------------------------
# Construction from a checkpoint


def build_cache(settings: EncoderSettings, metrics: EncoderMetrics | None) -> EmbeddingCache | None:
    observer = metrics.cache if metrics else None
    l1 = LruCache(settings.l1_cache_bytes, observer=observer) if settings.l1_cache_bytes > 0 else None
    l2 = None
    if settings.redis is not None:
        r = settings.redis
        l2 = RedisCache(
            r.url,
            key_prefix=r.key_prefix,
            timeout_s=r.timeout_s,
            ttl_s=r.ttl_s,
            max_value_bytes=r.max_value_bytes,
            async_writes=r.async_writes,
            observer=observer,
        )
    return TieredCache(l1, l2) if l1 is not None or l2 is not None else None


def load_engine(settings: EncoderSettings, metrics: EncoderMetrics | None = None) -> EncoderEngine:
    """Read config + tower weights from the checkpoint and build the engine described by `settings`."""
    config = load_model_config(settings.checkpoint)
    dtype = torch_dtype(settings.dtype)
    files = CheckpointFiles(settings.checkpoint)
    vision_state = audio_state = None
    if config.vision is not None:
        vision_state, _ = load_tower_weights(files, VISUAL, config, dtype, settings.device)
    if config.audio is not None:
        audio_state, _ = load_tower_weights(files, AUDIO, config, dtype, settings.device)
    vision, audio = build_towers(config, vision_state, audio_state, settings.device, dtype)
    planner = MediaPlanner.for_config(config, settings.limits)
    return EncoderEngine(
        vision=vision,
        audio=audio,
        dim=config.text.hidden_size,
        fingerprint=encoder_fingerprint_of(settings.checkpoint, settings.dtype),
        image_policy=planner.image_policy,
        audio_policy=planner.audio_policy,
        cache=build_cache(settings, metrics),
        limits=settings.limits,
        batcher=settings.batcher,
        preprocess_workers=settings.preprocess_workers,
        metrics=metrics,
        model_id=str(settings.checkpoint),
    )
