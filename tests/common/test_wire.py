"""bf16 payload round trips, chunking and stream corruption."""

import hashlib

import numpy as np
import pytest

from common.wire import (
    CHUNK_BYTES,
    EncodedItem,
    ItemFailure,
    Span,
    StreamAssembler,
    WireError,
    assemble,
    bf16_bits_to_float32,
    bf16_to_bytes,
    bytes_to_bf16,
    float32_to_bf16_bits,
    item_messages,
)
from proto.inkling_epd.v1 import encoder_pb2


def _item(index: int, rows: int, dim: int, seed: int = 0) -> EncodedItem:
    rng = np.random.default_rng(seed)
    bits = float32_to_bf16_bits(rng.standard_normal((rows, dim)).astype(np.float32))
    return EncodedItem(
        item_index=index,
        mm_key=hashlib.sha256(bytes([index])).digest(),
        modality="image",
        rows=rows,
        dim=dim,
        payload=bf16_to_bytes(bits),
        spans=(Span("image", rows),),
    )


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    values = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 100
    values[:4] = [0.0, -0.0, 1.00390625, 1.01171875]  # exact ties round to even
    ours = float32_to_bf16_bits(values)
    ref = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)
    assert np.array_equal(
        bf16_bits_to_float32(ours), torch.from_numpy(ours.view(np.int16)).view(torch.bfloat16).float().numpy()
    )


def test_payload_is_little_endian_row_major():
    bits = np.array([[0x3F80, 0x4000], [0xC000, 0x0001]], dtype=np.uint16)
    payload = bf16_to_bytes(bits)
    assert payload == bytes([0x80, 0x3F, 0x00, 0x40, 0x00, 0xC0, 0x01, 0x00])
    assert np.array_equal(bytes_to_bf16(payload, 2, 2), bits)
    with pytest.raises(WireError):
        bytes_to_bf16(payload, 3, 2)


def test_round_trip_multi_chunk_items():
    dim = 512
    big_rows = CHUNK_BYTES * 2 // (dim * 2) + 3  # crosses two chunk boundaries
    items = [_item(0, big_rows, dim, 1), _item(1, 1, dim, 2), _item(2, 0, dim, 3)]
    messages = [m for item in items for m in item_messages(item)]
    assert messages[0].header.num_chunks == 3
    assert all(len(m.data.payload) <= CHUNK_BYTES for m in messages if m.HasField("data"))
    assert assemble(messages, expected_items=3) == items


def test_item_error_in_stream():
    messages = list(item_messages(_item(0, 2, 8)))
    messages.append(
        encoder_pb2.EncodeChunk(
            error=encoder_pb2.ItemError(item_index=1, code="INVALID_ARGUMENT", message="item 1: bad")
        )
    )
    out = assemble(messages, expected_items=2)
    assert out[1] == ItemFailure(1, "INVALID_ARGUMENT", "item 1: bad")


def _messages(rows: int = 600, dim: int = 1024) -> list[encoder_pb2.EncodeChunk]:
    return list(item_messages(_item(0, rows, dim)))  # 1.2 MB -> 2 chunks


def test_truncated_stream_is_rejected():
    with pytest.raises(WireError, match="misses data"):
        assemble(_messages()[:-1])
    with pytest.raises(WireError, match="1 of 2 items"):
        assemble(_messages(), expected_items=2)


def test_garbled_payload_is_rejected():
    messages = _messages()
    payload = bytearray(messages[2].data.payload)
    payload[10] ^= 0x01
    messages[2].data.payload = bytes(payload)
    with pytest.raises(WireError, match="checksum"):
        assemble(messages)


def test_long_reordered_and_foreign_chunks_are_rejected():
    messages = _messages()
    extra = encoder_pb2.EncodeChunk()
    extra.CopyFrom(messages[2])
    extra.data.seq = 2
    with pytest.raises(WireError):
        assemble([*messages, extra])
    with pytest.raises(WireError, match="arrived, expected"):
        assemble([messages[0], messages[2], messages[1]])
    wrong = encoder_pb2.EncodeChunk()
    wrong.CopyFrom(messages[1])
    wrong.data.item_index = 5
    asm = StreamAssembler()
    asm.add(messages[0])
    with pytest.raises(WireError, match="inside item"):
        asm.add(wrong)


def test_header_inconsistent_with_shape_or_limit():
    messages = _messages()
    messages[0].header.total_bytes += 2
    with pytest.raises(WireError, match="does not match"):
        assemble(messages)
    with pytest.raises(WireError, match="exceeds the limit"):
        StreamAssembler(max_item_bytes=1000).add(_messages()[0])
