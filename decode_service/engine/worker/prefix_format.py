"""Byte format of the Redis prefix tier's values: a versioned header, then the raw little-endian payload.

See `redis_tier.py` for the keys and what a value holds; a value never passes through pickle."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.wire import checksum
from decode_service.engine.worker.kv_cache import KVCache

FORMAT_VERSION = 1
KIND_GLOBAL = 1  # one block of global-layer KV
KIND_BOUNDARY = 2  # one part of: sliding-window KV + conv states at one boundary
BOUNDARY_PART_BYTES = 16 << 20  # part of the format: every replica must split boundaries the same way
_MAGIC = b"INKP"
# magic, version, kind, dtype code, sha256(fingerprint), 11 geometry u32, position, window blocks, part, parts,
# crc32, payload length
_HEADER = struct.Struct("<4sHBB32s16IQ")
HEADER_BYTES = _HEADER.size
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


class CorruptValueError(ValueError):
    """A stored value does not match what this replica expects at that key."""


@dataclass(frozen=True)
class Geometry:
    """Everything besides the model fingerprint that gives a value's bytes their meaning."""

    dtype_code: int
    page_size: int
    window: int
    num_layers: int
    global_layers: int
    global_kv_heads: int
    global_head_dim: int
    sliding_layers: int
    sliding_kv_heads: int
    sliding_head_dim: int
    hidden_size: int
    conv_len: int

    @classmethod
    def of(cls, cache: KVCache) -> Geometry:
        config = cache.config
        n_sliding = sum(sliding for sliding, _ in cache.layer_kind)
        g, s = config.geometry(False), config.geometry(True)
        return cls(
            *(_DTYPE_CODES[cache.spec.dtype], cache.page_size, cache.window, config.num_layers),
            *(config.num_layers - n_sliding, g.num_kv_heads, g.head_dim),
            *(n_sliding, s.num_kv_heads, s.head_dim),
            *(config.hidden_size, config.conv_kernel_size - 1),
        )

    @property
    def fields(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.__dataclass_fields__)[1:]


@dataclass(frozen=True)
class ValueId:
    """What a value must be (besides the model and geometry); checked against its header."""

    kind: int
    position: int  # block index (global) or boundary in tokens
    window_blocks: int = 0
    part: int = 0
    num_parts: int = 1


def encode_value(vid: ValueId, fingerprint: bytes, geometry: Geometry, payload: bytes | memoryview) -> bytes:
    """Header + payload; the fingerprint is stored as its SHA-256."""
    ids = (vid.position, vid.window_blocks, vid.part, vid.num_parts)
    fp = hashlib.sha256(fingerprint).digest()
    header = _HEADER.pack(
        _MAGIC,
        FORMAT_VERSION,
        vid.kind,
        geometry.dtype_code,
        fp,
        *geometry.fields,
        *ids,
        checksum(payload),
        len(payload),
    )
    return header + payload


def decode_value(value: bytes, vid: ValueId, fingerprint: bytes, geometry: Geometry, payload_bytes: int) -> memoryview:
    """The payload of a value after every header field and the checksum matched; else `CorruptValueError`."""
    if len(value) < _HEADER.size:
        raise CorruptValueError(f"value of {len(value)} bytes is shorter than the header")
    magic, version, kind, dtype_code, fp, *rest = _HEADER.unpack_from(value)
    geo, ids, (crc, length) = tuple(rest[:11]), tuple(rest[11:15]), rest[15:]
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise CorruptValueError(f"unknown magic/version {magic!r}/{version}")
    if fp != hashlib.sha256(fingerprint).digest():
        raise CorruptValueError("model fingerprint mismatch")
    if (kind, dtype_code, geo) != (vid.kind, geometry.dtype_code, geometry.fields):
        raise CorruptValueError(f"kind/dtype/geometry {kind}/{dtype_code}/{geo}, expected {vid.kind}/{geometry}")
    if ids + (length,) != (vid.position, vid.window_blocks, vid.part, vid.num_parts, payload_bytes):
        raise CorruptValueError(f"position/blocks/part/parts/length {ids}/{length}, expected {vid}/{payload_bytes}")
    payload = memoryview(value)[_HEADER.size :]
    if len(payload) != payload_bytes or checksum(payload) != crc:
        raise CorruptValueError("payload length or checksum mismatch")
    return payload


def part_sizes(total: int) -> list[int]:
    """How a boundary payload of `total` bytes is split into values."""
    return [min(BOUNDARY_PART_BYTES, total - offset) for offset in range(0, total, BOUNDARY_PART_BYTES)]


def to_bytes(tensors: Sequence[torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
