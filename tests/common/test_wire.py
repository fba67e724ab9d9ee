"""bf16 and dMel-code payload round trips, chunking and stream corruption."""

import hashlib

import numpy as np
import pytest

from common.wire import (
    CHUNK_BYTES,
    DTYPE_UINT8,
    KIND_DMEL_CODES,
    EncodedItem,
    ItemFailure,
    Span,
    StreamAssembler,
    WireError,
    assemble,
    bf16_bits_to_float32,
    bf16_to_bytes,
    bytes_to_bf16,
    bytes_to_codes,
    codes_to_bytes,
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


def _audio(index: int, frames: int, dim: int = 64, mels: int = 80, seed: int = 0) -> EncodedItem:
    codes = np.random.default_rng(seed).integers(0, 16, size=(frames, mels))
    return EncodedItem(
        item_index=index,
        mm_key=hashlib.sha256(bytes([index, 1])).digest(),
        modality="audio",
        rows=frames,
        dim=dim,
        payload=codes_to_bytes(codes),
        spans=(Span("audio", frames),),
        dtype=DTYPE_UINT8,
        kind=KIND_DMEL_CODES,
        codes_per_row=mels,
        tower_dtype="bfloat16",
    )


def test_dmel_codes_round_trip_beside_bf16_rows():
    """A mixed stream: image rows, audio codes (one byte per mel bin per frame), image rows again."""
    items = [_item(0, 7, 64), _audio(1, 300), _item(2, 3, 64, seed=1)]
    messages = [m for item in items for m in item_messages(item, chunk_bytes=5000)]
    assert messages[2].header.payload_kind == encoder_pb2.PAYLOAD_KIND_DMEL_CODES
    assert messages[2].header.total_bytes == 300 * 80 and messages[2].header.dtype == "uint8"
    assert assemble(messages, expected_items=3) == items
    codes = bytes_to_codes(items[1].payload, 300, 80)
    assert codes.dtype == np.uint8 and codes.max() < 16
    with pytest.raises(WireError, match="expected 240"):
        bytes_to_codes(items[1].payload[:-1], 3, 80)


def _audio_messages() -> list[encoder_pb2.EncodeChunk]:
    return list(item_messages(_audio(0, 100), chunk_bytes=4096))


def test_corrupt_codes_payload_names_the_item():
    messages = _audio_messages()
    payload = bytearray(messages[1].data.payload)
    payload[17] = 200  # a code no tower has: the CRC catches it on the wire
    messages[1].data.payload = bytes(payload)
    with pytest.raises(WireError, match="item 0: checksum mismatch"):
        assemble(messages)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("total_bytes", 100 * 80 * 2, "item 0: total_bytes 16000 does not match dmel_codes of 100 rows"),
        ("codes_per_row", 0, "item 0: dMel codes need codes_per_row >= 1"),
        ("tower_dtype", "", "item 0: dMel codes: unknown tower_dtype ''"),
        ("tower_dtype", "int8", "item 0: dMel codes: unknown tower_dtype 'int8'"),
        ("dtype", "bfloat16", "item 0: unsupported dtype 'bfloat16' for dmel_codes"),
        ("modality", 1, "item 0: dMel codes for a non-audio item"),
        ("payload_kind", 7, "item 0: unknown payload kind 7"),
    ],
)
def test_codes_header_inconsistent_is_rejected(field, value, error):
    messages = _audio_messages()
    setattr(messages[0].header, field, value)
    with pytest.raises(WireError, match=error):
        assemble(messages)


def test_embeddings_header_with_codes_fields_is_rejected():
    messages = _messages()
    messages[0].header.tower_dtype = "float32"
    with pytest.raises(WireError, match="item 0: embeddings carry no codes_per_row/tower_dtype"):
        assemble(messages)


def test_encoded_item_checks_its_payload_kind():
    item = _audio(3, 10)
    with pytest.raises(WireError, match="item 3: payload has 799 bytes, expected 800 for dmel_codes"):
        EncodedItem(**{**item.__dict__, "payload": item.payload[:-1]})
    with pytest.raises(WireError, match="item 3: dmel_codes payload has dtype uint8, not 'bfloat16'"):
        EncodedItem(**{**item.__dict__, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="fit uint8"):
        codes_to_bytes(np.full((2, 80), 256))
