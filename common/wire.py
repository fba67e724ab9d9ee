"""Encoder outputs on the wire: raw little-endian bf16 payloads or dMel codes, <= 1 MiB chunks, CRC-32.

An encoded item is either a row-major `[rows, dim]` bf16 tensor carried as raw little-endian bytes (no pickle,
no base64), or, for an audio clip, its dMel codes `[rows, codes_per_row]` uint8 (`KIND_DMEL_CODES`: the audio
tower is a codebook sum, which the decode replica does itself; 80 bytes a frame instead of `2 * dim`), plus the
placeholder spans it fills; `dim` is always the width of the rows the item becomes. On an `Encode` stream it
becomes one `ItemHeader` followed by `DataChunk`s; `item_messages` writes that sequence and `StreamAssembler`
reads it back, rejecting short, long, reordered or garbled streams with `WireError`. The checksum is
`zlib.crc32` of the whole payload.

Tensors here are numpy arrays of bf16 bit patterns (`uint16`); converting to a torch tensor is a one-liner
left to engine code (`torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).view(rows, dim)`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from common.errors import InklingError
from common.settings import DTYPE_NAMES
from proto.inkling_epd.v1 import encoder_pb2, media_pb2

DTYPE_BF16 = "bfloat16"
DTYPE_UINT8 = "uint8"
BF16_BYTES = 2
KIND_EMBEDDINGS = "embeddings"  # bf16 rows [rows, dim]
KIND_DMEL_CODES = "dmel_codes"  # uint8 codes [rows, codes_per_row]; `tower_dtype` says how to sum them
TOWER_DTYPES = DTYPE_NAMES  # the compute dtypes an audio tower may run in
CHUNK_BYTES = 1 << 20  # upper bound of one DataChunk payload

_MODALITY_TO_PROTO = {
    "image": media_pb2.MODALITY_IMAGE,
    "audio": media_pb2.MODALITY_AUDIO,
    "video": media_pb2.MODALITY_VIDEO,
}
_MODALITY_FROM_PROTO = {v: k for k, v in _MODALITY_TO_PROTO.items()}
_KIND_TO_PROTO = {
    KIND_EMBEDDINGS: encoder_pb2.PAYLOAD_KIND_EMBEDDINGS,
    KIND_DMEL_CODES: encoder_pb2.PAYLOAD_KIND_DMEL_CODES,
}
_KIND_FROM_PROTO = {v: k for k, v in _KIND_TO_PROTO.items()}


class WireError(InklingError):
    """A received payload or stream is malformed (wrong size, order, checksum or item)."""


def checksum(payload: bytes | memoryview) -> int:
    """CRC-32 (zlib, ISO-HDLC polynomial) of a payload, as an unsigned 32-bit integer."""
    return zlib.crc32(payload) & 0xFFFFFFFF


def modality_to_proto(modality: str) -> int:
    return _MODALITY_TO_PROTO[modality]


def modality_from_proto(value: int) -> str:
    try:
        return _MODALITY_FROM_PROTO[value]
    except KeyError:
        raise WireError(f"unknown modality enum value {value}") from None


# ----------------------------------------------------------------------------------------------------------
# bf16 payloads


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16) with round-to-nearest-even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(values)
    return np.where(nan, (bits >> 16) | 0x0040, rounded).astype(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_to_bytes(bits: np.ndarray) -> bytes:
    """`[rows, dim]` bf16 bit patterns -> raw little-endian bytes."""
    if bits.dtype.kind != "u" or bits.dtype.itemsize != BF16_BYTES or bits.ndim != 2:
        raise ValueError(f"expected a 2-D uint16 array of bf16 bits, got {bits.dtype} {bits.shape}")
    return np.ascontiguousarray(bits, dtype="<u2").tobytes()


def bytes_to_bf16(payload: bytes | memoryview, rows: int, dim: int) -> np.ndarray:
    """Raw little-endian bytes -> read-only `[rows, dim]` uint16 view of bf16 bit patterns."""
    expected = rows * dim * BF16_BYTES
    if len(payload) != expected:
        raise WireError(f"payload has {len(payload)} bytes, expected {expected} for [{rows}, {dim}] bf16")
    return np.frombuffer(payload, dtype="<u2").reshape(rows, dim)


def payload_layout(kind: str, rows: int, dim: int, codes_per_row: int, tower_dtype: str) -> tuple[str, int]:
    """(element dtype, payload bytes) of an item; raises `WireError` for an inconsistent description."""
    if kind == KIND_EMBEDDINGS:
        if codes_per_row or tower_dtype:
            raise WireError(f"embeddings carry no codes_per_row/tower_dtype (got {codes_per_row}, {tower_dtype!r})")
        return DTYPE_BF16, rows * dim * BF16_BYTES
    if kind == KIND_DMEL_CODES:
        if codes_per_row < 1:
            raise WireError(f"dMel codes need codes_per_row >= 1, got {codes_per_row}")
        if tower_dtype not in TOWER_DTYPES:
            raise WireError(f"dMel codes: unknown tower_dtype {tower_dtype!r} (expected one of {TOWER_DTYPES})")
        return DTYPE_UINT8, rows * codes_per_row
    raise WireError(f"unknown payload kind {kind!r}")


def codes_to_bytes(codes: np.ndarray) -> bytes:
    """`[rows, codes_per_row]` dMel codes (any integer dtype, values 0..255) -> uint8 bytes."""
    if codes.ndim != 2 or codes.dtype.kind not in "iu":
        raise ValueError(f"expected a 2-D integer array of dMel codes, got {codes.dtype} {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() > 255):
        raise ValueError(f"dMel codes must fit uint8, got range [{codes.min()}, {codes.max()}]")
    return np.ascontiguousarray(codes, dtype=np.uint8).tobytes()


def bytes_to_codes(payload: bytes | memoryview, rows: int, codes_per_row: int) -> np.ndarray:
    """uint8 bytes -> read-only `[rows, codes_per_row]` uint8 view."""
    if len(payload) != rows * codes_per_row:
        raise WireError(
            f"payload has {len(payload)} bytes, expected {rows * codes_per_row} for [{rows}, {codes_per_row}] codes"
        )
    return np.frombuffer(payload, dtype=np.uint8).reshape(rows, codes_per_row)


# ----------------------------------------------------------------------------------------------------------
# Items and chunking


@dataclass(frozen=True)
class Span:
    """One run of placeholder tokens: an image (or video frame) or an audio clip (or video audio track)."""

    modality: str  # "image" or "audio"
    rows: int


@dataclass(frozen=True)
class EncodedItem:
    """The tower output (or, for audio, the tower input) of one media item, ready to be scattered into a prompt."""

    item_index: int
    mm_key: bytes
    modality: str  # the item's modality ("image", "audio", "video")
    rows: int
    dim: int  # width of the rows the item becomes
    payload: bytes  # raw little-endian bf16 [rows, dim], or uint8 codes [rows, codes_per_row]
    spans: tuple[Span, ...]
    cache_hit: bool = False
    dtype: str = DTYPE_BF16
    kind: str = KIND_EMBEDDINGS
    codes_per_row: int = 0  # KIND_DMEL_CODES: the audio tower's n_mel_bins
    tower_dtype: str = ""  # KIND_DMEL_CODES: the dtype the encoder's audio tower computes in

    def __post_init__(self) -> None:
        try:
            dtype, nbytes = payload_layout(self.kind, self.rows, self.dim, self.codes_per_row, self.tower_dtype)
        except WireError as exc:
            raise WireError(f"item {self.item_index}: {exc}") from None
        if self.dtype != dtype:
            raise WireError(f"item {self.item_index}: {self.kind} payload has dtype {dtype}, not {self.dtype!r}")
        if len(self.payload) != nbytes:
            raise WireError(
                f"item {self.item_index}: payload has {len(self.payload)} bytes, expected {nbytes} for {self.kind} "
                f"of {self.rows} rows"
            )
        if sum(s.rows for s in self.spans) != self.rows:
            raise WireError(
                f"item {self.item_index}: spans cover {sum(s.rows for s in self.spans)} rows, tensor has {self.rows}"
            )


def split_chunks(payload: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    """Zero-copy views of at most `chunk_bytes` each, covering the payload in order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    view = memoryview(payload)
    return [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]


