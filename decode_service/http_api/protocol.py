"""OpenAI request JSON -> `GenerateRequest`. Every accepted field maps onto the Generate contract; a field it
cannot express is a 400 naming it, never silently dropped. `None` values count as absent (as in OpenAI's API).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from decode_service.http_api.errors import ApiError, bad_request
from decode_service.http_api.media import MediaLoader, decode_base64
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import media_pb2

ROLES = {
    "system": pb.ROLE_SYSTEM,
    "developer": pb.ROLE_SYSTEM,
    "user": pb.ROLE_USER,
    "assistant": pb.ROLE_ASSISTANT,
    "tool": pb.ROLE_TOOL,
}
# The proto's named thinking levels (ChatPrompt.reasoning_effort).
REASONING_EFFORTS = {"none": 0.0, "minimal": 0.1, "low": 0.2, "medium": 0.7, "high": 0.9, "xhigh": 0.99, "max": 0.99}
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "m4a", "webm")
MAX_TOP_LOGPROBS = 20
_UINT32 = (1 << 32) - 1
_UINT64 = (1 << 64) - 1

_SAMPLING_FIELDS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "n",
    "stream",
    "stream_options",
    "model",
    "user",
    "cache_salt",
    "priority",
}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "response_format",
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of", "response_format"}


@dataclass(frozen=True)
class Parsed:
    """A request ready for the upstream plus what shaping the reply needs."""

    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool  # return logprobs in the reply
    top_logprobs: int
    media_paths: tuple[str, ...] = ()  # OpenAI path of each media item, in the upstream's media[N] order


# ---------------------------------------------------------------------------------------------------------
# Field readers: each returns None when the field is absent (or null) and raises a 400 naming it otherwise.


def _present(body: dict, name: str) -> bool:
    return body.get(name) is not None


def _number(body: dict, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(name, f"expected a finite number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise bad_request(name, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad_request(name, f"must be <= {hi}, got {value}")
    return float(value)


def _integer(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"expected an integer, got {value!r}")
    if lo is not None and value < lo:
        raise bad_request(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad_request(name, f"must be <= {hi}, got {value}")
    return value


def _boolean(body: dict, name: str, where: str | None = None) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(where or name, f"expected true or false, got {value!r}")
    return value


def _string(body: dict, name: str, where: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(where or name, f"expected a string, got {type(value).__name__}")
    return value


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(where, f"expected an object, got {type(value).__name__}")
    return value


def _known_fields(body: dict, allowed: set[str], kind: str) -> None:
    unknown = sorted(k for k, v in body.items() if k not in allowed and v is not None)
    if unknown:
        raise bad_request(unknown[0], f"not supported by this server's {kind} endpoint")


def _stops(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop", "expected a non-empty string or a list of non-empty strings")
    return stops


def _token_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(where, "expected a list of integer token ids")
    bad = [t for t in value if not 0 <= t <= _UINT32]
    if bad:
        raise bad_request(where, f"token id {bad[0]} is out of range")
    return value


def sampling(body: dict, max_tokens_fields: tuple[str, ...], default_max_tokens: int | None) -> pb.SamplingParams:
    """The SamplingParams shared by both endpoints (logprobs are set by the caller)."""
    s = pb.SamplingParams()
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise bad_request("n", f"only n=1 is supported, got {n}")
    if (t := _number(body, "temperature", lo=0.0)) is not None:
        s.temperature = t
    if (p := _number(body, "top_p", lo=0.0, hi=1.0, lo_open=True)) is not None:
        s.top_p = p
    if (k := _integer(body, "top_k", lo=-1, hi=_UINT32)) is not None and k > 0:
        s.top_k = k  # -1 and 0 both mean "no top-k filter" (vLLM's convention)
    if (m := _number(body, "min_p", lo=0.0, hi=1.0)) is not None:
        s.min_p = m
    if (seed := _integer(body, "seed", lo=0, hi=_UINT64)) is not None:
        s.seed = seed
    for name in ("presence_penalty", "frequency_penalty"):
        if (v := _number(body, name, lo=-2.0, hi=2.0)) is not None:
            setattr(s, name, v)
    if (r := _number(body, "repetition_penalty", lo=0.0, lo_open=True)) is not None:
        s.repetition_penalty = r
    s.stop.extend(_stops(body))
    if _present(body, "stop_token_ids"):
        s.stop_token_ids.extend(_token_ids(body["stop_token_ids"], "stop_token_ids"))
    caps = {f: _integer(body, f, lo=1, hi=_UINT32) for f in max_tokens_fields}
    given = {f: v for f, v in caps.items() if v is not None}
    if len(set(given.values())) > 1:
        raise bad_request(max_tokens_fields[-1], f"conflicts with {max_tokens_fields[0]}; give one of them")
    cap = next(iter(given.values()), default_max_tokens)
    if cap is not None:
        s.max_tokens = cap
    if (mt := _integer(body, "min_tokens", lo=0, hi=_UINT32)) is not None:
        s.min_tokens = mt
    s.ignore_eos = bool(_boolean(body, "ignore_eos"))
    return s


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(_boolean(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options", "only allowed with stream=true")
    options = _object(options, "stream_options")
    unknown = sorted(k for k, v in options.items() if k != "include_usage" and v is not None)
    if unknown:
        raise bad_request(f"stream_options.{unknown[0]}", "not supported")
    return stream, bool(_boolean(options, "include_usage"))


def _common_request(body: dict, request_id: str, sampling_params: pb.SamplingParams) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling_params)
    if (salt := _string(body, "cache_salt")) is not None:
        request.cache_salt = salt
    if (priority := _integer(body, "priority", lo=-(1 << 31), hi=(1 << 31) - 1)) is not None:
        request.priority = priority
    _string(body, "user")  # an end-user id for the caller's own bookkeeping: no effect on generation
    return request


# ---------------------------------------------------------------------------------------------------------
# Chat


_MEDIA_PARTS = {  # part type -> (modality, MIME prefix of its data: URLs)
    "image_url": (media_pb2.MODALITY_IMAGE, "image/"),
    "audio_url": (media_pb2.MODALITY_AUDIO, "audio/"),
    "video_url": (media_pb2.MODALITY_VIDEO, "video/"),
}


async def _content_part(part: Any, where: str, loader: MediaLoader, text_only: bool) -> pb.ContentPart:
    part = _object(part, where)
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text", "expected a string")
        return pb.ContentPart(text=text)
    if text_only:
        raise bad_request(f"{where}.type", f"only text parts are allowed in this message, got {kind!r}")
    if kind in _MEDIA_PARTS:
        modality, mime = _MEDIA_PARTS[kind]
        ref = part.get(kind)
        url = ref if isinstance(ref, str) else _object(ref, f"{where}.{kind}").get("url")
        if isinstance(ref, dict) and ref.get("detail") not in (None, "auto"):
            raise bad_request(f"{where}.{kind}.detail", f"only 'auto' is supported, got {ref.get('detail')!r}")
        data = await loader.load(url, f"{where}.{kind}.url", mime)
        return pb.ContentPart(media=media_pb2.MediaItem(modality=modality, data=data))
    if kind == "input_audio":
        audio = _object(part.get("input_audio"), f"{where}.input_audio")
        fmt = audio.get("format")
        if fmt not in AUDIO_FORMATS:
            raise bad_request(f"{where}.input_audio.format", f"expected one of {list(AUDIO_FORMATS)}, got {fmt!r}")
        data_text = audio.get("data")
        if not isinstance(data_text, str):
            raise bad_request(f"{where}.input_audio.data", "expected a base64 string")
        data = decode_base64(data_text, f"{where}.input_audio.data")
        return pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=data))
    allowed = ["text"] if text_only else ["text", *_MEDIA_PARTS, "input_audio"]
    raise bad_request(f"{where}.type", f"expected one of {allowed}, got {kind!r}")


async def _content(value: Any, where: str, loader: MediaLoader, text_only: bool) -> list[pb.ContentPart]:
    if value is None:
        return []
    if isinstance(value, str):
        return [pb.ContentPart(text=value)]
    if not isinstance(value, list):
        raise bad_request(where, "expected a string or a list of content parts")
    return [await _content_part(p, f"{where}[{i}]", loader, text_only) for i, p in enumerate(value)]


def _tool_calls(value: Any, where: str) -> Iterator[pb.ToolCall]:
    if not isinstance(value, list):
        raise bad_request(where, "expected a list of tool calls")
    for c, call in enumerate(value):
        at = f"{where}[{c}]"
        call = _object(call, at)
        if call.get("type", "function") != "function":
            raise bad_request(f"{at}.type", f"only 'function' is supported, got {call.get('type')!r}")
        function = _object(call.get("function"), f"{at}.function")
        name = _string(function, "name", f"{at}.function.name")
        if not name:
            raise bad_request(f"{at}.function.name", "required")
        arguments = _string(function, "arguments", f"{at}.function.arguments") or "{}"
        try:
            if not isinstance(json.loads(arguments), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise bad_request(f"{at}.function.arguments", f"expected a JSON object text ({exc})") from None
        yield pb.ToolCall(id=_string(call, "id", f"{at}.id") or "", name=name, arguments_json=arguments)


async def _message(raw: Any, where: str, loader: MediaLoader) -> pb.Message:
    raw = _object(raw, where)
    role = raw.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role", f"expected one of {sorted(ROLES)}, got {role!r}")
    message = pb.Message(role=ROLES[role])
    message.content.extend(await _content(raw.get("content"), f"{where}.content", loader, role != "user"))
    if role == "assistant":
        if raw.get("tool_calls") is not None:
            message.tool_calls.extend(_tool_calls(raw["tool_calls"], f"{where}.tool_calls"))
        for name in ("reasoning_content", "reasoning"):
            if (reasoning := _string(raw, name, f"{where}.{name}")) is not None:
                message.reasoning = reasoning
    elif role == "tool":
        call_id = _string(raw, "tool_call_id", f"{where}.tool_call_id")
        if not call_id:
            raise bad_request(f"{where}.tool_call_id", "required in a tool message")
        message.tool_call_id = call_id
    if role in ("tool", "user", "system", "developer") and raw.get("tool_calls") is not None:
        raise bad_request(f"{where}.tool_calls", f"only assistant messages carry tool calls, not {role!r}")
    if (name := _string(raw, "name", f"{where}.name")) is not None:
        if role != "tool":
            raise bad_request(f"{where}.name", f"participant names are not supported on {role!r} messages")
        message.name = name
    return message


def _tools(body: dict, forced: bool) -> list[pb.Tool]:
    """The declared tools; `forced` (tool_choice required or named): their arguments are schema-constrained, so
    `strict: true` holds."""
    value = body.get("tools")
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools", "expected a list of tools")
    tools = []
    for t, tool in enumerate(value):
        at = f"tools[{t}]"
        tool = _object(tool, at)
        if tool.get("type") != "function":
            raise bad_request(f"{at}.type", f"only 'function' is supported, got {tool.get('type')!r}")
        function = _object(tool.get("function"), f"{at}.function")
        name = _string(function, "name", f"{at}.function.name")
        if not name:
            raise bad_request(f"{at}.function.name", "required")
        if _boolean(function, "strict", f"{at}.function.strict") and not forced:
            raise bad_request(
                f"{at}.function.strict",
                "arguments are enforced only with tool_choice 'required' or a named function",
            )
        parameters = function.get("parameters")
        if parameters is not None:
            _object(parameters, f"{at}.function.parameters")
        description = _string(function, "description", f"{at}.function.description") or ""
        tools.append(pb.Tool(name=name, description=description, parameters_json=json.dumps(parameters or {})))
    return tools


def _forced(body: dict) -> bool:
    choice = body.get("tool_choice")
    return choice == "required" or isinstance(choice, dict)


def _tool_choice(body: dict, tools: list[pb.Tool], chat: pb.ChatPrompt) -> None:
    """Renders the tools into `chat` as `tool_choice` says: all of them for "auto" (the default), none for
    "none"; "required" (one or more calls) and a named function (exactly one call to it) also set
    `ChatPrompt.tool_choice`, so the output is tool calls with schema-valid arguments.

    `parallel_tool_calls: false` asks for at most one call: a named function gives exactly one; "required"
    with a single declared tool is that tool named; otherwise (the model may answer with several calls) a 400.
    """
    choice = body.get("tool_choice")
    single = _boolean(body, "parallel_tool_calls") is False
    if choice is None or choice == "auto":
        if single and tools:
            raise bad_request(
                "parallel_tool_calls",
                "false is only supported with tool_choice 'required' or a named function "
                "(with 'auto' the model may emit several calls)",
            )
        chat.tools.extend(tools)
        return
    if choice == "none":
        return
    if not tools:
        raise bad_request("tool_choice", f"{choice!r} needs at least one tool in `tools`")
    chat.tools.extend(tools)
    if choice == "required":
        if not single:
            chat.tool_choice.required = True
        elif len(tools) == 1:
            chat.tool_choice.function = tools[0].name
        else:
            raise bad_request(
                "parallel_tool_calls",
                "false with tool_choice 'required' needs exactly one declared tool (or name the function): "
                "'required' allows one or more calls",
            )
        return
    if not isinstance(choice, dict):
        raise bad_request(
            "tool_choice", f"expected 'auto', 'none', 'required' or a named function object, got {choice!r}"
        )
    if choice.get("type") != "function":
        raise bad_request("tool_choice.type", f"only 'function' is supported, got {choice.get('type')!r}")
    function = _object(choice.get("function"), "tool_choice.function")
    name = _string(function, "name", "tool_choice.function.name")
    if not name:
        raise bad_request("tool_choice.function.name", "required")
    if name not in {t.name for t in tools}:
        raise bad_request("tool_choice.function.name", f"{name!r} is not one of the declared tools")
    chat.tool_choice.function = name


def response_format(body: dict, request: pb.GenerateRequest) -> None:
    """`response_format` -> `GenerateRequest.constraint`: `json_schema` (its `schema` is enforced whether
    `strict` is true or not) and `json_object` constrain the answer; `text` (the default) leaves it free."""
    value = body.get("response_format")
    if value is None:
        return
    fmt = _object(value, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        request.constraint.json_object = True
        return
    if kind != "json_schema":
        raise bad_request("response_format.type", f"expected 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = _object(fmt.get("json_schema"), "response_format.json_schema")
    if not _string(spec, "name", "response_format.json_schema.name"):
        raise bad_request("response_format.json_schema.name", "required")
    _string(spec, "description", "response_format.json_schema.description")
    _boolean(spec, "strict", "response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:
        raise bad_request("response_format.json_schema.schema", "required")
    _object(schema, "response_format.json_schema.schema")
    request.constraint.json_schema = json.dumps(schema)


def _reasoning_effort(body: dict) -> float | None:
    value = body.get("reasoning_effort")
    if value is None:
        return None
    if value not in REASONING_EFFORTS:
        raise bad_request("reasoning_effort", f"expected one of {list(REASONING_EFFORTS)}, got {value!r}")
    return REASONING_EFFORTS[value]


def _logprobs(body: dict, request: pb.GenerateRequest) -> tuple[bool, int]:
    wanted = bool(_boolean(body, "logprobs"))
    top = _integer(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs", "needs logprobs=true")
    if wanted:
        request.sampling.logprobs = top or 0
    return wanted, top or 0


async def parse_chat(body: Any, request_id: str, loader: MediaLoader) -> Parsed:
    body = _object(body, "body")
    _known_fields(body, CHAT_FIELDS, "chat completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "expected a non-empty list of messages")
    stream, include_usage = stream_flags(body)
    params = sampling(body, ("max_tokens", "max_completion_tokens"), None)
    request = _common_request(body, request_id, params)
    chat = request.chat
    for m, raw in enumerate(messages):
        chat.messages.append(await _message(raw, f"messages[{m}]", loader))
    _tool_choice(body, _tools(body, _forced(body)), chat)
    response_format(body, request)
    if request.HasField("constraint") and chat.HasField("tool_choice"):
        raise bad_request("response_format", "cannot be combined with a forced tool_choice (the call is the output)")
    if (effort := _reasoning_effort(body)) is not None:
        chat.reasoning_effort = effort
    wanted, top = _logprobs(body, request)
    return Parsed(request, stream, include_usage, wanted, top, _media_paths(chat))


def _media_paths(chat: pb.ChatPrompt) -> tuple[str, ...]:
    return tuple(
        f"messages[{m}].content[{p}]"
        for m, message in enumerate(chat.messages)
        for p, part in enumerate(message.content)
        if part.WhichOneof("part") == "media"
    )


# ---------------------------------------------------------------------------------------------------------
# Completions


def parse_completion(body: Any, request_id: str) -> Parsed:
    """`prompt` is a text (a `TextPrompt`: the decode replica tokenizes it as ordinary text, no chat template)
    or a list of token ids (a `TokenPrompt`). A batch of several prompts is a 400 (send one request per
    prompt)."""
    body = _object(body, "body")
    _known_fields(body, COMPLETION_FIELDS, "completions")
    if _boolean(body, "echo"):
        raise bad_request("echo", "echo=true is not supported")
    if body.get("suffix") is not None:
        raise bad_request("suffix", "not supported")
    best_of = _integer(body, "best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("best_of", f"only best_of=1 is supported, got {best_of}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    text: str | None = None
    ids: list[int] = []
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt", "expected a non-empty string")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = _token_ids(prompt, "prompt")
    elif isinstance(prompt, list) and prompt:
        raise bad_request("prompt", "batched prompts are not supported: send one prompt per request")
    else:
        raise bad_request("prompt", "expected a non-empty string or a non-empty list of token ids")
    stream, include_usage = stream_flags(body)
    params = sampling(body, ("max_tokens",), 16)  # OpenAI's default for completions
    request = _common_request(body, request_id, params)
    if text is not None:
        request.text.text = text
    else:
        request.tokens.token_ids.extend(ids)
    response_format(body, request)
    top = _integer(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None:
        request.sampling.logprobs = top
    return Parsed(request, stream, include_usage, top is not None, top or 0)


def check_model(body: Any, served: str) -> None:
    model = _string(_object(body, "body"), "model")
    if model is None:
        raise bad_request("model", "required")
    if model != served:
        raise ApiError(
            404, f"model: {model!r} does not exist; this server serves {served!r}", "model", "model_not_found"
        )
