"""Property-based fuzzing of `Encoder.Encode` against a real in-process server (bounded examples, no deadline).

Every request (random fields, huge/negative/non-finite parameters, random, truncated or bit-flipped media,
raw bytes that are not a valid protobuf or carry invalid UTF-8) must end as a well-formed stream (one header
+ chunks or one ItemError per item, verified by `StreamAssembler`) or as a status code with a message from the
documented set. Afterwards the server is still SERVING and a valid request succeeds.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.settings import EncoderLimits, EncoderSettings, GrpcSettings
from common.wire import KIND_EMBEDDINGS, EncodedItem, ItemFailure, StreamAssembler
from encoder_service.server import build_server
from encoder_service.service import load_engine
from proto.inkling_epd.v1 import encoder_pb2, media_pb2
from tools.make_sample_media import sample_media

MEDIA = sample_media()
SEEDS = [MEDIA["shapes.png"], MEDIA["tones_16k.wav"], MEDIA["moving.mp4"]]
ENCODE = "/inkling_epd.v1.Encoder/Encode"
# What a request may legitimately fail with (serving spec: errors are these status codes, with a message).
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CALL_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint, loop_thread):
    """(address, server) of an encoder with small limits so that 'too big' is reachable by the fuzzer."""
    limits = EncoderLimits(
        max_items_per_request=4,
        max_item_bytes=1 << 20,
        max_image_patches=2048,
        max_audio_seconds=5.0,
        max_video_frames=4,
    )
    engine = load_engine(
        EncoderSettings(checkpoint=tiny_checkpoint, l1_cache_bytes=8 << 20, limits=limits, preprocess_workers=2)
    )

    async def start():
        server = build_server(engine, GrpcSettings(port=0, max_request_bytes=4 << 20), chunk_bytes=4096)
        await server.start()
        return server

    server = loop_thread.run(start())
    try:
        yield f"127.0.0.1:{server.port}", server
    finally:
        loop_thread.run(server.stop(1.0))


# ---------------------------------------------------------------------------------------------------------
# Strategies

finite_or_not = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e308]))
u32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1]))


@st.composite
def media_bytes(draw) -> bytes:
    seed = draw(st.sampled_from(SEEDS))
    kind = draw(st.sampled_from(["seed", "truncated", "flipped", "random", "empty", "prefix-garbage"]))
    if kind == "seed":
        return seed
    if kind == "truncated":
        return seed[: draw(st.integers(0, len(seed) - 1))]
    if kind == "flipped":
        data = bytearray(seed)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=4096))
    if kind == "empty":
        return b""
    return seed[:16] + draw(st.binary(max_size=512))


@st.composite
def image_params(draw) -> media_pb2.ImageParams:
    params = media_pb2.ImageParams(rescale_policy=draw(st.integers(0, 5)))
    if draw(st.booleans()):
        params.rescale_frac = draw(finite_or_not)
    if draw(st.booleans()):
        params.rescale_max_long_edge = draw(u32)
    return params


@st.composite
def media_item(draw) -> media_pb2.MediaItem:
    item = media_pb2.MediaItem(modality=draw(st.integers(0, 6)))
    if draw(st.integers(0, 9)):
        item.data = draw(media_bytes())
    which = draw(st.sampled_from([None, "image", "audio", "video"]))
    if which == "image":
        item.image.CopyFrom(draw(image_params()))
    elif which == "audio":
        item.audio.SetInParent()
    elif which == "video":
        item.video.SetInParent()
        if draw(st.booleans()):
            item.video.fps = draw(finite_or_not)
        if draw(st.booleans()):
            item.video.max_frames = draw(u32)
        if draw(st.booleans()):
            item.video.include_audio = draw(st.booleans())
        if draw(st.booleans()):
            item.video.frame.CopyFrom(draw(image_params()))
    return item


@st.composite
def encode_request(draw) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(
        request_id=draw(st.text(max_size=40)),
        items=draw(st.lists(media_item(), max_size=6)),
        expected_encoder_fingerprint=draw(st.one_of(st.just(b""), st.binary(max_size=40))),
        continue_on_item_error=draw(st.booleans()),
    )


# ---------------------------------------------------------------------------------------------------------
# Checks


def _check_call(channel: grpc.Channel, payload: bytes, expected_items: int | None) -> str:
    """Send raw request bytes; assert a well-formed stream or an allowed status. Returns the outcome."""
    call = channel.unary_stream(
        ENCODE, request_serializer=lambda b: b, response_deserializer=encoder_pb2.EncodeChunk.FromString
    )
    assembler = StreamAssembler(expected_items=expected_items)
    results: list[EncodedItem | ItemFailure] = []
    try:
        for message in call(payload, timeout=CALL_TIMEOUT_S):
            done = assembler.add(message)
            if done is not None:
                results.append(done)
        assembler.finish()
    except grpc.RpcError as exc:
        code = exc.code()
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "the server hung on this request"
        assert exc.details(), f"status {code.name} without a message"
        assert code in ALLOWED, f"unexpected {code.name}: {exc.details()}"
        return code.name
    if expected_items is not None:
        assert len(results) == expected_items
    for result in results:
        if isinstance(result, EncodedItem):
            width = result.dim * 2 if result.kind == KIND_EMBEDDINGS else result.codes_per_row  # bf16 rows or codes
            assert result.rows > 0 and len(result.payload) == result.rows * width
        else:
            assert result.code in {c.name for c in ALLOWED} and result.message
    return "OK"


def _assert_still_serving(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        good = encoder_pb2.EncodeRequest(
            request_id="after-fuzz",
            items=[
                media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=MEDIA["shapes.png"]),
                media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=MEDIA["tones_16k.wav"]),
            ],
        )
        assert _check_call(channel, good.SerializeToString(), 2) == "OK"


# ---------------------------------------------------------------------------------------------------------
# Properties


def test_random_encode_requests_end_cleanly(encoder):
    address, server = encoder
    outcomes: dict[str, int] = {}
    with grpc.insecure_channel(address) as channel:

        @FUZZ
        @given(request=encode_request())
        def check(request: encoder_pb2.EncodeRequest) -> None:
            outcome = _check_call(channel, request.SerializeToString(), len(request.items))
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        check()
    assert server.engine.inflight_items == 0
    assert len(outcomes) > 1, outcomes  # the fuzzer reached both success and refusal paths
    _assert_still_serving(address)


def test_malformed_wire_bytes_end_cleanly(encoder):
    address, server = encoder
    valid = encoder_pb2.EncodeRequest(
        request_id="x", items=[media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=MEDIA["shapes.png"])]
    ).SerializeToString()
    # field 1 (request_id, a proto3 string) holding bytes that are not UTF-8
    bad_utf8 = b"\x0a\x04\xff\xfe\xc3\x28" + valid[valid.index(b"\x12") :]
    with grpc.insecure_channel(address) as channel:
        assert _check_call(channel, bad_utf8, None) == "INVALID_ARGUMENT"

        @FUZZ
        @given(cut=st.integers(0, len(valid)), noise=st.binary(max_size=64))
        def check(cut: int, noise: bytes) -> None:
            _check_call(channel, valid[:cut] + noise, None)

        check()
    assert server.engine.inflight_items == 0
    _assert_still_serving(address)


def test_oversized_request_is_refused_by_the_message_limit(encoder):
    address, _ = encoder
    big = encoder_pb2.EncodeRequest(
        items=[media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=b"\0" * (9 << 20))]
    )
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        assert _check_call(channel, big.SerializeToString(), 1) == "RESOURCE_EXHAUSTED"
    _assert_still_serving(address)
