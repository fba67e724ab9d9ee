import asyncio
import threading

import pytest

from common.errors import InvalidInputError
from decode_service.chat import ToolSpec
from decode_service.structured.compiler import constraint_key
from decode_service.structured.constraint import ForcedToolCall, OutputConstraint

TOOLS = (ToolSpec("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}}),)


@pytest.mark.parametrize(
    "constraint,message",
    [
        (OutputConstraint("json_schema", '{"type": "foo"}'), r'^constraint\.json_schema: Unsupported type "foo"'),
        (OutputConstraint("json_schema", "{not json"), r"^constraint\.json_schema: not valid JSON"),
        (OutputConstraint("json_schema", "[1, 2]"), r"^constraint\.json_schema: Schema should be an object"),
        (OutputConstraint("regex", "a(b"), r"^constraint\.regex: Regex parsing error .* not closed"),
        (
            OutputConstraint("grammar", "root ::= foo"),
            r'^constraint\.grammar: EBNF parser error .*"foo" is not defined',
        ),
        (OutputConstraint("lark", "start: 'a' |"), r"^constraint\.lark: Lark error"),
        (ForcedToolCall("nope"), r"^chat\.tool_choice\.function: 'nope' is not a declared tool \(get_weather\)"),
    ],
)
def test_invalid_constraints_name_the_field_and_the_library_message(compiler, constraint, message):
    with pytest.raises(InvalidInputError, match=message):
        compiler.compile_sync(constraint, TOOLS)


def test_forced_tool_call_needs_tools(compiler):
    with pytest.raises(InvalidInputError, match=r"^chat\.tool_choice: the request declares no tools"):
        compiler.compile_sync(ForcedToolCall(), ())


def test_bad_tool_schema_names_the_tool(compiler):
    tools = (*TOOLS, ToolSpec("bad", "", {"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(InvalidInputError, match=r"^chat\.tools\[1\]\.parameters_json: Unsupported type"):
        compiler.compile_sync(ForcedToolCall(), tools)


def test_tool_arguments_must_be_an_object_schema(compiler):
    tools = (ToolSpec("echo", "", {"type": "string"}),)
    with pytest.raises(
        InvalidInputError, match=r"^chat\.tools\[0\]\.parameters_json: .*object schema, got type 'string'"
    ):
        compiler.compile_sync(ForcedToolCall("echo"), tools)


def test_cache_is_keyed_by_the_constraint_hash(compiler):
    regex = OutputConstraint("regex", "[a-c]{2}cache-test")
    hits, misses = compiler.hits, compiler.misses
    first = compiler.compile_sync(regex)
    again = compiler.compile_sync(OutputConstraint("regex", "[a-c]{2}cache-test"))
    assert again is first and (compiler.hits, compiler.misses) == (hits + 1, misses + 1)
    other = compiler.compile_sync(OutputConstraint("regex", "[a-c]{3}cache-test"))
    assert other.key != first.key
    compact = constraint_key(OutputConstraint("json_object"), ())
    assert constraint_key(OutputConstraint("json_object", flexible_whitespace=True), ()) != compact


def test_cache_is_bounded(engine):
    from decode_service.structured.compiler import ConstraintCompiler

    small = ConstraintCompiler(engine.config.text.unpadded_vocab_size, engine.config.eos_token_ids, cache_size=2)
    try:
        a, b, c = (OutputConstraint("regex", f"x{i}") for i in range(3))
        first = small.compile_sync(a)
        small.compile_sync(b)
        small.compile_sync(c)  # evicts a, the least recently used
        assert small.compile_sync(a) is not first
    finally:
        small.close()


def test_async_compile_runs_off_the_event_loop_thread(compiler, monkeypatch):
    seen = []
    original = compiler.compile_sync

    def spy(*args):
        seen.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(compiler, "compile_sync", spy)

    async def main():
        return await compiler.compile(OutputConstraint("regex", "[0-9]{4}"))

    assert asyncio.run(main()).description == "constraint.regex"
    assert seen and seen[0].startswith("grammar-compile")
