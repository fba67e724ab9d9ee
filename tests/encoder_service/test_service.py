"""EncoderEngine on a tiny random checkpoint: tower outputs, spans, caching, single flight, item errors."""

import asyncio
import dataclasses
import io
import uuid

import numpy as np
import pytest
import redis
import torch
from PIL import Image

from common.cache_store import Entry
from common.errors import InvalidInputError, ResourceExhaustedError
from common.media import ImageOptions, MediaInput, VideoOptions
from common.settings import EncoderLimits, EncoderSettings, RedisSettings
from common.wire import KIND_DMEL_CODES, bytes_to_bf16, bytes_to_codes
from encoder_service.codebook import AudioCodebook
from encoder_service.preprocess.audio import preprocess_audio
from encoder_service.preprocess.image import image_token_count, preprocess_image
from encoder_service.service import EncodedItem, ItemError, bf16_bits
from encoder_service.service import load_engine as _load_engine
from tools.make_sample_media import sample_media
from tools.make_tiny_checkpoint import make_tiny_checkpoint

MEDIA = sample_media()
PNG, WAV, MP4 = MEDIA["shapes.png"], MEDIA["tones_44k_stereo.wav"], MEDIA["moving.mp4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _engine(checkpoint, **limits):
    return _load_engine(
        EncoderSettings(checkpoint=str(checkpoint), l1_cache_bytes=64 << 20, limits=EncoderLimits(**limits))
    )


def _encode(engine, items):
    async def main():
        try:
            return [r async for r in engine.encode(items, "test")]
        finally:
            await engine.close()

    return asyncio.run(main())


def _reference(tower, inputs: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return bf16_bits(tower(torch.from_numpy(inputs)))


def test_image_audio_video_match_the_towers(checkpoint):
    engine = _engine(checkpoint)
    clip = MediaInput("video", MP4, video=VideoOptions(fps=4.0, max_frames=3))
    image, audio, video = _encode(engine, [MediaInput("image", PNG), MediaInput("audio", WAV), clip])
    assert all(isinstance(r, EncodedItem) for r in (image, audio, video))
    assert [image.item_index, audio.item_index, video.item_index] == [0, 1, 2]
    assert not image.cache_hit and len(image.mm_key) == 32

    pixels = preprocess_image(PNG, engine.image_policy).pixels
    assert image.rows == len(pixels) == image_token_count(96, 64, engine.image_policy)
    assert image.dim == 64 and [(s.modality, s.rows) for s in image.spans] == [("image", image.rows)]
    assert np.array_equal(bytes_to_bf16(image.payload, image.rows, image.dim), _reference(engine.vision, pixels))

    codes = preprocess_audio(WAV, engine.audio_policy)
    assert audio.rows == len(codes) == 30  # 1.5 s at 20 frames/s
    assert audio.kind == KIND_DMEL_CODES and audio.tower_dtype == "bfloat16" and audio.dim == 64
    assert np.array_equal(bytes_to_codes(audio.payload, audio.rows, audio.codes_per_row), codes)
    codebook = AudioCodebook.load(checkpoint)
    rows = codebook.rows(audio, "audio").view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(rows, _reference(engine.audio, codes))

    assert [s.modality for s in video.spans] == ["image"] * 3  # 1 s at 4 fps, capped at 3; no audio track
    assert sum(s.rows for s in video.spans) == video.rows


def test_cache_hit_and_parameters_change_the_key(checkpoint):
    engine = _engine(checkpoint)

    async def main():
        try:
            first = [r async for r in engine.encode([MediaInput("image", PNG)])][0]
            second = [r async for r in engine.encode([MediaInput("image", PNG)])][0]
            unscaled = MediaInput("image", PNG, image=ImageOptions(rescale="none"))
            raw = [r async for r in engine.encode([unscaled])][0]
            return first, second, raw
        finally:
            await engine.close()

    first, second, raw = asyncio.run(main())
    assert second.cache_hit and not first.cache_hit
    assert second.payload == first.payload and second.mm_key == first.mm_key
    assert raw.mm_key != first.mm_key and raw.rows == 8 * 13  # 96x64 unscaled, patch 8: 8 rows x 13 cols
    assert engine.cache.stats.hits == 1


def test_same_item_twice_is_computed_once(checkpoint):
    engine = _engine(checkpoint)
    calls = []
    run = engine._vision_batcher._run
    engine._vision_batcher._run = lambda x: calls.append(len(x)) or run(x)
    a, b = _encode(engine, [MediaInput("image", PNG), MediaInput("image", PNG)])
    assert a.payload == b.payload and a.mm_key == b.mm_key
    assert calls == [a.rows]


def test_bad_items_fail_alone_and_name_the_item(checkpoint):
    engine = _engine(checkpoint)
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    truncated = buf.getvalue()[:20]
    results = _encode(
        engine,
        [
            MediaInput("image", PNG),
            MediaInput("image", truncated),
            MediaInput("audio", b"not audio"),
            MediaInput("audio", WAV, image=ImageOptions()),
            MediaInput("image", truncated),
        ],
    )
    assert isinstance(results[0], EncodedItem)
    for index in (1, 2, 3, 4):
        assert isinstance(results[index], ItemError)
        assert isinstance(results[index].error, InvalidInputError)
        assert f"item {index}" in str(results[index].error)


def test_call_limits(checkpoint):
    engine = _engine(checkpoint, max_items_per_request=2, max_inflight_items=2)

    async def main():
        try:
            with pytest.raises(InvalidInputError, match="exceeds the limit"):
                [r async for r in engine.encode([MediaInput("image", PNG)] * 3)]
            with pytest.raises(InvalidInputError, match="no media"):
                [r async for r in engine.encode([])]
            stream = engine.encode([MediaInput("image", PNG)] * 2)
            first = await stream.__anext__()
            with pytest.raises(ResourceExhaustedError):
                [r async for r in engine.encode([MediaInput("image", PNG)])]
            await stream.aclose()
            assert engine.inflight_items == 0 and isinstance(first, EncodedItem)
            bad = [
                r
                async for r in engine.encode(
                    [MediaInput("image", PNG, image=ImageOptions(rescale="long_edge", rescale_frac=float("inf")))]
                )
            ]
            assert isinstance(bad[0], ItemError) and "item 0" in str(bad[0].error)
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_cached_entry_in_another_payload_layout_is_recomputed(checkpoint):
    """Audio rows cached under an audio item's key (or codes for another tower dtype) are not served."""
    engine = _engine(checkpoint)

    async def main():
        try:
            (first,) = [r async for r in engine.encode([MediaInput("audio", WAV)])]
            rows = Entry("audio", first.rows, first.dim, bytes(first.rows * first.dim * 2), first.spans)
            engine.cache.put(first.mm_key, rows)
            (second,) = [r async for r in engine.encode([MediaInput("audio", WAV)])]
            engine.cache.put(first.mm_key, dataclasses.replace(rows, **_codes_fields(first, "float32")))
            (third,) = [r async for r in engine.encode([MediaInput("audio", WAV)])]
            return first, second, third
        finally:
            await engine.close()

    first, second, third = asyncio.run(main())
    assert not second.cache_hit and second == first
    assert not third.cache_hit and third == first


def _codes_fields(item: EncodedItem, tower_dtype: str) -> dict:
    return {
        "payload": item.payload,
        "dtype": item.dtype,
        "kind": item.kind,
        "codes_per_row": item.codes_per_row,
        "tower_dtype": tower_dtype,
    }


def test_redis_shared_between_engines_and_redis_down_is_harmless(checkpoint):
    prefix = f"test:engine:{uuid.uuid4().hex}:"
    shared = RedisSettings(url="redis://127.0.0.1:6379/15", key_prefix=prefix, async_writes=False)
    down = RedisSettings(url="redis://127.0.0.1:1/15", key_prefix=prefix, timeout_s=0.1)

    def engine(redis_settings):
        return _load_engine(EncoderSettings(checkpoint=str(checkpoint), l1_cache_bytes=0, redis=redis_settings))

    client = redis.Redis.from_url(shared.url)
    items = [MediaInput("image", PNG), MediaInput("audio", WAV)]
    try:
        first, first_audio = _encode(engine(shared), items)
        second, second_audio = _encode(engine(shared), items)  # another replica, empty L1
        offline, offline_audio = _encode(engine(down), items)
        assert client.exists(prefix + first.mm_key.hex()) == 1
        stored = client.get(prefix + first_audio.mm_key.hex())  # audio is cached as its codes: 80 bytes a frame
        assert stored is not None and len(stored) == 28 + 5 + 30 * 80
    finally:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()
    assert not first.cache_hit and second.cache_hit and second.payload == first.payload
    assert not offline.cache_hit and offline.payload == first.payload
    assert (
        not first_audio.cache_hit
        and second_audio.cache_hit
        and second_audio == dataclasses.replace(first_audio, cache_hit=True)
    )
    assert second_audio.kind == KIND_DMEL_CODES and offline_audio.payload == first_audio.payload
