"""The front in front of a real cluster (encoder + decode replica + router, in-process, tiny checkpoint) through
the official `openai` client: greedy replies equal the gRPC `Generate` tokens for the same request, streamed or
not; a tool-call history renders; stop strings; bad input is a `BadRequestError` naming the field; a client
that disconnects mid-stream leaves the replica idle."""

from __future__ import annotations

import base64
import json

import grpc
import httpx
import jsonschema
import openai
import pytest

from decode_service.api import ServiceLimits
from decode_service.chat import encode_text, token_bytes
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


def grpc_generate(router_address: str, request: pb.GenerateRequest) -> tuple[list[pb.Delta], pb.Final]:
    with grpc.insecure_channel(router_address) as channel:
        responses = list(generator_pb2_grpc.GeneratorStub(channel).Generate(request, timeout=120))
    assert responses[-1].HasField("final")
    return [r.delta for r in responses[:-1]], responses[-1].final


def grpc_reference(router_address: str) -> tuple[list[pb.TokenLogprob], dict[str, str], pb.Final]:
    """The same request sent straight to the router's Generate: logprob entries, text per channel, the Final."""
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
    deltas, final = grpc_generate(router_address, request)
    entries = [e for d in deltas for e in d.logprobs]
    assert [e.token_id for e in entries] == [t for d in deltas for t in d.token_ids]
    text = {"content": "", "reasoning": ""}
    for delta in deltas:
        text["reasoning" if delta.channel == pb.CHANNEL_REASONING else "content"] += delta.text
    return entries, text, final


def _tokens(entries) -> list[tuple[str, bytes]]:
    """(text, bytes) of OpenAI logprob entries or of the upstream's TokenLogprob messages."""
    return [(e.token, bytes(e.bytes)) if hasattr(e, "bytes") else (e.token, e.token_bytes) for e in entries]


def test_models_list_the_upstream_model(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_greedy_chat_equals_generate_streamed_or_not(client, cluster):
    _, router = cluster
    entries, text, final = grpc_reference(router.address)
    assert len(entries) == MAX_TOKENS
    tokens = _tokens(entries)
    assert all(raw == token_bytes(e.token_id) for e, (_, raw) in zip(entries, tokens, strict=True))

    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    choice = plain.choices[0]
    assert _tokens(choice.logprobs.content) == tokens
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
    assert [t for d in deltas if d.logprobs for t in _tokens(d.logprobs.content)] == tokens
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


def test_text_completion_equals_the_token_prompt(client, cluster):
    _, router = cluster
    prompt = "Once upon a time"
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    request = pb.GenerateRequest(request_id="text-ref", tokens=pb.TokenPrompt(token_ids=encode_text(prompt)))
    request.sampling.CopyFrom(sampling)
    deltas, final = grpc_generate(router.address, request)
    reference = [e for d in deltas for e in d.logprobs]

    reply = client.completions.create(
        model="tiny", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=0, extra_body={"ignore_eos": True}
    )
    choice = reply.choices[0]
    assert choice.logprobs.tokens == [e.token for e in reference]
    assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in reference], abs=1e-5)
    assert choice.text == "".join(d.text for d in deltas)
    assert reply.usage.prompt_tokens == final.usage.prompt_tokens == len(encode_text(prompt))
    assert (reply.usage.completion_tokens, choice.finish_reason) == (MAX_TOKENS, "length")


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
SAMPLED = dict(temperature=0.7, seed=3, max_tokens=64)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_parses(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Plan a trip."}], response_format=response_format,
        stream=stream, **SAMPLED,
    )  # fmt: skip
    if stream:
        chunks = [c.choices[0] for c in reply if c.choices]
        content, finish = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
    else:
        content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)


def test_response_format_on_text_completions(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    reply = client.completions.create(
        model="tiny", prompt="A trip as JSON:", extra_body={"response_format": response_format}, **SAMPLED
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    # any JSON object has no bound a random model must meet: an object as far as it goes, or `length`
    reply = client.completions.create(
        model="tiny", prompt="JSON:", extra_body={"response_format": {"type": "json_object"}}, **SAMPLED
    )
    text, finish = reply.choices[0].text, reply.choices[0].finish_reason
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": NO_ARGUMENTS}},
]


@pytest.mark.parametrize(
    "tool_choice, parallel, names",
    [
        ({"type": "function", "function": {"name": "get_weather"}}, False, ["get_weather"]),
        ("required", None, None),
    ],
)
def test_forced_tool_choice_always_parses(client, tool_choice, parallel, names):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=tool_choice,
        **extra, **SAMPLED,
    )  # fmt: skip
    choice = reply.choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls
    if names is not None:
        assert [c.function.name for c in calls] == names
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER if call.function.name == "get_weather" else NO_ARGUMENTS)
