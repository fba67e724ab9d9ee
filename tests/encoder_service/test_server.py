"""In-process Encoder gRPC server on port 0: streaming, errors as status codes, health Watch, reflection."""

import asyncio
import io
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from common.metrics import EncoderMetrics, new_registry, start_metrics_server
from common.settings import EncoderLimits, EncoderSettings, GrpcSettings
from common.wire import (
    KIND_DMEL_CODES,
    KIND_EMBEDDINGS,
    EncodedItem,
    ItemFailure,
    StreamAssembler,
    bytes_to_bf16,
    bytes_to_codes,
)
from encoder_service.preprocess.audio import preprocess_audio
from encoder_service.preprocess.image import preprocess_image
from encoder_service.server import SERVICE_NAME, build_server
from encoder_service.service import bf16_bits, load_engine
from proto.inkling_epd.v1 import encoder_pb2, encoder_pb2_grpc, media_pb2
from tools.make_sample_media import sample_media
from tools.make_tiny_checkpoint import make_tiny_checkpoint

MEDIA = sample_media()
PNG, WAV = MEDIA["shapes.png"], MEDIA["tones_16k.wav"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _run(
    checkpoint,
    scenario,
    chunk_bytes: int = 4096,
    metrics: EncoderMetrics | None = None,
    limits: EncoderLimits | None = None,
):
    """Start a server on port 0 around a fresh engine, run `scenario(stub, server, channel)`, stop it."""
    settings = EncoderSettings(checkpoint=str(checkpoint), l1_cache_bytes=16 << 20, limits=limits or EncoderLimits())
    engine = load_engine(settings, metrics)

    async def main():
        server = build_server(engine, GrpcSettings(port=0), metrics, chunk_bytes=chunk_bytes)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return await scenario(encoder_pb2_grpc.EncoderStub(channel), server, channel)
        finally:
            await server.stop(0.5)

    return asyncio.run(main())


def _item(modality: int, data: bytes) -> media_pb2.MediaItem:
    return media_pb2.MediaItem(modality=modality, data=data)


async def _collect(stub, request, timeout: float = 30.0):
    assembler = StreamAssembler(expected_items=len(request.items))
    out, messages = [], 0
    async for message in stub.Encode(request, timeout=timeout):
        messages += 1
        result = assembler.add(message)
        if result is not None:
            out.append(result)
    assembler.finish()
    return out, messages


def test_encode_png_and_wav(checkpoint):
    async def scenario(stub, server, channel):
        request = encoder_pb2.EncodeRequest(
            request_id="r1", items=[_item(media_pb2.MODALITY_IMAGE, PNG), _item(media_pb2.MODALITY_AUDIO, WAV)]
        )
        items, messages = await _collect(stub, request)
        again, _ = await _collect(stub, request)
        return server.engine, items, messages, again

    engine, (image, audio), messages, again = _run(checkpoint, scenario)
    assert isinstance(image, EncodedItem) and isinstance(audio, EncodedItem)
    with torch.inference_mode():
        pixels = preprocess_image(PNG, engine.image_policy).pixels
        codes = preprocess_audio(WAV, engine.audio_policy)
        want_image = bf16_bits(engine.vision(torch.from_numpy(pixels)))
    assert np.array_equal(bytes_to_bf16(image.payload, image.rows, image.dim), want_image)
    assert image.kind == KIND_EMBEDDINGS and audio.kind == KIND_DMEL_CODES and audio.codes_per_row == 80
    assert np.array_equal(bytes_to_codes(audio.payload, audio.rows, audio.codes_per_row), codes)
    assert image.spans[0].modality == "image" and audio.spans[0].modality == "audio"
    # 400 x 64 bf16 = 51200 bytes in 4096-byte chunks (+ headers): the stream really was chunked.
    assert messages == 2 + -(-len(image.payload) // 4096) + -(-len(audio.payload) // 4096)
    assert [i.cache_hit for i in again] == [True, True]
    assert [i.payload for i in again] == [image.payload, audio.payload]


def test_bad_image_is_invalid_argument_naming_the_item(checkpoint):
    async def scenario(stub, server, channel):
        items = [
            _item(media_pb2.MODALITY_IMAGE, PNG),
            _item(media_pb2.MODALITY_IMAGE, b"\x89PNG garbage"),
            _item(media_pb2.MODALITY_AUDIO, WAV),
        ]
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _collect(stub, encoder_pb2.EncodeRequest(request_id="bad", items=items))
        lenient, _ = await _collect(stub, encoder_pb2.EncodeRequest(items=items, continue_on_item_error=True))
        with pytest.raises(grpc.aio.AioRpcError) as unset:
            await _collect(stub, encoder_pb2.EncodeRequest(items=[media_pb2.MediaItem(data=PNG)]))
        with pytest.raises(grpc.aio.AioRpcError) as mismatch:
            await _collect(
                stub,
                encoder_pb2.EncodeRequest(
                    items=[
                        media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=WAV, image=media_pb2.ImageParams())
                    ]
                ),
            )
        return failed.value, lenient, unset.value, mismatch.value

    failed, lenient, unset, mismatch = _run(checkpoint, scenario)
    assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT and "item 1" in failed.details()
    assert isinstance(lenient[0], EncodedItem) and isinstance(lenient[2], EncodedItem)
    assert isinstance(lenient[1], ItemFailure) and lenient[1].code == "INVALID_ARGUMENT"
    assert "item 1" in lenient[1].message
    assert unset.code() == grpc.StatusCode.INVALID_ARGUMENT and "item 0" in unset.details()
    assert mismatch.code() == grpc.StatusCode.INVALID_ARGUMENT and "item 0" in mismatch.details()


def test_info_fingerprint_and_deadline(checkpoint):
    async def scenario(stub, server, channel):
        info = await stub.GetInfo(encoder_pb2.EncoderInfoRequest())
        ok, _ = await _collect(
            stub,
            encoder_pb2.EncodeRequest(
                items=[_item(media_pb2.MODALITY_IMAGE, PNG)], expected_encoder_fingerprint=info.encoder_fingerprint
            ),
        )
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await _collect(
                stub,
                encoder_pb2.EncodeRequest(
                    items=[_item(media_pb2.MODALITY_IMAGE, PNG)], expected_encoder_fingerprint=bytes(32)
                ),
            )
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await _collect(stub, encoder_pb2.EncodeRequest(items=[_item(media_pb2.MODALITY_AUDIO, WAV)]), timeout=0.001)
        for _ in range(100):  # the server side of the expired call unwinds
            if server.engine.inflight_items == 0:
                break
            await asyncio.sleep(0.02)
        return info, ok, wrong.value, late.value, server.engine.inflight_items

    info, ok, wrong, late, inflight = _run(checkpoint, scenario)
    assert len(info.encoder_fingerprint) == 32 and info.dim == 64 and info.dtype == "bfloat16"
    assert set(info.modalities) == {media_pb2.MODALITY_IMAGE, media_pb2.MODALITY_AUDIO, media_pb2.MODALITY_VIDEO}
    assert isinstance(ok[0], EncodedItem)
    assert wrong.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert inflight == 0


def test_health_watch_and_reflection(checkpoint):
    async def scenario(stub, server, channel):
        health = health_pb2_grpc.HealthStub(channel)
        check = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        statuses = [(await watch.read()).status]
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        names = []
        async for response in reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        ):
            names = [s.name for s in response.list_services_response.service]
        stopping = asyncio.create_task(server.stop(1.0))
        statuses.append((await watch.read()).status)
        await stopping
        return check.status, statuses, names

    check, statuses, names = _run(checkpoint, scenario)
    assert check == health_pb2.HealthCheckResponse.SERVING
    assert statuses == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


