"""Bad input over a real in-process Encoder server (port 0): every bad item fails the call with a status that
names the item and the reason, nothing of the call reaches the client before that status, and the server
keeps serving. Silence and a 1x1 image are valid input.

Covered elsewhere, so not repeated here: a PNG signature followed by garbage and `b"junk"` bytes
(test_server.py), an image whose patch count exceeds the default limit (test_server.py, "patches"),
too many in-flight items (test_server.py, RESOURCE_EXHAUSTED), no items / too many items per call
(test_service.py, at the engine).
"""

from __future__ import annotations

import asyncio
import io
import re
import threading
import wave
from collections.abc import Iterator
from dataclasses import dataclass

import av
import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from common.settings import EncoderLimits, EncoderSettings, GrpcSettings
from common.wire import EncodedItem, StreamAssembler, bf16_bits_to_float32, bytes_to_codes
from encoder_service.codebook import AudioCodebook
from encoder_service.preprocess.audio import audio_token_count, preprocess_audio
from encoder_service.server import EncoderServer, build_server
from encoder_service.service import bf16_bits, load_engine
from proto.inkling_epd.v1 import encoder_pb2, encoder_pb2_grpc, media_pb2
from tools.make_sample_media import sample_media
from tools.make_tiny_checkpoint import make_tiny_checkpoint

MEDIA = sample_media()
PNG, WAV = MEDIA["shapes.png"], MEDIA["tones_16k.wav"]  # 96x64 (valid under LIMITS), 1.5 s at 16 kHz
IMAGE, AUDIO, VIDEO = media_pb2.MODALITY_IMAGE, media_pb2.MODALITY_AUDIO, media_pb2.MODALITY_VIDEO
LIMITS = EncoderLimits(max_image_patches=1000, max_audio_seconds=3.0, max_item_bytes=1 << 20, max_items_per_request=4)
MAX_REQUEST_BYTES = 2 << 20  # the gRPC receive limit of this server (max_message_bytes is below it)


# ---------------------------------------------------------------------------------------------------------
# Media


