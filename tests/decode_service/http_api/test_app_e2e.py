"""The front in front of a real cluster (encoder + decode replica + router, in-process, tiny checkpoint) through
the official `openai` client: greedy replies equal the gRPC `Generate` tokens for the same request, streamed or
not; a tool-call history renders; stop strings; bad input is a `BadRequestError` naming the field; a client
that disconnects mid-stream leaves the replica idle."""

from __future__ import annotations

import base64

import grpc
import httpx
import openai
import pytest

from decode_service.api import ServiceLimits
from decode_service.http_api.config import ApiSettings
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc, media_pb2
from tools.make_sample_media import sample_media

MEDIA = sample_media()
IMAGE, AUDIO = MEDIA["shapes.png"], MEDIA["tones_16k.wav"]
MAX_TOKENS = 6
MAX_PROMPT_TOKENS = 512
QUESTION = "What do you see and hear?"


@pytest.fixture(scope="module")
def cluster(e2e, tiny_checkpoint, fingerprints, loop_thread):
    async def start():
        encoder = await e2e.start_encoder(tiny_checkpoint)
        limits = ServiceLimits(max_prompt_tokens=MAX_PROMPT_TOKENS)
        decode = await e2e.start_decode(tiny_checkpoint, fingerprints, [encoder.address], limits=limits)
        router = await e2e.start_router([f"127.0.0.1:{decode.port}"])
        return encoder, decode, router

    encoder, decode, router = loop_thread.run(start(), timeout_s=300.0)
    try:
        yield decode, router
    finally:
        loop_thread.run(router.stop(1.0))
        loop_thread.run(decode.stop(1.0))
        loop_thread.run(encoder.stop(1.0))


@pytest.fixture(scope="module")
def api(api_thread, cluster):
    _, router = cluster
    return api_thread(ApiSettings(upstream=router.address))


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url("image/png", IMAGE)}},
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(AUDIO).decode(), "format": "wav"}},
            {"type": "text", "text": QUESTION},
        ],
    }
]
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, logprobs=True, extra_body={"ignore_eos": True})


def grpc_reference(router_address: str) -> tuple[list[int], dict[str, str], pb.Final]:
    """The same request sent straight to the router's Generate: token ids, text per channel, the Final."""
    parts = [
        pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=IMAGE)),
        pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=AUDIO)),
        pb.ContentPart(text=QUESTION),
    ]
    request = pb.GenerateRequest(
        request_id="reference",
        chat=pb.ChatPrompt(messages=[pb.Message(role=pb.ROLE_USER, content=parts)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
    )
    tokens: list[int] = []
    text = {"content": "", "reasoning": ""}
    final = None
    with grpc.insecure_channel(router_address) as channel:
        for response in generator_pb2_grpc.GeneratorStub(channel).Generate(request, timeout=120):
            if response.HasField("final"):
                final = response.final
                continue
            tokens += response.delta.token_ids
            text["reasoning" if response.delta.channel == pb.CHANNEL_REASONING else "content"] += response.delta.text
    assert final is not None
    return tokens, text, final


def _ids(entries) -> list[int]:
    return [int(e.token.removeprefix("token_id:")) for e in entries]


def test_models_list_the_upstream_model(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_greedy_chat_equals_generate_streamed_or_not(client, cluster):
    _, router = cluster
    tokens, text, final = grpc_reference(router.address)
    assert len(tokens) == MAX_TOKENS

    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    choice = plain.choices[0]
    assert _ids(choice.logprobs.content) == tokens
    assert (choice.message.content or "") == text["content"]
    assert (choice.message.model_extra.get("reasoning_content") or "") == text["reasoning"]
    assert choice.finish_reason == "length"
    assert plain.usage.completion_tokens == MAX_TOKENS
    assert plain.usage.prompt_tokens == final.usage.prompt_tokens > final.usage.image_tokens > 0

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == text["content"]
    assert "".join((d.delta.model_extra or {}).get("reasoning_content") or "" for d in deltas) == text["reasoning"]
    assert [i for d in deltas if d.logprobs for i in _ids(d.logprobs.content)] == tokens
    assert deltas[-1].finish_reason == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, MAX_TOKENS)
    # the second and third identical prompts may hit the prefix cache; the count is reported either way
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_stop_string_ends_the_reply_before_it(client):
    reference = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count."}],
        temperature=0,
        max_tokens=24,
        reasoning_effort="none",
        extra_body={"ignore_eos": True},
    )
    text = reference.choices[0].message.content or ""
    if len(text.strip()) < 4:
        pytest.skip(f"the tiny model's greedy content is too short to cut: {text!r}")
    cut = len(text) // 2
    stop = text[cut : cut + 2]
    stopped = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count."}],
        temperature=0,
        max_tokens=24,
        reasoning_effort="none",
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_video_data_url_is_encoded_as_frames(client):
    question = {"type": "text", "text": "What moves?"}
    video = {"type": "video_url", "video_url": {"url": data_url("video/mp4", MEDIA["moving.mp4"])}}
    text_only = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [question]}], max_tokens=1
    )
    with_video = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [video, question]}], max_tokens=1
    )
    assert with_video.usage.prompt_tokens > text_only.usage.prompt_tokens + 16  # the frames' placeholder runs


def test_tool_call_history_renders(client):
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
        }
    ]
    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    question = {"role": "user", "content": "Weather in Paris?"}
    asked = client.chat.completions.create(model="tiny", messages=[question], tools=tools, max_tokens=1)
    reply = client.chat.completions.create(
        model="tiny",
        messages=[
            question,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 21}'},
        ],
        tools=tools,
        max_tokens=2,
        temperature=0,
    )
    # the call and its result are rendered into the prompt (the renderer checks the id refers to the call)
    assert reply.usage.prompt_tokens > asked.usage.prompt_tokens + 10
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": data_url("image/png", b"\x89PNG broken")}},
                            {"type": "text", "text": "?"},
                        ],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "user", "content": "word " * (2 * MAX_PROMPT_TOKENS)}]}, "prompt"),
    ],
)
def test_bad_input_raises_bad_request_naming_the_field(client, kwargs, field):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    assert field in info.value.body["message"], info.value.body


def test_disconnect_mid_stream_frees_the_request(api, cluster, e2e, loop_thread):
    decode, _ = cluster
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{api.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break
    idle = loop_thread.run(e2e.wait_idle(decode, timeout_s=10.0))
    assert not any(idle.values()), idle
