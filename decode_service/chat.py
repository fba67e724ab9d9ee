"""Chat rendering: native request dataclasses -> Inkling prompt token ids + a media span table.

A thin adapter over `tml_renderers` (the model's own library). Its `v0.Renderer` produces the whole
TMLv0 grammar (spec multimodal 5.2/5.3): one message per content part, tool declarations, thinking
effort, assistant history, tool results. Media are handed to it as image pointers; each pointer span it
returns is then replaced by the placeholder run whose length the caller measured (the encoder's row count):
images and video frames as N x 200054, audio as F x 200053 inside `<|content_audio_input|> ... <|audio_end|>`.
The renderer cannot take a caller-given token count, and it reads audio files itself, so the audio layout is
spliced here; tests check it token for token against the renderer's own audio rendering.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from tml_renderers import chat as tml
from tml_renderers import tokenizers, v0

from common.errors import InvalidInputError

# Special token ids (spec multimodal 5.1); fixed by the O200kBaseChatTokenizer vocabulary.
MESSAGE_USER = 200000
MESSAGE_MODEL = 200001
MESSAGE_SYSTEM = 200002
MESSAGE_TOOL = 200003
CONTENT_TEXT = 200004
CONTENT_IMAGE = 200005
MODEL_END_SAMPLING = 200006
CONTENT_THINKING = 200008
END_MESSAGE = 200010
CONTENT_AUDIO_INPUT = 200020
CONTENT_TOOL_ERROR = 200022
AUDIO_END = 200043
CONTENT_INVOKE_TOOL_JSON = 200049
AUDIO_PLACEHOLDER = 200053
IMAGE_PLACEHOLDER = 200054
CONTENT_INVOKE_TOOL_TEXT = 200057

Role = Literal["system", "developer", "user", "assistant", "tool"]
Modality = Literal["image", "audio", "video"]
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")
MODALITIES: tuple[str, ...] = ("image", "audio", "video")

# Named thinking-effort levels (spec multimodal 5.3); numeric efforts must lie in [0, MAX_EFFORT].
EFFORT_LEVELS: dict[str, float] = {
    "none": 0.0,
    "minimal": 0.1,
    "low": 0.2,
    "medium": 0.7,
    "high": 0.9,
    "xhigh": 0.99,
    "max": 0.99,
}
MAX_EFFORT = 0.99


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class MediaPart:
    """A reference to the request's media item `index` (its rows come from the encoder)."""

    modality: Modality
    index: int


Part = TextPart | MediaPart


@dataclass(frozen=True)
class ToolCall:
    """A tool call in assistant history; `arguments` is a JSON object as text (OpenAI style)."""

    name: str
    arguments: str = "{}"
    id: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    parts: list[Part] = field(default_factory=list)
    name: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class MediaSpan:
    """Prompt positions [start, start + length) take rows [row_offset, row_offset + length) of item
    `item_index`. Images and audio have one span at row_offset 0; a video has one span per frame."""

    item_index: int
    modality: Modality
    start: int
    length: int
    row_offset: int = 0


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    media_spans: list[MediaSpan]


@lru_cache(maxsize=1)
def tokenizer() -> tokenizers.O200kBaseChatTokenizer:
    return tokenizers.O200kBaseChatTokenizer()


@lru_cache(maxsize=1)
def _renderer() -> v0.Renderer:
    return v0.Renderer(tokenizer())


def encode_text(text: str) -> list[int]:
    """Ordinary text -> token ids; text that spells a special token stays ordinary tokens."""
    return tokenizer().encode_ordinary(text)


def token_bytes(token_id: int) -> bytes:
    """The bytes of one token; ids outside the vocabulary (embedding padding rows) give U+FFFD."""
    try:
        return tokenizer().decode_bytes([token_id])
    except ValueError:
        return "\ufffd".encode()


