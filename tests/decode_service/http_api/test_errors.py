"""gRPC status -> HTTP status and OpenAI error JSON, in one table."""

from __future__ import annotations

import grpc
import pytest

from decode_service.http_api.errors import from_grpc


@pytest.mark.parametrize(
    "code, details, status, error_code",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: out of range", 400, "invalid_argument"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy: 9 requests in flight", 429, "resource_exhausted"),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "prompt: 900 tokens exceeds the limit of 512",
            400,
            "context_length_exceeded",
        ),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "decode replica 10.0.0.7:50051: RESOURCE_EXHAUSTED: prompt: 900 tokens exceeds the limit of 512",
            400,
            "context_length_exceeded",
        ),
        (grpc.StatusCode.UNAVAILABLE, "no healthy decode replica", 503, "unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", 504, "deadline_exceeded"),
        (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token", 401, "unauthenticated"),
        (grpc.StatusCode.INTERNAL, "internal error: KeyError", 500, "internal"),
    ],
)
def test_status_mapping(code, details, status, error_code):
    error = from_grpc(code, details)
    body = error.body()["error"]
    assert (error.status, body["code"]) == (status, error_code)
    assert set(body) == {"message", "type", "param", "code"} and details in body["message"]


def test_media_errors_name_the_openai_part():
    paths = ("messages[0].content[0]", "messages[2].content[1]")
    error = from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "media[1] (audio): cannot decode", paths)
    assert error.param == "messages[2].content[1]"
    assert error.message == "messages[2].content[1]: media[1] (audio): cannot decode"
