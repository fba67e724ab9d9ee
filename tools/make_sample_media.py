"""`python -m tools.make_sample_media DIR`: deterministic media files drawn by code for demos and tests.

Writes into DIR:
- `shapes.png`: 96x64 RGB, a gradient background with a rectangle, a disc and a triangle;
- `tones_16k.wav`: 1.5 s mono 16 kHz, three consecutive tones (16-bit PCM);
- `tones_44k_stereo.wav`: 1.5 s stereo 44.1 kHz, a different tone per channel (16-bit PCM);
- `moving.mp4`: 1 s, 8 fps, 96x64, a square and a disc moving across the frame (mpeg4 in MP4).

Same code and library versions -> same bytes (no timestamps or randomness are written).
"""

from __future__ import annotations

import argparse
import io
import logging
import wave
from collections.abc import Sequence
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw

log = logging.getLogger(__name__)

IMAGE_NAME = "shapes.png"
WAV_16K_NAME = "tones_16k.wav"
WAV_44K_NAME = "tones_44k_stereo.wav"
VIDEO_NAME = "moving.mp4"
SAMPLE_FILES = (IMAGE_NAME, WAV_16K_NAME, WAV_44K_NAME, VIDEO_NAME)

IMAGE_SIZE = (96, 64)  # width, height
AUDIO_SECONDS = 1.5
VIDEO_FPS = 8
VIDEO_FRAMES = 8


def draw_shapes(width: int = IMAGE_SIZE[0], height: int = IMAGE_SIZE[1], shift: int = 0) -> Image.Image:
    """A gradient background with a rectangle, a disc and a triangle; `shift` moves the shapes right."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    background = np.stack(
        [
            np.broadcast_to(x, (height, width)),
            np.broadcast_to(y, (height, width)),
            np.full((height, width), 96.0, dtype=np.float32),
        ],
        axis=-1,
    )
    image = Image.fromarray(background.round().astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    s = shift
    draw.rectangle((8 + s, 8, 8 + s + width // 4, 8 + height // 3), fill=(220, 40, 40))
    r = height // 6
    cx, cy = width // 2 + s // 2, 2 * height // 3
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(30, 200, 90))
    draw.polygon([(width - 30, height - 8), (width - 8, height - 8), (width - 19, 10)], fill=(40, 60, 230))
    return image


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def tones(sample_rate: int, seconds: float, freqs_hz: Sequence[float], amplitude: float = 0.3) -> np.ndarray:
    """Consecutive sine tones of equal length with 5 ms fades, as float32 in [-1, 1]."""
    n = int(round(sample_rate * seconds))
    out = np.zeros(n, dtype=np.float64)
    bounds = np.linspace(0, n, len(freqs_hz) + 1).round().astype(int)
    fade = max(1, int(0.005 * sample_rate))
    for freq, lo, hi in zip(freqs_hz, bounds[:-1], bounds[1:], strict=True):
        t = np.arange(hi - lo) / sample_rate
        seg = np.sin(2 * np.pi * freq * t)
        ramp = np.minimum(1.0, np.minimum(np.arange(hi - lo) + 1, np.arange(hi - lo)[::-1] + 1) / fade)
        out[lo:hi] = seg * ramp
    return (amplitude * out).astype(np.float32)


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV; `samples` is [n] (mono) or [n, channels] float in [-1, 1]."""
    frames = samples if samples.ndim == 2 else samples[:, None]
    pcm = np.clip(np.round(frames * 32767.0), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def mp4_bytes(num_frames: int = VIDEO_FRAMES, fps: int = VIDEO_FPS) -> bytes:
    """An MPEG-4 Part 2 video in an MP4 container: the shapes image with the shapes moving right."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = IMAGE_SIZE
        stream.pix_fmt = "yuv420p"
        stream.codec_context.options = {"flags": "+bitexact"}
        stream.codec_context.thread_count = 1
        for i in range(num_frames):
            frame = av.VideoFrame.from_image(draw_shapes(shift=4 * i))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def sample_media() -> dict[str, bytes]:
    """File name -> bytes of every sample file."""
    return {
        IMAGE_NAME: png_bytes(draw_shapes()),
        WAV_16K_NAME: wav_bytes(tones(16000, AUDIO_SECONDS, (440.0, 660.0, 880.0)), 16000),
        WAV_44K_NAME: wav_bytes(
            np.stack([tones(44100, AUDIO_SECONDS, (330.0,)), tones(44100, AUDIO_SECONDS, (550.0, 770.0))], axis=1),
            44100,
        ),
        VIDEO_NAME: mp4_bytes(),
    }


def make_sample_media(out_dir: str | Path) -> dict[str, Path]:
    """Write the sample files into `out_dir` (created if missing); returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, data in sample_media().items():
        path = out / name
        path.write_bytes(data)
        paths[name] = path
    log.info("wrote sample media", extra={"dir": str(out), "files": sorted(paths)})
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_sample_media", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    for name, path in make_sample_media(args.out_dir).items():
        print(f"{name}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
