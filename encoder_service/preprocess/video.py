"""Video bytes -> sampled frames as image items (+ the audio track as an audio item), spec multimodal section 4.

No reference stack implements Inkling video; this follows the recommended extension: frames sampled with the
SGLang formula, each frame sent through the image path as its own still image (T=2 duplicate, no timestamps).
Unvalidated for model quality.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import av
import numpy as np

from common.errors import InvalidInputError
from encoder_service.preprocess.audio import AudioPolicy, av_reason, preprocess_audio
from encoder_service.preprocess.image import ImagePatches, ImagePolicy, preprocess_pil

# Demuxers of single pictures: FFmpeg opens a PNG or JPEG as a one-frame "video"; refuse it as one.
STILL_IMAGE_FORMATS = frozenset({"image2"})  # and every "*_pipe" image demuxer (png_pipe, jpeg_pipe, ...)


@dataclass(frozen=True)
class VideoPolicy:
    fps: float = 1.0  # desired sampling rate; never above the source rate
    max_frames: int = 32  # sampled frames per video
    include_audio: bool = True
    max_seconds: float = 600.0
    max_source_frames: int = 108_000  # frames in the container (bounds demuxing work)
    max_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fps) and self.fps > 0):
            raise InvalidInputError(f"VideoPolicy.fps must be finite and > 0, got {self.fps}")
        for name in ("max_frames", "max_source_frames", "max_bytes"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"VideoPolicy.{name} must be >= 1, got {getattr(self, name)}")

    def fingerprint(self) -> dict:
        """Parameters that change which frames (and audio) reach the towers; the image and audio policies'
        fingerprints are added by the caller."""
        return {
            "fps": self.fps,
            "max_frames": self.max_frames,
            "include_audio": self.include_audio,
            "sampling": "sglang_linspace",
        }


@dataclass(frozen=True)
class VideoItems:
    frames: list[ImagePatches]  # one image item per sampled frame, in time order
    frame_indices: list[int]
    audio: np.ndarray | None  # dMel codes [F, n_mels] uint8 of the first audio track, if any and wanted


def sample_frame_indices(total: int, source_fps: float, desired_fps: float, max_frames: int) -> list[int]:
    """SGLang's rule: n = clamp(floor(duration * min(desired, source fps)), 1, min(max_frames, total)); all frames
    when n == total, else linspace(0, total - 1, n) truncated to int."""
    if total < 1:
        return []
    duration = total / source_fps if source_fps > 0 else 0.0
    fps = min(desired_fps, source_fps)
    n = max(1, min(max_frames, math.floor(duration * fps), total))
    if n == total:
        return list(range(total))
    return [int(i) for i in np.linspace(0, total - 1, n)]


def _count_frames(data: bytes) -> int:
    """Video packets in the first video stream (containers without a frame count in the header)."""
    with av.open(io.BytesIO(data), mode="r") as container:
        return sum(1 for packet in container.demux(container.streams.video[0]) if packet.size)


def preprocess_video(
    data: bytes, policy: VideoPolicy, image_policy: ImagePolicy, audio_policy: AudioPolicy, item: str = "video"
) -> VideoItems:
    """Encoded video -> sampled frames through the image path, plus the audio track when asked for."""
    if len(data) > policy.max_bytes:
        raise InvalidInputError(f"{item}: {len(data)} bytes exceeds the limit of {policy.max_bytes}")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if container.format.name in STILL_IMAGE_FORMATS or container.format.name.endswith("_pipe"):
                raise InvalidInputError(f"{item}: a still image ({container.format.name}), not a video")
            if not container.streams.video:
                raise InvalidInputError(f"{item}: no video stream")
            stream = container.streams.video[0]
            has_audio = bool(container.streams.audio)
            source_fps = float(stream.average_rate or stream.guessed_rate or 0)
            total = stream.frames or _count_frames(data)
            if total > policy.max_source_frames:
                raise InvalidInputError(f"{item}: {total} frames exceeds the limit of {policy.max_source_frames}")
            if source_fps > 0 and total / source_fps > policy.max_seconds:
                raise InvalidInputError(f"{item}: longer than the limit of {policy.max_seconds} s")
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > image_policy.max_pixels:
                raise InvalidInputError(
                    f"{item}: {width}x{height} frames exceed the limit of {image_policy.max_pixels} pixels"
                )
            wanted = sample_frame_indices(total, source_fps, policy.fps, policy.max_frames)
            frames, indices = _decode_frames(container, stream, wanted, image_policy, item)
    except InvalidInputError:
        raise
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise InvalidInputError(f"{item}: not decodable video ({av_reason(exc)})") from exc
    if not frames:
        raise InvalidInputError(f"{item}: no decodable frames")
    audio = None
    if policy.include_audio and has_audio:
        audio = preprocess_audio(data, audio_policy, f"{item} (audio track)", check_bytes=False)
    return VideoItems(frames=frames, frame_indices=indices, audio=audio)


def _decode_frames(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    wanted: list[int],
    image_policy: ImagePolicy,
    item: str,
) -> tuple[list[ImagePatches], list[int]]:
    """Decode in order, converting only the wanted frames (indices count decoded frames from 0)."""
    if not wanted:
        return [], []
    wanted_set = set(wanted)
    frames: list[ImagePatches] = []
    indices: list[int] = []
    for index, frame in enumerate(container.decode(stream)):
        if index > wanted[-1]:
            break
        if index in wanted_set:
            rgb = frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
            frames.append(preprocess_pil(rgb, image_policy, f"{item} frame {index}"))
            indices.append(index)
    return frames, indices
