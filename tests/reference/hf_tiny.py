"""Tiny random `transformers` Inkling models (the oracle) built from a RELEASED-style raw config dict."""

from __future__ import annotations

import copy

import torch

# A tiny released-layout config: hidden 64, 6 layers (layer 5 global), dense layers 0-1, MoE 2-5, window 16,
# rel_extent 32, tau active from position 24, the real vocabulary size.
TINY_TEXT = {
    "vocab_size": 201024,
    "unpadded_vocab_size": 200058,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "sliding_window_size": 16,
    "d_rel": 4,
    "rel_extent": 32,
    "log_scaling_n_floor": 24,
    "log_scaling_alpha": 0.1,
    "local_layer_ids": [0, 1, 2, 3, 4],
    "dense_mlp_idx": 2,
    "dense_intermediate_size": 96,
    "intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "route_scale": 8.0,
    "logits_mup_width_multiplier": 24.0,
    "rms_norm_eps": 1e-6,
    "sconv_kernel_size": 4,
    "model_max_length": 4096,
}

TINY_VISION = {"vision_encoder_type": "hmlp", "patch_size": 8, "temporal_patch_size": 2, "n_channels": 3,
               "n_layers": 3, "decoder_dmodel": 64, "use_vision_norm": True}
TINY_AUDIO = {"n_mel_bins": 80, "mel_vocab_size": 16, "dmel_min_value": -7.0, "dmel_max_value": 2.0,
              "decoder_dmodel": 64, "use_audio_norm": True, "audio_mode": "dmel"}


def raw_config(text_overrides: dict | None = None, vision: dict | None = None) -> dict:
    text = copy.deepcopy(TINY_TEXT)
    text.update(text_overrides or {})
    vision = copy.deepcopy(vision or TINY_VISION)
    vision["decoder_dmodel"] = text["hidden_size"]
    audio = dict(TINY_AUDIO, decoder_dmodel=text["hidden_size"])
    return {
        "model_type": "inkling_mm_model",
        "architectures": ["InklingForConditionalGeneration"],
        "eos_token_id": 200006,
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "image_token_id": 200054,
        "audio_token_id": 200053,
    }


def hf_config(raw: dict):
    from transformers import InklingConfig

    vision = raw["vision_config"]
    audio = raw["audio_config"]
    return InklingConfig(
        text_config=dict(raw["text_config"]),
        vision_config={"patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
                       "num_channels": vision["n_channels"], "num_hidden_layers": vision["n_layers"]},
        audio_config={"n_mel_bins": audio["n_mel_bins"], "mel_vocab_size": audio["mel_vocab_size"]},
        image_token_id=raw["image_token_id"],
        audio_token_id=raw["audio_token_id"],
        eos_token_id=raw["eos_token_id"],
    )


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random and non-trivial: norms and scales away from 1, convs and rel banks non-zero."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("global_scale"):
            value = 1.0 + 0.3 * torch.randn(shape, generator=gen)
        elif "sconv" in name:
            value = 0.3 * torch.randn(shape, generator=gen)
        elif name.endswith("rel_logits_proj.proj"):
            value = 0.5 * torch.randn(shape, generator=gen)
        elif "embed_tokens.weight" in name and "audio" not in name:
            value = torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            value = torch.randn(shape, generator=gen) / fan_in**0.5
        p.copy_(value.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build_hf_model(raw: dict, seed: int = 0):
    """An fp32 eager `InklingForConditionalGeneration` with random weights."""
    from transformers import InklingForConditionalGeneration

    config = hf_config(raw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = InklingForConditionalGeneration(config).float().eval()
    randomize_(model, seed)
    return model