def item_messages(item: EncodedItem, chunk_bytes: int = CHUNK_BYTES) -> Iterator[encoder_pb2.EncodeChunk]:
    """One `ItemHeader` then the `DataChunk`s of an item."""
    chunks = split_chunks(item.payload, chunk_bytes)
    header = encoder_pb2.ItemHeader(
        item_index=item.item_index,
        mm_key=item.mm_key,
        modality=modality_to_proto(item.modality),
        rows=item.rows,
        dim=item.dim,
        dtype=item.dtype,
        total_bytes=len(item.payload),
        num_chunks=len(chunks),
        checksum=checksum(item.payload),
        cache_hit=item.cache_hit,
        payload_kind=_KIND_TO_PROTO[item.kind],
        codes_per_row=item.codes_per_row,
        tower_dtype=item.tower_dtype,
        spans=[encoder_pb2.Span(modality=modality_to_proto(s.modality), rows=s.rows) for s in item.spans],
    )
    yield encoder_pb2.EncodeChunk(header=header)
    for seq, chunk in enumerate(chunks):
        yield encoder_pb2.EncodeChunk(
            data=encoder_pb2.DataChunk(item_index=item.item_index, seq=seq, payload=bytes(chunk))
        )


@dataclass(frozen=True)
class ItemFailure:
    """An `ItemError` received in place of an item (only with `continue_on_item_error`)."""

    item_index: int
    code: str
    message: str


