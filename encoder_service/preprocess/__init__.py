"""Media preprocessing (CPU only, no model code): image -> hMLP patches, audio -> dMel codes, video -> sampled
frames (image items) plus its audio track (an audio item). Each modality has a frozen policy whose
`fingerprint()` lists the parameters that change the tower input (they go into the mm_key)."""

from encoder_service.preprocess.audio import AudioPolicy, audio_token_count, preprocess_audio, preprocess_waveform
from encoder_service.preprocess.image import (
    ImagePatches,
    ImagePolicy,
    image_token_count,
    preprocess_image,
    preprocess_pil,
    probe_image,
)
from encoder_service.preprocess.video import VideoItems, VideoPolicy, preprocess_video

__all__ = [
    "AudioPolicy",
    "ImagePatches",
    "ImagePolicy",
    "VideoItems",
    "VideoPolicy",
    "audio_token_count",
    "image_token_count",
    "preprocess_audio",
    "preprocess_image",
    "preprocess_pil",
    "preprocess_video",
    "preprocess_waveform",
    "probe_image",
]
