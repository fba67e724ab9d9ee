"""dMel codes against HF (feature extractor + processor binning) and tml-renderers' canonical audio tokenizer."""

from __future__ import annotations

import io
import wave

import av
import numpy as np
import pytest
import torch
from tml_renderers import chat, tokenizers, v0
from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor

from common.errors import InvalidInputError
from encoder_service.preprocess.audio import (
    AudioPolicy,
    audio_token_count,
    decode_audio,
    log_mel,
    mel_filters,
    preprocess_audio,
    preprocess_waveform,
)

POLICY = AudioPolicy()


def _hf_codes(samples: np.ndarray) -> np.ndarray:
    """HF InklingFeatureExtractor, then InklingProcessor's dMel binning (float64 linspace -> float32 centres)."""
    features = InklingFeatureExtractor()(samples, sampling_rate=16000, return_tensors="pt")["input_features"][0]
    centres = torch.linspace(-7.0, 2.0, 16, dtype=torch.float64).to(torch.float32)
    return (features.clamp(min=-7.0, max=2.0).unsqueeze(-1) - centres).abs().argmin(dim=-1).numpy()


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """int16 PCM WAV; samples [n] or [n, channels] in [-1, 1]."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1 if pcm.ndim == 1 else pcm.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def _tml_codes(path: str) -> np.ndarray:
    renderer = v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    pointer = chat.AudioPointer(path, chat.AudioFormat.Wav, 0, 16000)
    spans, _ = renderer.render_for_completion([chat.Message(pointer, chat.Author(chat.AuthorKind.User))])
    return next(s.span.dmel.numpy() for s in spans if isinstance(s.span, chat.DmelTokenSpan))


def _speechlike(n: int, rate: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / rate
    tone = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))
    return (tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


def test_mel_filters_equal_hf():
    assert np.array_equal(mel_filters(POLICY), InklingFeatureExtractor().mel_filters.numpy())


@pytest.mark.parametrize("n", [1, 500, 799, 800, 16000, 16001, 24321])
def test_codes_equal_hf(n):
    samples = _speechlike(n, 16000, seed=n)
    features = InklingFeatureExtractor()(samples, sampling_rate=16000, return_tensors="pt")["input_features"][0]
    assert np.array_equal(log_mel(samples, POLICY), features.numpy())
    codes = preprocess_waveform(samples, 16000, POLICY)
    assert codes.dtype == np.uint8 and codes.shape == (audio_token_count(n, POLICY), 80)
    assert np.array_equal(codes, _hf_codes(samples))


def test_codes_cover_the_range():
    loud = np.concatenate([np.zeros(8000, np.float32), _speechlike(16000, 16000, 1) * 3])
    codes = preprocess_waveform(loud, 16000, POLICY)
    assert len(np.unique(codes[:9])) == 1 and len(np.unique(codes)) >= 5  # silence is flat; speech spreads
    assert np.array_equal(codes, _hf_codes(loud))


def test_wav_16k_equals_tml_renderers(tmp_path):
    path = tmp_path / "mono.wav"
    path.write_bytes(_wav_bytes(_speechlike(16001, 16000, 2), 16000))
    assert np.array_equal(preprocess_audio(path.read_bytes(), POLICY), _tml_codes(str(path)))


def test_wav_44k_stereo_decodes_and_equals_tml_renderers(tmp_path):
    stereo = np.stack([_speechlike(44100, 44100, 3), _speechlike(44100, 44100, 4)], axis=1)  # [n, 2]
    path = tmp_path / "stereo.wav"
    path.write_bytes(_wav_bytes(stereo, 44100))
    samples, rate = decode_audio(path.read_bytes(), POLICY)
    assert rate == 44100 and samples.shape == (44100,)
    pcm = np.clip(np.round(stereo * 32767), -32768, 32767).astype(np.int16) / np.float32(32768)
    np.testing.assert_allclose(samples, pcm.mean(axis=1), atol=1e-7)  # int16/32768, mean over channels
    codes = preprocess_audio(path.read_bytes(), POLICY)
    assert codes.shape == (20, 80)
    assert np.array_equal(codes, _tml_codes(str(path)))


def _encode_with_pyav(samples: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(
    "container,codec,rate",
    [("flac", "flac", 16000), ("ogg", "libopus", 48000), ("mp3", "libmp3lame", 22050), ("adts", "aac", 16000)],
)
def test_compressed_containers_decode(container, codec, rate):
    samples = _speechlike(rate, rate, 5)
    codes = preprocess_audio(_encode_with_pyav(samples, rate, container, codec), POLICY)
    assert abs(codes.shape[0] - 20) <= 2 and codes.shape[1] == 80  # codec delay/padding moves a frame or two
    if codec == "flac":  # lossless at 16 kHz: same codes as the 16-bit-quantised input
        pcm = (np.clip(np.round(samples * 32767), -32768, 32767) / 32768).astype(np.float32)
        assert np.array_equal(codes, _hf_codes(pcm))


def test_bad_audio_names_the_item():
    with pytest.raises(InvalidInputError, match="clip 2: not decodable audio"):
        preprocess_audio(b"\x00\x01garbage" * 10, POLICY, item="clip 2")
    with pytest.raises(InvalidInputError, match="clip: empty audio"):
        preprocess_audio(_wav_bytes(np.zeros(0, np.float32), 16000), POLICY, item="clip")
    with pytest.raises(InvalidInputError, match="empty audio"):
        preprocess_waveform(np.zeros(0, np.float32), 16000, POLICY)
    with pytest.raises(InvalidInputError, match="frames exceeds"):
        preprocess_waveform(np.zeros(1700, np.float32), 16000, AudioPolicy(max_frames=2))
    with pytest.raises(InvalidInputError, match="longer than"):
        preprocess_audio(_wav_bytes(np.zeros(32000, np.float32), 16000), AudioPolicy(max_seconds=1.0))


def test_fingerprint():
    assert AudioPolicy(num_dmel_bins=8).fingerprint() != POLICY.fingerprint()
    assert AudioPolicy(max_frames=3).fingerprint() == POLICY.fingerprint()
    assert POLICY.fingerprint()["n_fft"] == 1600 and POLICY.hop_length == 800