class StreamAssembler:
    """Rebuilds `EncodedItem`s from `EncodeChunk` messages, verifying order, sizes and checksums.

    Feed messages with `add`; it returns a finished item (or `ItemFailure`) when one completes, else None.
    `finish` checks that no item is left half-received and that `expected_items` (if given) all arrived.
    """

    def __init__(self, expected_items: int | None = None, max_item_bytes: int | None = None) -> None:
        self.expected_items = expected_items
        self.max_item_bytes = max_item_bytes
        self._header: encoder_pb2.ItemHeader | None = None
        self._parts: list[bytes] = []
        self._received = 0
        self._next_index = 0

    def add(self, message: encoder_pb2.EncodeChunk) -> EncodedItem | ItemFailure | None:
        kind = message.WhichOneof("part")
        if kind == "header":
            return self._start(message.header)
        if kind == "data":
            return self._data(message.data)
        if kind == "error":
            self._expect_no_open_item("an ItemError")
            self._check_index(message.error.item_index)
            self._next_index += 1
            return ItemFailure(message.error.item_index, message.error.code, message.error.message)
        raise WireError("empty EncodeChunk (no header, data or error)")

    def _check_index(self, index: int) -> None:
        if index != self._next_index:
            raise WireError(f"expected item {self._next_index}, got item {index}")
        if self.expected_items is not None and index >= self.expected_items:
            raise WireError(f"item {index} beyond the {self.expected_items} requested")

    def _expect_no_open_item(self, what: str) -> None:
        if self._header is not None:
            raise WireError(
                f"{what} arrived while item {self._header.item_index} still misses data "
                f"({self._received} of {self._header.total_bytes} bytes)"
            )

    def _start(self, header: encoder_pb2.ItemHeader) -> EncodedItem | None:
        self._expect_no_open_item(f"header of item {header.item_index}")
        self._check_index(header.item_index)
        if header.payload_kind not in _KIND_FROM_PROTO:
            raise WireError(f"item {header.item_index}: unknown payload kind {header.payload_kind}")
        kind = _KIND_FROM_PROTO[header.payload_kind]
        try:
            dtype, expected = payload_layout(kind, header.rows, header.dim, header.codes_per_row, header.tower_dtype)
        except WireError as exc:
            raise WireError(f"item {header.item_index}: {exc}") from None
        if header.dtype != dtype:
            raise WireError(f"item {header.item_index}: unsupported dtype {header.dtype!r} for {kind}")
        if kind == KIND_DMEL_CODES and header.modality != media_pb2.MODALITY_AUDIO:
            raise WireError(f"item {header.item_index}: dMel codes for a non-audio item")
        if header.total_bytes != expected:
            raise WireError(
                f"item {header.item_index}: total_bytes {header.total_bytes} does not match {kind} of "
                f"{header.rows} rows ({expected})"
            )
        if self.max_item_bytes is not None and header.total_bytes > self.max_item_bytes:
            raise WireError(
                f"item {header.item_index}: {header.total_bytes} bytes exceeds the limit {self.max_item_bytes}"
            )
        if len(header.mm_key) != 32:
            raise WireError(f"item {header.item_index}: mm_key has {len(header.mm_key)} bytes, expected 32")
        self._header, self._parts, self._received = header, [], 0
        return self._complete() if header.total_bytes == 0 else None

    def _data(self, chunk: encoder_pb2.DataChunk) -> EncodedItem | None:
        header = self._header
        if header is None:
            raise WireError(f"data chunk of item {chunk.item_index} without a header")
        if chunk.item_index != header.item_index:
            raise WireError(f"data chunk of item {chunk.item_index} inside item {header.item_index}")
        if chunk.seq != len(self._parts):
            raise WireError(f"item {header.item_index}: chunk {chunk.seq} arrived, expected {len(self._parts)}")
        if not chunk.payload or len(chunk.payload) > CHUNK_BYTES:
            raise WireError(f"item {header.item_index}: chunk {chunk.seq} has {len(chunk.payload)} bytes")
        self._received += len(chunk.payload)
        if self._received > header.total_bytes:
            raise WireError(
                f"item {header.item_index}: {self._received} bytes received, header says {header.total_bytes}"
            )
        self._parts.append(chunk.payload)
        return self._complete() if self._received == header.total_bytes else None

    def _complete(self) -> EncodedItem:
        header = self._header
        assert header is not None
        payload = b"".join(self._parts)
        num_parts = len(self._parts)
        self._header, self._parts, self._received = None, [], 0
        if num_parts != header.num_chunks:
            raise WireError(f"item {header.item_index}: {num_parts} chunks received, header says {header.num_chunks}")
        if checksum(payload) != header.checksum:
            raise WireError(f"item {header.item_index}: checksum mismatch (payload garbled)")
        self._next_index += 1
        spans = tuple(Span(modality_from_proto(s.modality), s.rows) for s in header.spans)
        return EncodedItem(
            item_index=header.item_index,
            mm_key=header.mm_key,
            modality=modality_from_proto(header.modality),
            rows=header.rows,
            dim=header.dim,
            payload=payload,
            spans=spans,
            cache_hit=header.cache_hit,
            dtype=header.dtype,
            kind=_KIND_FROM_PROTO[header.payload_kind],
            codes_per_row=header.codes_per_row,
            tower_dtype=header.tower_dtype,
        )

    def finish(self) -> None:
        """Call at end of stream: raises if an item was cut short or requested items are missing."""
        self._expect_no_open_item("end of stream")
        if self.expected_items is not None and self._next_index != self.expected_items:
            raise WireError(f"stream ended after {self._next_index} of {self.expected_items} items")


def assemble(
    messages: Iterable[encoder_pb2.EncodeChunk],
    expected_items: int | None = None,
) -> list[EncodedItem | ItemFailure]:
    """Assemble a complete (already received) stream."""
    assembler = StreamAssembler(expected_items)
    out = [item for item in (assembler.add(m) for m in messages) if item is not None]
    assembler.finish()
    return out
