"""Chat rendering checked token for token against tml-renderers' own rendering of the same conversation."""

from __future__ import annotations

import wave

import numpy as np
import pytest
from tml_renderers import chat as tml
from tml_renderers import tokenizers, v0

from common.errors import InvalidInputError
from decode_service.chat import (
    ChatMessage,
    IncrementalDetokenizer,
    MediaPart,
    MediaSpan,
    TextPart,
    ToolCall,
    ToolSpec,
    attach_media,
    decode_tokens,
    encode_text,
    render_chat,
    resolve_effort,
)

TOK = tokenizers.O200kBaseChatTokenizer()
RENDERER = v0.Renderer(TOK)
SYSTEM, USER, MODEL, TOOL = (
    tml.AuthorKind.System,
    tml.AuthorKind.User,
    tml.AuthorKind.Model,
    tml.AuthorKind.Tool,
)


def _tml_ids(messages: list[tml.Message], effort: float | None = None) -> list[int]:
    """The reference: tml-renderers' rendering, with each media span shown as placeholder ids."""
    if effort is None:
        spans, _ = RENDERER.render_for_completion(messages)
    else:
        spans, _ = RENDERER.render_for_completion_with_effort(messages, effort)
    ids: list[int] = []
    for span in spans:
        inner = span.span
        if isinstance(inner, tml.EncodedTextTokenSpan):
            ids += inner.tokens
        elif isinstance(inner, tml.ImageAssetPointerTokenSpan):
            ids += [200054] * inner.num_tokens
        elif isinstance(inner, tml.DmelTokenSpan):
            ids += [200053] * inner.token_count()
        else:
            raise AssertionError(f"unexpected span {inner!r}")
    return ids


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _msg(content: object, kind: tml.AuthorKind, name: str | None = None) -> tml.Message:
    return tml.Message(content, tml.Author(kind, name))


def test_text_conversation_matches_tml_and_literal_ids() -> None:
    got = render_chat(
        [ChatMessage("system", [TextPart("You are helpful.")]), ChatMessage("user", [TextPart("Describe.")])]
    )
    want = _tml_ids([_msg(tml.Text("You are helpful."), SYSTEM), _msg(tml.Text("Describe."), USER)])
    assert got.token_ids == want
    assert got.token_ids[:7] == [200002, 200004, 3575, 553, 10297, 13, 200010]
    assert got.token_ids[7:9] == [200000, 200004] and got.token_ids[-1] == 200010
    assert got.media_spans == []


def test_image_span_matches_tml_pointer_rendering() -> None:
    pointer = tml.ImagePointer("a.png", tml.ImageFormat.Png, 80, 120)
    n = RENDERER.render_for_completion([_msg(pointer, USER)])[0][1].span.num_tokens
    assert n > 1
    want = _tml_ids([_msg(tml.Text("sys"), SYSTEM), _msg(pointer, USER), _msg(tml.Text("What?"), USER)], 0.9)
    got = render_chat(
        [
            ChatMessage("system", [TextPart("sys")]),
            ChatMessage("user", [MediaPart("image", 0), TextPart("What?")]),
        ],
        effort="high",
        media_token_counts=[n],
    )
    assert got.token_ids == want
    start = got.token_ids.index(200054)
    assert got.token_ids[start - 2 : start] == [200000, 200005]
    assert got.token_ids[start + n] == 200010
    assert got.media_spans == [MediaSpan(0, "image", start, n, 0)]


def test_audio_span_matches_tml_dmel_rendering(tmp_path) -> None:
    path = tmp_path / "clip.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.sin(np.arange(6400) * 0.05) * 3000).astype(np.int16).tobytes())
    audio = tml.AudioPointer(str(path), tml.AudioFormat.Wav, 6400, 16000)
    spans, _ = RENDERER.render_for_completion([_msg(audio, USER)])
    (dmel,) = [s.span for s in spans if isinstance(s.span, tml.DmelTokenSpan)]
    frames = dmel.token_count()
    assert frames == 8  # 0.4 s at 20 frames per second
    want = _tml_ids([_msg(audio, USER), _msg(tml.Text("Transcribe."), USER)])
    got = render_chat(
        [ChatMessage("user", [MediaPart("audio", 0), TextPart("Transcribe.")])], media_token_counts=[frames]
    )
    assert got.token_ids == want
    assert got.token_ids[:2] == [200000, 200020]
    assert got.token_ids[2 : 2 + frames] == [200053] * frames
    assert got.token_ids[2 + frames : 4 + frames] == [200043, 200010]
    assert got.media_spans == [MediaSpan(0, "audio", 2, frames, 0)]


