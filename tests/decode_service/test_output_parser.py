"""Streaming output parser: cross-checked against tml-renderers' own (non-streaming) parser."""

from __future__ import annotations

import json

import pytest
from tml_renderers import chat as tml
from tml_renderers import tokenizers, v0
from tml_renderers.v0 import ParseError

from decode_service.chat import ChatMessage, TextPart, ToolCall, render_chat
from decode_service.output_parser import Delta, OutputParser, ParsedToolCall

TOK = tokenizers.O200kBaseChatTokenizer()
_, TML_PARSER = v0.Renderer(TOK).render_for_completion([tml.Message(tml.Text("hi"), tml.Author(tml.AuthorKind.User))])
USER, MODEL, SYS = 200000, 200001, 200002
TEXT, THINK, END, EOM = 200004, 200008, 200006, 200010
TOOL_JSON, TOOL_TEXT, TOOL_ERROR = 200049, 200057, 200022


def e(text: str) -> list[int]:
    return TOK.encode_ordinary(text)


def tool(name: str, payload: str, header: str | None = None) -> list[int]:
    return [MODEL] + e(name if header is None else header) + [TOOL_JSON] + e(payload) + [EOM]


def stream(tokens: list[int], stop: tuple[str, ...] = (), reason: str = "stop") -> tuple[list[Delta], str | None]:
    parser = OutputParser(stop_strings=stop)
    deltas: list[Delta] = []
    for token in tokens:
        deltas += parser.feed(token)
    deltas += parser.finish(reason)
    return deltas, parser.finish_reason


def channels(deltas: list[Delta]) -> tuple[str, str, list[tuple]]:
    reasoning = "".join(d.text for d in deltas if d.channel == "reasoning")
    content = "".join(d.text for d in deltas if d.channel == "content")
    calls = [(c.id, c.name, c.arguments, c.text) for d in deltas if (c := d.tool_call) is not None]
    return reasoning, content, calls


def tml_channels(tokens: list[int]) -> tuple[str, str, list[tuple]]:
    reasoning, content, calls = "", "", []
    for message in TML_PARSER.parse_tokens(tokens):
        if message.author.kind != tml.AuthorKind.Model:
            continue
        body = message.content
        if isinstance(body, tml.Thinking):
            reasoning += body.text
        elif isinstance(body, (tml.Text, tml.ToolError)):
            content += body.text
        elif isinstance(body, tml.InvokeTool):
            if body.text is None:
                args = "{" + ",".join(f"{json.dumps(a.name, ensure_ascii=False)}:{a.value}" for a in body.args) + "}"
                calls.append((body.tool_call_id, body.name, args, None))
            else:
                calls.append((body.tool_call_id, "", "", body.text))
    return reasoning, content, calls


AGREED = {
    "thinking_text_tool_text": [MODEL, THINK]
    + e("Let me think… ")
    + [EOM, MODEL, TEXT]
    + e("Hello 🦩")
    + [EOM]
    + tool("get_weather", '{"name":"get_weather","args":{"city":"Paris","n":{"b":1,"a":2.0}}}')
    + [MODEL, TEXT]
    + e("after")
    + [EOM, END],
    "headerless_first_kind": [TEXT] + e("plain") + [EOM, END],
    "headerless_thinking_then_tool": [THINK] + e("a") + [EOM, TOOL_JSON] + e('{"name":"f","args":{}}') + [EOM, END],
    "two_tools_unicode_args": tool("f", '{"args":{"a":"\\u00e9\\n","b":[1,2.5,null,true]},"name":"f"}')
    + tool("g", '{"name":"g","args":{}}')
    + [END],
    "text_tool_and_json_tool": [MODEL]
    + e("f")
    + [TOOL_TEXT]
    + e("search x")
    + [EOM]
    + tool("g", '{"name":"g","args":{}}'),
    "tool_error_is_content": [MODEL, TOOL_ERROR] + e("oops") + [EOM, END],
    "non_model_messages_dropped": [USER, TEXT]
    + e("u")
    + [EOM, SYS, TEXT]
    + e("s")
    + [EOM, MODEL, TEXT]
    + e("z")
    + [EOM, END],
    "marker_spelled_by_ordinary_tokens": [MODEL, TEXT] + e("<|end_message|><|content_thinking|>") + [EOM, END],
    "named_text_header": [MODEL] + e("bob") + [TEXT] + e("hi") + [EOM, END],
    "no_turn_end": [MODEL, TEXT] + e("abc") + [EOM],
    "empty_blocks": [MODEL, THINK, EOM, MODEL, TEXT, EOM, END],
}


