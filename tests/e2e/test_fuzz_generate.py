"""Property-based fuzzing of `Generator.Generate` against a real in-process decode replica with a real encoder
(bounded examples, no deadline).

Random chat and token prompts (random roles, unicode text, tool JSON garbage, huge token ids, random and
truncated media bytes, non-finite and huge sampling parameters, random salts and priorities) and raw request
bytes (truncated protobuf, invalid UTF-8 in string fields) must each end as a well-formed stream (deltas, then
exactly one Final, then OK) or a status from the documented set with a message. Afterwards the replica is idle
(no request, KV page or conv slot held), still SERVING, and a valid request succeeds.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode_service.api import ServiceLimits
from decode_service.chat import AUDIO_PLACEHOLDER, CONTENT_TEXT, END_MESSAGE, IMAGE_PLACEHOLDER, MESSAGE_USER
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import media_pb2
from tools.make_sample_media import sample_media

MEDIA = sample_media()
SEEDS = [MEDIA["shapes.png"], MEDIA["tones_16k.wav"], MEDIA["moving.mp4"]]
GENERATE = "/inkling_epd.v1.Generator/Generate"
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_COMPLETION = 6
VOCAB = 201024
FUZZ = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def replica(e2e, tiny_checkpoint, fingerprints, loop_thread):
    async def start():
        encoder = await e2e.start_encoder(tiny_checkpoint, l1_cache_bytes=8 << 20)
        limits = ServiceLimits(max_prompt_tokens=2048, max_completion_tokens=MAX_COMPLETION, max_media_items=3)
        decode = await e2e.start_decode(tiny_checkpoint, fingerprints, [encoder.address], limits=limits)
        return encoder, decode

    encoder, decode = loop_thread.run(start())
    try:
        yield f"127.0.0.1:{decode.port}", decode
    finally:
        loop_thread.run(decode.stop(1.0))
        loop_thread.run(encoder.stop(1.0))


# ---------------------------------------------------------------------------------------------------------
# Strategies

any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -1.0, 1.0, 0.5, 2.0, 1e30])
)
u32 = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 16))
json_garbage = st.one_of(
    st.just(""),
    st.just("{}"),
    st.just('{"type": "object", "properties": {"x": {}}}'),
    st.just("[1, 2]"),
    st.just("{"),
    st.just('{"a": NaN}'),
    st.text(max_size=40),
)


@st.composite
def media_item(draw, wild: bool) -> media_pb2.MediaItem:
    if not wild:
        modality = draw(st.sampled_from([media_pb2.MODALITY_IMAGE, media_pb2.MODALITY_AUDIO]))
        return media_pb2.MediaItem(modality=modality, data=SEEDS[modality - 1])
    seed = draw(st.sampled_from(SEEDS))
    kind = draw(st.sampled_from(["seed", "truncated", "random"]))
    data = (
        seed
        if kind == "seed"
        else (seed[: draw(st.integers(0, len(seed) - 1))] if kind == "truncated" else draw(st.binary(max_size=256)))
    )
    return media_pb2.MediaItem(modality=draw(st.integers(0, 4)), data=data)


@st.composite
def sampling(draw, wild: bool) -> pb.SamplingParams:
    if not wild:  # valid values only
        return pb.SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
            top_k=draw(st.integers(0, 50)),
            top_p=draw(st.sampled_from([0.5, 0.9, 1.0])),
            seed=draw(st.integers(0, 2**64 - 1)),
            max_tokens=draw(st.integers(1, MAX_COMPLETION)),
            ignore_eos=draw(st.booleans()),
            stop=draw(st.lists(st.text(min_size=1, max_size=4), max_size=2)),
            logprobs=draw(st.integers(0, 3)),
        )
    s = pb.SamplingParams(ignore_eos=draw(st.booleans()))
    for name, strategy in (
        ("temperature", any_float),
        ("top_k", u32),
        ("top_p", any_float),
        ("min_p", any_float),
        ("seed", st.integers(0, 2**64 - 1)),
        ("repetition_penalty", any_float),
        ("presence_penalty", any_float),
        ("frequency_penalty", any_float),
        ("logprobs", u32),
        ("max_tokens", st.one_of(st.integers(0, MAX_COMPLETION + 2), u32)),
        ("min_tokens", st.integers(0, 4)),
    ):
        if draw(st.integers(0, 3)) == 0:
            setattr(s, name, draw(strategy))
    s.stop.extend(draw(st.lists(st.text(max_size=8), max_size=3)))
    s.stop_token_ids.extend(draw(st.lists(u32, max_size=3)))
    return s


@st.composite
def message(draw, wild: bool) -> pb.Message:
    if not wild:
        m = pb.Message(role=draw(st.sampled_from([pb.ROLE_SYSTEM, pb.ROLE_USER, pb.ROLE_ASSISTANT])))
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.integers(0, 3)):
                m.content.append(pb.ContentPart(text=draw(st.text(max_size=60))))
            else:
                m.content.append(pb.ContentPart(media=draw(media_item(False))))
        return m
    m = pb.Message(
        role=draw(st.integers(0, 6)),
        name=draw(st.text(max_size=8)),
        tool_call_id=draw(st.text(max_size=8)),
        reasoning=draw(st.text(max_size=20)),
    )
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.integers(0, 4)):
            m.content.append(pb.ContentPart(text=draw(st.text(max_size=60))))
        elif draw(st.booleans()):
            m.content.append(pb.ContentPart(media=draw(media_item(True))))
        else:
            m.content.append(pb.ContentPart())  # neither text nor media
    for _ in range(draw(st.integers(0, 2))):
        m.tool_calls.append(
            pb.ToolCall(id=draw(st.text(max_size=8)), name=draw(st.text(max_size=8)), arguments_json=draw(json_garbage))
        )
    return m


@st.composite
def generate_request(draw) -> pb.GenerateRequest:
    """Half the requests are valid in every field (they must succeed or be refused by a limit); the other half
    draw each field from anything the proto can carry."""
    wild = draw(st.booleans())
    request = pb.GenerateRequest(
        request_id=draw(st.text(max_size=16)),
        sampling=draw(sampling(wild)),
        cache_salt=draw(st.text(max_size=8)),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
    )
    kind = draw(st.sampled_from(["chat", "tokens", "none"] if wild else ["chat", "chat", "tokens"]))
    if kind == "chat":
        messages = draw(st.lists(message(wild), min_size=0 if wild else 1, max_size=3))
        if not wild:
            messages[-1].role = pb.ROLE_USER
        request.chat.messages.extend(messages)
        for _ in range(draw(st.integers(0, 2))):
            request.chat.tools.append(
                pb.Tool(
                    name=draw(st.text(min_size=1, max_size=8)),
                    description=draw(st.text(max_size=20)),
                    parameters_json=draw(json_garbage) if wild else "{}",
                )
            )
        if draw(st.booleans()):
            request.chat.reasoning_effort = draw(any_float) if wild else draw(st.sampled_from([0.0, 0.2, 0.9]))
    elif kind == "tokens":
        special = st.sampled_from([MESSAGE_USER, CONTENT_TEXT, END_MESSAGE, IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER])
        ids = (
            draw(st.lists(st.one_of(st.integers(0, VOCAB + 10), special, u32), max_size=40))
            if wild
            else [
                MESSAGE_USER,
                CONTENT_TEXT,
                *draw(st.lists(st.integers(0, 100_000), min_size=1, max_size=30)),
                END_MESSAGE,
            ]
        )
        request.tokens.token_ids.extend(ids)
        request.tokens.media.extend(draw(st.lists(media_item(True), max_size=2)) if wild else [])
    return request


# ---------------------------------------------------------------------------------------------------------
# Checks


def check_call(channel: grpc.Channel, payload: bytes) -> str:
    call = channel.unary_stream(
        GENERATE, request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString
    )
    deltas: list[pb.Delta] = []
    finals: list[pb.Final] = []
    try:
        for response in call(payload, timeout=60.0):
            assert not finals, "a message after the Final"
            if response.HasField("delta"):
                deltas.append(response.delta)
            else:
                assert response.HasField("final"), "an empty GenerateResponse"
                finals.append(response.final)
    except grpc.RpcError as exc:
        code = exc.code()
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "the server hung on this request"
        assert exc.details(), f"status {code.name} without a message"
        assert code in ALLOWED, f"unexpected {code.name}: {exc.details()}"
        return code.name
    assert len(finals) == 1, "an OK stream must end with exactly one Final"
    final = finals[0]
    tokens = [t for d in deltas for t in d.token_ids]
    assert final.usage.completion_tokens == len(tokens) <= MAX_COMPLETION
    assert all(0 <= t < VOCAB for t in tokens)
    assert final.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert all(d.channel in pb.Channel.values() for d in deltas)
    return "OK"


def assert_healthy(e2e, address: str, decode, loop_thread) -> None:
    idle = loop_thread.run(e2e.wait_idle(decode))
    assert not any(idle.values()), idle
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        good = e2e.chat_request("after-fuzz", "image+audio", variant=1, max_tokens=3)
        assert check_call(channel, good.SerializeToString()) == "OK"


# ---------------------------------------------------------------------------------------------------------
# Properties


def test_random_generate_requests_end_cleanly(e2e, replica, loop_thread):
    address, decode = replica
    outcomes: dict[str, int] = {}
    with grpc.insecure_channel(address) as channel:

        @FUZZ
        @given(request=generate_request())
        def check(request: pb.GenerateRequest) -> None:
            outcome = check_call(channel, request.SerializeToString())
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        check()
    assert outcomes.get("OK", 0) >= 10 and outcomes.get("INVALID_ARGUMENT", 0) >= 10, outcomes
    assert_healthy(e2e, address, decode, loop_thread)


def test_malformed_generate_bytes_end_cleanly(e2e, replica, loop_thread):
    address, decode = replica
    valid = e2e.chat_request("wire", "text", max_tokens=2).SerializeToString()
    # request_id (field 1, a string) holding bytes that are not UTF-8, followed by a valid rest
    bad_utf8 = b"\x0a\x03\xff\xc3\x28" + valid[valid.index(b"\x12") :]
    with grpc.insecure_channel(address) as channel:
        assert check_call(channel, bad_utf8) == "INVALID_ARGUMENT"

        @FUZZ
        @given(cut=st.integers(0, len(valid)), noise=st.binary(max_size=32))
        def check(cut: int, noise: bytes) -> None:
            check_call(channel, valid[:cut] + noise)

        check()
    assert_healthy(e2e, address, decode, loop_thread)
