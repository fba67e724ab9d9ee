"""The front against a scripted fake upstream, through the official `openai` client: JSON shapes, streaming,
reasoning and tool calls, sampling mapping, error statuses, auth, health, metrics and disconnect -> cancel."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2

from common.settings import SecuritySettings
from decode_service.http_api.config import ApiSettings
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import media_pb2

PNG = b"\x89PNG\r\n\x1a\nnot-really-an-image"
WAV = b"RIFF....WAVEfmt "


@pytest.fixture(scope="module")
def api(api_thread, fake_upstream):
    return api_thread(ApiSettings(upstream=fake_upstream.address, served_model_name="inkling-test"))


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=30)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list()] == ["inkling-test"]


def test_models_default_to_the_upstream_model_id(api_thread, fake_upstream):
    api = api_thread(ApiSettings(upstream=fake_upstream.address))
    ids = [m.id for m in openai.OpenAI(base_url=f"{api.url}/v1", api_key="x", max_retries=0).models.list()]
    assert ids == ["fake-inkling"]


def test_chat_maps_media_and_sampling_onto_generate(client, fake_upstream):
    reply = client.chat.completions.create(
        model="inkling-test",
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()},
                    },
                    {"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV).decode(), "format": "wav"}},
                    {"type": "text", "text": "hello"},
                ],
            },
        ],
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop=["END"],
        max_completion_tokens=12,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        reasoning_effort="low",
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "cache_salt": "t1"},
    )
    request = fake_upstream.servicer.requests[-1]
    s = request.sampling
    assert (s.temperature, s.top_k, s.seed, s.max_tokens, list(s.stop), s.ignore_eos) == (0.5, 5, 7, 12, ["END"], True)
    assert s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.1)
    assert s.repetition_penalty == pytest.approx(1.1) and s.presence_penalty == 0.5 and s.frequency_penalty == -0.5
    assert not s.HasField("logprobs") and request.cache_salt == "t1"
    assert request.chat.reasoning_effort == pytest.approx(0.2)
    system, message = request.chat.messages
    assert system.role == pb.ROLE_SYSTEM and system.content[0].text == "Be brief."
    image, audio, text = message.content
    assert (image.media.modality, image.media.data) == (media_pb2.MODALITY_IMAGE, PNG)
    assert (audio.media.modality, audio.media.data) == (media_pb2.MODALITY_AUDIO, WAV)
    assert text.text == "hello"

    choice = reply.choices[0]
    assert choice.message.content == "Hello world"
    assert choice.message.model_extra["reasoning_content"] == "Let me think."
    assert choice.finish_reason == "stop" and reply.model == "inkling-test"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (7, 3, 10)
    assert reply.usage.prompt_tokens_details.cached_tokens == 3


def test_stream_with_usage_matches_the_plain_reply(client):
    plain = client.chat.completions.create(model="inkling-test", messages=user("hello"))
    chunks = list(
        client.chat.completions.create(
            model="inkling-test", messages=user("hello"), stream=True, stream_options={"include_usage": True}
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    assert content == plain.choices[0].message.content == "Hello world"
    assert reasoning == plain.choices[0].message.model_extra["reasoning_content"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_x_request_id_travels_upstream_and_back(client, fake_upstream):
    reply = client.chat.completions.create(
        model="inkling-test", messages=user("hello"), extra_headers={"X-Request-Id": "gw-42"}
    )
    assert reply.id == fake_upstream.servicer.requests[-1].request_id == "gw-42"
    plain = client.chat.completions.create(model="inkling-test", messages=user("hello"))
    assert plain.id.startswith("chatcmpl-") and plain.id == fake_upstream.servicer.requests[-1].request_id
    with pytest.raises(openai.BadRequestError, match="X-Request-Id"):
        client.chat.completions.create(
            model="inkling-test", messages=user("hello"), extra_headers={"X-Request-Id": "x" * 200}
        )


def test_logprobs_carry_token_text_and_bytes(client, fake_upstream):
    reply = client.chat.completions.create(model="inkling-test", messages=user("hello"), logprobs=True, top_logprobs=2)
    assert fake_upstream.servicer.requests[-1].sampling.logprobs == 2
    entries = reply.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in entries] == [
        ("Hello", -0.5, list(b"Hello")),
        (" world", -0.25, list(b" world")),
        ("\ufffd", -2.0, [0xC3]),
    ]
    assert [(t.token, t.logprob, t.bytes) for t in entries[0].top_logprobs] == [
        ("Hello", -0.5, list(b"Hello")),
        ("Hi", -1.5, list(b"Hi")),
    ]
    one = client.chat.completions.create(model="inkling-test", messages=user("hello"), logprobs=True, top_logprobs=1)
    assert [len(e.top_logprobs) for e in one.choices[0].logprobs.content] == [1, 1, 0]
    streamed = client.chat.completions.create(
        model="inkling-test", messages=user("hello"), logprobs=True, top_logprobs=2, stream=True
    )
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == ["Hello", " world", "\ufffd"]


def test_completion_logprobs_are_the_legacy_shape(client):
    reply = client.completions.create(model="inkling-test", prompt="hello", logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == ["Hello", " world", "\ufffd"]
    assert logprobs.token_logprobs == [-0.5, -0.25, -2.0]
    assert logprobs.top_logprobs == [{"Hello": -0.5, "Hi": -1.5}, {" world": -0.25}, {}]
    streamed = client.completions.create(model="inkling-test", prompt="hello", logprobs=2, stream=True)
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == logprobs.tokens


def test_logprobs_without_token_text_are_an_upstream_error(client):
    with pytest.raises(openai.InternalServerError, match="carries no token text") as info:
        client.chat.completions.create(model="inkling-test", messages=user("no token text"), logprobs=True)
    assert info.value.status_code == 502


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_tool_call_round_trip(client, fake_upstream):
    reply = client.chat.completions.create(model="inkling-test", messages=user("weather?"), tools=TOOLS)
    sent = fake_upstream.servicer.requests[-1].chat.tools
    assert [(t.name, json.loads(t.parameters_json)) for t in sent] == [
        ("get_weather", TOOLS[0]["function"]["parameters"])
    ]
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "functions.get_weather:0",
        "get_weather",
        {"city": "Paris"},
    )

    streamed = [
        tc
        for chunk in client.chat.completions.create(
            model="inkling-test", messages=user("weather?"), tools=TOOLS, stream=True
        )
        for tc in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
    ]
    assert [(t.index, t.id, t.function.name, t.function.arguments) for t in streamed] == [
        (0, call.id, "get_weather", call.function.arguments)
    ]

    client.chat.completions.create(
        model="inkling-test",
        messages=[
            *user("weather?"),
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()], "reasoning_content": "Need it."},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
            *user("hello"),
        ],
        tools=TOOLS,
    )
    _, assistant, tool, _ = fake_upstream.servicer.requests[-1].chat.messages
    assert assistant.role == pb.ROLE_ASSISTANT and assistant.reasoning == "Need it."
    assert [(c.id, c.name, c.arguments_json) for c in assistant.tool_calls] == [
        (call.id, "get_weather", call.function.arguments)
    ]
    assert (tool.role, tool.tool_call_id, tool.content[0].text) == (pb.ROLE_TOOL, call.id, '{"temp_c": 21}')


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
        ({"n": 2}, "n"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
            "tool_choice.function.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"top_p": 0}, "top_p"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, overrides, field):
    body = {"model": "inkling-test", "messages": user("hello"), **overrides}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{k: body.pop(k) for k in ("model", "messages")}, extra_body=body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == field and info.value.body["message"].startswith(f"{field}:")


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=user("hello"))


@pytest.mark.parametrize(
    "code, message, error, status",
    [
        ("INVALID_ARGUMENT", "chat.messages[0].content[0]: cannot decode image", openai.BadRequestError, 400),
        ("RESOURCE_EXHAUSTED", "prompt: 9000 tokens exceeds the limit of 4096", openai.BadRequestError, 400),
        ("RESOURCE_EXHAUSTED", "server busy: 1024 requests in flight", openai.RateLimitError, 429),
        ("UNAVAILABLE", "no healthy decode replica", openai.InternalServerError, 503),
        ("DEADLINE_EXCEEDED", "deadline exceeded", openai.InternalServerError, 504),
        ("UNAUTHENTICATED", "missing or invalid bearer token", openai.AuthenticationError, 401),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_status_maps_to_http(client, code, message, error, status, stream):
    with pytest.raises(error) as info:
        reply = client.chat.completions.create(
            model="inkling-test", messages=user(f"status {code} {message}"), stream=stream
        )
        list(reply) if stream else None
    assert info.value.status_code == status and message in str(info.value)


@pytest.mark.parametrize("script, problem", [("no final", "without a Final"), ("no reason", "no known finish_reason")])
def test_a_broken_upstream_stream_is_an_error_not_a_reply(client, script, problem):
    with pytest.raises(openai.InternalServerError, match=problem) as info:
        client.chat.completions.create(model="inkling-test", messages=user(script))
    assert info.value.status_code == 502
    with pytest.raises(openai.APIError, match=problem):
        list(client.chat.completions.create(model="inkling-test", messages=user(script), stream=True))


def test_completions_with_token_ids(client, fake_upstream):
    reply = client.completions.create(model="inkling-test", prompt=[1, 2, 3], max_tokens=2)
    request = fake_upstream.servicer.requests[-1]
    assert list(request.tokens.token_ids) == [1, 2, 3] and request.sampling.max_tokens == 2
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == ("abc", "length")
    streamed = list(client.completions.create(model="inkling-test", prompt=[1, 2, 3], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "abc"
    reply = client.completions.create(model="inkling-test", prompt="hello", max_tokens=2)
    request = fake_upstream.servicer.requests[-1]
    assert request.WhichOneof("prompt") == "text" and request.text.text == "hello"
    assert reply.choices[0].text == "Let me think.Hello world"
    with pytest.raises(openai.BadRequestError, match="prompt: batched"):
        client.completions.create(model="inkling-test", prompt=["a", "b"])


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_response_format_becomes_the_upstream_constraint(client, fake_upstream):
    client.chat.completions.create(
        model="inkling-test",
        messages=user("hello"),
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )
    constraint = fake_upstream.servicer.requests[-1].constraint
    assert constraint.WhichOneof("kind") == "json_schema" and json.loads(constraint.json_schema) == SCHEMA
    client.chat.completions.create(
        model="inkling-test", messages=user("hello"), response_format={"type": "json_object"}
    )
    assert fake_upstream.servicer.requests[-1].constraint.json_object
    client.chat.completions.create(model="inkling-test", messages=user("hello"), response_format={"type": "text"})
    assert not fake_upstream.servicer.requests[-1].HasField("constraint")
    client.completions.create(
        model="inkling-test", prompt="hello", extra_body={"response_format": {"type": "json_object"}}
    )
    assert fake_upstream.servicer.requests[-1].constraint.json_object


def test_forced_tool_choice_becomes_the_upstream_tool_choice(client, fake_upstream):
    client.chat.completions.create(model="inkling-test", messages=user("weather?"), tools=TOOLS, tool_choice="required")
    assert fake_upstream.servicer.requests[-1].chat.tool_choice.required
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model="inkling-test", messages=user("weather?"), tools=TOOLS, tool_choice=named, parallel_tool_calls=False
    )
    assert fake_upstream.servicer.requests[-1].chat.tool_choice.function == "get_weather"
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]


def test_disconnect_mid_stream_cancels_the_upstream_call(api, fake_upstream):
    fake_upstream.servicer.cancelled.clear()
    body = {"model": "inkling-test", "messages": user("slow"), "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{api.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert any(line.startswith("data:") and '"x"' in line for line in lines)
    assert fake_upstream.servicer.cancelled.wait(5), "the upstream Generate call was not cancelled"


def test_disconnect_while_waiting_for_a_plain_reply_cancels_the_upstream_call(api, fake_upstream):
    fake_upstream.servicer.cancelled.clear()
    body = {"model": "inkling-test", "messages": user("slow")}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api.url}/v1/chat/completions", json=body, timeout=1.0)
    assert fake_upstream.servicer.cancelled.wait(5), "the upstream Generate call was not cancelled"


def test_upstream_bearer_token_is_passed_through(api_thread, fake_upstream_with_token):
    def client(token: str | None) -> openai.OpenAI:
        security = SecuritySettings(token=token)
        settings = ApiSettings(upstream=fake_upstream_with_token.address, upstream_security=security)
        return openai.OpenAI(base_url=f"{api_thread(settings).url}/v1", api_key="x", max_retries=0)

    with pytest.raises(openai.AuthenticationError, match="bearer token"):
        client(None).chat.completions.create(model="fake-inkling", messages=user("hello"))
    reply = client("upstream-secret").chat.completions.create(model="fake-inkling", messages=user("hello"))
    assert reply.choices[0].message.content == "Hello world"


def test_upstream_mtls_flags_are_passed_through(api_thread, fake_upstream_mtls, pki):
    from decode_service.http_api.config import api_settings
    from tools.cli import build_parser

    def front(*tls: str):
        argv = ["api", "--upstream", fake_upstream_mtls.address, "--served-model-name", "m", *tls]
        return api_thread(api_settings(build_parser().parse_args(argv)))

    mtls = front(
        "--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")
    )
    assert httpx.get(f"{mtls.url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{mtls.url}/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(model="m", messages=user("hello")).choices[0].message.content == "Hello world"
    no_client_cert = front("--tls-ca", str(pki / "ca.pem"))
    assert httpx.get(f"{no_client_cert.url}/health").status_code == 503


def test_api_key_is_required_when_configured(api_thread, fake_upstream, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    from decode_service.http_api.config import api_settings
    from tools.cli import build_parser

    args = build_parser().parse_args(
        ["api", "--upstream", fake_upstream.address, "--served-model-name", "m", "--api-key-file", str(key_file)]
    )
    api = api_thread(api_settings(args))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{api.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in openai.OpenAI(base_url=f"{api.url}/v1", api_key="s3cret", max_retries=0).models.list()] == [
        "m"
    ]
    assert httpx.get(f"{api.url}/health").status_code == 200  # probes need no key


def test_health_follows_the_upstream(api, fake_upstream):
    assert httpx.get(f"{api.url}/health").status_code == 200
    fake_upstream.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert httpx.get(f"{api.url}/health").status_code == 503
    finally:
        fake_upstream.health.set("", health_pb2.HealthCheckResponse.SERVING)


def test_health_is_503_when_the_upstream_is_down(api_thread):
    api = api_thread(ApiSettings(upstream="127.0.0.1:1", served_model_name="m", health_timeout_s=0.5))
    assert httpx.get(f"{api.url}/health").status_code == 503


def test_metrics_are_prometheus_text(client, api):
    client.chat.completions.create(model="inkling-test", messages=user("hello"))
    text = httpx.get(f"{api.url}/metrics").text
    for name in (
        "inkling_api_time_to_first_token_seconds_count",
        "inkling_api_inter_token_latency_seconds_count",
        "inkling_api_e2e_request_latency_seconds_count",
        'inkling_api_request_success_total{finished_reason="stop"}',
        'inkling_api_http_requests_total{route="/v1/chat/completions",status="200"}',
    ):
        assert name in text
    # every call of this module, disconnected ones included, was counted out again
    assert "inkling_api_num_requests_running 0.0" in text