def test_metrics_exporter_counts_requests_and_cache(checkpoint):
    metrics = EncoderMetrics(new_registry())
    exporter = start_metrics_server(0, metrics.registry, "127.0.0.1")

    async def scenario(stub, server, channel):
        request = encoder_pb2.EncodeRequest(items=[_item(media_pb2.MODALITY_IMAGE, PNG)])
        await _collect(stub, request)
        await _collect(stub, request)
        with pytest.raises(grpc.aio.AioRpcError):
            await _collect(stub, encoder_pb2.EncodeRequest(items=[_item(media_pb2.MODALITY_IMAGE, b"junk")]))

    try:
        _run(checkpoint, scenario, metrics=metrics)
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).read().decode()
    finally:
        exporter.stop()
    assert 'inkling_encoder_requests_total{status="OK"} 2.0' in text
    assert 'inkling_encoder_requests_total{status="INVALID_ARGUMENT"} 1.0' in text
    assert 'inkling_encoder_cache_hits_total{modality="image",tier="l1"} 1.0' in text
    assert 'inkling_encoder_items_per_batch_count{tower="vision"} 1.0' in text


def test_request_above_the_response_limit_reaches_the_engine(checkpoint):
    noise = np.random.default_rng(0).integers(0, 256, (1750, 1800, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG", compress_level=1)
    big = buf.getvalue()
    assert len(big) > 8 << 20  # over the 8 MiB message limit that applies to responses

    async def scenario(stub, server, channel):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _collect(stub, encoder_pb2.EncodeRequest(items=[_item(media_pb2.MODALITY_IMAGE, big)]))
        return failed.value

    failed = _run(checkpoint, scenario)
    assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT and "patches" in failed.details()


def test_overload_is_resource_exhausted(checkpoint):
    async def scenario(stub, server, channel):
        items = [_item(media_pb2.MODALITY_IMAGE, PNG), _item(media_pb2.MODALITY_AUDIO, WAV)]
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await _collect(stub, encoder_pb2.EncodeRequest(items=items))
        ok, _ = await _collect(stub, encoder_pb2.EncodeRequest(items=items[:1]))
        return busy.value, ok

    busy, ok = _run(checkpoint, scenario, limits=EncoderLimits(max_inflight_items=1))
    assert busy.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in busy.details()
    assert isinstance(ok[0], EncodedItem)