@pytest.mark.parametrize("name", sorted(AGREED))
def test_streamed_channels_equal_tml_parse(name: str) -> None:
    tokens = AGREED[name]
    deltas, _ = stream(tokens)
    assert channels(deltas) == tml_channels(tokens)


def test_reasoning_and_content_stream_incrementally_and_tool_calls_arrive_whole() -> None:
    tokens = AGREED["thinking_text_tool_text"]
    parser = OutputParser()
    per_token = [parser.feed(t) for t in tokens]
    first_eom = tokens.index(EOM)
    assert sum(1 for ds in per_token[:first_eom] for d in ds if d.channel == "reasoning") > 2
    tool_deltas = [(i, d) for i, ds in enumerate(per_token) for d in ds if d.channel == "tool_call"]
    assert len(tool_deltas) == 1
    position, delta = tool_deltas[0]
    assert tokens[position] == EOM and tokens[position - 1] != EOM
    assert delta.tool_call == ParsedToolCall(
        0, "functions.get_weather:0", "get_weather", '{"city":"Paris","n":{"b":1,"a":2.0}}'
    )
    assert parser.done
    assert parser.finish("stop") == [] and parser.finish_reason == "tool_calls"


def test_finish_reasons() -> None:
    assert stream([MODEL, TEXT] + e("a") + [EOM, END])[1] == "stop"
    assert stream(tool("f", '{"name":"f","args":{}}'), reason="length")[1] == "length"
    assert stream(tool("f", '{"name":"f","args":{}}') + [END])[1] == "tool_calls"


def test_headerless_plain_text_is_content_and_a_control_token_closes_it() -> None:
    deltas, _ = stream(e("plain text") + [MODEL, THINK] + e("r") + [EOM] + e(" more") + [END])
    assert channels(deltas) == ("r", "plain text more", [])


@pytest.mark.parametrize(
    ("tokens", "content"),
    [
        (tool("f", '{"name":"f",'), '{"name":"f",'),  # JSON incomplete
        (tool("f", '{"name":"g","args":{}}'), '{"name":"g","args":{}}'),  # header names another tool
        (tool("f", '{"name":"f","args":[1]}'), '{"name":"f","args":[1]}'),  # args not an object
        (tool("f", '{"name":"f","args":{},"k":1}'), '{"name":"f","args":{},"k":1}'),  # extra field
        (tool("f", '{"name":"f"}'), '{"name":"f"}'),  # args missing
        ([MODEL] + e("header only") + [EOM], "header only"),  # no content kind
    ],
)
def test_parse_errors_surface_raw_payload_as_content(tokens: list[int], content: str) -> None:
    with pytest.raises(ParseError):
        TML_PARSER.parse_tokens(tokens + [END])
    deltas, reason = stream(tokens + [MODEL, TEXT] + e("ok") + [EOM, END])
    assert channels(deltas) == ("", content + "ok", [])
    assert reason == "stop"


def test_cut_off_blocks_at_max_tokens() -> None:
    deltas, reason = stream([MODEL, THINK] + e("half a thou"), reason="length")
    assert channels(deltas) == ("half a thou", "", []) and reason == "length"
    deltas, _ = stream([MODEL] + e("f") + [TOOL_JSON] + e('{"name":"f","ar'), reason="length")
    assert channels(deltas) == ("", '{"name":"f","ar', [])
    deltas, _ = stream([MODEL, TEXT] + e("x") + TOK.encode_ordinary("🦩")[:1], reason="length")
    assert channels(deltas) == ("", "x\ufffd", [])


