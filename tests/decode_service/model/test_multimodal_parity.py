"""Towers + decoder with image and audio rows scattered == transformers' full multimodal forward (fp32).

Audio features come from HF's own feature extractor and dMel binning. HF's image processor needs torchvision
(not installable beside the CPU torch wheel here), so image patches come from our preprocessor, whose patches are
checked against the spec's formulas in tests/encoder_service; both models then get the same pixels.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor

from common.checkpoint import AUDIO, VISUAL, CheckpointFiles, load_decoder_weights, load_tower_weights
from common.config import AUDIO_BOS_TOKEN_ID, IMAGE_BOS_TOKEN_ID, parse_model_config
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.inkling import InklingDecoder
from encoder_service.preprocess.image import ImagePolicy, preprocess_image
from encoder_service.towers import build_towers
from tests.reference.hf_tiny import build_hf_model, raw_config
from tests.reference.released_layout import hf_state_to_released, write_released_checkpoint

END_MESSAGE, AUDIO_END, USER, TEXT = 200010, 200043, 200000, 200004


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _hf_audio_codes(samples: np.ndarray, raw: dict) -> torch.Tensor:
    """dMel codes the HF way: its feature extractor, then nearest of float32 linspace centers."""
    audio = raw["audio_config"]
    features = InklingFeatureExtractor()(samples, sampling_rate=16000, return_tensors="pt")["input_features"]
    centers = torch.linspace(
        audio["dmel_min_value"], audio["dmel_max_value"], audio["mel_vocab_size"], dtype=torch.float64
    ).float()
    clamped = features.clamp(audio["dmel_min_value"], audio["dmel_max_value"])
    return (clamped.unsqueeze(-1) - centers).abs().argmin(-1).to(torch.int32)  # [1, F, 80]


@torch.no_grad()
def test_image_and_audio_prompt_matches_transformers(tmp_path):
    raw = raw_config()
    hf = build_hf_model(raw, seed=11)
    write_released_checkpoint(tmp_path, raw, hf_state_to_released(hf.state_dict()))
    config = parse_model_config(raw)
    files = CheckpointFiles(tmp_path)
    weights, _ = load_decoder_weights(files, config, dtype=torch.float32, device="cpu")
    decoder = InklingDecoder.from_weights(config.text, weights, torch.float32)
    vision, audio = build_towers(
        config,
        load_tower_weights(files, VISUAL, config)[0],
        load_tower_weights(files, AUDIO, config)[0],
        "cpu",
        torch.float32,
    )

    patch = config.vision.patch_size
    images = [preprocess_image(_png(37, 21, seed), ImagePolicy(patch_size=patch, rescale_frac=None)) for seed in (1, 2)]
    samples = np.random.default_rng(3).standard_normal(16000 * 3 // 4).astype(np.float32) * 0.1
    codes = _hf_audio_codes(samples, raw)  # [1, F, 80]

    text = torch.randint(0, 199000, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    ids = [USER, TEXT, *text[:5], END_MESSAGE]
    for image in images:
        ids += [USER, IMAGE_BOS_TOKEN_ID] + [config.image_token_id] * image.num_tokens + [END_MESSAGE]
    ids += [USER, AUDIO_BOS_TOKEN_ID] + [config.audio_token_id] * codes.shape[1] + [AUDIO_END, END_MESSAGE]
    ids += [USER, TEXT, *text[5:], END_MESSAGE]
    ids = torch.tensor(ids)

    pixels = torch.cat([torch.from_numpy(image.pixels) for image in images])  # [N, P, P, 3]
    hf_out = hf(
        input_ids=ids[None],
        pixel_values=pixels[:, None].expand(-1, 2, -1, -1, -1),
        audio_input_ids=codes,
        audio_input_ids_mask=torch.ones(codes.shape[:2], dtype=torch.bool),
    )

    image_rows, audio_rows = vision(pixels), audio(codes[0])
    hf_image_rows = hf.model.get_image_features(pixels[:, None].expand(-1, 2, -1, -1, -1)).pooler_output
    torch.testing.assert_close(image_rows, hf_image_rows.reshape(image_rows.shape), rtol=1e-5, atol=1e-5)

    index = torch.cat(
        [torch.nonzero(ids == config.image_token_id)[:, 0], torch.nonzero(ids == config.audio_token_id)[:, 0]]
    )
    state = decoder.new_state()
    batch = ForwardBatch(
        ids, [SequenceSlice(0, len(ids), state.layers)], mm_rows=torch.cat([image_rows, audio_rows]), mm_index=index
    )
    ours = decoder.logits(decoder(batch))
    ref = hf_out.logits[0]
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4 * ref.abs().max().item(), f"max abs diff {diff:.3e}"
