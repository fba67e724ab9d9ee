"""OpenAI's error JSON, and the one mapping from upstream gRPC status codes to HTTP statuses."""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc

# OpenAI's error `type` per HTTP status (what the official SDKs switch on is the status itself).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_server_error",
    501: "not_implemented",
    503: "service_unavailable",
    504: "timeout",
}

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "internal_server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_request(param: str, problem: str) -> ApiError:
    """400 whose message starts with the offending field, e.g. `max_tokens: must be >= 1, got -1`."""
    return ApiError(400, f"{param}: {problem}", param=param)


# Upstream messages start with the field they are about, possibly behind the router's "replica ...: CODE: ".
_TOO_LONG_PROMPT = re.compile(r"(^|: )prompt: \d+ tokens|prompt tokens leave no room")
_MEDIA_ITEM = re.compile(r"(?:^|: )media\[(\d+)\]")


def _too_long_prompt(details: str) -> bool:
    return _TOO_LONG_PROMPT.search(details) is not None


def from_grpc(code: grpc.StatusCode, details: str | None, media_paths: Sequence[str] = ()) -> ApiError:
    """The upstream's status -> HTTP. RESOURCE_EXHAUSTED is 429 (busy: retry later) except for a prompt
    too long for the budget, which no retry fixes: 400 `context_length_exceeded`. An upstream message about
    `media[N]` is prefixed with the OpenAI path of that item (`media_paths[N]`, e.g. messages[0].content[1])."""
    details = details or code.name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _too_long_prompt(details):
        return ApiError(400, details, code="context_length_exceeded")
    status = _HTTP_STATUS.get(code, 500)
    param = None
    match = _MEDIA_ITEM.search(details)
    if match and int(match.group(1)) < len(media_paths):
        param = media_paths[int(match.group(1))]
        details = f"{param}: {details}"
    return ApiError(status, details, param=param, code=code.name.lower())
