"""Media items in native form and their protobuf conversion: the contract between the decode side (which
receives media in `GenerateRequest`s and forwards them to encoders) and the encoder (which preprocesses them).

`media_from_proto` is the one edge parser of `inkling_epd.v1.MediaItem` (both servers use it);
`media_to_proto` is its inverse (the encoder client sends what the decode server received). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import InvalidInputError
from common.wire import WireError, modality_from_proto, modality_to_proto
from proto.inkling_epd.v1 import media_pb2

_RESCALE_FROM_PROTO = {
    media_pb2.RESCALE_POLICY_SERVER_DEFAULT: "default",
    media_pb2.RESCALE_POLICY_NONE: "none",
    media_pb2.RESCALE_POLICY_LONG_EDGE: "long_edge",
}
_RESCALE_TO_PROTO = {v: k for k, v in _RESCALE_FROM_PROTO.items()}


@dataclass(frozen=True)
class ImageOptions:
    rescale: str = "default"  # "default" (server policy), "none", "long_edge"
    rescale_frac: float | None = None  # long_edge: overrides the server factor
    rescale_max_long_edge: int | None = None  # long_edge: overrides the server growth cap


@dataclass(frozen=True)
class VideoOptions:
    fps: float | None = None  # None: the server's policy
    max_frames: int | None = None
    include_audio: bool | None = None
    frame: ImageOptions = field(default_factory=ImageOptions)


@dataclass(frozen=True)
class MediaInput:
    modality: str  # "image", "audio", "video"
    data: bytes
    image: ImageOptions | None = None
    video: VideoOptions | None = None


def media_modality(value: int, where: str) -> str:
    """A `Modality` enum value -> "image" / "audio" / "video"; unset or unknown raises naming `where`."""
    try:
        return modality_from_proto(value)
    except WireError:
        raise InvalidInputError(f"{where}: modality is not set or unknown ({value})") from None


def _image_options(params: media_pb2.ImageParams) -> ImageOptions:
    return ImageOptions(
        rescale=_RESCALE_FROM_PROTO.get(params.rescale_policy, f"enum value {params.rescale_policy}"),
        rescale_frac=params.rescale_frac if params.HasField("rescale_frac") else None,
        rescale_max_long_edge=(params.rescale_max_long_edge if params.HasField("rescale_max_long_edge") else None),
    )


def media_from_proto(index: int, item: media_pb2.MediaItem) -> MediaInput:
    """A `MediaItem` -> `MediaInput`; malformed items raise `InvalidInputError` naming `item {index}`."""
    modality = media_modality(item.modality, f"item {index}")
    if item.WhichOneof("source") != "data":
        raise InvalidInputError(f"item {index} ({modality}): no media data")
    params = item.WhichOneof("params")
    if params is not None and params != modality:
        raise InvalidInputError(f"item {index} ({modality}): {params} parameters do not match the modality")
    image = _image_options(item.image) if params == "image" else None
    video = None
    if params == "video":
        v = item.video
        video = VideoOptions(
            fps=v.fps if v.HasField("fps") else None,
            max_frames=v.max_frames if v.HasField("max_frames") else None,
            include_audio=v.include_audio if v.HasField("include_audio") else None,
            frame=_image_options(v.frame),
        )
    return MediaInput(modality=modality, data=item.data, image=image, video=video)


def media_to_proto(item: MediaInput) -> media_pb2.MediaItem:
    """`MediaInput` -> `MediaItem` (the inverse of `media_from_proto`)."""
    msg = media_pb2.MediaItem(modality=modality_to_proto(item.modality), data=item.data)
    if item.image is not None:
        msg.image.CopyFrom(_image_params(item.image))
    if item.video is not None:
        v = item.video
        msg.video.SetInParent()
        if v.fps is not None:
            msg.video.fps = v.fps
        if v.max_frames is not None:
            msg.video.max_frames = v.max_frames
        if v.include_audio is not None:
            msg.video.include_audio = v.include_audio
        msg.video.frame.CopyFrom(_image_params(v.frame))
    return msg


def _image_params(options: ImageOptions) -> media_pb2.ImageParams:
    params = media_pb2.ImageParams(rescale_policy=_RESCALE_TO_PROTO[options.rescale])
    if options.rescale_frac is not None:
        params.rescale_frac = options.rescale_frac
    if options.rescale_max_long_edge is not None:
        params.rescale_max_long_edge = options.rescale_max_long_edge
    return params