def test_video_is_one_image_span_per_frame_and_spans_cover_every_placeholder() -> None:
    messages = [
        ChatMessage("user", [MediaPart("video", 1), TextPart("and"), MediaPart("image", 0)]),
        ChatMessage("user", [MediaPart("audio", 2)]),
    ]
    got = render_chat(messages, effort=0.2, media_token_counts=[2, [3, 4], 5])
    frame = tml.ImagePointer("f.png", tml.ImageFormat.Png, 1, 1)
    assert RENDERER.render_for_completion([_msg(frame, USER)])[0][1].span.num_tokens == 1
    kinds = [s.modality for s in got.media_spans]
    assert kinds == ["video", "video", "image", "audio"]
    assert [(s.item_index, s.length, s.row_offset) for s in got.media_spans] == [
        (1, 3, 0),
        (1, 4, 3),
        (0, 2, 0),
        (2, 5, 0),
    ]
    ids = got.token_ids
    covered = set()
    for span in got.media_spans:
        placeholder = 200053 if span.modality == "audio" else 200054
        assert ids[span.start : span.start + span.length] == [placeholder] * span.length
        assert ids[span.start - 1] == (200020 if span.modality == "audio" else 200005)
        assert ids[span.start - 2] == 200000
        covered.update(range(span.start, span.start + span.length))
    assert covered == {i for i, t in enumerate(ids) if t in (200053, 200054)}
    effort_text = decode_tokens(ids[: ids.index(200000)])
    assert effort_text == "<|message_system|><|content_text|>Thinking effort level: 0.2<|end_message|>"


def test_tools_effort_history_and_tool_results_match_tml() -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    messages = [
        ChatMessage("system", [TextPart("sys")]),
        ChatMessage("developer", [TextPart("dev")]),
        ChatMessage("user", [TextPart("Weather?")], name="bob"),
        ChatMessage(
            "assistant",
            [TextPart("Let me check.")],
            tool_calls=[ToolCall("get_weather", '{"units": {"y": 1, "x": 2.0}, "city": "Paris é"}', "call_7")],
            reasoning="need a tool",
        ),
        ChatMessage("tool", [TextPart("sunny")], tool_call_id="call_7"),
        ChatMessage("assistant", [TextPart("It is sunny.")]),
        ChatMessage("user", [TextPart("Thanks")]),
    ]
    got = render_chat(messages, tools=[ToolSpec("get_weather", "Get weather", params)], effort="medium")
    call = tml.InvokeTool(
        tml.StructuredToolCall(
            "get_weather", [tml.ToolArg("city", '"Paris é"'), tml.ToolArg("units", '{"x":2.0,"y":1}')]
        )
    )
    declare = tml.ToolDeclareJson([tml.ToolSpecJson("function", "get_weather", "Get weather", params)])
    want = _tml_ids(
        [
            _msg(tml.Text("sys"), SYSTEM),
            _msg(tml.Text("dev"), SYSTEM),
            _msg(declare, SYSTEM, "tool_declare"),
            _msg(tml.Text("Weather?"), USER, "bob"),
            _msg(tml.Thinking("need a tool"), MODEL),
            _msg(tml.Text("Let me check."), MODEL),
            _msg(call, MODEL),
            _msg(tml.ModelEndSampling(), MODEL),
            _msg(tml.Text("sunny"), TOOL, "get_weather"),
            _msg(tml.Text("It is sunny."), MODEL),
            _msg(tml.ModelEndSampling(), MODEL),
            _msg(tml.Text("Thanks"), USER),
        ],
        0.7,
    )
    assert got.token_ids == want
    text = decode_tokens(got.token_ids)
    assert (
        '<|message_system|>tool_declare<|content_xml|>[{"description":"Get weather","name":"get_weather",'
        '"parameters":{"properties":{"city":{"type":"string"}},"required":["city"],'
        '"type":"object"},"type":"function"}]<|end_message|>'
        "<|message_system|><|content_text|>Thinking effort level: 0.7<|end_message|><|message_user|>bob" in text
    )
    assert (
        '<|message_model|>get_weather<|content_invoke_tool_json|>{"name":"get_weather","args":'
        '{"city":"Paris é","units":{"x":2.0,"y":1}}}<|end_message|><|content_model_end_sampling|>'
        "<|message_tool|>get_weather<|content_text|>sunny<|end_message|>" in text
    )


def test_generation_prompt_is_optional_and_effort_goes_last_without_other_messages() -> None:
    plain = render_chat([ChatMessage("user", [TextPart("hi")])])
    prompted = render_chat([ChatMessage("user", [TextPart("hi")])], add_generation_prompt=True)
    assert prompted.token_ids == plain.token_ids + [200001]
    only_system = render_chat([ChatMessage("system", [TextPart("s")])], effort=0.125)
    want = _tml_ids([_msg(tml.Text("s"), SYSTEM)], 0.125)
    assert only_system.token_ids == want
    assert decode_tokens(want).endswith("Thinking effort level: 0.12<|end_message|>")


