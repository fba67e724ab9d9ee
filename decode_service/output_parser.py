"""Streaming parser of Inkling output tokens into reasoning / content / tool-call deltas.

Output grammar (spec multimodal 6.1): blocks `[<|message_model|>] [header] KIND payload <|end_message|>`,
then `<|content_model_end_sampling|>`. Control tokens are recognised by id only; ordinary tokens that spell a
marker stay text. Streaming rules follow spec 6.2 (the TML-backed SGLang behaviour):

* thinking blocks stream as `reasoning`, text and tool-error blocks as `content`;
* tool-call blocks are buffered and emitted whole at `<|end_message|>` (id `functions.NAME:INDEX`);
* a block may omit `<|message_model|>`; ordinary tokens at a block boundary open an implicit text block,
  which the next control token closes;
* inside a framed block, control tokens other than `<|end_message|>` and the turn end stay inside the block
  (as in `tml_renderers`' parser) but are never text: their `<|name|>` spellings are dropped, so no control
  token leaks into reasoning, content or a tool payload; `<|content_model_end_sampling|>` also closes an open
  block (vLLM);
* blocks authored by anyone but the model are dropped;
* parse errors (bad tool JSON, a control token inside a tool payload, a header without a kind) and blocks cut
  off by `finish` surface their raw un-streamed payload (its ordinary tokens) as content;
* stop strings are matched within the text of one reasoning or content block (not inside tool-call
  payloads) once `min_tokens` tokens were fed; text that could start a stop string is held back until it
  cannot, and a match ends the output at the match (`done` turns true, `matched_stop` names the string;
  the caller then calls `finish("stop")`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from decode_service.chat import (
    CONTENT_INVOKE_TOOL_JSON,
    CONTENT_INVOKE_TOOL_TEXT,
    CONTENT_TEXT,
    CONTENT_THINKING,
    CONTENT_TOOL_ERROR,
    END_MESSAGE,
    MESSAGE_MODEL,
    MESSAGE_SYSTEM,
    MESSAGE_TOOL,
    MESSAGE_USER,
    MODEL_END_SAMPLING,
    IncrementalDetokenizer,
    decode_tokens,
    tokenizer,
)

Channel = Literal["reasoning", "content", "tool_call"]

_ROLE_TOKENS = frozenset({MESSAGE_USER, MESSAGE_MODEL, MESSAGE_SYSTEM, MESSAGE_TOOL})
_STREAMED_KINDS: dict[int, Channel] = {
    CONTENT_THINKING: "reasoning",
    CONTENT_TEXT: "content",
    CONTENT_TOOL_ERROR: "content",
}
_TOOL_KINDS = frozenset({CONTENT_INVOKE_TOOL_JSON, CONTENT_INVOKE_TOOL_TEXT})


@dataclass(frozen=True)
class ParsedToolCall:
    """A complete tool call. `arguments` is a compact JSON object; a raw-text invocation
    (`<|content_invoke_tool_text|>`) has an empty name and arguments and carries `text` instead."""

    index: int
    id: str
    name: str
    arguments: str
    text: str | None = None


@dataclass(frozen=True)
class Delta:
    channel: Channel
    text: str = ""
    tool_call: ParsedToolCall | None = None


class OutputParser:
    """Feed sampled token ids one at a time; call `finish` once when generation ends."""

    def __init__(self, stop_strings: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._stop_strings = [s for s in stop_strings if s]
        self._min_tokens = min_tokens  # stop strings end the output only from this many fed tokens on
        self._fed = 0
        self._matched_stop = ""
        self._is_special = tokenizer().is_special_token
        self._state: Literal["boundary", "header", "body"] = "boundary"
        self._model_authored = True
        self._implicit = False
        self._kind = CONTENT_TEXT
        self._header: list[int] = []
        self._payload: list[int] = []
        self._detok = IncrementalDetokenizer()
        self._held = ""
        self._tool_calls = 0
        self._done = False
        self._finish_reason: str | None = None

    @property
    def done(self) -> bool:
        """True once the turn ended (`<|content_model_end_sampling|>`) or a stop string matched."""
        return self._done

    @property
    def matched_stop(self) -> str:
        """The stop string that ended the output ("" when none did)."""
        return self._matched_stop

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    def feed(self, token_id: int) -> list[Delta]:
        assert self._finish_reason is None, "feed after finish"
        if self._done:
            return []
        self._fed += 1
        if self._state == "boundary":
            return self._at_boundary(token_id)
        if self._state == "header":
            return self._in_header(token_id)
        return self._in_body(token_id)

    def finish(self, reason: str) -> list[Delta]:
        """Flush what is pending. A "stop" reason becomes "tool_calls" when a tool call was produced."""
        assert self._finish_reason is None, "finish called twice"
        deltas: list[Delta] = []
        if not self._done:
            if self._state == "header":
                deltas += self._surface_header()
            elif self._state == "body":
                deltas += self._cut_off_body()
            self._state = "boundary"
        self._done = True
        self._finish_reason = "tool_calls" if reason == "stop" and self._tool_calls else reason
        return deltas

    # -- states -----------------------------------------------------------------------------------------

    def _at_boundary(self, token_id: int) -> list[Delta]:
        if token_id == MODEL_END_SAMPLING:
            self._done = True
        elif token_id in _ROLE_TOKENS:
            self._open_header(model_authored=token_id == MESSAGE_MODEL)
        elif token_id in _STREAMED_KINDS or token_id in _TOOL_KINDS:
            self._open_body(token_id, implicit=False)
        elif not self._is_special(token_id):
            self._open_body(CONTENT_TEXT, implicit=True)
            return self._in_body(token_id)
        return []

    def _in_header(self, token_id: int) -> list[Delta]:
        if not self._is_special(token_id):
            self._header.append(token_id)
            return []
        if token_id in _STREAMED_KINDS or token_id in _TOOL_KINDS:
            self._open_body(token_id, implicit=False)
            return []
        deltas = self._surface_header()  # a header without a content kind is a parse error
        self._state = "boundary"
        if token_id == MODEL_END_SAMPLING or token_id in _ROLE_TOKENS:
            deltas += self._at_boundary(token_id)
        return deltas

    def _in_body(self, token_id: int) -> list[Delta]:
        closes = token_id in (END_MESSAGE, MODEL_END_SAMPLING)
        if self._implicit and self._is_special(token_id):
            deltas = self._close_body()
            return deltas + (self._at_boundary(token_id) if token_id != END_MESSAGE else [])
        if closes:
            deltas = self._close_body()
            self._done = self._done or token_id == MODEL_END_SAMPLING
            return deltas
        if not self._model_authored:
            return []
        if self._kind in _TOOL_KINDS:
            self._payload.append(token_id)
            return []
        if self._is_special(token_id):
            return []
        return self._stream(_STREAMED_KINDS[self._kind], self._detok.feed(token_id))

    # -- transitions ------------------------------------------------------------------------------------

    def _open_header(self, model_authored: bool) -> None:
        self._state = "header"
        self._model_authored = model_authored
        self._header = []

    def _open_body(self, kind: int, implicit: bool) -> None:
        if self._state == "boundary":
            self._model_authored = True
            self._header = []
        self._state = "body"
        self._kind = kind
        self._implicit = implicit
        self._payload = []
        self._detok = IncrementalDetokenizer()
        self._held = ""

    def _close_body(self) -> list[Delta]:
        self._state = "boundary"
        if not self._model_authored:
            return []
        if self._kind in _TOOL_KINDS:
            return self._tool_call_deltas()
        channel = _STREAMED_KINDS[self._kind]
        deltas = self._stream(channel, self._detok.flush())
        return deltas + self._release_held(channel)

    def _cut_off_body(self) -> list[Delta]:
        """Generation ended inside a block: streamed text keeps its channel, a tool call becomes content."""
        if not self._model_authored:
            return []
        if self._kind in _TOOL_KINDS:
            return self._raw_content(self._text_of(self._payload))
        channel = _STREAMED_KINDS[self._kind]
        return self._stream(channel, self._detok.flush()) + self._release_held(channel)

    def _surface_header(self) -> list[Delta]:
        if not self._model_authored or not self._header:
            return []
        return self._raw_content(decode_tokens(self._header))

    def _raw_content(self, text: str) -> list[Delta]:
        return self._stream("content", text) + self._release_held("content")

    def _text_of(self, token_ids: Sequence[int]) -> str:
        """The text of the ordinary tokens (control tokens are never text)."""
        return decode_tokens([t for t in token_ids if not self._is_special(t)])

    # -- tool calls -------------------------------------------------------------------------------------

    def _tool_call_deltas(self) -> list[Delta]:
        payload = self._text_of(self._payload)
        if self._kind == CONTENT_INVOKE_TOOL_TEXT:
            call = ParsedToolCall(self._tool_calls, f"functions.unknown:{self._tool_calls}", "", "", payload)
        else:
            has_control = any(self._is_special(t) for t in self._payload)
            parsed = None if has_control else _parse_tool_json(payload, decode_tokens(self._header))
            if parsed is None:
                return self._raw_content(payload)
            name, arguments = parsed
            call = ParsedToolCall(self._tool_calls, f"functions.{name}:{self._tool_calls}", name, arguments)
        self._tool_calls += 1
        return [Delta("tool_call", tool_call=call)]

    # -- text and stop strings --------------------------------------------------------------------------

    def _stream(self, channel: Channel, text: str) -> list[Delta]:
        """Emit text, holding back a suffix that may start a stop string; a full match ends the output."""
        if not text:
            return []
        if not self._stop_strings or self._fed < self._min_tokens:
            return [Delta(channel, text)]
        pending = self._held + text
        found = [(i, -len(s), s) for s in self._stop_strings if (i := pending.find(s)) >= 0]
        match = min(found)[0] if found else -1
        if match >= 0:
            self._matched_stop = min(found)[2]  # the earliest match; the longest of those starting there
            self._held = ""
            self._done = True
            self._state = "boundary"
            return [Delta(channel, pending[:match])] if match else []
        keep = _stop_prefix_length(pending, self._stop_strings)
        self._held = pending[len(pending) - keep :]
        emit = pending[: len(pending) - keep]
        return [Delta(channel, emit)] if emit else []

    def _release_held(self, channel: Channel) -> list[Delta]:
        held, self._held = self._held, ""
        return [Delta(channel, held)] if held and not self._done else []


def _stop_prefix_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def _parse_tool_json(payload: str, header: str) -> tuple[str, str] | None:
    """`{"name": str, "args": object}` -> (name, compact args JSON); None when malformed, when it has
    other fields, or when a non-empty header names a different tool."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "args"}:
        return None
    name, args = obj["name"], obj["args"]
    if not isinstance(name, str) or not isinstance(args, dict) or (header and header != name):
        return None
    return name, json.dumps(args, ensure_ascii=False, separators=(",", ":"))