def decode_tokens(token_ids: Sequence[int]) -> str:
    """Token ids -> text; special tokens appear as their `<|name|>` spelling, bad UTF-8 as U+FFFD."""
    return b"".join(token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Streams text from token ids, emitting only complete UTF-8 characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._decoder.decode(token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: a dangling partial character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


def resolve_effort(effort: str | float | None) -> float | None:
    """A named level or a number in [0, 0.99] -> the numeric effort; None means no effort message."""
    if effort is None:
        return None
    if isinstance(effort, str):
        if effort not in EFFORT_LEVELS:
            raise InvalidInputError(
                f"reasoning_effort: unknown level {effort!r}; expected one of {sorted(EFFORT_LEVELS)} "
                f"or a number in [0, {MAX_EFFORT}]"
            )
        return EFFORT_LEVELS[effort]
    if isinstance(effort, bool) or not isinstance(effort, (int, float)):
        raise InvalidInputError(f"reasoning_effort: expected a level name or a number, got {effort!r}")
    value = float(effort)
    if not math.isfinite(value) or not 0.0 <= value <= MAX_EFFORT:
        raise InvalidInputError(f"reasoning_effort: {effort!r} is outside [0, {MAX_EFFORT}]")
    return value


@dataclass(frozen=True)
class _Slot:
    """One placeholder run to splice in, in prompt order."""

    item_index: int
    modality: Modality
    length: int
    row_offset: int


def render_chat(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] = (),
    effort: str | float | None = None,
    media_token_counts: Sequence[int | Sequence[int]] = (),
    add_generation_prompt: bool = False,
) -> RenderedPrompt:
    """Render a conversation with the canonical TMLv0 grammar.

    media_token_counts[i] is the placeholder count of media item i: an int for an image or audio clip, a
    list with one count per sampled frame for a video. `add_generation_prompt` appends `<|message_model|>`
    (vLLM style); the canonical TML renderer appends nothing and lets the model sample it.
    """
    counts = _check_messages(messages, media_token_counts)
    tml_messages, slots = _to_tml(messages, tools, counts)
    value = resolve_effort(effort)
    renderer = _renderer()
    try:
        if value is None:
            spans, _ = renderer.render_for_completion(tml_messages)
        else:
            spans, _ = renderer.render_for_completion_with_effort(tml_messages, value)
    except ValueError as exc:
        raise InvalidInputError(f"messages: the chat renderer rejected the conversation: {exc}") from exc
    token_ids, media_spans = _splice(spans, slots)
    if add_generation_prompt:
        token_ids.append(MESSAGE_MODEL)
    return RenderedPrompt(token_ids=token_ids, media_spans=media_spans)


def attach_media(
    token_ids: Sequence[int],
    media_modalities: Sequence[Modality],
    media_token_counts: Sequence[int | Sequence[int]],
) -> RenderedPrompt:
    """Validate a raw (pre-rendered) prompt against its media items and locate their placeholder runs.

    Every maximal run of 200054 is one image or one video frame, every run of 200053 one audio clip;
    items of each kind are consumed in prompt order and each run must match the item's count exactly.
    """
    if len(media_modalities) != len(media_token_counts):
        raise InvalidInputError(f"media: {len(media_modalities)} modalities but {len(media_token_counts)} token counts")
    visual: list[_Slot] = []
    audio: list[_Slot] = []
    for index, modality in enumerate(media_modalities):
        if modality not in MODALITIES:
            raise InvalidInputError(f"media[{index}].modality: unknown modality {modality!r}")
        slots = _slots_of(index, modality, media_token_counts[index])
        (audio if modality == "audio" else visual).extend(slots)
    runs = _placeholder_runs(token_ids)
    spans: list[MediaSpan] = []
    for placeholder, expected in ((IMAGE_PLACEHOLDER, visual), (AUDIO_PLACEHOLDER, audio)):
        found = [run for run in runs if run[0] == placeholder]
        kind = "image/video-frame" if placeholder == IMAGE_PLACEHOLDER else "audio"
        if len(found) != len(expected):
            raise InvalidInputError(
                f"prompt_token_ids: {len(found)} {kind} placeholder runs (id {placeholder}) but the "
                f"request's media need {len(expected)}"
            )
        for n, ((_, start, length), slot) in enumerate(zip(found, expected, strict=True)):
            if length != slot.length:
                raise InvalidInputError(
                    f"prompt_token_ids: {kind} placeholder run {n} at position {start} has {length} tokens "
                    f"but media item {slot.item_index} needs {slot.length}"
                )
            spans.append(MediaSpan(slot.item_index, slot.modality, start, length, slot.row_offset))
    spans.sort(key=lambda s: s.start)
    return RenderedPrompt(token_ids=list(token_ids), media_spans=spans)


def _placeholder_runs(token_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of placeholder ids as (placeholder_id, start, length)."""
    runs: list[tuple[int, int, int]] = []
    position = 0
    while position < len(token_ids):
        token = token_ids[position]
        if token in (IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER):
            end = position
            while end < len(token_ids) and token_ids[end] == token:
                end += 1
            runs.append((token, position, end - position))
            position = end
        else:
            position += 1
    return runs


def _slots_of(index: int, modality: Modality, count: int | Sequence[int]) -> list[_Slot]:
    """The placeholder runs of one media item, checking its count has the right shape."""
    if modality == "video":
        if isinstance(count, (int, bool)) or not isinstance(count, Sequence) or len(count) == 0:
            raise InvalidInputError(
                f"media[{index}]: a video needs a non-empty list of per-frame token counts, got {count!r}"
            )
        frames = list(count)
    else:
        if isinstance(count, bool) or not isinstance(count, int):
            raise InvalidInputError(f"media[{index}]: an {modality} needs one token count, got {count!r}")
        frames = [count]
    slots = []
    offset = 0
    for frame, length in enumerate(frames):
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            where = f"media[{index}] frame {frame}" if modality == "video" else f"media[{index}]"
            raise InvalidInputError(f"{where}: token count must be a positive int, got {length!r}")
        slots.append(_Slot(index, modality, length, offset))
        offset += length
    return slots


def _check_messages(
    messages: Sequence[ChatMessage], media_token_counts: Sequence[int | Sequence[int]]
) -> dict[int, list[_Slot]]:
    """Check roles, names and parts, every media reference (range, modality, role), every item used."""
    modality_of: dict[int, Modality] = {}
    for m, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidInputError(
                f"messages[{m}].role: unknown role {message.role!r}; expected one of {', '.join(ROLES)}"
            )
        if message.name is not None and not isinstance(message.name, str):
            raise InvalidInputError(f"messages[{m}].name: expected a string, got {type(message.name).__name__}")
        for p, part in enumerate(message.parts):
            where = f"messages[{m}].parts[{p}]"
            if isinstance(part, TextPart):
                if not isinstance(part.text, str):
                    raise InvalidInputError(f"{where}.text: expected a string")
                continue
            if not isinstance(part, MediaPart):
                raise InvalidInputError(f"{where}: unsupported part type {type(part).__name__}")
            if part.modality not in MODALITIES:
                raise InvalidInputError(f"{where}.modality: unknown modality {part.modality!r}")
            if message.role != "user":
                raise InvalidInputError(
                    f"{where}: {part.modality} parts are only allowed in user messages, not {message.role}"
                )
            if isinstance(part.index, bool) or not 0 <= part.index < len(media_token_counts):
                raise InvalidInputError(
                    f"{where}.index: media item {part.index} is out of range "
                    f"(the request has {len(media_token_counts)} media items)"
                )
            previous = modality_of.setdefault(part.index, part.modality)
            if previous != part.modality:
                raise InvalidInputError(
                    f"{where}: media item {part.index} is referenced as {part.modality} and as {previous}"
                )
    unused = [i for i in range(len(media_token_counts)) if i not in modality_of]
    if unused:
        raise InvalidInputError(f"media[{unused[0]}]: the item is not referenced by any message part")
    return {i: _slots_of(i, modality, media_token_counts[i]) for i, modality in modality_of.items()}


def _to_tml(
    messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], counts: dict[int, list[_Slot]]
) -> tuple[list[tml.Message], list[_Slot]]:
    """Native messages -> tml Messages (one per content part) + the media slots in prompt order."""
    out: list[tml.Message] = []
    slots: list[_Slot] = []
    tool_names = {call.id: call.name for msg in messages for call in msg.tool_calls if call.id}
    leading_system = 0
    while leading_system < len(messages) and messages[leading_system].role in ("system", "developer"):
        leading_system += 1
    for m, message in enumerate(messages):
        if m == leading_system and tools:
            out.append(_tool_declaration(tools))
        out.extend(_message_to_tml(m, message, counts, slots, tool_names))
    if leading_system == len(messages) and tools:
        out.append(_tool_declaration(tools))
    return out, slots


def _message_to_tml(
    m: int,
    message: ChatMessage,
    counts: dict[int, list[_Slot]],
    slots: list[_Slot],
    tool_names: dict[str, str],
) -> list[tml.Message]:
    kind = {
        "system": tml.AuthorKind.System,
        "developer": tml.AuthorKind.System,
        "user": tml.AuthorKind.User,
        "assistant": tml.AuthorKind.Model,
        "tool": tml.AuthorKind.Tool,
    }[message.role]
    if message.role == "tool":
        author = tml.Author(kind, _tool_result_name(m, message, tool_names))
    elif message.role == "assistant":
        author = tml.Author(kind)
    else:
        author = tml.Author(kind, message.name)
    if message.role != "assistant" and (message.tool_calls or message.reasoning):
        field_name = "tool_calls" if message.tool_calls else "reasoning"
        raise InvalidInputError(f"messages[{m}].{field_name}: only assistant messages may carry it")
    out: list[tml.Message] = []
    if message.role == "assistant" and message.reasoning:
        out.append(tml.Message(tml.Thinking(message.reasoning), author))
    for part in message.parts:
        if isinstance(part, TextPart):
            out.append(tml.Message(tml.Text(part.text), author))
            continue
        for slot in counts[part.index]:
            slots.append(slot)
            pointer = tml.ImagePointer(f"inkling-epd:media/{len(slots) - 1}", tml.ImageFormat.Png, 1, 1)
            out.append(tml.Message(pointer, author))
    if message.role == "assistant":
        for c, call in enumerate(message.tool_calls):
            out.append(tml.Message(_invoke_tool(m, c, call), author))
        out.append(tml.Message(tml.ModelEndSampling(), author))
    return out


def _tool_result_name(m: int, message: ChatMessage, tool_names: dict[str, str]) -> str | None:
    if message.name:
        return message.name
    if message.tool_call_id is None:
        return None
    if message.tool_call_id not in tool_names:
        raise InvalidInputError(
            f"messages[{m}].tool_call_id: {message.tool_call_id!r} matches no assistant tool call id"
        )
    return tool_names[message.tool_call_id]


def _invoke_tool(m: int, c: int, call: ToolCall) -> tml.InvokeTool:
    where = f"messages[{m}].tool_calls[{c}]"
    if not call.name:
        raise InvalidInputError(f"{where}.name: must not be empty")
    try:
        args = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{where}.arguments: not valid JSON ({exc})") from exc
    if not isinstance(args, dict):
        raise InvalidInputError(f"{where}.arguments: must be a JSON object, got {type(args).__name__}")
    tool_args = [tml.ToolArg(key, _canonical_json(args[key])) for key in sorted(args)]
    return tml.InvokeTool(tml.StructuredToolCall(call.name, tool_args, tool_call_id=call.id))


def _canonical_json(value: object) -> str:
    """Keys sorted recursively, compact, raw UTF-8; Python keeps 1.0 as 1.0 like the TML renderer."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _tool_declaration(tools: Sequence[ToolSpec]) -> tml.Message:
    specs = []
    for t, tool in enumerate(tools):
        if not tool.name:
            raise InvalidInputError(f"tools[{t}].name: must not be empty")
        if not isinstance(tool.parameters, dict):
            raise InvalidInputError(f"tools[{t}].parameters: must be a JSON object")
        specs.append(tml.ToolSpecJson("function", tool.name, tool.description, tool.parameters))
    return tml.Message(tml.ToolDeclareJson(specs), tml.Author(tml.AuthorKind.System, "tool_declare"))


def _splice(spans: Sequence[tml.TokenSpan], slots: Sequence[_Slot]) -> tuple[list[int], list[MediaSpan]]:
    """Flatten the renderer's spans, replacing the n-th image pointer span with slot n's placeholders."""
    token_ids: list[int] = []
    media_spans: list[MediaSpan] = []
    next_slot = 0
    for span in spans:
        inner = span.span
        if isinstance(inner, tml.EncodedTextTokenSpan):
            token_ids.extend(inner.tokens)
            continue
        assert isinstance(inner, tml.ImageAssetPointerTokenSpan), f"unexpected span {inner!r}"
        assert inner.location == f"inkling-epd:media/{next_slot}", inner.location
        assert token_ids and token_ids[-1] == CONTENT_IMAGE, "an image pointer follows <|content_image|>"
        slot = slots[next_slot]
        next_slot += 1
        if slot.modality == "audio":
            token_ids[-1] = CONTENT_AUDIO_INPUT
        media_spans.append(MediaSpan(slot.item_index, slot.modality, len(token_ids), slot.length, slot.row_offset))
        placeholder = AUDIO_PLACEHOLDER if slot.modality == "audio" else IMAGE_PLACEHOLDER
        token_ids.extend([placeholder] * slot.length)
        if slot.modality == "audio":
            token_ids.append(AUDIO_END)
    assert next_slot == len(slots), "every media slot was rendered"
    return token_ids, media_spans
