"""Content keys for multimodal items (`mm_key`) and the encoder fingerprint they include.

`mm_key` = SHA-256 over a framed encoding of (format version, modality, media bytes, preprocessing
parameters, encoder fingerprint). Framing gives every value a one-byte type tag and an 8-byte little-endian
length, mappings are written with their keys sorted by encoded key, so no two different inputs share an
encoding: `b"ab" + b"c"` differs from `b"a" + b"bc"`, 30x100 differs from 100x30, the int 1 differs from the
float 1.0, the string "1" and the bytes b"1". The full 32-byte digest is used everywhere (serving spec
sections 2 and 3.3).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any

MM_KEY_VERSION = "inkling-epd/mm_key/v1"
ENCODER_FINGERPRINT_VERSION = "inkling-epd/encoder_fingerprint/v1"
MODALITIES = ("image", "audio", "video")
MM_KEY_BYTES = 32

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _BYTES, _LIST, _MAP = (bytes([t]) for t in range(1, 10))


def _frame(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def canonical_encoding(value: Any) -> bytes:
    """Self-delimiting, type-tagged encoding of plain data (None, bool, int, float, str, bytes, list,
    dict)."""
    if value is None:
        return _frame(_NONE, b"")
    if isinstance(value, bool):
        return _frame(_TRUE if value else _FALSE, b"")
    if isinstance(value, int):
        return _frame(_INT, str(value).encode())
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot hash a non-finite float ({value!r})")
        return _frame(_FLOAT, struct.pack("<d", value))
    if isinstance(value, str):
        return _frame(_STR, value.encode("utf-8"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _frame(_BYTES, bytes(value))
    if isinstance(value, (list, tuple)):
        return _frame(_LIST, struct.pack("<Q", len(value)) + b"".join(canonical_encoding(v) for v in value))
    if isinstance(value, Mapping):
        items = sorted((canonical_encoding(k), canonical_encoding(v)) for k, v in value.items())
        return _frame(_MAP, struct.pack("<Q", len(items)) + b"".join(k + v for k, v in items))
    raise TypeError(f"cannot hash a value of type {type(value).__name__}")


def _digest(parts: Iterable[Any]) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(canonical_encoding(part))
    return h.digest()


def mm_key(
    modality: str,
    media_bytes: bytes | memoryview,
    preprocess_fingerprint: Mapping[str, Any],
    encoder_fingerprint: bytes,
) -> bytes:
    """The 32-byte content key of one media item.

    `preprocess_fingerprint` holds every parameter that changes the tower input (resize policy, patch
    size, normalisation, frame sampling, audio resampler, code version ...); limits that only accept or
    reject do not belong in it. `encoder_fingerprint` identifies the tower weights and config (see
    `encoder_fingerprint`).
    """
    if modality not in MODALITIES:
        raise ValueError(f"unknown modality {modality!r}; expected one of {MODALITIES}")
    if len(encoder_fingerprint) != MM_KEY_BYTES:
        raise ValueError(f"encoder fingerprint must be {MM_KEY_BYTES} bytes, got {len(encoder_fingerprint)}")
    return _digest((MM_KEY_VERSION, modality, media_bytes, dict(preprocess_fingerprint), encoder_fingerprint))


def tensor_digest(dtype: str, shape: Iterable[int], data: bytes | memoryview) -> bytes:
    """SHA-256 of one weight tensor: its dtype name, shape and raw bytes (framed, so shape changes count)."""
    return _digest(("tensor", dtype, [int(d) for d in shape], data))


def encoder_fingerprint(config_fields: Mapping[str, Any], tensor_digests: Mapping[str, bytes]) -> bytes:
    """32 bytes identifying an encoder: tower config (plain data) and the digest of every tower tensor.

    Any change of weights, config or (through `config_fields`) code version yields a new fingerprint and
    thereby new `mm_key`s, so stale cached embeddings are never served.
    """
    return _digest((ENCODER_FINGERPRINT_VERSION, dict(config_fields), dict(tensor_digests)))
