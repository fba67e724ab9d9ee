"""Video: frame sampling formula, frames through the image path, audio track through the audio path."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from common.errors import InvalidInputError
from encoder_service.preprocess.audio import AudioPolicy, preprocess_waveform
from encoder_service.preprocess.image import ImagePolicy, preprocess_pil
from encoder_service.preprocess.video import VideoPolicy, preprocess_video, sample_frame_indices

IMAGE = ImagePolicy(patch_size=8, rescale_frac=None)
AUDIO = AudioPolicy()
COLOURS = [
    (255, 0, 0),
    (0, 255, 0),
    (0, 0, 255),
    (255, 255, 0),
    (0, 255, 255),
    (255, 0, 255),
    (128, 128, 128),
    (0, 0, 0),
    (255, 255, 255),
    (64, 32, 16),
]


def _video(n_frames: int, fps: int, codec: str, with_audio: bool = False) -> bytes:
    """Tiny MP4 of solid colours (32x24), optionally with a 16 kHz mono AAC track."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        video = out.add_stream(codec, rate=fps)
        video.width, video.height, video.pix_fmt = 32, 24, "yuv420p"
        if codec == "libx264":
            video.options = {"qp": "0", "preset": "ultrafast"}
        audio = out.add_stream("aac", rate=16000, layout="mono") if with_audio else None
        for i in range(n_frames):
            rgb = np.empty((24, 32, 3), np.uint8)
            rgb[:] = COLOURS[i % len(COLOURS)]
            for packet in video.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in video.encode(None):
            out.mux(packet)
        if audio is not None:
            tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)
            frame = av.AudioFrame.from_ndarray(tone[None], format="flt", layout="mono")
            frame.sample_rate = 16000
            for packet in audio.encode(frame):
                out.mux(packet)
            for packet in audio.encode(None):
                out.mux(packet)
    return buf.getvalue()


def _codec() -> str:
    for name in ("libx264", "mpeg4"):
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:
            continue
    pytest.skip("no H.264 or MPEG-4 encoder in this PyAV build")


def test_sampling_formula():
    # n = clamp(floor(duration * min(fps, source fps)), 1, min(max_frames, total)); linspace, truncated
    assert sample_frame_indices(10, 5.0, 1.0, 32) == [0, 9]
    assert sample_frame_indices(10, 5.0, 2.0, 32) == [0, 3, 6, 9]
    assert sample_frame_indices(10, 5.0, 30.0, 32) == list(range(10))  # fps capped at the source's
    assert sample_frame_indices(10, 5.0, 30.0, 3) == [0, 4, 9]
    assert sample_frame_indices(3, 30.0, 1.0, 32) == [0]  # shorter than a sample interval: one frame
    assert sample_frame_indices(7, 0.0, 1.0, 32) == [0]  # unknown rate
    assert sample_frame_indices(300, 30.0, 2.0, 8) == [int(v) for v in np.linspace(0, 299, 8)]
    assert sample_frame_indices(0, 30.0, 1.0, 8) == []


def test_frames_follow_the_formula_and_the_image_path():
    data = _video(10, 5, _codec())
    out = preprocess_video(data, VideoPolicy(fps=2.0, max_frames=32), IMAGE, AUDIO)
    assert out.frame_indices == [0, 3, 6, 9] and out.audio is None
    for index, frame in zip(out.frame_indices, out.frames, strict=True):
        solid = np.empty((24, 32, 3), np.uint8)
        solid[:] = COLOURS[index]
        expected = preprocess_pil(solid, IMAGE)
        assert (frame.rows, frame.cols) == (3, 5)
        # lossy YUV 4:2:0 round trip: the colour survives within a few levels (normalised units ~ 1/66 per level)
        np.testing.assert_allclose(frame.pixels, expected.pixels, atol=0.1)


def test_audio_track_becomes_an_audio_item():
    data = _video(5, 5, _codec(), with_audio=True)
    out = preprocess_video(data, VideoPolicy(fps=1.0), IMAGE, AUDIO)
    assert out.frame_indices == [0] and out.audio is not None
    assert out.audio.shape[1] == 80 and abs(out.audio.shape[0] - 20) <= 2
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)
    assert np.mean(out.audio[:18] == preprocess_waveform(tone, 16000, AUDIO)[:18]) > 0.5  # lossy AAC
    assert preprocess_video(data, VideoPolicy(include_audio=False), IMAGE, AUDIO).audio is None
    # the video's byte limit bounds its audio track, not the (smaller) audio item limit
    assert preprocess_video(data, VideoPolicy(), IMAGE, AudioPolicy(max_bytes=10)).audio is not None


def test_limits_and_bad_input():
    data = _video(10, 5, _codec())
    with pytest.raises(InvalidInputError, match="clip: 10 frames exceeds"):
        preprocess_video(data, VideoPolicy(max_source_frames=5), IMAGE, AUDIO, item="clip")
    with pytest.raises(InvalidInputError, match="longer than"):
        preprocess_video(data, VideoPolicy(max_seconds=1.0), IMAGE, AUDIO)
    with pytest.raises(InvalidInputError, match="pixels"):
        preprocess_video(data, VideoPolicy(), ImagePolicy(max_pixels=100), AUDIO)
    with pytest.raises(InvalidInputError, match="movie: not decodable video"):
        preprocess_video(b"\x00" * 64, VideoPolicy(), IMAGE, AUDIO, item="movie")
    assert VideoPolicy(fps=2.0).fingerprint() != VideoPolicy().fingerprint()
