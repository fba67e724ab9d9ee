"""Audio bytes or samples -> dMel codes (spec multimodal section 3).

Decode with PyAV (any container FFmpeg reads), float32, mean over channels, resample to 16 kHz with
`librosa.resample(res_type="soxr_hq")` (the canonical TML tokenizer's resampler), then a magnitude STFT
(periodic Hann, left pad n_fft - hop, no centring), Slaney mel filters (float64 built, float32 applied), log10,
and nearest-centre quantisation into `num_dmel_bins` codes per mel bin. One frame = one token = one hop.

The spectral part runs with torch on the CPU so that it is bit-equal to the HF feature extractor.
"""

from __future__ import annotations

import functools
import io
import math
import re
from dataclasses import asdict, dataclass

import av
import librosa
import numpy as np
import torch
import torch.nn.functional as F

from common.errors import InvalidInputError

_LOG_FLOOR = 1e-10


@dataclass(frozen=True)
class AudioPolicy:
    """Every knob of the audio path; `fingerprint()` lists those that change the codes."""

    sample_rate: int = 16000
    token_duration_s: float = 0.05  # hop = 800 samples at 16 kHz
    window_size_multiplier: float = 2.0  # window = 1600 samples
    n_fft: int | None = None  # None: the window length
    n_mels: int = 80
    num_dmel_bins: int = 16
    dmel_min: float = -7.0
    dmel_max: float = 2.0
    resample: str = "soxr_hq"
    max_seconds: float = 600.0
    max_frames: int = 12000
    max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        _exact_int(self.token_duration_s * self.sample_rate, "AudioPolicy.token_duration_s * sample_rate")
        _exact_int(
            self.token_duration_s * self.window_size_multiplier * self.sample_rate,
            "AudioPolicy.token_duration_s * window_size_multiplier * sample_rate",
        )
        if not self.dmel_min < self.dmel_max:
            raise InvalidInputError(f"AudioPolicy: dmel_min={self.dmel_min} must be below dmel_max={self.dmel_max}")
        for name in ("sample_rate", "n_mels", "num_dmel_bins", "max_frames", "max_bytes"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"AudioPolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_dmel_bins > 256:
            raise InvalidInputError(f"AudioPolicy.num_dmel_bins={self.num_dmel_bins} does not fit uint8 codes")
        if self.n_fft is not None and self.n_fft < self.window_length:
            raise InvalidInputError(f"AudioPolicy.n_fft={self.n_fft} is shorter than the window {self.window_length}")

    @property
    def hop_length(self) -> int:
        return _exact_int(self.token_duration_s * self.sample_rate, "hop")

    @property
    def window_length(self) -> int:
        return _exact_int(self.token_duration_s * self.window_size_multiplier * self.sample_rate, "window")

    @property
    def fft_size(self) -> int:
        return self.n_fft or self.window_length

    def fingerprint(self) -> dict:
        """Parameters that change the codes (limits only accept or reject)."""
        fields = asdict(self)
        for name in ("max_seconds", "max_frames", "max_bytes"):
            fields.pop(name)
        fields.update(n_fft=self.fft_size, mel="slaney", window="hann_periodic", downmix="mean")
        return fields


def av_reason(exc: Exception) -> str:
    """Why FFmpeg refused the input, without the errno and the input's name (a Python buffer repr)."""
    if isinstance(exc, av.FFmpegError) and exc.strerror:
        return exc.strerror
    return re.sub(r"<[^<>]* object at 0x[0-9a-fA-F]+>", "the input", str(exc))


def _exact_int(value: float, name: str) -> int:
    rounded = round(value)
    if abs(value - rounded) > 1e-6 or rounded < 1:
        raise InvalidInputError(f"{name} must be a positive whole number of samples, got {value}")
    return int(rounded)


def audio_token_count(num_samples: int, policy: AudioPolicy) -> int:
    """Frames (tokens) for a clip of `num_samples` at the policy's sample rate: ceil(n / hop)."""
    return -(-num_samples // policy.hop_length)


# ---------------------------------------------------------------------------------------------------------------
# Decoding


def decode_audio(
    data: bytes, policy: AudioPolicy, item: str = "audio", check_bytes: bool = True
) -> tuple[np.ndarray, int]:
    """Bytes of any container PyAV reads -> (mono float32 samples [n], native sample rate) of its first audio
    stream. `check_bytes=False` for the audio track of a video, whose bytes the video limit already bounds."""
    if check_bytes and len(data) > policy.max_bytes:
        raise InvalidInputError(f"{item}: {len(data)} bytes exceeds the limit of {policy.max_bytes}")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise InvalidInputError(f"{item}: no audio stream")
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate or stream.rate
            if not rate:
                raise InvalidInputError(f"{item}: unknown sample rate")
            to_float = av.AudioResampler(format="fltp")  # planar float32, native layout and rate
            limit = math.ceil(policy.max_seconds * rate)
            chunks: list[np.ndarray] = []
            total = 0
            for frame in container.decode(stream):
                for converted in to_float.resample(frame):
                    planes = converted.to_ndarray()  # [channels, samples] float32
                    chunks.append(planes.mean(axis=0, dtype=np.float32))
                    total += planes.shape[1]
                if total > limit:
                    raise InvalidInputError(f"{item}: longer than the limit of {policy.max_seconds} s")
            for converted in to_float.resample(None):
                chunks.append(converted.to_ndarray().mean(axis=0, dtype=np.float32))
    except InvalidInputError:
        raise
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise InvalidInputError(f"{item}: not decodable audio ({av_reason(exc)})") from exc
    samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    return samples, int(rate)


def to_mono_16k(samples: np.ndarray, sample_rate: int, policy: AudioPolicy, item: str = "audio") -> np.ndarray:
    """[n] or [channels, n] float samples -> mono float32 at the policy rate."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.mean(axis=0, dtype=np.float32)
    elif samples.ndim != 1:
        raise InvalidInputError(f"{item}: expected [samples] or [channels, samples], got shape {samples.shape}")
    if samples.size == 0:
        raise InvalidInputError(f"{item}: empty audio")
    if not np.isfinite(samples).all():
        raise InvalidInputError(f"{item}: samples contain NaN or infinity")
    if sample_rate < 1:
        raise InvalidInputError(f"{item}: invalid sample rate {sample_rate}")
    if samples.size > policy.max_seconds * sample_rate:
        raise InvalidInputError(f"{item}: longer than the limit of {policy.max_seconds} s")
    if sample_rate != policy.sample_rate:
        samples = librosa.resample(
            samples, orig_sr=sample_rate, target_sr=policy.sample_rate, res_type=policy.resample
        ).astype(np.float32, copy=False)
    return samples


# ---------------------------------------------------------------------------------------------------------------
# Spectral front end


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic (ln(6.4)/27 per mel) above."""
    linear = hz * 3.0 / 200.0
    log = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * 27.0 / np.log(6.4)
    return np.where(hz >= 1000.0, log, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    linear = mel * 200.0 / 3.0
    log = 1000.0 * np.exp((mel - 15.0) * np.log(6.4) / 27.0)
    return np.where(mel >= 15.0, log, linear)


def mel_filters(policy: AudioPolicy) -> np.ndarray:
    """[n_mels, n_fft/2+1] Slaney-normalised triangular filters, 0 Hz to Nyquist; float64 math, float32 out."""
    n_bins = policy.fft_size // 2 + 1
    nyquist = policy.sample_rate / 2.0
    bin_hz = np.linspace(0.0, nyquist, n_bins)  # [B]
    edges_mel = np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(nyquist)), policy.n_mels + 2)
    edges = _mel_to_hz(edges_mel)  # [M+2]
    widths = np.diff(edges)  # [M+1]
    offsets = edges[:, None] - bin_hz[None, :]  # [M+2, B]
    rising = -offsets[:-2] / widths[:-1, None]  # [M, B]
    falling = offsets[2:] / widths[1:, None]  # [M, B]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= (2.0 / (edges[2:] - edges[:-2]))[:, None]  # Slaney area normalisation
    return filters.astype(np.float32)


@functools.lru_cache(maxsize=8)
def _mel_matrix(policy: AudioPolicy) -> torch.Tensor:
    return torch.from_numpy(mel_filters(policy))  # [n_mels, n_fft/2+1]


def log_mel(samples: np.ndarray, policy: AudioPolicy) -> np.ndarray:
    """Mono float32 at the policy rate -> [F, n_mels] float32 log10 mel magnitudes, F = ceil(n / hop)."""
    hop, n_fft = policy.hop_length, policy.fft_size
    wave = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))[None]  # [1, n]
    right = -(-wave.shape[-1] // hop) * hop - wave.shape[-1]
    wave = F.pad(wave, (n_fft - hop, right))
    window = torch.hann_window(policy.window_length, periodic=True, dtype=torch.float32)
    spec = torch.stft(
        wave, n_fft, hop_length=hop, win_length=policy.window_length, window=window, center=False, return_complex=True
    )  # [1, n_fft/2+1, F]
    magnitude = torch.view_as_real(spec).pow(2).sum(-1).clamp_min(_LOG_FLOOR).sqrt()
    mel = _mel_matrix(policy) @ magnitude  # [1, n_mels, F]
    return mel.clamp_min(_LOG_FLOOR).log10()[0].T.contiguous().numpy()


def quantize_dmel(features: np.ndarray, policy: AudioPolicy) -> np.ndarray:
    """[F, n_mels] log-mel -> uint8 codes: clamp, then the index of the nearest bin centre (first on ties)."""
    centres = np.linspace(policy.dmel_min, policy.dmel_max, policy.num_dmel_bins, dtype=np.float64)
    centres = centres.astype(np.float32)
    clamped = np.clip(features, np.float32(policy.dmel_min), np.float32(policy.dmel_max))
    distance = np.abs(clamped[..., None] - centres)  # [F, n_mels, bins]
    return distance.argmin(axis=-1).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------------------
# Entry points


def preprocess_waveform(samples: np.ndarray, sample_rate: int, policy: AudioPolicy, item: str = "audio") -> np.ndarray:
    """Float samples ([n] or [channels, n]) at any rate -> dMel codes [F, n_mels] uint8."""
    mono = to_mono_16k(samples, sample_rate, policy, item)
    frames = audio_token_count(mono.size, policy)
    if frames > policy.max_frames:
        raise InvalidInputError(f"{item}: {frames} frames exceeds the limit of {policy.max_frames}")
    return quantize_dmel(log_mel(mono, policy), policy)


def preprocess_audio(data: bytes, policy: AudioPolicy, item: str = "audio", check_bytes: bool = True) -> np.ndarray:
    """Encoded audio bytes (or a video's bytes, for its audio track) -> dMel codes [F, n_mels] uint8."""
    samples, rate = decode_audio(data, policy, item, check_bytes)
    return preprocess_waveform(samples, rate, policy, item)
