from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]

class RescalePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESCALE_POLICY_SERVER_DEFAULT: _ClassVar[RescalePolicy]
    RESCALE_POLICY_NONE: _ClassVar[RescalePolicy]
    RESCALE_POLICY_LONG_EDGE: _ClassVar[RescalePolicy]
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_AUDIO: Modality
MODALITY_VIDEO: Modality
RESCALE_POLICY_SERVER_DEFAULT: RescalePolicy
RESCALE_POLICY_NONE: RescalePolicy
RESCALE_POLICY_LONG_EDGE: RescalePolicy

class ImageParams(_message.Message):
    __slots__ = ("rescale_policy", "rescale_frac", "rescale_max_long_edge")
    RESCALE_POLICY_FIELD_NUMBER: _ClassVar[int]
    RESCALE_FRAC_FIELD_NUMBER: _ClassVar[int]
    RESCALE_MAX_LONG_EDGE_FIELD_NUMBER: _ClassVar[int]
    rescale_policy: RescalePolicy
    rescale_frac: float
    rescale_max_long_edge: int
    def __init__(self, rescale_policy: _Optional[_Union[RescalePolicy, str]] = ..., rescale_frac: _Optional[float] = ..., rescale_max_long_edge: _Optional[int] = ...) -> None: ...

class AudioParams(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VideoParams(_message.Message):
    __slots__ = ("fps", "max_frames", "include_audio", "frame")
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_AUDIO_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    fps: float
    max_frames: int
    include_audio: bool
    frame: ImageParams
    def __init__(self, fps: _Optional[float] = ..., max_frames: _Optional[int] = ..., include_audio: _Optional[bool] = ..., frame: _Optional[_Union[ImageParams, _Mapping]] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("modality", "data", "image", "audio", "video")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    modality: Modality
    data: bytes
    image: ImageParams
    audio: AudioParams
    video: VideoParams
    def __init__(self, modality: _Optional[_Union[Modality, str]] = ..., data: _Optional[bytes] = ..., image: _Optional[_Union[ImageParams, _Mapping]] = ..., audio: _Optional[_Union[AudioParams, _Mapping]] = ..., video: _Optional[_Union[VideoParams, _Mapping]] = ...) -> None: ...
