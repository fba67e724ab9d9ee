"""The per-request matcher (rollback, termination, the final event's detail) and constrained requests through
the `DecodeService` (chat rendering with tools, stop strings, errors before any token)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.errors import InvalidInputError
from decode_service.api import FinalEvent, GenerateInput, SamplingParams
from decode_service.chat import (
    CONTENT_TEXT,
    END_MESSAGE,
    MESSAGE_MODEL,
    MODEL_END_SAMPLING,
    ChatMessage,
    TextPart,
    ToolSpec,
    encode_text,
)
from decode_service.service import DecodeService
from decode_service.structured.constraint import ForcedToolCall, OutputConstraint
from decode_service.structured.matcher import ConstraintMatcher, finish_detail

pytestmark = pytest.mark.anyio

TOOL = ToolSpec(
    "lookup",
    "Look a word up",
    {
        "type": "object",
        "properties": {"word": {"enum": ["cat", "dog"]}, "limit": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["word"],
    },
)
MESSAGES = (ChatMessage("user", [TextPart("Look up a word")]),)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_matcher_accepts_rolls_back_and_terminates(compiler, engine):
    compiled = compiler.compile_sync(OutputConstraint("regex", "ab"))
    matcher = ConstraintMatcher(compiled, [1, 2], engine.config.eos_token_ids)
    a, b = encode_text("a")[0], encode_text("b")[0]
    for token in (MESSAGE_MODEL, CONTENT_TEXT, a):
        matcher.accept(token)
    with pytest.raises(RuntimeError, match=r"constraint\.regex: token .* outside the grammar mask"):
        matcher.accept(a)
    matcher.rollback(1)
    with pytest.raises(ValueError, match="cannot roll back 3 of 2"):
        matcher.rollback(3)
    for token in (a, b, END_MESSAGE):
        matcher.accept(token)
    assert not matcher.is_terminated
    assert finish_detail(matcher, "length", 5).startswith("constraint.regex: not satisfied within 5 tokens")
    matcher.accept(MODEL_END_SAMPLING)
    assert matcher.is_terminated
    assert finish_detail(matcher, "length", 6) == "" and finish_detail(None, "length", 6) == ""


@pytest.fixture
async def service(engine):
    svc = DecodeService(engine)
    await svc.start()
    yield svc
    await svc.close()


async def run(service, **fields):
    events = [e async for e in service.generate(GenerateInput(request_id=fields.pop("rid", "s"), **fields))]
    final = events[-1]
    assert isinstance(final, FinalEvent)
    text = "".join(e.text for e in events[:-1] if e.channel == "content")
    calls = [e.tool_call for e in events[:-1] if e.tool_call is not None]
    return text, calls, final


async def test_forced_tool_call_through_the_chat_service(service):
    sampling = SamplingParams(temperature=1.0, seed=11, max_tokens=96)
    for choice in (ForcedToolCall(), ForcedToolCall("lookup")):
        _, calls, final = await run(service, messages=MESSAGES, tools=(TOOL,), sampling=sampling, constraint=choice)
        assert final.finish_reason == "tool_calls" and calls
        assert len(calls) == 1 or choice.function is None
        for i, call in enumerate(calls):
            assert call.name == "lookup" and call.id == f"functions.lookup:{i}"
            jsonschema.validate(json.loads(call.arguments), TOOL.parameters)


async def test_constraint_with_stop_strings(service):
    schema = {"type": "object", "properties": {"k": {"enum": ["alpha", "beta"]}}, "required": ["k"]}
    constraint = OutputConstraint("json_schema", json.dumps(schema))
    never = SamplingParams(temperature=0.5, seed=5, max_tokens=64, stop=("zzz",))
    text, _, final = await run(service, messages=MESSAGES, sampling=never, constraint=constraint)
    assert final.finish_reason == "stop" and not final.matched_stop
    jsonschema.validate(json.loads(text), schema)
    cut = SamplingParams(temperature=0.0, max_tokens=64, stop=('"k"',))
    text, _, final = await run(service, messages=MESSAGES, sampling=cut, constraint=constraint)
    assert final.finish_reason == "stop" and final.matched_stop == '"k"' and text == "{"


async def test_invalid_constraints_fail_before_any_token(service):
    bad = [
        (OutputConstraint("regex", "(("), (), r"^constraint\.regex: "),
        (ForcedToolCall("missing"), (TOOL,), r"^chat\.tool_choice\.function: 'missing' is not a declared tool"),
    ]
    for constraint, tools, message in bad:
        with pytest.raises(InvalidInputError, match=message):
            await run(service, messages=MESSAGES, tools=tools, constraint=constraint)
    assert service.load().running == 0
