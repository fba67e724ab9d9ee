"""The `Generate` stream -> OpenAI JSON: whole replies (`ChatReply`, `CompletionReply`) and SSE chunks
(`ChatChunks`, `CompletionChunks`).

Reasoning text goes to `reasoning_content` (vLLM/SGLang's convention), visible text to `content`, complete
tool calls to `tool_calls` (one delta per call when streaming). The front holds no tokenizer: logprob entries
carry the token text and bytes the decode replica put in `TokenLogprob.token` / `token_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_service.http_api.errors import ApiError
from proto.inkling_epd.v1 import generator_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class ReplyMeta:
    id: str
    model: str
    created: int


def usage_json(usage: pb.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def finish_reason(final: pb.Final) -> str:
    if final.finish_reason not in FINISH_REASONS:
        raise ApiError(502, f"upstream Final has no known finish_reason ({final.finish_reason})")
    return FINISH_REASONS[final.finish_reason]


def tool_call_json(call: pb.ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


def _checked(entry: pb.TokenLogprob | pb.TopLogprob) -> pb.TokenLogprob | pb.TopLogprob:
    if not entry.token_bytes:
        raise ApiError(502, f"upstream logprob entry for token {entry.token_id} carries no token text")
    return entry


def _chat_entry(entry: pb.TokenLogprob | pb.TopLogprob) -> dict:
    entry = _checked(entry)
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.token_bytes)}


def chat_logprobs(entries: list[pb.TokenLogprob], top: int) -> list[dict]:
    return [{**_chat_entry(e), "top_logprobs": [_chat_entry(t) for t in e.top[:top]]} for e in entries]


def completion_logprobs(entries: list[pb.TokenLogprob], top: int) -> dict:
    """The legacy shape: token texts, their logprobs, and per position a {token: logprob} map of the top ones
    (tokens with equal text share one key: the most likely one's logprob is kept)."""
    tops = []
    for e in entries:
        best: dict[str, float] = {}
        for t in e.top[:top]:
            best.setdefault(_checked(t).token, t.logprob)
        tops.append(best)
    return {
        "tokens": [_checked(e).token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
    }


@dataclass
class _Collected:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    final: pb.Final | None = None

    def feed(self, response: pb.GenerateResponse) -> None:
        if response.WhichOneof("response") == "final":
            self.final = response.final
            return
        delta = response.delta
        if delta.channel == pb.CHANNEL_REASONING:
            self.reasoning += delta.text
        else:
            self.content += delta.text
        if delta.HasField("tool_call"):
            self.tool_calls.append(tool_call_json(delta.tool_call))
        self.logprobs.extend(delta.logprobs)


class ChatReply(_Collected):
    def json(self, meta: ReplyMeta, logprobs: bool, top: int) -> dict:
        assert self.final is not None, "a Generate stream ends with a Final"
        message: dict = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": chat_logprobs(self.logprobs, top)} if logprobs else None,
            "finish_reason": finish_reason(self.final),
        }
        return {
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [choice],
            "usage": usage_json(self.final.usage),
        }


class CompletionReply(_Collected):
    def json(self, meta: ReplyMeta, logprobs: bool, top: int) -> dict:
        assert self.final is not None, "a Generate stream ends with a Final"
        choice = {
            "index": 0,
            "text": self.reasoning + self.content,
            "logprobs": completion_logprobs(self.logprobs, top) if logprobs else None,
            "finish_reason": finish_reason(self.final),
        }
        return {
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [choice],
            "usage": usage_json(self.final.usage),
        }


class _Chunks:
    """The stream's chunk envelope (id, object kind, model; `usage: null` until the usage chunk when asked for)."""

    OBJECT = ""

    def __init__(self, meta: ReplyMeta, include_usage: bool, logprobs: bool, top: int) -> None:
        self.meta, self.include_usage, self.logprobs, self.top = meta, include_usage, logprobs, top

    def _chunk(self, choices: list[dict], **extra) -> dict:
        chunk = {
            "id": self.meta.id,
            "object": self.OBJECT,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        chunk.update(extra)
        return chunk


class ChatChunks(_Chunks):
    """`chat.completion.chunk` objects for one stream: a role chunk, then one per delta with text, a tool call
    or logprobs, then the finish chunk and, with `include_usage`, a usage chunk with no choices."""

    OBJECT = "chat.completion.chunk"

    def __init__(self, meta: ReplyMeta, include_usage: bool, logprobs: bool, top: int) -> None:
        super().__init__(meta, include_usage, logprobs, top)
        self._tool_index = 0

    def first(self) -> dict:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def feed(self, response: pb.GenerateResponse) -> list[dict]:
        if response.WhichOneof("response") == "final":
            final = response.final
            out = [self._chunk([{"index": 0, "delta": {}, "finish_reason": finish_reason(final)}])]
            if self.include_usage:
                out.append(self._chunk([], usage=usage_json(final.usage)))
            return out
        d = response.delta
        delta: dict = {}
        if d.text:
            delta["reasoning_content" if d.channel == pb.CHANNEL_REASONING else "content"] = d.text
        if d.HasField("tool_call"):
            delta["tool_calls"] = [{"index": self._tool_index, **tool_call_json(d.tool_call)}]
            self._tool_index += 1
        logprobs = {"content": chat_logprobs(list(d.logprobs), self.top)} if self.logprobs and d.logprobs else None
        if not delta and logprobs is None:
            return []
        return [self._chunk([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}])]


class CompletionChunks(_Chunks):
    """`text_completion` chunks: one per delta with text (or logprobs), the finish chunk, an optional usage one."""

    OBJECT = "text_completion"

    def first(self) -> None:
        return None

    def feed(self, response: pb.GenerateResponse) -> list[dict]:
        if response.WhichOneof("response") == "final":
            final = response.final
            out = [self._chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(final)}])]
            if self.include_usage:
                out.append(self._chunk([], usage=usage_json(final.usage)))
            return out
        d = response.delta
        logprobs = completion_logprobs(list(d.logprobs), self.top) if self.logprobs and d.logprobs else None
        if not d.text and logprobs is None:
            return []
        return [self._chunk([{"index": 0, "text": d.text, "logprobs": logprobs, "finish_reason": None}])]
