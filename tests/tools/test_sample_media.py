"""The sample media are valid, have the promised shapes and durations, and are byte-for-byte reproducible."""

from __future__ import annotations

import io
import wave

import av
import numpy as np
from PIL import Image

from tools.make_sample_media import (
    IMAGE_NAME,
    SAMPLE_FILES,
    VIDEO_NAME,
    WAV_16K_NAME,
    WAV_44K_NAME,
    make_sample_media,
    sample_media,
)


def _wav_info(data: bytes) -> tuple[int, int, float, np.ndarray]:
    with wave.open(io.BytesIO(data)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, w.getnchannels())
        return w.getframerate(), w.getnchannels(), w.getnframes() / w.getframerate(), pcm


def test_files_are_written_and_deterministic(tmp_path):
    paths = make_sample_media(tmp_path / "media")
    assert sorted(paths) == sorted(SAMPLE_FILES)
    again = sample_media()
    for name, path in paths.items():
        assert path.read_bytes() == again[name], name


def test_png_is_a_drawn_pattern():
    image = Image.open(io.BytesIO(sample_media()[IMAGE_NAME]))
    assert image.format == "PNG" and image.mode == "RGB" and image.size == (96, 64)
    pixels = np.asarray(image)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # not a flat colour
    assert tuple(pixels[15, 15]) == (220, 40, 40)  # inside the rectangle


def test_wavs_have_the_promised_format():
    media = sample_media()
    rate, channels, seconds, pcm = _wav_info(media[WAV_16K_NAME])
    assert (rate, channels) == (16000, 1) and abs(seconds - 1.5) < 1e-9
    assert 0 < np.abs(pcm).max() < 32767
    rate, channels, seconds, pcm = _wav_info(media[WAV_44K_NAME])
    assert (rate, channels) == (44100, 2) and abs(seconds - 1.5) < 1e-4
    assert not np.array_equal(pcm[:, 0], pcm[:, 1])  # a different tone per channel


def test_mp4_decodes_to_moving_frames():
    with av.open(io.BytesIO(sample_media()[VIDEO_NAME])) as container:
        stream = container.streams.video[0]
        seconds = container.duration / av.time_base
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(frames) == 8 and frames[0].shape == (64, 96, 3)
    assert abs(seconds - 1.0) < 0.2
    assert np.abs(frames[0].astype(int) - frames[-1].astype(int)).mean() > 1.0  # the shapes move
