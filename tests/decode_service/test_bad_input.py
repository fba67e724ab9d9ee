"""Bad input against a real in-process decode server (+ encoder server), tiny checkpoint in float32.

Every malformed request ends with a status code (INVALID_ARGUMENT, RESOURCE_EXHAUSTED or NOT_FOUND) whose
message names the offending field or item, before any output: never an OK stream with an error inside. After
all of them the replica still serves a valid request.
"""

from __future__ import annotations

import grpc
import pytest

from common.settings import DecodeEngineSettings, EncoderLimits, EncoderSettings, GrpcSettings
from decode_service.api import ServiceLimits
from decode_service.chat import AUDIO_PLACEHOLDER, CONTENT_TEXT, END_MESSAGE, IMAGE_PLACEHOLDER, MESSAGE_USER
from decode_service.encoder_client import EncoderClient
from decode_service.engine.build import build_engine
from decode_service.local_encoder import LocalEncoder
from decode_service.server import build_server
from decode_service.service import DecodeService
from encoder_service.codebook import AudioCodebook
from encoder_service.server import build_server as build_encoder_server
from encoder_service.service import load_engine
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc, media_pb2
from tools.make_sample_media import draw_shapes, png_bytes, sample_media

pytestmark = pytest.mark.anyio

MEDIA = sample_media()
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
MAX_PROMPT_TOKENS = 1000
MAX_MEDIA_ITEMS = 3
MAX_IMAGE_PIXELS = 128 * 128  # the sample image (96x64) fits, a 256x256 one does not
MAX_AUDIO_SECONDS = 1.0  # the 1.5 s sample clip does not fit


@pytest.fixture(scope="module")
async def stub(checkpoint):
    """A Generator stub on a decode server (small limits) whose encoder server has small media limits."""
    limits = EncoderLimits(max_image_pixels=MAX_IMAGE_PIXELS, max_audio_seconds=MAX_AUDIO_SECONDS)
    encoder = build_encoder_server(
        load_engine(EncoderSettings(checkpoint=str(checkpoint), dtype="float32", limits=limits)), GrpcSettings(port=0)
    )
    await encoder.start()
    keys = LocalEncoder.load(checkpoint, dtype="float32")
    client = EncoderClient(
        [f"127.0.0.1:{encoder.port}"], keys.preprocess_fingerprint, local_fingerprint=keys.fingerprint
    )
    engine = build_engine(
        checkpoint,
        DecodeEngineSettings(
            dtype="float32",
            kv_cache_bytes=8 << 20,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            enable_prefix_cache=False,
        ),
    )
    service = DecodeService(
        engine,
        client,
        ServiceLimits(max_prompt_tokens=MAX_PROMPT_TOKENS, max_media_items=MAX_MEDIA_ITEMS),
        audio_codebook=AudioCodebook.load(checkpoint),
    )
    decode = build_server(service, GrpcSettings(port=0), client)
    await decode.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}")
    try:
        yield generator_pb2_grpc.GeneratorStub(channel)
    finally:
        await channel.close()
        await decode.stop(0.5)
        await encoder.stop(0.5)
        await keys.close()


def _image(data: bytes = MEDIA["shapes.png"]) -> media_pb2.MediaItem:
    return media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=data)


def _audio() -> media_pb2.MediaItem:
    return media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=MEDIA["tones_16k.wav"])


def chat(
    rid: str, text: str = "Hello.", media: tuple[media_pb2.MediaItem, ...] = (), role: int = pb.ROLE_USER, **sampling
) -> pb.GenerateRequest:
    parts = [pb.ContentPart(media=m) for m in media] + [pb.ContentPart(text=text)]
    params = {"temperature": 0.0, "max_tokens": 2, **sampling}
    return pb.GenerateRequest(
        request_id=rid,
        chat=pb.ChatPrompt(messages=[pb.Message(role=role, content=parts)]),
        sampling=pb.SamplingParams(**params),
    )


def tokens(rid: str, token_ids: list[int], media: tuple[media_pb2.MediaItem, ...] = ()) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokens=pb.TokenPrompt(token_ids=token_ids, media=media),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=2),
    )


async def expect_error(stub, request: pb.GenerateRequest, code: grpc.StatusCode, *named: str) -> None:
    """The call fails with `code` before any message, and the message names every string of `named`."""
    call = stub.Generate(request, timeout=30)
    received = [message async for message in _until_error(call)]
    assert received == [], f"messages streamed before the error: {received}"
    assert await call.code() == code, f"{await call.code()}: {await call.details()}"
    details = await call.details()
    for name in named:
        assert name in details, f"{name!r} not named in {details!r}"


