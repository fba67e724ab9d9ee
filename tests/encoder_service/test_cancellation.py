"""A client that cancels an Encode mid-stream frees the work of that call: the items it no longer waits for never
reach the tower, the engine's in-flight count returns to 0, and the next call succeeds.

The tiny tower in bf16 on the CPU takes ~0.3 s per "large" item here, and the batch budget equals one large
item, so the large items reach the tower one batch at a time: the tower's row count shows which ran."""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
from PIL import Image

from common.settings import BatcherSettings, EncoderSettings, GrpcSettings
from common.wire import EncodedItem, StreamAssembler
from encoder_service.server import EncoderServer, build_server
from encoder_service.service import load_engine
from proto.inkling_epd.v1 import encoder_pb2, encoder_pb2_grpc, media_pb2
from tools.make_sample_media import sample_media
from tools.make_tiny_checkpoint import make_tiny_checkpoint

PNG = sample_media()["shapes.png"]  # 96x64 -> 400 patches of 8 px after the default 2x rescale
SMALL_ROWS = 400
LARGE_SIZE = (312, 200)  # no rescale: 25 rows x 40 cols of 8 px
LARGE_ROWS = 25 * 40
N_LARGE = 5
NO_RESCALE = media_pb2.ImageParams(rescale_policy=media_pb2.RESCALE_POLICY_NONE)


def _large_jpeg(seed: int) -> bytes:
    """A distinct photo-like image per seed (distinct mm_keys: no single-flight sharing between items)."""
    rng = np.random.default_rng(seed)
    width, height = LARGE_SIZE
    ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    pixels = np.clip(ramp + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def large_items() -> list[media_pb2.MediaItem]:
    return [
        media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=_large_jpeg(seed), image=NO_RESCALE)
        for seed in range(N_LARGE)
    ]


def _run(checkpoint, scenario):
    """A server on port 0 (one preprocessing thread, no cache, one large item per tower batch, 4 KiB chunks);
    the tower's rows are counted."""
    engine = load_engine(
        EncoderSettings(
            checkpoint=str(checkpoint),
            l1_cache_bytes=0,
            preprocess_workers=1,
            batcher=BatcherSettings(max_batch_tokens=LARGE_ROWS),
        )
    )
    tower_rows: list[int] = []
    engine.vision.register_forward_hook(lambda module, args, output: tower_rows.append(len(output)))

    async def main():
        server = build_server(engine, GrpcSettings(port=0), chunk_bytes=4096)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return await scenario(encoder_pb2_grpc.EncoderStub(channel), server, tower_rows)
        finally:
            await server.stop(0.5)

    return asyncio.run(main())


async def _settled(server: EncoderServer, tower_rows: list[int], quiet_s: float = 1.0) -> int:
    """Wait for the engine's in-flight count to reach 0 and the tower to stay idle for `quiet_s`."""
    for _ in range(250):
        if server.engine.inflight_items == 0:
            break
        await asyncio.sleep(0.02)
    seen = -1
    while seen != len(tower_rows):
        seen = len(tower_rows)
        await asyncio.sleep(quiet_s)
    return server.engine.inflight_items


async def _dropped(server: EncoderServer, tower_rows: list[int]) -> int:
    """Wait for the server to drop the cancelled call's items (in-flight count 0): the tower rows run by then."""
    for _ in range(500):
        if server.engine.inflight_items == 0:
            break
        await asyncio.sleep(0.01)
    return sum(tower_rows)


async def _encode_ok(stub: encoder_pb2_grpc.EncoderStub) -> EncodedItem:
    request = encoder_pb2.EncodeRequest(items=[media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=PNG)])
    assembler = StreamAssembler(expected_items=1)
    out = [r async for r in _results(stub.Encode(request, timeout=30), assembler)]
    assembler.finish()
    return out[0]


async def _results(call, assembler: StreamAssembler):
    async for message in call:
        result = assembler.add(message)
        if result is not None:
            yield result


def check_cancelled_work(rows_at_drop: int, rows_after_cancel: int) -> None:
    """Without cancellation the tower would see every item (400 + 5 * 1000 rows). Once the server has dropped the
    call, at most the batch already running may finish (one large item); how many large items ran before the
    cancel reached the server depends on this machine's load, but never all of them."""
    assert rows_after_cancel - rows_at_drop <= LARGE_ROWS, (rows_at_drop, rows_after_cancel)
    assert rows_after_cancel < SMALL_ROWS + N_LARGE * LARGE_ROWS, rows_after_cancel


def test_cancel_after_first_chunk_frees_the_remaining_items(checkpoint, large_items):
    """Streaming call (continue_on_item_error: each item is sent as soon as it is ready): the small first item
    arrives while the large ones are still being decoded one at a time; cancelling then must stop them."""

    async def scenario(stub, server, tower_rows):
        items = [media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=PNG), *large_items]
        call = stub.Encode(encoder_pb2.EncodeRequest(items=items, continue_on_item_error=True), timeout=60)
        first = await call.read()
        assert first.WhichOneof("part") == "header" and first.header.item_index == 0
        inflight_before = server.engine.inflight_items
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        rows_at_drop = await _dropped(server, tower_rows)
        inflight_after = await _settled(server, tower_rows)
        rows_after_cancel = sum(tower_rows)
        ok = await _encode_ok(stub)
        return inflight_before, inflight_after, rows_at_drop, rows_after_cancel, ok

    inflight_before, inflight_after, rows_at_drop, rows_after_cancel, ok = _run(checkpoint, scenario)
    assert inflight_before == 1 + N_LARGE
    assert inflight_after == 0
    check_cancelled_work(rows_at_drop, rows_after_cancel)
    assert isinstance(ok, EncodedItem) and ok.rows == SMALL_ROWS


def test_cancel_before_any_chunk_frees_the_remaining_items(checkpoint, large_items):
    """Default call (nothing is sent until every item succeeded): the client cancels once the tower has run the
    first item; the other items are dropped, nothing of the call was received, and the server serves on."""

    async def scenario(stub, server, tower_rows):
        items = [media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=PNG), *large_items]
        call = stub.Encode(encoder_pb2.EncodeRequest(items=items), timeout=60)
        for _ in range(500):
            if tower_rows:
                break
            await asyncio.sleep(0.01)
        call.cancel()
        received = [m async for m in _drain(call)]
        rows_at_drop = await _dropped(server, tower_rows)
        inflight_after = await _settled(server, tower_rows)
        rows_after_cancel = sum(tower_rows)
        ok = await _encode_ok(stub)
        return received, await call.code(), inflight_after, rows_at_drop, rows_after_cancel, ok

    received, code, inflight_after, rows_at_drop, rows_after_cancel, ok = _run(checkpoint, scenario)
    assert received == [] and code == grpc.StatusCode.CANCELLED
    assert inflight_after == 0
    check_cancelled_work(rows_at_drop, rows_after_cancel)
    assert isinstance(ok, EncodedItem) and ok.rows == SMALL_ROWS


async def _drain(call):
    try:
        async for message in call:
            yield message
    except asyncio.CancelledError:
        return
