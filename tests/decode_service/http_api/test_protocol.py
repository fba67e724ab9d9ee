"""OpenAI JSON -> GenerateRequest: the mapping of each accepted field and a 400 naming every one it refuses."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from decode_service.http_api.config import MediaFetchSettings
from decode_service.http_api.errors import ApiError
from decode_service.http_api.media import MediaLoader
from decode_service.http_api.protocol import REASONING_EFFORTS, parse_chat, parse_completion
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import media_pb2

LOADER = MediaLoader(MediaFetchSettings())
MP4 = b"\x00\x00\x00\x18ftypmp42"


def chat(**body):
    body.setdefault("model", "m")
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return asyncio.run(parse_chat(body, "rid", LOADER))


def refused(field: str, parse=chat, **body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.param == field, info.value.body()
    assert info.value.message.startswith(f"{field}:")
    return info.value


def test_defaults_leave_sampling_unset():
    parsed = chat()
    s = parsed.request.sampling
    assert parsed.request.request_id == "rid" and not parsed.stream and not parsed.include_usage
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "logprobs", "min_p"):
        assert not s.HasField(name), name
    assert not parsed.request.chat.HasField("reasoning_effort")


def test_video_and_developer_roles_map():
    url = "data:video/mp4;base64," + base64.b64encode(MP4).decode()
    parsed = chat(
        messages=[
            {"role": "developer", "content": "rules"},
            {
                "role": "user",
                "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}],
            },
        ]
    )
    system, user = parsed.request.chat.messages
    assert system.role == pb.ROLE_SYSTEM
    assert (user.content[0].media.modality, user.content[0].media.data) == (media_pb2.MODALITY_VIDEO, MP4)
    assert parsed.media_paths == ("messages[1].content[0]",)


@pytest.mark.parametrize("name, value", sorted(REASONING_EFFORTS.items()))
def test_reasoning_effort_levels(name, value):
    assert chat(reasoning_effort=name).request.chat.reasoning_effort == pytest.approx(value)


def test_tool_choice_none_renders_no_tools_and_top_k_minus_one_is_off():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert len(chat(tools=tools).request.chat.tools) == 1
    assert len(chat(tools=tools, tool_choice="none").request.chat.tools) == 0
    assert not chat(top_k=-1).request.sampling.HasField("top_k")


def test_stream_options_and_max_tokens_pairs():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    refused("stream_options", stream_options={"include_usage": True})
    refused("stream_options.continuous_usage_stats", stream=True, stream_options={"continuous_usage_stats": True})
    assert chat(max_tokens=5, max_completion_tokens=5).request.sampling.max_tokens == 5
    refused("max_completion_tokens", max_tokens=5, max_completion_tokens=6)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
TOOL_G = [{"type": "function", "function": {"name": "g"}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_maps_onto_the_constraint():
    assert not chat().request.HasField("constraint")
    assert not chat(response_format={"type": "text"}).request.HasField("constraint")
    c = chat(response_format={"type": "json_object"}).request.constraint
    assert c.WhichOneof("kind") == "json_object" and c.json_object and not c.flexible_whitespace
    for strict in (True, False, None):
        spec = {"name": "answer", "schema": SCHEMA, "strict": strict}
        c = chat(response_format={"type": "json_schema", "json_schema": spec}).request.constraint
        assert c.WhichOneof("kind") == "json_schema" and json.loads(c.json_schema) == SCHEMA
    spec = {"name": "answer", "schema": SCHEMA}
    c = completion(prompt="x", response_format={"type": "json_schema", "json_schema": spec}).request.constraint
    assert json.loads(c.json_schema) == SCHEMA
    assert completion(prompt=[1], response_format={"type": "json_object"}).request.constraint.json_object


def test_tool_choice_required_and_named_map_onto_tool_choice():
    both = TOOLS + TOOL_G
    chat_prompt = chat(tools=both, tool_choice="required").request.chat
    assert chat_prompt.tool_choice.WhichOneof("choice") == "required" and len(chat_prompt.tools) == 2
    named = {"type": "function", "function": {"name": "g"}}
    for parallel in (None, True, False):
        chat_prompt = chat(tools=both, tool_choice=named, parallel_tool_calls=parallel).request.chat
        assert chat_prompt.tool_choice.function == "g" and len(chat_prompt.tools) == 2
    # "required" + no parallel calls with one tool is exactly one call to that tool.
    assert chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).request.chat.tool_choice.function == "f"
    assert not chat(tools=both).request.chat.HasField("tool_choice")
    assert not chat(tools=both, tool_choice="auto", parallel_tool_calls=True).request.chat.HasField("tool_choice")
    strict = [{"type": "function", "function": {"name": "f", "strict": True}}]
    assert chat(tools=strict, tool_choice="required").request.chat.tool_choice.required


@pytest.mark.parametrize(
    "field, body",
    [
        ("seed", {"seed": -1}),
        ("top_logprobs", {"top_logprobs": 2}),
        ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
        ("frequency_penalty", {"frequency_penalty": 2.5}),
        ("repetition_penalty", {"repetition_penalty": 0}),
        ("stop", {"stop": [""]}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("temperature", {"temperature": "hot"}),
        ("max_tokens", {"max_tokens": 1.5}),
        ("ignore_eos", {"ignore_eos": "yes"}),
        ("response_format.type", {"response_format": {"type": "yaml"}}),
        ("response_format", {"response_format": "json"}),
        ("response_format.json_schema", {"response_format": {"type": "json_schema"}}),
        ("response_format.json_schema.name", {"response_format": {"type": "json_schema", "json_schema": {}}}),
        (
            "response_format.json_schema.schema",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
        ),
        (
            "response_format.json_schema.schema",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}},
        ),
        (
            "response_format",
            {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
        ),
        ("parallel_tool_calls", {"parallel_tool_calls": False, "tools": TOOLS}),
        ("parallel_tool_calls", {"parallel_tool_calls": False, "tools": TOOLS + TOOL_G, "tool_choice": "required"}),
        ("parallel_tool_calls", {"parallel_tool_calls": "no"}),
        (
            "response_format.json_schema.strict",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "strict": 1}}},
        ),
        (
            "tools[0].function.strict",
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "y"}}], "tool_choice": "required"},
        ),
        ("functions", {"functions": [{"name": "f"}]}),
        ("messages", {"messages": []}),
        ("messages[0].name", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}),
        ("messages[0].tool_call_id", {"messages": [{"role": "tool", "content": "42"}]}),
        ("messages[0].tool_calls", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
        (
            "messages[0].content[0].type",
            {"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
        ),
        (
            "messages[0].tool_calls[0].function.arguments",
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}
                ]
            },
        ),
        (
            "messages[0].content[0].input_audio.format",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "aiff"}}],
                    }
                ]
            },
        ),
        (
            "messages[0].content[0].image_url.detail",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,", "detail": "high"}}],
                    }
                ]
            },
        ),
        ("tools[0].type", {"tools": [{"type": "code_interpreter"}]}),
        ("tools[0].function.strict", {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}),
        ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
        ("tool_choice", {"tool_choice": "required"}),
        ("tool_choice", {"tool_choice": "always", "tools": TOOLS}),
        ("tool_choice.type", {"tool_choice": {"type": "custom"}, "tools": TOOLS}),
        ("tool_choice.function.name", {"tool_choice": {"type": "function", "function": {}}, "tools": TOOLS}),
        (
            "tool_choice.function.name",
            {"tool_choice": {"type": "function", "function": {"name": "h"}}, "tools": TOOLS},
        ),
    ],
)
def test_refused_fields_are_named(field, body):
    refused(field, **body)


def completion(**body):
    body.setdefault("model", "m")
    return parse_completion(body, "rid")


def test_completions_take_token_ids_or_text_with_openai_defaults():
    parsed = completion(prompt=[[3, 4]], logprobs=2)
    assert list(parsed.request.tokens.token_ids) == [3, 4]
    assert parsed.request.sampling.max_tokens == 16 and parsed.request.sampling.logprobs == 2 and parsed.logprobs
    for prompt in ("Once upon", ["Once upon"]):
        request = completion(prompt=prompt).request
        assert request.WhichOneof("prompt") == "text" and request.text.text == "Once upon"
    refused("prompt", completion, prompt="")
    refused("prompt", completion, prompt=["a", "b"])
    refused("response_format.type", completion, prompt="x", response_format={"type": "xml"})
    refused("prompt", completion, prompt=[[1], [2]])
    refused("prompt", completion, prompt=[])
    refused("echo", completion, prompt=[1], echo=True)
    refused("best_of", completion, prompt=[1], best_of=2)
    refused("suffix", completion, prompt=[1], suffix="x")