async def _until_error(call):
    try:
        async for message in call:
            yield message
    except grpc.aio.AioRpcError:
        return


async def test_unknown_role(stub):
    await expect_error(stub, chat("role-1", role=pb.ROLE_UNSPECIFIED), INVALID, "chat.messages[0].role")
    await expect_error(stub, chat("role-2", role=17), INVALID, "chat.messages[0].role")


async def test_placeholder_and_media_count_mismatch(stub):
    text = [MESSAGE_USER, CONTENT_TEXT, 13225, END_MESSAGE]
    two_placeholders = [MESSAGE_USER, IMAGE_PLACEHOLDER, IMAGE_PLACEHOLDER, *text[1:]]
    await expect_error(stub, tokens("mm-1", two_placeholders, (_image(),)), INVALID, "prompt.token_ids", "placeholder")
    await expect_error(stub, tokens("mm-2", text, (_image(),)), INVALID, "prompt.token_ids")
    audio_for_image = [MESSAGE_USER, AUDIO_PLACEHOLDER, *text[1:]]
    await expect_error(stub, tokens("mm-3", audio_for_image, (_image(),)), INVALID, "prompt.token_ids")


async def test_media_exceeding_limits(stub):
    await expect_error(
        stub, chat("lim-1", media=(_image(),) * (MAX_MEDIA_ITEMS + 1)), INVALID, "media", f"limit of {MAX_MEDIA_ITEMS}"
    )
    big = png_bytes(draw_shapes(256, 256))
    await expect_error(stub, chat("lim-2", media=(_image(), _image(big))), INVALID, "media[1]", "limit")
    await expect_error(stub, chat("lim-3", media=(_audio(),)), INVALID, "media[0]", "limit")


async def test_empty_prompt(stub):
    await expect_error(stub, pb.GenerateRequest(request_id="empty-1"), INVALID, "prompt")
    await expect_error(stub, pb.GenerateRequest(request_id="empty-2", chat=pb.ChatPrompt()), INVALID, "prompt")
    await expect_error(stub, tokens("empty-3", []), INVALID, "prompt")


async def test_prompt_over_the_limits(stub):
    await expect_error(
        stub, chat("long-1", "word " * (2 * MAX_PROMPT_TOKENS)), EXHAUSTED, "prompt", str(MAX_PROMPT_TOKENS)
    )
    await expect_error(stub, tokens("long-2", [13225] * (2 * MAX_PROMPT_TOKENS)), EXHAUSTED, "prompt")


async def test_prompt_over_the_context_limit(checkpoint):
    """Without a prompt limit, the engine's context (here the KV capacity) bounds the prompt."""
    engine = build_engine(
        checkpoint,
        DecodeEngineSettings(
            dtype="float32",
            kv_cache_bytes=1 << 20,
            max_num_seqs=2,
            max_num_batched_tokens=256,
            enable_prefix_cache=False,
        ),
    )
    decode = build_server(DecodeService(engine), GrpcSettings(port=0))
    await decode.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            request = tokens("ctx-1", [13225] * (engine.max_model_len + 1))
            await expect_error(generator_pb2_grpc.GeneratorStub(channel), request, EXHAUSTED, "prompt")
    finally:
        await decode.stop(0.5)


@pytest.mark.parametrize("max_tokens", [0])
async def test_max_tokens_below_one(stub, max_tokens):
    await expect_error(stub, chat("mt-1", max_tokens=max_tokens), INVALID, "sampling.max_tokens")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 1.5),
        ("top_p", 0.0),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("logprobs", 1000),
        ("stop_token_ids", [300000]),
        ("stop", [""]),
    ],
)
async def test_invalid_sampling_values(stub, field, value):
    await expect_error(stub, chat(f"smp-{field}", **{field: value}), INVALID, f"sampling.{field}")


async def test_abort_of_unknown_ids_is_not_found(stub):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Abort(pb.AbortRequest(request_ids=["nope-1", "nope-2"]), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope-1" in err.value.details() and "request_ids" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Abort(pb.AbortRequest(), timeout=10)
    assert err.value.code() == INVALID


async def test_still_serving_after_bad_input(stub):
    responses = [r async for r in stub.Generate(chat("ok-1", media=(_image(),)), timeout=60)]
    assert responses[-1].final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert sum(len(r.delta.token_ids) for r in responses[:-1]) >= 1


async def test_request_ids_that_would_pollute_logs(stub):
    await expect_error(stub, chat("line\nbreak"), INVALID, "request_id", "printable")
    await expect_error(stub, chat("x" * 129), INVALID, "request_id", "at most 128")
