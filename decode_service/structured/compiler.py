"""Constraint -> compiled xgrammar grammar over the whole Inkling output block, off the engine thread, cached.

The grammar covers the model's own framing (spec multimodal 6.1), so the output parser always finds a block:

* content: `<|message_model|> <|content_text|> BODY <|end_message|>`;
* forced tool call: `<|message_model|> NAME <|content_invoke_tool_json|> {"name":NAME,"args":ARGS} <|end_message|>`
  with ARGS valid against the tool's parameter schema, one alternative per declared tool; a named tool choice
  gives exactly one call to it, "required" one or more calls (OpenAI semantics);

then the matcher allows only the stop tokens (the model's EOS, `<|content_model_end_sampling|>`, and the
request's stop token ids), so a satisfied constraint finishes with `stop`. Special tokens appear only where the
framing names them: xgrammar never lets grammar text match a special token. JSON is compact by default (no
whitespace between tokens), so a weak model cannot spend its budget on whitespace.

Compilation runs on this module's own thread pool (never the event loop or the engine thread); results are
cached by the SHA-256 of the canonical constraint (kind, value, whitespace, tool schemas), LRU-bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr

from common.errors import InvalidInputError
from decode_service.chat import CONTENT_INVOKE_TOOL_JSON, CONTENT_TEXT, END_MESSAGE, MESSAGE_MODEL, ToolSpec
from decode_service.structured.constraint import Constraint, ForcedToolCall, OutputConstraint
from decode_service.structured.vocab import tokenizer_info

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's C++ log prefix: "[13:25:59] /path/file.cc:94: "


@dataclass(frozen=True)
class CompiledConstraint:
    key: bytes  # SHA-256 of the canonical constraint
    grammar: xgr.CompiledGrammar
    description: str  # for messages: "constraint.json_schema", "chat.tool_choice", ...


class ConstraintCompiler:
    """One per engine: `vocab_size` is the logits width, `eos_token_ids` the model's EOS ids."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256, threads: int = 2):
        if cache_size < 1 or threads < 1:
            raise ValueError(f"cache_size={cache_size} and threads={threads} must be >= 1")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[bytes, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()  # the cache and its counters
        self._init_lock = threading.Lock()  # the xgrammar compiler, built once
        self._compiler: xgr.GrammarCompiler | None = None
        self._executor.submit(self._xgr)  # the vocabulary's TokenizerInfo (~1 s) before the first request needs it

    async def compile(self, constraint: Constraint, tools: Sequence[ToolSpec] = ()) -> CompiledConstraint:
        """Compile on the compiler's threads; raises `InvalidInputError` naming the field."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.compile_sync, constraint, tuple(tools))

    def compile_sync(self, constraint: Constraint, tools: Sequence[ToolSpec] = ()) -> CompiledConstraint:
        key = constraint_key(constraint, tools)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached
        tag = {"type": "structural_tag", "format": output_format(constraint, tools)}
        try:
            grammar = self._xgr().compile_structural_tag(json.dumps(tag, ensure_ascii=False))
        except (RuntimeError, ValueError) as exc:
            raise InvalidInputError(f"{constraint.field}: {library_message(exc)}") from None
        compiled = CompiledConstraint(key, grammar, constraint.field)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _xgr(self) -> xgr.GrammarCompiler:
        with self._init_lock:
            if self._compiler is None:
                info = tokenizer_info(self.vocab_size, self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads)
            return self._compiler


def constraint_key(constraint: Constraint, tools: Sequence[ToolSpec]) -> bytes:
    if isinstance(constraint, OutputConstraint):
        canonical: dict = {"kind": constraint.kind, "value": constraint.value, "ws": constraint.flexible_whitespace}
    else:
        canonical = {
            "tool": constraint.function,
            "tools": [(t.name, t.parameters) for t in allowed_tools(constraint, tools)],
        }
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, ensure_ascii=False).encode()).digest()


def output_format(constraint: Constraint, tools: Sequence[ToolSpec]) -> dict:
    """The structural-tag format of the whole output block (see the module docstring)."""
    if isinstance(constraint, OutputConstraint):
        return _sequence(_token(MESSAGE_MODEL), _token(CONTENT_TEXT), body_format(constraint), _token(END_MESSAGE))
    allowed = allowed_tools(constraint, tools)
    calls = [_tool_call_format(t, i) for i, t in enumerate(tools) if t in allowed]
    if constraint.function is not None:
        return calls[0]
    return {"type": "plus", "content": calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}}


def allowed_tools(choice: ForcedToolCall, tools: Sequence[ToolSpec]) -> list[ToolSpec]:
    if not tools:
        raise InvalidInputError(f"{choice.field}: the request declares no tools (chat.tools is empty)")
    if choice.function is None:
        return list(tools)
    named = [t for t in tools if t.name == choice.function]
    if not named:
        names = ", ".join(t.name for t in tools)
        raise InvalidInputError(f"{choice.field}: {choice.function!r} is not a declared tool ({names})")
    return named[:1]


def body_format(constraint: OutputConstraint) -> dict:
    """The block's payload as an xgrammar grammar (EBNF text); invalid input -> `InvalidInputError`."""
    kind, value = constraint.kind, constraint.value
    try:
        if kind == "json_schema":
            grammar = _json_grammar(_json_document(value, constraint.field), constraint.flexible_whitespace)
        elif kind == "json_object":
            grammar = _json_grammar('{"type": "object"}', constraint.flexible_whitespace)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(value)
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(value)
        else:
            grammar = xgr.Grammar.from_lark(value)
    except RuntimeError as exc:
        raise InvalidInputError(f"{constraint.field}: {library_message(exc)}") from None
    return {"type": "grammar", "grammar": str(grammar)}


def library_message(exc: BaseException) -> str:
    return _LOG_PREFIX.sub("", str(exc).strip())


def _tool_call_format(tool: ToolSpec, index: int) -> dict:
    where = f"chat.tools[{index}].parameters_json"
    if tool.parameters.get("type", "object") != "object":
        raise InvalidInputError(
            f"{where}: a forced tool call needs an object schema, got type {tool.parameters['type']!r}"
        )
    schema = json.dumps(tool.parameters or {"type": "object"}, ensure_ascii=False)
    try:
        args = _json_grammar(schema, flexible=False)
    except RuntimeError as exc:
        raise InvalidInputError(f"{where}: {library_message(exc)}") from None
    envelope = '{"name":' + json.dumps(tool.name, ensure_ascii=False) + ',"args":'
    return _sequence(
        _token(MESSAGE_MODEL),
        {"type": "const_string", "value": tool.name},
        _token(CONTENT_INVOKE_TOOL_JSON),
        {"type": "const_string", "value": envelope},
        {"type": "grammar", "grammar": str(args)},
        {"type": "const_string", "value": "}"},
        _token(END_MESSAGE),
    )


def _json_grammar(schema: str, flexible: bool) -> xgr.Grammar:
    if flexible:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=True)
    return xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))


def _json_document(text: str, field: str) -> str:
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{field}: not valid JSON: {exc}") from None
    return text


def _token(token_id: int) -> dict:
    return {"type": "token", "token": token_id}


def _sequence(*elements: dict) -> dict:
    return {"type": "sequence", "elements": list(elements)}
