"""AudioCodebook: the decode side's codebook sum of dMel codes equals the encoder's audio tower, bit for bit."""

import asyncio

import numpy as np
import pytest
import torch

from common.errors import UnavailableError
from common.media import MediaInput
from common.settings import EncoderSettings
from common.wire import KIND_DMEL_CODES, EncodedItem, Span, codes_to_bytes
from encoder_service.codebook import AudioCodebook
from encoder_service.service import bf16_bits, load_engine
from tools.make_sample_media import sample_media
from tools.make_tiny_checkpoint import make_tiny_checkpoint

WAV = sample_media()["tones_44k_stereo.wav"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def codebook(checkpoint):
    return AudioCodebook.load(checkpoint)


def _encode_audio(checkpoint, dtype: str):
    engine = load_engine(EncoderSettings(checkpoint=str(checkpoint), dtype=dtype, l1_cache_bytes=0))

    async def main():
        try:
            return [r async for r in engine.encode([MediaInput("audio", WAV)])][0]
        finally:
            await engine.close()

    return engine, asyncio.run(main())


def _tower_bits(tower, codes: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return bf16_bits(tower(torch.from_numpy(codes)))


def _codes_item(codes: np.ndarray, tower_dtype: str, dim: int = 64) -> EncodedItem:
    return EncodedItem(
        item_index=2,
        mm_key=bytes(32),
        modality="audio",
        rows=len(codes),
        dim=dim,
        payload=codes_to_bytes(codes),
        spans=(Span("audio", len(codes)),),
        dtype="uint8",
        kind=KIND_DMEL_CODES,
        codes_per_row=codes.shape[1],
        tower_dtype=tower_dtype,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_equal_the_encoder_tower_bit_for_bit(checkpoint, codebook, dtype):
    """What the encoder sends (codes + its tower dtype) becomes exactly the rows its tower would have sent."""
    engine, item = _encode_audio(checkpoint, dtype)
    assert item.kind == KIND_DMEL_CODES and item.tower_dtype == dtype and item.rows == 30
    codes = np.frombuffer(item.payload, np.uint8).reshape(item.rows, item.codes_per_row).copy()
    rows = codebook.rows(item, "media[0] (audio)")
    assert rows.dtype == torch.bfloat16 and tuple(rows.shape) == (30, 64)
    assert np.array_equal(bf16_bits(rows), _tower_bits(engine.audio, codes))
    # Every code of every mel bin, not only those a test tone produces.
    every = np.random.default_rng(0).integers(0, 16, size=(200, 80)).astype(np.uint8)
    every[:16] = np.arange(16, dtype=np.uint8)[:, None]
    want = _tower_bits(engine.audio, every)
    assert np.array_equal(bf16_bits(codebook.rows(_codes_item(every, dtype), "media[2] (audio)")), want)


def test_tower_dtype_changes_the_rows(codebook):
    """The rounding points differ between an fp32 and a bf16 tower: summing in the wrong one is not the same."""
    codes = np.random.default_rng(1).integers(0, 16, size=(64, 80)).astype(np.uint8)
    fp32 = bf16_bits(codebook.rows(_codes_item(codes, "float32"), "audio"))
    bf16 = bf16_bits(codebook.rows(_codes_item(codes, "bfloat16"), "audio"))
    assert not np.array_equal(fp32, bf16)


def test_loads_only_the_audio_tower(codebook):
    assert set(codebook.tower("float32").state_dict()) == {"encoder.weight", "final_norm.weight"}


def test_corrupt_codes_name_the_item_frame_and_bin(codebook):
    codes = np.zeros((10, 80), np.uint8)
    codes[3, 5] = 16
    with pytest.raises(
        UnavailableError, match=r"media\[2\] \(audio\): corrupt dMel codes: frame 3, mel bin 5 holds code 16"
    ):
        codebook.rows(_codes_item(codes, "float32"), "media[2] (audio)")


def test_codes_that_do_not_fit_this_tower_name_the_item(codebook):
    with pytest.raises(UnavailableError, match=r"media\[2\] \(audio\): dMel codes of 40 mel bins"):
        codebook.rows(_codes_item(np.zeros((4, 40), np.uint8), "float32"), "media[2] (audio)")
    with pytest.raises(UnavailableError, match=r"media\[2\] \(audio\): .*rows of width 32"):
        codebook.rows(_codes_item(np.zeros((4, 80), np.uint8), "float32", dim=32), "media[2] (audio)")
