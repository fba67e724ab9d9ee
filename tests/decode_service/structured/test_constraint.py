"""Constraints from the Generate protobuf, and one structured request through a real in-process gRPC server."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from common.errors import InvalidInputError
from common.settings import GrpcSettings
from decode_service.server import build_server, generate_input
from decode_service.service import DecodeService
from decode_service.structured.constraint import ForcedToolCall, OutputConstraint, constraint_from_proto
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
}


def chat_request(**fields) -> pb.GenerateRequest:
    message = pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text="Answer in JSON")])
    chat = pb.ChatPrompt(messages=[message], tools=fields.pop("tools", []), tool_choice=fields.pop("tool_choice", None))
    return pb.GenerateRequest(request_id="r", chat=chat, **fields)


def test_output_constraints_from_proto():
    req = chat_request(constraint=pb.OutputConstraint(json_schema='{"type":"object"}', flexible_whitespace=True))
    assert constraint_from_proto(req) == OutputConstraint("json_schema", '{"type":"object"}', True)
    assert constraint_from_proto(chat_request(constraint=pb.OutputConstraint(json_object=True))) == OutputConstraint(
        "json_object"
    )
    tokens = pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[1]), constraint=pb.OutputConstraint(regex="a+"))
    assert constraint_from_proto(tokens) == OutputConstraint("regex", "a+")
    assert constraint_from_proto(chat_request()) is None
    assert generate_input(tokens, None).constraint == OutputConstraint("regex", "a+")


def test_tool_choice_from_proto():
    assert constraint_from_proto(chat_request(tool_choice=pb.ToolChoice(required=True))) == ForcedToolCall()
    assert constraint_from_proto(chat_request(tool_choice=pb.ToolChoice(function="f"))) == ForcedToolCall("f")


@pytest.mark.parametrize(
    "request_fields,message",
    [
        ({"constraint": pb.OutputConstraint()}, r"^constraint: set one of json_schema"),
        ({"constraint": pb.OutputConstraint(json_object=False)}, r"^constraint\.json_object: must be true"),
        ({"constraint": pb.OutputConstraint(regex="")}, r"^constraint\.regex: is empty"),
        ({"constraint": pb.OutputConstraint(grammar="x", flexible_whitespace=True)}, r"flexible_whitespace applies"),
        ({"tool_choice": pb.ToolChoice()}, r"^chat\.tool_choice: set required=true"),
        ({"tool_choice": pb.ToolChoice(required=False)}, r"^chat\.tool_choice: set required=true"),
        ({"tool_choice": pb.ToolChoice(function="")}, r"^chat\.tool_choice\.function: is empty"),
        (
            {"tool_choice": pb.ToolChoice(required=True), "constraint": pb.OutputConstraint(json_object=True)},
            r"exclusive",
        ),
    ],
)
def test_bad_constraints_name_the_field(request_fields, message):
    with pytest.raises(InvalidInputError, match=message):
        constraint_from_proto(chat_request(**request_fields))


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def stub(engine):
    server = build_server(DecodeService(engine), GrpcSettings(port=0))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield generator_pb2_grpc.GeneratorStub(channel)
    finally:
        await channel.close()
        await server.stop(1.0)


@pytest.mark.anyio
async def test_structured_generate_through_grpc(stub):
    sampling = pb.SamplingParams(temperature=0.7, seed=3, max_tokens=64)
    req = chat_request(constraint=pb.OutputConstraint(json_schema=json.dumps(SCHEMA)), sampling=sampling)
    responses = [r async for r in stub.Generate(req)]
    final = responses[-1].final
    assert final.finish_reason == pb.FINISH_REASON_STOP and not final.finish_detail
    content = "".join(r.delta.text for r in responses[:-1] if r.delta.channel == pb.CHANNEL_CONTENT)
    jsonschema.validate(json.loads(content), SCHEMA)

    cut = chat_request(
        constraint=pb.OutputConstraint(json_schema=json.dumps(SCHEMA)), sampling=pb.SamplingParams(max_tokens=3)
    )
    final = [r async for r in stub.Generate(cut)][-1].final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.finish_detail == "constraint.json_schema: not satisfied within 3 tokens; the output is incomplete"


@pytest.mark.anyio
async def test_invalid_schema_is_invalid_argument_before_any_token(stub):
    req = chat_request(constraint=pb.OutputConstraint(json_schema='{"type": "integer", "minimum": "a"}'))
    responses = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for r in stub.Generate(req):
            responses.append(r)
    assert not responses
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "constraint.json_schema: Value must be a number"


def test_cli_flags_set_the_constraint(tmp_path):
    from tools.cli import _generate_request, build_parser

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    grammar_file = tmp_path / "g.ebnf"
    grammar_file.write_text('root ::= "a"')

    def request(*flags):
        return _generate_request(build_parser().parse_args(["generate", "--local", "--prompt", "hi", *flags]))

    assert request("--json-schema", str(schema_file), "--flexible-whitespace").constraint == pb.OutputConstraint(
        json_schema=json.dumps(SCHEMA), flexible_whitespace=True
    )
    assert request("--regex", "a|b").constraint == pb.OutputConstraint(regex="a|b")
    assert request("--grammar", str(grammar_file)).constraint == pb.OutputConstraint(grammar='root ::= "a"')
    assert request("--json-object").constraint == pb.OutputConstraint(json_object=True)
    assert not request().HasField("constraint")
    with pytest.raises(SystemExit, match="--flexible-whitespace needs"):
        request("--flexible-whitespace")


def test_cli_generate_local_with_a_json_schema(checkpoint, tmp_path, capsys):
    from tools.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    flags = ["--checkpoint", str(checkpoint), "--prompt", "JSON please", "--max-tokens", "48", "--json"]
    assert main(["generate", "--local", *flags, "--json-schema", str(schema_file)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


@pytest.mark.anyio
async def test_forced_tool_call_through_grpc(stub):
    params = {"type": "object", "properties": {"q": {"enum": ["a", "b"]}}, "required": ["q"]}
    tools = [pb.Tool(name="search", parameters_json=json.dumps(params)), pb.Tool(name="noop", parameters_json="{}")]
    req = chat_request(
        tools=tools, tool_choice=pb.ToolChoice(function="search"), sampling=pb.SamplingParams(max_tokens=48)
    )
    responses = [r async for r in stub.Generate(req)]
    calls = [r.delta.tool_call for r in responses[:-1] if r.delta.HasField("tool_call")]
    assert responses[-1].final.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert [c.name for c in calls] == ["search"] and calls[0].id == "functions.search:0"
    jsonschema.validate(json.loads(calls[0].arguments_json), params)
