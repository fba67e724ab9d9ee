from proto.inkling_epd.v1 import media_pb2 as _media_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_EMBEDDINGS: _ClassVar[PayloadKind]
    PAYLOAD_KIND_DMEL_CODES: _ClassVar[PayloadKind]
PAYLOAD_KIND_EMBEDDINGS: PayloadKind
PAYLOAD_KIND_DMEL_CODES: PayloadKind

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items", "expected_encoder_fingerprint", "continue_on_item_error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ENCODER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_ON_ITEM_ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[_media_pb2.MediaItem]
    expected_encoder_fingerprint: bytes
    continue_on_item_error: bool
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[_media_pb2.MediaItem, _Mapping]]] = ..., expected_encoder_fingerprint: _Optional[bytes] = ..., continue_on_item_error: _Optional[bool] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("modality", "rows")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    modality: _media_pb2.Modality
    rows: int
    def __init__(self, modality: _Optional[_Union[_media_pb2.Modality, str]] = ..., rows: _Optional[int] = ...) -> None: ...

class ItemHeader(_message.Message):
    __slots__ = ("item_index", "mm_key", "modality", "rows", "dim", "dtype", "total_bytes", "num_chunks", "checksum", "spans", "cache_hit", "payload_kind", "codes_per_row", "tower_dtype")
    ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    MM_KEY_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KIND_FIELD_NUMBER: _ClassVar[int]
    CODES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    TOWER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    item_index: int
    mm_key: bytes
    modality: _media_pb2.Modality
    rows: int
    dim: int
    dtype: str
    total_bytes: int
    num_chunks: int
    checksum: int
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    cache_hit: bool
    payload_kind: PayloadKind
    codes_per_row: int
    tower_dtype: str
    def __init__(self, item_index: _Optional[int] = ..., mm_key: _Optional[bytes] = ..., modality: _Optional[_Union[_media_pb2.Modality, str]] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., checksum: _Optional[int] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., cache_hit: _Optional[bool] = ..., payload_kind: _Optional[_Union[PayloadKind, str]] = ..., codes_per_row: _Optional[int] = ..., tower_dtype: _Optional[str] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("item_index", "seq", "payload")
    ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    item_index: int
    seq: int
    payload: bytes
    def __init__(self, item_index: _Optional[int] = ..., seq: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("item_index", "code", "message")
    ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    item_index: int
    code: str
    message: str
    def __init__(self, item_index: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class EncodeChunk(_message.Message):
    __slots__ = ("header", "data", "error")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    header: ItemHeader
    data: DataChunk
    error: ItemError
    def __init__(self, header: _Optional[_Union[ItemHeader, _Mapping]] = ..., data: _Optional[_Union[DataChunk, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class EncoderInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncoderInfo(_message.Message):
    __slots__ = ("encoder_fingerprint", "model_id", "dim", "dtype", "modalities", "max_items_per_request", "max_item_bytes", "max_batch_tokens", "inflight_items")
    ENCODER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_ITEMS_FIELD_NUMBER: _ClassVar[int]
    encoder_fingerprint: bytes
    model_id: str
    dim: int
    dtype: str
    modalities: _containers.RepeatedScalarFieldContainer[_media_pb2.Modality]
    max_items_per_request: int
    max_item_bytes: int
    max_batch_tokens: int
    inflight_items: int
    def __init__(self, encoder_fingerprint: _Optional[bytes] = ..., model_id: _Optional[str] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., modalities: _Optional[_Iterable[_Union[_media_pb2.Modality, str]]] = ..., max_items_per_request: _Optional[int] = ..., max_item_bytes: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., inflight_items: _Optional[int] = ...) -> None: ...