def test_turn_end_inside_a_block_closes_it() -> None:
    deltas, reason = stream(tool("f", '{"name":"f","args":{"a":1}}')[:-1] + [END])
    assert channels(deltas)[2] == [("functions.f:0", "f", '{"a":1}', None)] and reason == "tool_calls"


def test_stop_string_cuts_at_the_match_and_holds_back_prefixes() -> None:
    tokens = [MODEL, TEXT] + e("The answer is 42. STOP here") + [EOM, END]
    parser = OutputParser(stop_strings=["STOP", "42!"])
    emitted = ""
    for token in tokens:
        for delta in parser.feed(token):
            emitted += delta.text
            assert "S" not in emitted  # a possible start of "STOP" is held back
        if parser.done:
            break
    assert parser.done
    assert emitted == "The answer is 42. "
    assert parser.finish("stop") == [] and parser.finish_reason == "stop"


def test_stop_string_prefix_that_does_not_match_is_released() -> None:
    deltas, _ = stream([MODEL, THINK] + e("a ST b") + [EOM, MODEL, TEXT] + e("ST") + [EOM, END], stop=("STOP",))
    assert channels(deltas) == ("a ST b", "ST", [])
    deltas, _ = stream([MODEL, TEXT] + e("end S"), stop=("STOP",), reason="length")
    assert channels(deltas) == ("", "end S", [])


def test_stop_string_split_across_tokens_in_reasoning() -> None:
    tokens = [MODEL, THINK] + e("xx") + e("<") + e("/") + e("done") + e(">tail") + [EOM, END]
    deltas, reason = stream(tokens, stop=("</done>",))
    assert channels(deltas) == ("xx", "", []) and reason == "stop"


def test_ids_past_the_vocabulary_decode_as_replacement_characters() -> None:
    deltas, _ = stream([MODEL, TEXT, 200500] + e("a") + [EOM, END])
    assert channels(deltas) == ("", "\ufffda", [])


def test_rendered_assistant_history_parses_back() -> None:
    user = render_chat([ChatMessage("user", [TextPart("q")])]).token_ids
    call = ToolCall("f", '{"b":2,"a":"x"}')
    turn = ChatMessage("assistant", [TextPart("Sure.")], tool_calls=[call], reasoning="hm")
    full = render_chat([ChatMessage("user", [TextPart("q")]), turn]).token_ids
    assert full[: len(user)] == user
    deltas, reason = stream(full[len(user) :])
    assert channels(deltas) == ("hm", "Sure.", [("functions.f:0", "f", '{"a":"x","b":2}', None)])
    assert channels(deltas) == tml_channels(full[len(user) :]) and reason == "tool_calls"


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        # tml-renderers keeps the spellings as text (content "abc<|message_model|><|content_thinking|>d")
        ([MODEL, TEXT] + e("abc") + [MODEL, THINK] + e("d") + [EOM, END], ("", "abcd", [])),
        ([MODEL, THINK] + e("r") + [TOOL_JSON] + e("s") + [EOM, END], ("rs", "", [])),
        # a control token inside a JSON tool payload: a parse error, surfaced without the control token
        (
            [MODEL] + e("f") + [TOOL_JSON] + e('{"name":"f",') + [TOOL_JSON] + e('"args":{}}') + [EOM, END],
            ("", '{"name":"f","args":{}}', []),
        ),
        (
            [MODEL] + e("f") + [TOOL_TEXT] + e("search ") + [TEXT] + e("x") + [EOM, END],
            ("", "", [("functions.unknown:0", "", "", "search x")]),
        ),
    ],
)
def test_control_tokens_never_leak_into_text(tokens: list[int], expected: tuple) -> None:
    deltas, _ = stream(tokens)
    assert channels(deltas) == expected
    assert not any("<|" in (d.text + (d.tool_call.text or "" if d.tool_call else "")) for d in deltas)


def test_cut_off_tool_payload_drops_control_tokens() -> None:
    deltas, _ = stream([MODEL] + e("f") + [TOOL_JSON] + e('{"a":') + [THINK] + e("1"), reason="length")
    assert channels(deltas) == ("", '{"a":1', [])
