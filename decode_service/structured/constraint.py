"""What a request asks its output to match: a content constraint (`OutputConstraint`) or a forced tool call
(`ForcedToolCall`), and their parsing from the `Generate` protobuf (duck-typed: no gRPC, no torch here).

Field names in errors are the proto paths: `constraint.json_schema`, `chat.tool_choice.function`, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from common.errors import InvalidInputError

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar", "lark")
JSON_KINDS: tuple[str, ...] = ("json_schema", "json_object")


@dataclass(frozen=True)
class OutputConstraint:
    """The visible answer is one text block matching `value`: a JSON Schema document (JSON text), any JSON
    object (`value` empty), a regex, an xgrammar EBNF grammar (root rule `root`) or a Lark grammar.
    JSON is compact by default (no whitespace between tokens); `flexible_whitespace` allows any."""

    kind: ConstraintKind
    value: str = ""
    flexible_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInputError(f"constraint: unknown kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "json_object" and self.value:
            raise InvalidInputError("constraint.json_object takes no value")
        if self.kind != "json_object" and not self.value:
            raise InvalidInputError(f"constraint.{self.kind}: is empty")
        if self.flexible_whitespace and self.kind not in JSON_KINDS:
            raise InvalidInputError(
                f"constraint.flexible_whitespace applies to json_schema and json_object, not {self.kind}"
            )

    @property
    def field(self) -> str:
        return f"constraint.{self.kind}"


@dataclass(frozen=True)
class ForcedToolCall:
    """The output is tool calls in the model's tool-call format with arguments valid against the tool's
    parameter schema: exactly one call to `function`, or (None, OpenAI "required") one or more calls to any
    of the declared tools."""

    function: str | None = None

    def __post_init__(self) -> None:
        if self.function is not None and not self.function:
            raise InvalidInputError("chat.tool_choice.function: is empty")

    @property
    def field(self) -> str:
        return "chat.tool_choice" if self.function is None else "chat.tool_choice.function"


Constraint = OutputConstraint | ForcedToolCall


def constraint_from_proto(request: Any) -> Constraint | None:
    """`GenerateRequest.constraint` or `GenerateRequest.chat.tool_choice` -> the native constraint (or None)."""
    output = None
    if request.HasField("constraint"):
        c = request.constraint
        kind = c.WhichOneof("kind")
        if kind is None:
            raise InvalidInputError(f"constraint: set one of {', '.join(KINDS)}")
        value = getattr(c, kind)
        if kind == "json_object":
            if not value:
                raise InvalidInputError("constraint.json_object: must be true when set")
            value = ""
        output = OutputConstraint(kind, value, c.flexible_whitespace)
    tool = None
    if request.WhichOneof("prompt") == "chat" and request.chat.HasField("tool_choice"):
        choice = request.chat.tool_choice
        which = choice.WhichOneof("choice")
        if which is None or (which == "required" and not choice.required):
            raise InvalidInputError("chat.tool_choice: set required=true or a function name")
        tool = ForcedToolCall(choice.function if which == "function" else None)
    if output is not None and tool is not None:
        raise InvalidInputError("constraint and chat.tool_choice are exclusive: a forced tool call is the whole output")
    return output or tool
