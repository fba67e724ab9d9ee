"""Client-side request building and output rendering for `inkling-epd generate` (gRPC messages only, no torch).

    messages = load_messages("chat.json")      # [{"role": "user", "content": "hi" | [{"type": "image", "path": ...}]}]
    request = build_request(messages=messages, sampling=sampling_params(temperature=0.0, max_tokens=16))
    for response in stub.Generate(request): printer.feed(response)

A messages file is a JSON list of {role, content}; content is a string or a list of parts {type: text, text} or
{type: image | audio | video, path} (a relative path is resolved against the file's folder). Media are sent as
inline bytes in the order they appear.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from google.protobuf.json_format import MessageToDict

from common.errors import InvalidInputError
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import media_pb2

ROLES = {"system": pb.ROLE_SYSTEM, "user": pb.ROLE_USER, "assistant": pb.ROLE_ASSISTANT, "tool": pb.ROLE_TOOL}
MODALITIES = {"image": media_pb2.MODALITY_IMAGE, "audio": media_pb2.MODALITY_AUDIO, "video": media_pb2.MODALITY_VIDEO}
_DIM, _RESET = "\x1b[2m", "\x1b[0m"


def media_item(kind: str, path: str | Path, no_rescale: bool = False) -> media_pb2.MediaItem:
    """A media item with the file's bytes; `no_rescale` patches images (and video frames) as they are."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"cannot read {kind} file {path}: {exc}") from exc
    item = media_pb2.MediaItem(modality=MODALITIES[kind], data=data)
    if no_rescale and kind == "image":
        item.image.rescale_policy = media_pb2.RESCALE_POLICY_NONE
    elif no_rescale and kind == "video":
        item.video.frame.rescale_policy = media_pb2.RESCALE_POLICY_NONE
    return item


def load_messages(path: str | Path, no_rescale: bool = False) -> list[pb.Message]:
    """Parse a messages JSON file (see the module docstring); errors name the message and part."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"--messages {path}: {exc}") from exc
    if not isinstance(raw, list) or not raw:
        raise InvalidInputError(f"--messages {path}: expected a non-empty JSON list of messages")
    messages = []
    for m, entry in enumerate(raw):
        where = f"--messages {path}: message {m}"
        if not isinstance(entry, dict) or entry.get("role") not in ROLES:
            raise InvalidInputError(f"{where}: needs a role, one of {sorted(ROLES)}")
        content = entry.get("content", "")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise InvalidInputError(f"{where}: content must be a string or a list of parts")
        message = pb.Message(role=ROLES[entry["role"]])
        for p, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                message.content.append(pb.ContentPart(text=part["text"]))
            elif kind in MODALITIES and isinstance(part.get("path"), str):
                media_path = path.parent / part["path"]
                message.content.append(pb.ContentPart(media=media_item(kind, media_path, no_rescale)))
            else:
                raise InvalidInputError(
                    f"{where}, part {p}: expected {{type: text, text}} or "
                    f"{{type: image|audio|video, path}}, got {part!r}"
                )
        messages.append(message)
    return messages


def sampling_params(
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logprobs: int | None = None,
    ignore_eos: bool = False,
) -> pb.SamplingParams:
    """`SamplingParams` with only the given fields set (unset ones keep the server's neutral default)."""
    given = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        max_tokens=max_tokens,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logprobs=logprobs,
    )
    return pb.SamplingParams(
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        **{k: v for k, v in given.items() if v is not None},
    )


def build_request(
    sampling: pb.SamplingParams,
    messages: Sequence[pb.Message] = (),
    prompt: str | None = None,
    media: Sequence[media_pb2.MediaItem] = (),
    prompt_ids: Sequence[int] | None = None,
    reasoning_effort: float | None = None,
    request_id: str = "",
) -> pb.GenerateRequest:
    """A chat request from `messages`, or from `prompt` with `media` before it in one user message, or a token
    prompt from `prompt_ids` (one placeholder token per media item)."""
    rid = request_id or f"cli-{uuid.uuid4().hex[:12]}"
    if prompt_ids is not None:
        return pb.GenerateRequest(
            request_id=rid, sampling=sampling, tokens=pb.TokenPrompt(token_ids=list(prompt_ids), media=list(media))
        )
    if not messages:
        parts = [pb.ContentPart(media=m) for m in media] + [pb.ContentPart(text=prompt or "")]
        messages = [pb.Message(role=pb.ROLE_USER, content=parts)]
    chat = pb.ChatPrompt(messages=list(messages))
    if reasoning_effort is not None:
        chat.reasoning_effort = reasoning_effort
    return pb.GenerateRequest(request_id=rid, sampling=sampling, chat=chat)


class OutputPrinter:
    """Collects a Generate stream; with `stream`, writes text as it arrives, reasoning dimmed on a terminal
    and marked `[reasoning]` / `[answer]` at channel changes otherwise."""

    def __init__(
        self, out: TextIO = sys.stdout, stream: bool = False, prompt_token_ids: Sequence[int] | None = None
    ) -> None:
        self.out = out
        self.prompt_token_ids = None if prompt_token_ids is None else list(prompt_token_ids)
        self.stream = stream
        self.color = stream and out.isatty()
        self.token_ids: list[int] = []
        self.text = {"content": "", "reasoning": ""}
        self.tool_calls: list[dict] = []
        self.final: pb.Final | None = None
        self._channel: str | None = None

    def feed(self, response: pb.GenerateResponse) -> None:
        if response.WhichOneof("response") == "final":
            self.final = response.final
            return
        delta = response.delta
        self.token_ids += delta.token_ids
        if delta.HasField("tool_call"):
            self.tool_calls.append(MessageToDict(delta.tool_call, preserving_proto_field_name=True))
        channel = "reasoning" if delta.channel == pb.CHANNEL_REASONING else "content"
        self.text[channel] += delta.text
        if self.stream and delta.text:
            self._write(channel, delta.text)

    def _write(self, channel: str, text: str) -> None:
        if self.color:
            self.out.write(f"{_DIM}{text}{_RESET}" if channel == "reasoning" else text)
        else:
            if channel != self._channel:
                self.out.write(
                    ("\n" if self._channel else "") + ("[reasoning] " if channel == "reasoning" else "[answer] ")
                )
            self.out.write(text)
        self._channel = channel
        self.out.flush()

    def summary(self) -> dict:
        """The `generate` JSON contract (prompt_token_ids: the token prompt's ids, or a chat's rendered ids when
        the request set `return_prompt_token_ids`; token_ids, text, finish_reason) plus reasoning, tool calls,
        usage and timings."""
        result: dict = {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text["content"],
            "reasoning": self.text["reasoning"],
            "tool_calls": self.tool_calls,
        }
        if self.final is not None:
            final = MessageToDict(
                self.final, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            final["finish_reason"] = final.get("finish_reason", "").removeprefix("FINISH_REASON_").lower()
            echoed = final.pop("prompt_token_ids", [])  # the rendered prompt, when the request asked for it
            if echoed:
                result["prompt_token_ids"] = echoed
            result.update(final)
        return result
