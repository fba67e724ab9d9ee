"""Client-chosen request ids travel into logs, metrics and other services: bound them before anything uses them."""

from __future__ import annotations

from common.errors import InvalidInputError

MAX_REQUEST_ID_LENGTH = 128


def check_request_id(value: str, field: str = "request_id") -> str:
    """`value` if it is printable ASCII of at most 128 characters (empty is allowed: the server picks one)."""
    if len(value) > MAX_REQUEST_ID_LENGTH:
        raise InvalidInputError(f"{field}: {len(value)} characters, at most {MAX_REQUEST_ID_LENGTH} allowed")
    if not (value.isascii() and value.isprintable()):
        raise InvalidInputError(f"{field}: only printable ASCII characters are allowed, got {value[:32]!r}")
    return value
