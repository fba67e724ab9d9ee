"""What one media item becomes before a tower sees it: the per-item preprocessing policy, the preprocessing
fingerprint that goes into its `mm_key`, and the CPU call that produces the tower input.

The planner needs no towers and no weights: the encoder engine uses it for every item, and a decode replica
builds one (`MediaPlanner.for_checkpoint`) to compute `mm_key`s for its Redis lookups without loading the
towers (with `common.fingerprint.encoder_fingerprint_of` for the tower part of the key).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common.config import ModelConfig, load_model_config
from common.errors import InvalidInputError
from common.media import ImageOptions, MediaInput, VideoOptions
from common.settings import EncoderLimits
from encoder_service.preprocess.audio import AudioPolicy, preprocess_audio
from encoder_service.preprocess.image import ImagePolicy, preprocess_image
from encoder_service.preprocess.video import VideoItems, VideoPolicy, preprocess_video

PREPROCESS_VERSION = "encoder-preprocess/v1"  # bump when preprocessing code changes its output


class MediaPlanner:
    def __init__(
        self,
        has_vision: bool,
        has_audio: bool,
        limits: EncoderLimits | None = None,
        image_policy: ImagePolicy | None = None,
        audio_policy: AudioPolicy | None = None,
        video_policy: VideoPolicy | None = None,
    ) -> None:
        self.has_vision, self.has_audio = has_vision, has_audio
        self.limits = limits or EncoderLimits()
        base_image = image_policy or ImagePolicy()
        self.image_policy = dataclasses.replace(
            base_image,
            max_patches=self.limits.max_image_patches,
            max_pixels=self.limits.max_image_pixels,
            max_bytes=self.limits.max_item_bytes,
        )
        base_audio = audio_policy or AudioPolicy()
        self.audio_policy = dataclasses.replace(
            base_audio,
            max_seconds=self.limits.max_audio_seconds,
            max_bytes=self.limits.max_item_bytes,
            max_frames=min(
                base_audio.max_frames,
                math.ceil(self.limits.max_audio_seconds * base_audio.sample_rate / base_audio.hop_length),
            ),
        )
        base_video = video_policy or VideoPolicy()
        self.video_policy = dataclasses.replace(
            base_video,
            max_frames=min(base_video.max_frames, self.limits.max_video_frames),
            max_seconds=self.limits.max_audio_seconds,
            max_bytes=self.limits.max_item_bytes,
        )

    @classmethod
    def for_config(cls, config: ModelConfig, limits: EncoderLimits | None = None) -> MediaPlanner:
        """The planner of an encoder serving `config`'s towers (the policies `load_engine` uses)."""
        image_policy = ImagePolicy(patch_size=config.vision.patch_size) if config.vision else None
        audio_policy = None
        if config.audio is not None:
            a = config.audio
            audio_policy = AudioPolicy(
                n_mels=a.n_mel_bins,
                num_dmel_bins=a.mel_vocab_size,
                dmel_min=a.dmel_min_value,
                dmel_max=a.dmel_max_value,
            )
        return cls(config.vision is not None, config.audio is not None, limits, image_policy, audio_policy)

    @classmethod
    def for_checkpoint(cls, checkpoint: str | Path, limits: EncoderLimits | None = None) -> MediaPlanner:
        return cls.for_config(load_model_config(checkpoint), limits)

    @property
    def modalities(self) -> tuple[str, ...]:
        out = []
        if self.has_vision:
            out.append("image")
        if self.has_audio:
            out.append("audio")
        if self.has_vision:
            out.append("video")
        return tuple(out)

    def image_policy_for(self, options: ImageOptions | None, item: str) -> ImagePolicy:
        base = self.image_policy
        if options is None or options.rescale == "default":
            if options is not None and (options.rescale_frac is not None or options.rescale_max_long_edge):
                raise InvalidInputError(f"{item}: rescale_frac/rescale_max_long_edge need the long_edge policy")
            return base
        if options.rescale == "none":
            return dataclasses.replace(base, rescale_frac=None)
        if options.rescale != "long_edge":
            raise InvalidInputError(f"{item}: unknown rescale policy {options.rescale!r}")
        frac = options.rescale_frac if options.rescale_frac is not None else (base.rescale_frac or 1.0)
        cap = options.rescale_max_long_edge or base.max_upscaled_long_edge
        try:
            return dataclasses.replace(base, rescale_frac=frac, max_upscaled_long_edge=cap)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{item}: {exc}") from None

    def video_policy_for(self, options: VideoOptions, item: str) -> VideoPolicy:
        base = self.video_policy
        if options.max_frames is not None and options.max_frames < 1:
            raise InvalidInputError(f"{item}: max_frames must be >= 1, got {options.max_frames}")
        include_audio = options.include_audio
        if include_audio is None:
            include_audio = base.include_audio and self.has_audio
        if include_audio and not self.has_audio:
            raise InvalidInputError(f"{item}: include_audio needs the audio tower, which this encoder lacks")
        try:
            return dataclasses.replace(
                base,
                fps=base.fps if options.fps is None else options.fps,
                include_audio=include_audio,
                max_frames=min(options.max_frames or base.max_frames, self.limits.max_video_frames),
            )
        except InvalidInputError as exc:
            raise InvalidInputError(f"{item}: {exc}") from None

    def plan(self, media: MediaInput, item: str) -> tuple[dict, Callable[[], np.ndarray | VideoItems]]:
        """(preprocessing fingerprint, the CPU preprocessing call) for one item."""
        if media.modality not in self.modalities:
            supported = ", ".join(self.modalities) or "none"
            raise InvalidInputError(f"{item}: modality {media.modality!r} is not served here ({supported})")
        if media.modality != "image" and media.image is not None:
            raise InvalidInputError(f"{item}: image parameters given for a {media.modality} item")
        if media.modality != "video" and media.video is not None:
            raise InvalidInputError(f"{item}: video parameters given for a {media.modality} item")
        if not media.data:
            raise InvalidInputError(f"{item}: empty media data")
        if len(media.data) > self.limits.max_item_bytes:
            raise InvalidInputError(
                f"{item}: {len(media.data)} bytes exceeds the limit of {self.limits.max_item_bytes}"
            )
        data = media.data
        if media.modality == "image":
            policy = self.image_policy_for(media.image, item)
            return (
                {"version": PREPROCESS_VERSION, "image": policy.fingerprint()},
                lambda: preprocess_image(data, policy, item).pixels,
            )
        if media.modality == "audio":
            audio_policy = self.audio_policy
            return (
                {"version": PREPROCESS_VERSION, "audio": audio_policy.fingerprint()},
                lambda: preprocess_audio(data, audio_policy, item),
            )
        options = media.video or VideoOptions()
        frame_policy = self.image_policy_for(options.frame, item)
        video_policy = self.video_policy_for(options, item)
        audio_policy = self.audio_policy
        fingerprint = {
            "version": PREPROCESS_VERSION,
            "video": video_policy.fingerprint(),
            "frame": frame_policy.fingerprint(),
            "audio": audio_policy.fingerprint() if video_policy.include_audio else None,
        }
        return fingerprint, lambda: preprocess_video(data, video_policy, frame_policy, audio_policy, item)

    def preprocess_fingerprint(self, media: MediaInput, item: str = "item") -> dict:
        """The preprocessing part of `media`'s mm_key: the decode side's encoder client computes keys with
        this very function, so its Redis lookups hit what encoders store."""
        return self.plan(media, item)[0]