def _image(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _video_without_frames() -> bytes:
    """A well-formed AVI with a video stream that holds no frame."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        out.start_encoding()
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _item(modality: int, data: bytes, **params) -> media_pb2.MediaItem:
    return media_pb2.MediaItem(modality=modality, data=data, **params)


# ---------------------------------------------------------------------------------------------------------
# One server for the module, on its own event loop thread; the tests use a blocking channel.


@dataclass
class Running:
    server: EncoderServer
    channel: grpc.Channel
    stub: encoder_pb2_grpc.EncoderStub


@pytest.fixture(scope="module")
def running(tmp_path_factory) -> Iterator[Running]:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)
    engine = load_engine(
        EncoderSettings(checkpoint=str(checkpoint), l1_cache_bytes=0, limits=LIMITS, preprocess_workers=2)
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    grpc_settings = GrpcSettings(port=0, max_message_bytes=1 << 20, max_request_bytes=MAX_REQUEST_BYTES)

    async def start() -> EncoderServer:
        server = build_server(engine, grpc_settings, chunk_bytes=4096)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Running(server, channel, encoder_pb2_grpc.EncoderStub(channel))
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _call(
    stub: encoder_pb2_grpc.EncoderStub,
    items: list[media_pb2.MediaItem],
) -> tuple[list[encoder_pb2.EncodeChunk], grpc.RpcError | None]:
    """Every message the client received, and the error status (None: the call ended OK)."""
    received: list[encoder_pb2.EncodeChunk] = []
    try:
        for message in stub.Encode(encoder_pb2.EncodeRequest(items=items), timeout=30):
            received.append(message)
    except grpc.RpcError as exc:
        return received, exc
    return received, None


def _assemble(messages: list[encoder_pb2.EncodeChunk], n_items: int) -> list[EncodedItem]:
    assembler = StreamAssembler(expected_items=n_items)
    out = [r for r in (assembler.add(m) for m in messages) if r is not None]
    assembler.finish()
    return out


def _still_serving(running: Running) -> None:
    received, error = _call(running.stub, [_item(IMAGE, PNG), _item(AUDIO, WAV)])
    assert error is None
    image, audio = _assemble(received, 2)
    assert image.rows == 16 * 25 and audio.rows == 30  # 192x128 after rescale, 8 px patches
    engine = running.server.engine
    for _ in range(100):
        if engine.inflight_items == 0:
            break
        threading.Event().wait(0.02)
    assert engine.inflight_items == 0


# ---------------------------------------------------------------------------------------------------------
# Failing calls: (items, failing index, codes allowed, words the reason must contain)

_JPEG = _image(80, 60, "JPEG", seed=1)

BAD_CASES = {
    "truncated_jpeg": ([_item(IMAGE, PNG), _item(IMAGE, _JPEG[: len(_JPEG) // 2])], 1, "corrupt image"),
    "corrupt_png_body": ([_item(AUDIO, WAV), _item(IMAGE, _image(64, 48)[:60] + bytes(400))], 1, "image"),
    "random_bytes_as_audio": (
        [_item(IMAGE, PNG), _item(AUDIO, np.random.default_rng(2).bytes(4096))],
        1,
        "not decodable audio",
    ),
    "random_bytes_as_video": ([_item(VIDEO, np.random.default_rng(3).bytes(4096))], 0, "not decodable video"),
    "unsupported_image_format": ([_item(IMAGE, PNG), _item(IMAGE, _image(16, 16, "PPM"))], 1, "not a decodable image"),
    "svg_is_unsupported": (
        [_item(IMAGE, b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>')],
        0,
        "not a decodable image",
    ),
    "audio_bytes_as_image": ([_item(IMAGE, WAV)], 0, "not a decodable image"),
    "zero_length_audio_data": ([_item(IMAGE, PNG), _item(AUDIO, b"")], 1, "empty media data"),
    "zero_sample_wav": ([_item(IMAGE, PNG), _item(AUDIO, _wav(np.zeros(0)))], 1, "empty audio"),
    "video_without_frames": ([_item(AUDIO, WAV), _item(VIDEO, _video_without_frames())], 1, "no decodable frames"),
    "audio_file_as_video": ([_item(VIDEO, WAV)], 0, "no video stream"),
    "png_as_video": ([_item(AUDIO, WAV), _item(VIDEO, PNG)], 1, "a still image (png_pipe), not a video"),
    "jpeg_as_video": ([_item(VIDEO, _JPEG)], 0, "not a video"),
    "image_over_patch_limit": ([_item(IMAGE, PNG), _item(IMAGE, _image(200, 200))], 1, "patches"),
    "audio_over_length_limit": ([_item(AUDIO, WAV), _item(AUDIO, _wav(np.zeros(4 * 16000)))], 1, "longer than"),
    "item_over_byte_limit": ([_item(IMAGE, PNG), _item(IMAGE, PNG + bytes(1 << 20))], 1, "bytes exceeds"),
    "too_many_items": ([_item(IMAGE, PNG)] * 5, None, "5 items exceeds"),
}
LIMIT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
LIMIT_CASES = {"image_over_patch_limit", "audio_over_length_limit", "item_over_byte_limit", "too_many_items"}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_item_fails_the_call_naming_it_and_the_server_keeps_serving(running: Running, case: str) -> None:
    items, index, reason = BAD_CASES[case]
    received, error = _call(running.stub, items)
    assert error is not None, f"{case}: the call succeeded"
    allowed = LIMIT_CODES if case in LIMIT_CASES else {grpc.StatusCode.INVALID_ARGUMENT}
    assert error.code() in allowed, (error.code(), error.details())
    if index is not None:
        assert f"item {index}" in error.details()
    assert reason in error.details()
    # no internal reprs (buffer objects, errnos, Python containers) and the item named once
    assert not re.search(r"object at 0x|Errno|\('|\['|Error:", error.details()), error.details()
    assert len(re.findall(r"item \d+ \(", error.details())) <= 1, error.details()
    assert received == []  # no header or chunk of any item (not even the good ones) before the status
    _still_serving(running)


def test_oversized_request_is_resource_exhausted(running: Running) -> None:
    received, error = _call(running.stub, [_item(IMAGE, PNG), _item(IMAGE, bytes(MAX_REQUEST_BYTES))])
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert received == []
    _still_serving(running)


# ---------------------------------------------------------------------------------------------------------
# Valid edge cases


def test_silent_audio_is_valid_input(running: Running) -> None:
    """Silence is audio (spec 3.2: only EMPTY audio is rejected): F = ceil(n / 800) frames; every frame sees
    the same all-zero window (magnitudes at the 1e-10 floor), so all codes (what goes out) and all rows the
    codebook makes of them are equal."""
    silence = _wav(np.zeros(16000 + 1))
    received, error = _call(running.stub, [_item(AUDIO, silence)])
    assert error is None
    (item,) = _assemble(received, 1)
    engine = running.server.engine
    assert item.rows == audio_token_count(16001, engine.audio_policy) == 21
    codes = preprocess_audio(silence, engine.audio_policy)
    assert (codes == codes[0]).all()
    assert np.array_equal(bytes_to_codes(item.payload, item.rows, item.codes_per_row), codes)
    rows = bf16_bits(AudioCodebook(engine.audio.config, engine.audio.state_dict()).rows(item, "audio"))
    with torch.inference_mode():
        assert np.array_equal(rows, bf16_bits(engine.audio(torch.from_numpy(codes))))
    assert (rows == rows[0]).all() and np.isfinite(bf16_bits_to_float32(rows)).all()


def test_one_pixel_image_is_one_token(running: Running) -> None:
    """1x1 -> 2x2 with the default f=2.0 -> one row of floor(2/P)+1 = 1 patch (the padded end-of-row one)."""
    one_pixel = _image(1, 1)
    plain = media_pb2.ImageParams(rescale_policy=media_pb2.RESCALE_POLICY_NONE)
    received, error = _call(running.stub, [_item(IMAGE, one_pixel), _item(IMAGE, one_pixel, image=plain)])
    assert error is None
    scaled, unscaled = _assemble(received, 2)
    assert scaled.rows == 1 and unscaled.rows == 1
    assert scaled.payload != unscaled.payload  # 2x2 resampled pixels vs the single pixel: different patches