def test_text_that_spells_a_placeholder_stays_ordinary_tokens() -> None:
    got = render_chat([ChatMessage("user", [TextPart("<|unused_200054|><|end_message|>")])])
    assert 200054 not in got.token_ids and got.token_ids.count(200010) == 1
    assert encode_text("<|end_message|>") == TOK.encode_ordinary("<|end_message|>")


def test_effort_levels() -> None:
    assert resolve_effort(None) is None
    assert resolve_effort("none") == 0.0 and resolve_effort("max") == 0.99 and resolve_effort(0.5) == 0.5
    for bad in ("turbo", 1.5, -0.1, float("nan"), True):
        with pytest.raises(InvalidInputError, match="reasoning_effort"):
            resolve_effort(bad)


@pytest.mark.parametrize(
    ("messages", "counts", "match"),
    [
        ([ChatMessage("robot", [TextPart("x")])], [], r"messages\[0\]\.role"),
        (
            [ChatMessage("user", [TextPart("a")]), ChatMessage("assistant", [], [1])],
            [],
            r"messages\[1\]\.name",
        ),
        (
            [ChatMessage("user", [TextPart("x"), MediaPart("image", 1)])],
            [4],
            r"messages\[0\]\.parts\[1\]\.index",
        ),
        ([ChatMessage("system", [MediaPart("audio", 0)])], [4], r"messages\[0\]\.parts\[0\].*only allowed"),
        ([ChatMessage("assistant", [MediaPart("image", 0)])], [4], r"messages\[0\]\.parts\[0\]"),
        ([ChatMessage("user", [TextPart("x")])], [4], r"media\[0\].*not referenced"),
        ([ChatMessage("user", [MediaPart("video", 0)])], [4], r"media\[0\].*per-frame"),
        ([ChatMessage("user", [MediaPart("image", 0)])], [[4]], r"media\[0\].*one token count"),
        ([ChatMessage("user", [MediaPart("image", 0)])], [0], r"media\[0\].*positive"),
        ([ChatMessage("user", [MediaPart("image", 0), MediaPart("audio", 0)])], [3], r"parts\[1\].*image"),
        ([ChatMessage("user", [MediaPart("sound", 0)])], [3], r"parts\[0\]\.modality"),
        ([ChatMessage("assistant", tool_calls=[ToolCall("f", "[1]")])], [], r"tool_calls\[0\]\.arguments"),
        ([ChatMessage("assistant", tool_calls=[ToolCall("f", "{")])], [], r"tool_calls\[0\]\.arguments"),
        ([ChatMessage("tool", [TextPart("r")], tool_call_id="nope")], [], r"messages\[0\]\.tool_call_id"),
        ([ChatMessage("user", [TextPart("x")], reasoning="r")], [], r"messages\[0\]\.reasoning"),
    ],
)
def test_invalid_requests_name_the_item(messages: list[ChatMessage], counts: list, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        render_chat(messages, media_token_counts=counts)


def test_attach_media_locates_and_validates_raw_prompt_placeholders() -> None:
    rendered = render_chat(
        [ChatMessage("user", [MediaPart("image", 0), MediaPart("audio", 1), MediaPart("video", 2)])],
        media_token_counts=[2, 3, [1, 2]],
    )
    raw = attach_media(rendered.token_ids, ["image", "audio", "video"], [2, 3, [1, 2]])
    assert raw == rendered
    with pytest.raises(InvalidInputError, match=r"run 0 at position 2 has 2 tokens but media item 0 needs 5"):
        attach_media(rendered.token_ids, ["image", "audio", "video"], [5, 3, [1, 2]])
    with pytest.raises(InvalidInputError, match="3 image/video-frame placeholder runs"):
        attach_media(rendered.token_ids, ["image", "audio"], [2, 3])
    with pytest.raises(InvalidInputError, match="1 audio placeholder runs"):
        attach_media(rendered.token_ids, ["image", "audio", "audio", "video"], [2, 3, 3, [1, 2]])
    with pytest.raises(InvalidInputError, match=r"media\[0\]\.modality"):
        attach_media([1, 2], ["gif"], [1])


def test_incremental_detokenizer_emits_only_complete_characters() -> None:
    text = "héllo 🦩 日本語 龘 done"
    ids = TOK.encode_ordinary(text)
    detok = IncrementalDetokenizer()
    pieces = [detok.feed(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # some token ended inside a multi-byte character
    assert decode_tokens(ids) == TOK.decode(ids) == text
    cut = IncrementalDetokenizer()
    partial = TOK.encode_ordinary("🦩")[0]
    assert not _is_utf8(TOK.decode_bytes([partial]))
    assert cut.feed(partial) == "" and cut.flush() == "\ufffd"
    assert decode_tokens([200500]) == "\ufffd"  # an id past the vocabulary (embedding padding row)
